"""``client.fedavg``: the user's side of the ``fedavg`` job kind.

A federated round from the SDK::

    client = Client()
    keys = [f"rounds/7/clients/{cid}.safetensors" for cid in range(len(models))]
    for key, model, n in zip(keys, models, examples):
        client.fedavg.save_update(model.state_dict(), key, num_examples=n)
    result = client.fedavg.run(keys)
    global_state = client.fedavg.load(result["output"], framework="torch")

Updates are safetensors objects; ``save_update`` writes the client's example count as
``__metadata__["num_examples"]``, which the job uses as the client's weight unless the spec gives one.
torch is imported only when a torch tensor is passed in or ``framework="torch"`` is asked for.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy

from functions import store
from functions.errors import ShardfoldError, SpecError
from functions.fedavg.spec import FedAvgClient, FedAvgJob
from functions.specs import parse_spec
from functions.store.uri import resolve

# safetensors dtype tags numpy has no type for, decoded with ml_dtypes (safetensors.numpy cannot load them)
_EXTRA_DTYPES = {
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
}
HEADER_PROBE = 64 * 1024  # one ranged read usually holds a whole safetensors header


class UpdateError(ShardfoldError):
    """An update cannot be written or read as asked (a tensor of an unsupported type, a bad header...)."""


UpdateInput = str | Mapping[str, Any] | tuple[str, float] | FedAvgClient


def _is_torch_tensor(value: Any) -> bool:
    # checked by module name so that numpy-only users never import torch
    return type(value).__module__.split(".", 1)[0] == "torch" and hasattr(value, "detach")


def _torch_to_numpy(name: str, tensor: Any) -> np.ndarray:
    import torch

    t = tensor.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    try:
        return t.numpy()
    except TypeError as exc:
        raise UpdateError(f"tensor {name!r}: torch dtype {t.dtype} has no numpy equivalent ({exc})") from exc


def to_numpy(tensors: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """A dict of contiguous numpy arrays from a dict of numpy arrays or a torch ``state_dict``."""
    if not isinstance(tensors, Mapping):
        raise UpdateError(f"an update is a dict of tensors (name -> array), got {type(tensors).__name__}")
    if not tensors:
        raise UpdateError("an update needs at least one tensor")
    out: dict[str, np.ndarray] = {}
    for name, value in tensors.items():
        if not isinstance(name, str) or not name:
            raise UpdateError(f"tensor names must be non-empty strings, got {name!r}")
        if _is_torch_tensor(value):
            arr = _torch_to_numpy(name, value)
        elif isinstance(value, np.ndarray | np.generic):
            arr = np.asarray(value)
        else:
            raise UpdateError(
                f"tensor {name!r} is a {type(value).__name__}; pass numpy arrays or torch tensors"
            )
        if arr.dtype.kind == "O" or arr.dtype.fields is not None:
            raise UpdateError(f"tensor {name!r} has dtype {arr.dtype}, which safetensors cannot store")
        out[name] = arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)  # keeps 0-d shapes
    return out


def encode_update(tensors: Mapping[str, Any], num_examples: int | None = None) -> bytes:
    """The safetensors bytes of an update, with ``__metadata__["num_examples"]`` when given."""
    arrays = to_numpy(tensors)
    metadata = None
    if num_examples is not None:
        if isinstance(num_examples, bool) or not isinstance(num_examples, int | np.integer):
            raise UpdateError(f"num_examples must be an integer, got {num_examples!r}")
        if num_examples <= 0:
            raise UpdateError(f"num_examples must be > 0 (it is the client's weight), got {num_examples}")
        metadata = {"num_examples": str(int(num_examples))}
    try:
        return safetensors.numpy.save(arrays, metadata=metadata)
    except Exception as exc:  # the Rust side reports unsupported dtypes as a generic error
        raise UpdateError(f"cannot encode the update as safetensors: {exc}") from exc


def decode_update(data: bytes, framework: str = "numpy") -> dict[str, Any]:
    """The tensors in safetensors bytes: numpy arrays (BF16 and F8 as ml_dtypes types) or, with
    ``framework="torch"``, torch tensors."""
    if framework in ("pt", "torch"):
        try:
            from safetensors.torch import load as torch_load
        except ImportError as exc:
            raise UpdateError(f"framework='torch' needs torch installed ({exc})") from exc
        try:
            return torch_load(data)
        except Exception as exc:
            raise UpdateError(f"not a valid safetensors object: {exc}") from exc
    if framework not in ("numpy", "np"):
        raise UpdateError(f"unknown framework {framework!r}; use 'numpy' or 'torch'")
    try:
        flat = safetensors.deserialize(data)
    except Exception as exc:
        raise UpdateError(f"not a valid safetensors object: {exc}") from exc
    out: dict[str, np.ndarray] = {}
    for name, view in flat:
        tag = view["dtype"]
        dtype = _EXTRA_DTYPES.get(tag) or safetensors.numpy._TYPES.get(tag)
        if dtype is None:
            raise UpdateError(f"tensor {name!r} has safetensors dtype {tag}, which numpy cannot represent")
        out[name] = np.frombuffer(view["data"], dtype=dtype).reshape(view["shape"])
    return out


def _header(uri: str) -> dict[str, Any]:
    head = store.get(uri, 0, min(HEADER_PROBE, max(store.size(uri), 8)))
    if len(head) < 8:
        raise UpdateError(f"{uri} is too short to be a safetensors object")
    n = int.from_bytes(head[:8], "little")
    if n > 100 * 1024 * 1024:
        raise UpdateError(f"{uri}: header length {n} is not plausible; not a safetensors object?")
    raw = head[8 : 8 + n] if 8 + n <= len(head) else store.get(uri, 8, n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UpdateError(f"{uri}: the safetensors header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise UpdateError(f"{uri}: the safetensors header is not a JSON object")
    return header


class FedAvg:
    """The ``client.fedavg`` namespace: write and read model updates, run a FedAvg round.

    URIs are ``s3://``, ``file://`` or keys relative to the client's store root (the bucket on AWS and
    moto, ``.shardfold/`` locally), the same keys a spec may use.
    """

    def __init__(self, client: Any):
        self._client = client

    def uri(self, uri_or_key: str) -> str:
        """The full URI of ``uri_or_key`` on this client's backend."""
        return resolve(uri_or_key, root=self._client.store_root)

    # -- updates ------------------------------------------------------------------------------------------

    def save_update(self, tensors: Mapping[str, Any], uri: str, num_examples: int | None = None) -> str:
        """Write one client's update as a safetensors object; returns its full URI.

        ``tensors`` is a dict of numpy arrays (``ml_dtypes.bfloat16`` for BF16) or a torch ``state_dict``
        (converted with ``.detach().cpu()``; bfloat16 kept bit for bit). ``num_examples`` becomes the
        file's ``__metadata__["num_examples"]``, the client's default weight in a ``fedavg`` job.
        """
        full = self.uri(uri)
        store.put(full, encode_update(tensors, num_examples))
        return full

    def load(self, uri: str, framework: str = "numpy") -> dict[str, Any]:
        """The tensors of a safetensors object (an update or a job's output) as numpy arrays, or as a torch
        ``state_dict`` with ``framework="torch"``."""
        return decode_update(store.get(self.uri(uri)), framework)

    def metadata(self, uri: str) -> dict[str, str]:
        """The ``__metadata__`` of a safetensors object (e.g. ``num_examples``), read with ranged GETs."""
        meta = _header(self.uri(uri)).get("__metadata__") or {}
        return {str(k): str(v) for k, v in meta.items()}

    # -- jobs ---------------------------------------------------------------------------------------------

    def _client_entry(self, update: UpdateInput) -> FedAvgClient:
        if isinstance(update, FedAvgClient):
            entry = update
        elif isinstance(update, str):
            entry = FedAvgClient(uri=update)
        elif isinstance(update, tuple) and len(update) == 2:
            entry = FedAvgClient(uri=update[0], weight=update[1])
        elif isinstance(update, Mapping):
            entry = FedAvgClient.model_validate(dict(update))
        else:
            raise SpecError(
                f"an update is a URI, a (uri, weight) pair or a dict with 'uri', got {type(update).__name__}"
            )
        # relative keys name objects under this client's store root, where save_update wrote them
        return entry.model_copy(update={"uri": self.uri(entry.uri)})

    def spec(self, updates: Iterable[UpdateInput], output: str | None = None, **options: Any) -> FedAvgJob:
        """The ``fedavg`` spec averaging ``updates`` (in this order); ``options`` are FedAvgJob fields
        (aggregator, trim_fraction, uniform, accumulate, integer_policy, allow_nonfinite, shards)."""
        try:
            clients = [self._client_entry(u) for u in updates]
        except ValueError as exc:  # pydantic's ValidationError of one entry
            raise SpecError(f"invalid fedavg update: {exc}") from exc
        doc: dict[str, Any] = {
            "kind": "fedavg",
            "clients": [c.model_dump(exclude_none=True) for c in clients],
        }
        if output is not None:
            doc["output"] = self.uri(output)
        doc.update(options)
        return parse_spec(doc)  # type: ignore[return-value]

    def submit(self, updates: Iterable[UpdateInput], output: str | None = None, **options: Any) -> Any:
        """Start a ``fedavg`` job over ``updates``; returns its :class:`client.Job` at once."""
        return self._client.submit(self.spec(updates, output, **options))

    def run(
        self,
        updates: Iterable[UpdateInput],
        output: str | None = None,
        *,
        progress: bool = False,
        timeout_s: float | None = None,
        **options: Any,
    ) -> dict[str, Any]:
        """Submit a ``fedavg`` job, wait for it and return its result (``result["output"]`` is the averaged
        model's URI). Raises :class:`client.errors.JobFailed` if the job fails, naming the cause."""
        job = self.submit(updates, output, **options)
        job.wait(progress=progress, timeout_s=timeout_s)
        return job.result()
