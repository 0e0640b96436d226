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
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy

from shardfold.functions import extras, store
from shardfold.functions.errors import ShardfoldError, SpecError
from shardfold.functions.fedavg.layout import DTYPES
from shardfold.functions.fedavg.spec import FedAvgClient, FedAvgSpec
from shardfold.functions.ledger import DATASET_ID
from shardfold.functions.specs import parse_spec
from shardfold.functions.store.uri import resolve

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


# the float dtypes a secure update may hold, by their safetensors names (the job's own table)
_FLOAT_NAMES = {d.np.newbyteorder("="): name for name, d in DTYPES.items() if d.kind == "float"}
_CLIENT_ID = re.compile(DATASET_ID)  # the same safe-id rule as a ledger key: it names a store object


def _round_key(round_prefix: str, *parts: str) -> str:
    return "/".join([round_prefix.rstrip("/"), *parts])


def _check_client_id(client_id: str) -> None:
    if not isinstance(client_id, str) or not _CLIENT_ID.match(client_id):
        raise UpdateError(f"client_id {client_id!r}: letters, digits, '.', '_', '-' (at most 128)")


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

    # -- secure aggregation (client side) ------------------------------------------------------------------

    def secure_keys(self, round_prefix: str, client_id: str) -> bytes:
        """Join a secure round: make this client's X25519 key pair, publish the public key at
        ``<round_prefix>/keys/<client_id>.pub`` and return the private key (32 bytes; keep it secret, and
        keep it until :meth:`mask_update`). Every client of the round publishes before any masks."""
        extras.require("secure", "secure aggregation")
        from shardfold.client import secagg

        _check_client_id(client_id)
        private = secagg.new_private_key()
        key = self.uri(_round_key(round_prefix, "keys", f"{client_id}.pub"))
        if not store.put_if_absent(key, secagg.public_key(private)):
            raise UpdateError(f"client {client_id!r} already published a key for round {round_prefix}")
        return private

    def round_keys(self, round_prefix: str) -> dict[str, bytes]:
        """The public keys published for a secure round: client id -> key."""
        prefix = self.uri(_round_key(round_prefix, "keys", ""))
        keys = {}
        for uri in store.list_uris(prefix):
            name = uri.rsplit("/", 1)[-1]
            if name.endswith(".pub"):
                keys[name[: -len(".pub")]] = store.get(uri)
        return keys

    def mask_update(
        self,
        tensors: Mapping[str, Any],
        uri: str,
        *,
        round_prefix: str,
        client_id: str,
        private_key: bytes,
        roster: Sequence[str] | Mapping[str, bytes],
        clip_range: float = 8.0,
        seed: int | None = None,
    ) -> str:
        """Quantise and mask one client's update for a secure round; write it (U32 safetensors) to ``uri``.

        Every float value is clipped to [-clip_range, clip_range] and rounded stochastically to the round's
        integer grid (:mod:`functions.fedavg.secagg`), then masked with one pairwise mask per other client
        of the round: the masks cancel only in the sum of all of them, so the job (``"secure": true``)
        learns the mean and no single update. Integer and bool tensors cannot be masked: leave them out.
        ``seed`` seeds the rounding (tests only).

        ``roster`` is the round's client ids, as the clients know them (not as the bucket lists them): at
        least two, this client among them, every one's key published under ``round_prefix``
        (:meth:`round_keys`). Keys published by anyone else are ignored, so a writer who adds keys cannot
        make a client mask for fewer real peers. Given as ``{client id: public key}`` (keys exchanged out of
        band), each published key must also be that one: then a writer who replaces a key is refused too.
        """
        extras.require("secure", "secure aggregation")
        from shardfold.client import secagg as masks
        from shardfold.functions.fedavg import secagg

        _check_client_id(client_id)
        if not (isinstance(clip_range, int | float) and 0 < clip_range < float("inf")):
            raise UpdateError(f"clip_range must be a finite number > 0, got {clip_range!r}")
        arrays = to_numpy(tensors)
        peers = self._roster_keys(round_prefix, client_id, roster)
        if peers[client_id] != masks.public_key(private_key):
            raise UpdateError(
                f"client {client_id!r} has no key published for round {round_prefix} matching private_key; "
                "call secure_keys first"
            )
        dtypes = {}
        for name, arr in arrays.items():
            if arr.dtype.newbyteorder("=") not in _FLOAT_NAMES:
                raise UpdateError(
                    f"tensor {name!r} is {arr.dtype}: a secure round masks float tensors only; leave it out"
                )
            if not np.isfinite(arr).all():
                raise UpdateError(f"tensor {name!r} holds NaN or Inf, which cannot be quantised")
            dtypes[name] = _FLOAT_NAMES[arr.dtype.newbyteorder("=")]
        round_id = self.uri(_round_key(round_prefix))
        params = secagg.RoundParams(
            round=round_id,
            clients=len(peers),
            clip_range=float(clip_range),
            scale=secagg.scale(len(peers)),
            dtypes=dtypes,
        )
        names = sorted(arrays)
        rng = np.random.default_rng(seed)
        flat = np.concatenate(  # to_numpy refuses an update without tensors
            [secagg.quantise(arrays[n].ravel(), params.clip_range, params.scale, rng) for n in names]
        )
        # One masked update per key and round: a second one under the same masks would show the server the
        # difference of the two updates.
        marker = self.uri(_round_key(round_prefix, "masked", client_id))
        if not store.put_if_absent(marker, b""):
            raise UpdateError(
                f"client {client_id!r} already masked an update for round {round_prefix}; a second one with "
                "the same keys would reveal the difference of the two: join a new round (secure_keys)"
            )
        masked = masks.mask(flat, private_key, client_id, peers, round_id)
        out, at = {}, 0
        for n in names:
            size = arrays[n].size
            out[n] = masked[at : at + size].reshape(arrays[n].shape)
            at += size
        full = self.uri(uri)
        store.put(full, safetensors.numpy.save(out, metadata={secagg.METADATA_KEY: params.to_json()}))
        return full

    def _roster_keys(
        self, round_prefix: str, client_id: str, roster: Sequence[str] | Mapping[str, bytes]
    ) -> dict[str, bytes]:
        """The public keys of ``roster``'s clients (see :meth:`mask_update`), or :class:`UpdateError`."""
        if isinstance(roster, str | bytes) or not isinstance(roster, Sequence | Mapping):
            raise UpdateError("roster is the round's client ids (a list), or {client id: public key}")
        ids = list(roster)
        for cid in ids:
            _check_client_id(cid)
        if len(set(ids)) != len(ids) or len(ids) < 2:
            raise UpdateError(
                f"a secure round's roster lists at least two distinct clients (got {ids!r}): with fewer, the "
                "masks would hide nothing"
            )
        if client_id not in ids:
            raise UpdateError(f"client {client_id!r} is not in the round's roster {ids!r}")
        published = self.round_keys(round_prefix)
        missing = [cid for cid in ids if cid not in published]
        if missing:
            raise UpdateError(
                f"no key published for {missing} in round {round_prefix}: every client of the roster calls "
                "secure_keys before any masks (masking for fewer peers would expose the update)"
            )
        if isinstance(roster, Mapping):
            replaced = [cid for cid in ids if bytes(roster[cid]) != published[cid]]
            if replaced:
                raise UpdateError(
                    f"the keys published for {replaced} in round {round_prefix} are not the ones the roster "
                    "gives: someone replaced them; nothing was masked"
                )
        return {cid: published[cid] for cid in ids}

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

    def spec(self, updates: Iterable[UpdateInput], output: str | None = None, **options: Any) -> FedAvgSpec:
        """The ``fedavg`` spec averaging ``updates`` (in this order); ``options`` are FedAvgSpec fields
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
