"""PyTorch integration: a map-style dataset whose mini-batches are single GetBatch requests.

``torch.utils.data.DataLoader`` calls ``dataset.__getitems__(indices)`` once per mini-batch when the method
exists (``torch/utils/data/_utils/fetch.py``), so each batch costs exactly one :func:`get_batch` call:
one ordered, windowed, retried request instead of ``batch_size`` separate GETs (the GetBatch paper's point).
Shuffling stays with the sampler, so random access is kept.

This is the only module of Shardfold that imports torch (``pip install shardfold[dev]`` or ``[inference]``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torch.utils.data import Dataset

from shardfold.functions import store
from shardfold.functions.errors import BatchItemError
from shardfold.functions.log import logger
from shardfold.functions.specs import BatchItem
from shardfold.functions.store.uri import join, store_root


def _as_item(item: BatchItem | dict | str, root: str) -> BatchItem:
    item = (
        item
        if isinstance(item, BatchItem)
        else BatchItem.model_validate({"uri": item} if isinstance(item, str) else item)
    )
    if "://" not in item.uri:  # a key under the store root, resolved once here, not per worker
        item = item.model_copy(update={"uri": join(root, item.uri)})
    return item


class GetBatchDataset(Dataset):
    """Samples ``items[i]`` (object URIs, keys under the store root, ranges or TAR members).

    ``decode(data: bytes)`` turns an object's bytes into a sample (default: the bytes). With
    ``continue_on_error=True`` a missing object yields ``None`` instead of failing the batch (use a
    ``collate_fn`` that drops them); otherwise the batch raises :class:`BatchItemError` naming the item.
    ``options`` pass through to :func:`functions.store.get_batch` (window, concurrency, max_bytes,
    hedge_after...).

    Safe with ``num_workers > 0``: per-process state (the store's S3 connection pool) is created lazily in
    each worker, never inherited across ``fork``, and dropped when the dataset is pickled for ``spawn``.
    """

    def __init__(
        self,
        items: Iterable[BatchItem | dict | str],
        decode: Callable[[bytes], Any] | None = None,
        continue_on_error: bool = False,
        *,
        root: str | None = None,
        **options: Any,
    ):
        root = root or store_root()
        self.items: list[BatchItem] = [_as_item(i, root) for i in items]
        self.decode = decode
        self.continue_on_error = continue_on_error
        self.options = options
        self._pid: int | None = None
        self._transport: Any = None

    def __len__(self) -> int:
        return len(self.items)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_pid"] = None  # a pickled copy (spawn workers) starts its own state
        state["_transport"] = None
        return state

    def _worker_transport(self) -> Any:
        """This process's transport, created on its first fetch (in a DataLoader worker: after the fork).

        The store keys its S3 clients and thread pools by process id, so a worker never reuses sockets
        inherited from its parent; holding one transport per worker just avoids rebuilding it per batch.
        """
        pid = os.getpid()
        if self._pid != pid:
            from shardfold.functions.store.transport import default_transport

            self._transport = default_transport()
            self._pid = pid
        return self._transport

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """One mini-batch: exactly one GetBatch request for all ``indices``, samples in the same order."""
        batch = [self.items[i] for i in indices]
        options = {"transport": self._worker_transport(), **self.options}
        samples: list[Any] = []
        try:
            for entry in store.get_batch(batch, continue_on_error=self.continue_on_error, **options):
                if entry.error is not None:
                    logger.warning(
                        "item missing", extra={"index": indices[entry.index], "error": entry.error}
                    )
                    samples.append(None)
                else:
                    samples.append(self.decode(entry.data) if self.decode else entry.data)
        except BatchItemError as exc:  # named by its dataset index, not its place in this mini-batch
            raise BatchItemError(indices[exc.index], exc.item, exc.reason) from None
        return samples

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])[0]
