"""GetBatchDataset in a torch DataLoader: one GetBatch per mini-batch, same batches for any worker count."""

from __future__ import annotations

import pickle

import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader  # noqa: E402

from shardfold.client.data import GetBatchDataset  # noqa: E402
from shardfold.functions import store  # noqa: E402
from shardfold.functions.errors import BatchItemError  # noqa: E402
from shardfold.functions.store.uri import join, store_root  # noqa: E402

N = 37  # not a multiple of the batch size, so the last batch is short


@pytest.fixture
def root(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "home"))
    r = store_root()
    for i in range(N):
        store.put(join(r, "samples", f"{i:03d}.txt"), f"sample {i}".encode())
    return r


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """Wrap store.get_batch so every call (in any DataLoader worker) appends its batch size to a file."""
    log = tmp_path / "calls.log"
    real = store.get_batch

    def get_batch(items, **kwargs):
        items = list(items)
        with open(log, "a") as f:  # O_APPEND: one short line per call, safe across worker processes
            f.write(f"{len(items)}\n")
        return real(items, **kwargs)

    monkeypatch.setattr(store, "get_batch", get_batch)

    def calls() -> list[int]:
        return [int(x) for x in log.read_text().split()] if log.exists() else []

    return calls


def keys(n: int = N) -> list[str]:
    return [f"samples/{i:03d}.txt" for i in range(n)]


def decode(data: bytes) -> int:
    return int(data.decode().split()[1])


def loader(ds, workers: int, seed: int = 1234, batch_size: int = 8) -> DataLoader:
    return DataLoader(
        ds,
        batch_size=batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
        num_workers=workers,
        collate_fn=list,
        multiprocessing_context="fork" if workers else None,
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_one_get_batch_call_per_mini_batch(root, counted, workers):
    ds = GetBatchDataset(keys(), decode=decode)
    batches = list(loader(ds, workers))
    assert counted() and sorted(counted()) == sorted(len(b) for b in batches)
    assert len(counted()) == len(batches) == -(-N // 8)
    assert sorted(x for b in batches for x in b) == list(range(N))


def test_same_batches_with_zero_and_two_workers(root):
    ds = GetBatchDataset(keys(), decode=decode)
    zero = list(loader(ds, 0))
    two = list(loader(ds, 2))
    assert zero == two
    assert zero != list(loader(ds, 0, seed=99))  # the seed, not luck, fixes the order


def test_getitem_and_len(root, counted):
    ds = GetBatchDataset(keys(), decode=decode)
    assert len(ds) == N and ds[5] == 5 and counted() == [1]
    assert ds.__getitems__([3, 1, 3]) == [3, 1, 3] and counted() == [1, 3]
    raw = GetBatchDataset(["samples/002.txt", {"uri": "samples/010.txt", "start": 7}])
    assert raw.__getitems__([0, 1]) == [b"sample 2", b"10"]


def test_missing_items(root):
    items = [*keys(3), "samples/nope.txt"]
    lenient = GetBatchDataset(items, decode=decode, continue_on_error=True)
    assert lenient.__getitems__([0, 3, 2]) == [0, None, 2]
    strict = GetBatchDataset(items, decode=decode)
    with pytest.raises(BatchItemError, match=r"^item 3 \(.*nope.txt\)") as raised:  # its dataset index
        strict.__getitems__([1, 0, 3])  # third in the mini-batch
    assert raised.value.index == 3


def test_pickles_without_process_state(root):
    ds = GetBatchDataset(keys(4), decode=decode)
    assert ds[0] == 0 and ds._transport is not None
    copy = pickle.loads(pickle.dumps(ds))  # what a spawn-started worker receives
    assert copy._transport is None and copy[1] == 1
