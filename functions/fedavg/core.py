"""Pure core of the ``fedavg`` job: plan → aggregate (one task per shard) → commit.

Input: N client updates, each a safetensors object at any store URI, with a weight (number of training
examples) from the spec or from the file's ``__metadata__["num_examples"]``. Output: one safetensors object
with the same tensors (names, dtypes, shapes) whose values are the clients' aggregate.

* **plan** (:func:`plan`, via :func:`inspect`) reads every client's 8-byte length prefix in one GetBatch,
  then every header in a second, and the objects' sizes (HEAD) alongside; checks each file (see
  :mod:`functions.fedavg.layout`) and that all clients have the same tensor names, dtypes and shapes
  (offsets may differ: each comes from its own header); resolves the weights; chooses the shards (see
  :mod:`functions.fedavg.shardplan`); writes the plan document ``jobs/<id>/fedavg/plan.json`` and the shard
  work list ``jobs/<id>/fedavg/worklist.json``; returns small references only.
* **aggregate** (:func:`aggregate`) streams its shard's byte range from all N clients in chunks: one
  GetBatch whose ranged reads go chunk by chunk, client by client in spec order, with a bounded window of
  reads in flight; each client's bytes are viewed in place (``np.frombuffer``) and folded into the chunk's
  accumulators; a finished chunk is converted to the tensors' dtypes and appended to the part, spooled to
  ephemeral storage and uploaded as ``jobs/<id>/fedavg/parts/<k>.bin`` (shard 0's part starts with the output
  header). Peak memory is the read window plus one chunk's accumulators: flat in N and in the model size.
* **commit** (:func:`commit`) joins the parts into the output (S3: multipart UploadPartCopy, every part but
  the last >= 5 MiB; locally: concatenation), writes ``jobs/<id>/result.json`` and removes the temporaries.

**Aggregators** (``aggregator``; formulas in :mod:`functions.fedavg.kernels`):

* ``mean`` (FedAvg): ``sum_i w_i x_i / sum_i w_i`` computed as ``acc = w_0 x_0; acc += w_i x_i`` in spec
  order, elementwise (never a reordering reduction), then ``acc / W`` and a round-to-nearest-even cast to the
  tensor's dtype. ``W`` is ``math.fsum`` of the weights, cast to the accumulator dtype. ``uniform``: all
  weights 1 and ``W = N`` (GradsSharding's plain mean). For float32 inputs this is bit for bit Flower's
  ``aggregate()`` (``reduce(np.add, [x * n]) / sum(n)``). Weights far from 1 (any finite positive weight
  works, 5e-324 to 1e308) are first scaled in float64 by a power of two, which changes no ratio and
  keeps their float32 casts away from 0 and Inf (:func:`functions.fedavg.kernels.weight_scale`).
* ``median``: per coordinate, the middle value (odd N) or the mean of the two middle values (even N).
* ``trimmed_mean``: per coordinate, drop ``k = floor(trim_fraction * N)`` lowest and highest values and
  average the rest (summed in sorted order). Both robust aggregators are unweighted and need all N values of
  a coordinate at once: their chunk is ``Budget.robust_bytes / (N x acc_ratio)`` bytes, so a task holds
  ``O(N x chunk)`` = at most ``robust_bytes`` whatever N is (more, smaller GETs as N grows).

Because every step is elementwise in a fixed client order, the result is bitwise identical whatever the shard
count, the chunk size and the executor.

**Dtypes.** Float tensors (F64, F32, F16, BF16 via ml_dtypes, F8_E4M3, F8_E5M2) accumulate in float32
(``accumulate="float32"``, the default) or float64 (``"float64"``); F64 tensors always accumulate in
float64, so a tensor is never summed below its own precision. **Integer tensors** (I8..I64, U8..U64, e.g.
BatchNorm's ``num_batches_tracked``) follow ``integer_policy``:

* ``mean`` (default): the job's aggregator (weighted/uniform mean, median or trimmed mean) computed in
  float64, rounded half to even, cast back (exact for |x| < 2**53);
* ``first``: client 0's values;
* ``max``: the elementwise maximum.

**BOOL** tensors are integers 0/1 (any non-zero byte is true) under the same policy: ``mean`` is a weighted
majority vote (a tie, 0.5, rounds to false), ``first`` client 0's, ``max`` a logical or. Other dtypes
(complex, sub-byte and E8M0 floats) are refused at plan time naming the tensor.

**Bad input** is refused with a :class:`ShardfoldError` naming the client (``client <i> (<uri>)``) and the
tensor, before any output exists: a missing object (:class:`ObjectNotFound`), not safetensors (bad length
prefix, header over 100 MB, header not a JSON object, unknown dtype, offsets that overlap, leave gaps or
disagree with dtype x shape), truncated or followed by stray bytes, tensors unlike client 0's, a missing,
non-numeric or non-positive ``num_examples`` when the weight is needed (:class:`InvalidModelFile`); NaN or
Inf in an update (:class:`NonFiniteUpdate`, found while aggregating, unless ``allow_nonfinite``); a weighted
sum that overflows its accumulator although every input is finite (:class:`AggregationOverflow`); weights
whose total exceeds float64 (:class:`SpecError`). Every chunk's result is checked finite before it is written
(:class:`NonFiniteAggregate`, naming the tensor and element: e.g. a float32 median of two values near 3e38),
with ``allow_nonfinite`` too, unless an input at that element was itself NaN or Inf. A failed aggregate never
reaches commit, so no output object is written.

Weights are needed only by the weighted mean (``aggregator="mean"`` without ``uniform``); otherwise a
client's weight is recorded when known and the output's ``num_examples`` is their total if all are known.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import json
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from shardfold.functions import access, ledger, store
from shardfold.functions.errors import (
    AggregationOverflow,
    BatchItemError,
    InputChanged,
    InvalidModelFile,
    InvalidRange,
    NonFiniteAggregate,
    NonFiniteUpdate,
    ObjectExists,
    ObjectNotFound,
    PlanError,
    ShardfoldError,
    SpecError,
    StoreError,
    TooFewClients,
)
from shardfold.functions.fedavg import dp, kernels, secagg
from shardfold.functions.fedavg.layout import (
    PREFIX_BYTES,
    FileHeader,
    bad_file,
    check_like_first,
    check_object_size,
    format_number,
    output_tensors,
    parse_header,
    parse_length_prefix,
    weight_from_metadata,
    where,
)
from shardfold.functions.fedavg.shardplan import (
    SPOOL_BYTES,
    Budget,
    ClientRef,
    Geometry,
    RunRead,
    Segment,
    ShardPlan,
    cut_shards,
    default_budget,
    runs,
    shard_caps,
    task_loads,
)
from shardfold.functions.fedavg.spec import FedAvgSpec
from shardfold.functions.jobs import scratch_key
from shardfold.functions.log import logger
from shardfold.functions.privacy import REPORT_DELTA, cdp_eps
from shardfold.functions.store.pinning import Pin
from shardfold.functions.store.retry import TransientError
from shardfold.functions.store.s3 import MAX_SINGLE_PUT
from shardfold.functions.store.uri import is_s3, join
from shardfold.functions.worklist import worklist_ref

STAGE = "fedavg"
DEFAULT_FORMAT = "pt"  # __metadata__["format"] when client 0's file has none (what transformers expects)


# --- keys ---------------------------------------------------------------------------------------------------


def job_uri(store_root: str, job_id: str, *parts: str) -> str:
    return join(store_root, "jobs", job_id, *parts)


def plan_uri(store_root: str, job_id: str) -> str:
    return job_uri(store_root, job_id, STAGE, "plan.json")


def worklist_uri(store_root: str, job_id: str) -> str:
    return job_uri(store_root, job_id, STAGE, "worklist.json")


def norms_worklist_uri(store_root: str, job_id: str) -> str:
    return job_uri(store_root, job_id, STAGE, "norms-worklist.json")


def norms_uri(store_root: str, job_id: str, shard: int) -> str:
    return job_uri(store_root, job_id, STAGE, "norms", f"{shard:05d}.f64")  # clip deletes norms/ whole


def clip_uri(store_root: str, job_id: str) -> str:
    return job_uri(store_root, job_id, STAGE, "clip.f64")


def part_uri(store_root: str, job_id: str, shard: int) -> str:
    return job_uri(store_root, job_id, STAGE, "parts", f"{shard:05d}.bin")


def output_uri(spec: FedAvgSpec, store_root: str, job_id: str) -> str:
    if spec.output:
        return access.output_uri(spec.output, store_root, "output", job_id)
    return job_uri(store_root, job_id, "output", "model.safetensors")


# --- plan ---------------------------------------------------------------------------------------------------


def _client_uris(spec: FedAvgSpec, store_root: str) -> list[str]:
    uris, errors = [], []
    for i, c in enumerate(spec.clients):
        try:
            uris.append(access.input_uri(c.uri, store_root))
        except StoreError as exc:
            errors.append({"field": f"clients.{i}.uri", "error": str(exc)})
    if errors:
        summary = "; ".join(f"{e['field']}: {e['error']}" for e in errors[:10])
        raise SpecError(f"{len(errors)} invalid client URI(s): {summary}", errors)
    return uris


def _batch_error(exc: BatchItemError, i: int, uri: str, what: str) -> ShardfoldError | TransientError:
    """A GetBatch failure as an error naming client ``i`` (its place in the spec) and its ``uri``."""
    cause = exc.__cause__
    label = where(i, uri)
    if isinstance(cause, InputChanged):
        return InputChanged(f"{label}: {cause}", uri=uri)
    if isinstance(cause, ObjectNotFound):
        return ObjectNotFound(f"{label}: no object at {uri}")
    if isinstance(cause, InvalidRange):
        return InvalidModelFile(f"{label}: {what}", client=i, uri=uri, reason=what)
    if isinstance(cause, TransientError):
        return TransientError(f"{label}: {exc.reason}")
    return StoreError(f"{label}: {exc.reason}")


# The polling step's gaps between looks for late updates (wait_s), in whole seconds (a Wait state's
# SecondsPath): the first, doubling up to the longest (each look HEADs every update).
POLL_FIRST_S, POLL_MAX_S = 2, 30
_LEFT_OUT = Pin(size=-1)  # stands for an update whose HEAD failed and whose client is out (not "missing")


def await_updates(
    spec: FedAvgSpec, store_root: str, last: dict[str, Any] | None = None, *, now: float | None = None
) -> dict[str, Any]:
    """One look for the updates, for the workflow's polling step: ``{"ready": true, "looks"}`` once each is
    there (or, under ``min_clients``, its HEAD failed otherwise, which leaves its client out) or ``wait_s``
    has passed since the first look; else ``{"ready": false, "wait_s", "deadline", "looks"}``, the whole
    seconds the workflow waits before the next look (a Wait state on AWS: no Lambda runs meanwhile).
    ``last``: the previous look's result; ``now``: the clock (epoch seconds)."""
    if spec.wait_s <= 0:
        return {"ready": True, "looks": 0}
    now = time.time() if now is None else now
    deadline = min(float(last["deadline"]) if last else math.inf, now + spec.wait_s)
    looks = (last or {}).get("looks", 0) + 1
    members = _Round(spec, _client_uris(spec, store_root))
    found = _pins_of(members, members.uris)
    if all(p is not None for p in found.values()) or now >= deadline:
        return {"ready": True, "looks": looks}
    gap = min(POLL_FIRST_S * 2 ** (looks - 1), POLL_MAX_S, math.ceil(deadline - now))
    return {"ready": False, "wait_s": max(1, gap), "deadline": deadline, "looks": looks}


def _pins_of(members: _Round, uris: list[str]) -> dict[str, Pin | None]:
    """The updates' pins, all in flight at once; a tolerant round leaves out the clients whose HEAD fails."""
    failed: dict[str, StoreError] = {}
    found = store.pins(uris, failed=failed if members.spec.tolerant else None)
    place = {u: i for i, u in enumerate(members.uris)}
    for u, exc in failed.items():
        members.out(place[u], StoreError(f"{where(place[u], u)}: {exc}"))
    return {u: found.get(u, _LEFT_OUT) for u in uris}


class _Round:
    """Who is in the round: a failure that names a client either fails the round (every update needed) or
    leaves that client out (``min_clients``/``min_fraction``), with its reason."""

    def __init__(self, spec: FedAvgSpec, uris: list[str]):
        self.spec, self.uris = spec, uris
        self.left_out: dict[int, str] = {}

    def out(self, i: int, exc: ShardfoldError | TransientError) -> None:
        """Leave client ``i`` out for ``exc``, or raise it when the round needs every client (and always for
        a transient fault, which a retry of the task may not meet)."""
        if not self.spec.tolerant or isinstance(exc, TransientError):
            raise exc
        prefix = f"{where(i, self.uris[i])}: "
        text = str(exc)
        self.left_out[i] = text[len(prefix) :] if text.startswith(prefix) else text

    def live(self) -> list[int]:
        return [i for i in range(len(self.uris)) if i not in self.left_out]

    def excluded(self) -> list[dict[str, Any]]:
        return [{"client": i, "uri": self.uris[i], "reason": r} for i, r in sorted(self.left_out.items())]

    def check_enough(self) -> None:
        n, need, have = len(self.uris), self.spec.required_clients, len(self.live())
        if have >= need:
            return
        listed = "; ".join(f"client {e['client']} ({e['uri']}): {e['reason']}" for e in self.excluded()[:10])
        more = f" and {len(self.left_out) - 10} more" if len(self.left_out) > 10 else ""
        raise TooFewClients(
            f"the round needs {need} of its {n} client updates but only {have} can be aggregated; left out: "
            f"{listed}{more}",
            self.excluded(),
        )

    def read_each(
        self,
        items: dict[int, dict[str, Any]],
        pins: dict[str, Pin],
        what: Callable[[int], str],
        take: Callable[[int, bytes], None],
    ) -> None:
        """One ranged read per client (``items``: client -> GetBatch item), in client order, ``take(i, data)``
        each; a client whose read or ``take`` fails is left out (or fails the round), and the reads after a
        failed one are made again."""
        pending = dict(items)
        while pending:
            order = list(pending)
            try:
                with store.get_batch([pending[i] for i in order], pins=pins) as stream:
                    for entry in stream:
                        i = order[entry.index]
                        del pending[i]
                        try:
                            take(i, entry.data)
                        except InvalidModelFile as exc:
                            self.out(i, exc)
            except BatchItemError as exc:
                i = order[exc.index]
                del pending[i]
                self.out(i, _batch_error(exc, i, self.uris[i], what(i)))


def inspect(spec: FedAvgSpec, job_id: str, store_root: str, *, budget: Budget | None = None) -> ShardPlan:
    """Read and check every client's header and size, resolve weights, choose shards; write nothing.

    Requests: 1 HEAD (the client's pin: size and ETag, or size, mtime and inode) then 2 ranged GETs per
    client, the GETs pinned, so the plan describes exactly the objects the aggregate tasks will read (they
    refuse any other: :class:`InputChanged`); late updates were waited for before, by the polling step
    (:func:`await_updates`). Memory: one parsed header per distinct set of tensors (one,
    for a sound round) plus the one being read, and one offset list per distinct layout. ``budget``
    defaults to :func:`~functions.fedavg.shardplan.default_budget` (the deployed functions, and as many
    workers as run aggregate tasks at once where the job runs); tests pass small ones.

    Every update is needed unless the spec sets ``min_clients``/``min_fraction``: then a client whose update
    is missing, unreadable, not safetensors, unlike the round's (the tensors most clients have; a tie goes to
    the earliest), or without a needed weight is left out, and :class:`TooFewClients` is raised when fewer
    than needed remain. Otherwise the first such problem fails the round naming the client.
    """
    budget = budget or default_budget(store_root)
    uris = _client_uris(spec, store_root)
    out = output_uri(spec, store_root, job_id)
    inputs = [(f"clients.{i}.uri", u) for i, u in enumerate(uris)]
    base_uri = _dp_uri(spec, store_root, "base")
    if base_uri is not None:
        inputs.append(("dp.base", base_uri))
    structure_uri = _dp_uri(spec, store_root, "structure")
    if structure_uri is not None:
        inputs.append(("dp.structure", structure_uri))
    access.not_an_input(out, inputs, "output")
    if is_s3(out) != is_s3(store_root):
        raise SpecError(
            f"output {out} must be in the job's store ({store_root.split('://')[0]}://): the parts are "
            "assembled into it server-side"
        )
    members = _Round(spec, uris)
    found = _pins_of(members, uris)
    base = _read_base(base_uri) if base_uri is not None else None
    # a DP round's tensors: the public model's (dp.structure, else dp.base), never the clients' majority
    structure = _read_base(structure_uri, "dp.structure")[0] if structure_uri is not None else None
    for i, u in enumerate(uris):
        if found[u] is None:
            members.out(i, ObjectNotFound(f"{where(i, u)}: no object at {u}"))
    pins = {u: p for u, p in found.items() if p is not None and p is not _LEFT_OUT}
    reference = structure or (base[0] if base is not None else None)
    return _inspect(spec, job_id, members, out, pins, budget, base, reference)


def _dp_uri(spec: FedAvgSpec, store_root: str, name: str) -> str | None:
    """The full URI of ``dp.<name>`` (a server-side model: ``base``, ``structure``), if the round has one."""
    uri = None if spec.dp is None else getattr(spec.dp, name)
    if uri is None:
        return None
    try:
        return access.input_uri(uri, store_root)
    except StoreError as exc:
        raise SpecError(f"dp.{name}: {exc}", [{"field": f"dp.{name}", "error": str(exc)}]) from None


def _read_base(uri: str, field: str = "dp.base") -> tuple[FileHeader, Pin, str]:
    """A server-side model's header and pin (dp.base, dp.structure): the server's own, so any problem with
    it fails the round."""
    pin = store.pins([uri])[uri]
    if pin is None:
        raise ObjectNotFound(f"{field}: no object at {uri}")
    try:
        length = parse_length_prefix(store.get(uri, 0, PREFIX_BYTES, pin), -1, uri)
        header = parse_header(store.get(uri, PREFIX_BYTES, length, pin), -1, uri)
        check_object_size(header, pin.size, -1, uri)
    except (InvalidModelFile, InvalidRange) as exc:
        raise InvalidModelFile(f"{field} ({uri}): {exc.reason}", uri=uri, reason=exc.reason) from None
    return header, pin, uri


def _signature(header: FileHeader) -> tuple:
    """What clients must share to be averaged: tensor names, dtypes and shapes (not offsets)."""
    return tuple(sorted((t.name, t.dtype, tuple(t.shape)) for t in header.tensors.values()))


def _inspect(
    spec: FedAvgSpec,
    job_id: str,
    members: _Round,
    out: str,
    pins: dict[str, Pin],
    budget: Budget,
    base: tuple[FileHeader, Pin, str] | None = None,
    reference: FileHeader | None = None,
) -> ShardPlan:
    """The plan of a round whose updates' pins are known: headers read and checked, the round's tensors
    chosen, the clients' weights and layouts resolved, then its terms (plain, DP or secure) and shards."""
    # A DP round's tensors are the public reference's: an update unlike it is absent, whoever else sent what
    headers = _read_headers(members, pins, _signature(reference) if reference is not None else None)
    ref, first = _round_tensors(members, headers)
    order = output_tensors(first)
    position = {name: k for k, name in enumerate(sorted(first.tensors))}
    clients, layouts = _clients(spec, members, headers, order, position, pins)
    known = [c.weight for c in clients]
    total = _total_weight(spec, known, members.uris, clients) if all(w is not None for w in known) else None
    n = len(clients)
    if spec.secure:
        terms = _secure_terms(members, headers, order, ref, first, n)
    elif spec.dp is None:
        terms = {"metadata": _plain_metadata(spec, first, n, total)}
    else:
        base_ref = _base_ref(spec, first, ref, order, position, layouts, base)
        terms = _dp_terms(spec, base, base_ref, order, budget, len(members.uris))
    plan = ShardPlan(
        **{
            "job_id": job_id,
            "output": out,
            "tensors": order,
            "clients": clients,
            "layouts": [list(k) for k in layouts],
            "bounds": [0, first.data_bytes],
            "chunk_bytes": 1,
            "read_window": 1,
            "aggregator": spec.aggregator,
            "uniform": spec.uniform,
            "accumulate": spec.accumulate,
            "integer_policy": spec.integer_policy,
            "trim_fraction": spec.trim_fraction,
            "allow_nonfinite": spec.allow_nonfinite,
            "total_weight": total,
            "budget": budget,
            "clients_listed": len(members.uris),
            "excluded": members.excluded(),
            **terms,  # what a secure or DP round sets otherwise
        }
    )
    cut_shards(plan, spec.shards)
    return plan


@dataclass
class _Headers:
    """What the round's headers say, one parsed header kept per distinct set of tensors (its signature):
    ``kinds``, each signature's first client and that client's header; per client its signature, its
    tensors' data offsets in tensor-name order (equal tuples are one object: a layout), its data start and
    its ``__metadata__`` (for its weight)."""

    kinds: dict[tuple, tuple[int, FileHeader]] = dataclasses.field(default_factory=dict)
    sig_of: dict[int, tuple] = dataclasses.field(default_factory=dict)
    begins: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    data_start: dict[int, int] = dataclasses.field(default_factory=dict)
    metadata: dict[int, dict[str, str]] = dataclasses.field(default_factory=dict)


def _read_headers(members: _Round, pins: dict[str, Pin], ref_sig: tuple | None) -> _Headers:
    """Every live client's length prefix, then its header (two GetBatches), checked; ``ref_sig``: the
    tensors a DP round's public reference fixes (an update unlike them is out)."""
    uris, tolerant = members.uris, members.spec.tolerant
    lengths: dict[int, int] = {}
    got = _Headers()
    signatures: dict[tuple, tuple] = {}  # one tuple per distinct set of tensors, however many clients
    distinct: dict[tuple[int, ...], tuple[int, ...]] = {}

    def take_length(i: int, data: bytes) -> None:
        lengths[i] = parse_length_prefix(data, i, uris[i])

    def take_header(i: int, data: bytes) -> None:
        header = parse_header(data, i, uris[i])
        # a truncated file is out before it is counted: it may not vote on the round's tensors
        check_object_size(header, pins[uris[i]].size, i, uris[i])
        sig = _signature(header)
        sig = signatures.setdefault(sig, sig)
        kinds = got.kinds
        if ref_sig is not None:
            if sig != ref_sig:
                raise InvalidModelFile(
                    f"{where(i, uris[i])}: its tensors are not the round's (dp.structure's, else dp.base's)",
                    uri=uris[i],
                )
            kinds.setdefault(sig, (i, header))
        elif not kinds and not tolerant:
            kinds[sig] = (i, header)
        elif sig not in kinds:
            if not tolerant:  # every update needed: the first one's tensors are the round's
                ref, first = next(iter(kinds.values()))
                check_like_first(first, header, i, uris[i], ref)
            kinds[sig] = (i, header)
        got.sig_of[i] = sig
        offsets = tuple(header.tensors[name].begin for name in sorted(header.tensors))
        got.begins[i] = distinct.setdefault(offsets, offsets)
        got.data_start[i] = header.data_start
        got.metadata[i] = header.metadata

    prefixes = {i: {"uri": uris[i], "start": 0, "length": PREFIX_BYTES} for i in members.live()}
    members.read_each(prefixes, pins, lambda i: "shorter than 8 bytes: not a safetensors file", take_length)
    headers = {i: {"uri": uris[i], "start": PREFIX_BYTES, "length": lengths[i]} for i in members.live()}
    members.read_each(
        headers,
        pins,
        lambda i: (
            f"its length prefix announces a {lengths[i]}-byte header, past the end of the object "
            "(truncated, or not a safetensors file)"
        ),
        take_header,
    )
    return got


def _round_tensors(members: _Round, headers: _Headers) -> tuple[int, FileHeader]:
    """The round's tensors, those most clients have (a tie: the earliest client's), as ``(client, header)``;
    a client with others is out (or fails the round)."""
    kinds, sig_of = headers.kinds, headers.sig_of
    if not kinds:
        members.check_enough()  # no client left: raises
    votes: dict[tuple, int] = {}
    for i in members.live():
        votes[sig_of[i]] = votes.get(sig_of[i], 0) + 1
    sig = max(votes, key=lambda k: (votes[k], -kinds[k][0]))
    ref, first = kinds[sig]
    for i in members.live():
        if sig_of[i] != sig:
            try:
                check_like_first(first, kinds[sig_of[i]][1], i, members.uris[i], ref)
            except InvalidModelFile as exc:
                members.out(i, exc)
    return ref, first


def _clients(
    spec: FedAvgSpec, members: _Round, headers: _Headers, order: list, position: dict[str, int], pins: dict
) -> tuple[list[ClientRef], dict[tuple[int, ...], int]]:
    """The clients that stay, with their weights, and their distinct layouts (offsets in ``order``) with each
    one's index; enough of them, or :class:`TooFewClients`."""
    uris = members.uris
    # Weights last: a broken file is reported as broken before its metadata is judged. DP and secure rounds
    # take the uniform mean; a weight is needed where the mean is weighted (ShardPlan.weighted's rule).
    uniform = spec.uniform or spec.dp is not None or spec.secure
    weight_needed = spec.aggregator == "mean" and not uniform
    weights: dict[int, float | None] = {}
    for i in members.live():
        try:
            weights[i] = _weight(spec, headers.metadata[i], i, uris[i], weight_needed)
        except InvalidModelFile as exc:
            members.out(i, exc)
    members.check_enough()
    clients: list[ClientRef] = []
    layouts: dict[tuple[int, ...], int] = {}
    for i in members.live():
        key = tuple(headers.begins[i][position[t.name]] for t in order)
        layout = layouts.setdefault(key, len(layouts))
        clients.append(ClientRef(uris[i], weights[i], headers.data_start[i], layout, pins[uris[i]], i))
    return clients, layouts


# Only inputs and options go into the output's header, so the same round gives the same bytes in any job.


def _metadata(fmt_from: FileHeader | None, **more: str) -> dict[str, str]:
    """The output's ``__metadata__``: ``fmt_from``'s format (else :data:`DEFAULT_FORMAT`), then ``more``."""
    fmt = fmt_from.metadata.get("format", DEFAULT_FORMAT) if fmt_from is not None else DEFAULT_FORMAT
    return {"format": fmt, **more}


def _plain_metadata(spec: FedAvgSpec, first: FileHeader, n: int, total: float | None) -> dict[str, str]:
    """A plain round's output names its aggregator, its clients and their total weight."""
    name = spec.aggregator + (" (uniform)" if spec.uniform else "")
    meta = _metadata(first, shardfold_aggregator=name, shardfold_clients=str(n))
    if total is not None:
        meta["num_examples"] = format_number(total)
    return meta


def _dp_terms(
    spec: FedAvgSpec, base: tuple | None, base_ref: ClientRef | None, order: list, budget: Budget, listed: int
) -> dict[str, Any]:
    """A DP round's plan terms: the mean in float64, its integer and bool tensors the base's. Nothing that
    depends on the clients goes into its output beyond the noisy mean: not how many took part, nor their
    example counts, nor a client's format (the base's, or the default)."""
    doc = {
        "clip_norm": spec.dp.clip_norm,
        "noise_multiplier": spec.dp.noise_multiplier,
        "denominator": spec.dp.expected_clients or listed,
    }
    name = (
        f"dp-fedavg (clip_norm {spec.dp.clip_norm!r}, noise_multiplier {spec.dp.noise_multiplier!r}, "
        f"expected_clients {doc['denominator']})"
    )
    return {
        "uniform": True,
        "accumulate": "float64",
        "integer_policy": "base",
        "metadata": _metadata(base[0] if base is not None else None, shardfold_aggregator=name),
        "total_weight": None,
        "dp": doc,
        "base": base_ref,
        "budget": _with_noise_time(budget, order, listed),
    }


def _base_ref(
    spec: FedAvgSpec,
    first: FileHeader,
    ref: int,
    order: list,
    position: dict[str, int],
    layouts: dict[tuple[int, ...], int],
    base: tuple[FileHeader, Pin, str] | None,
) -> ClientRef | None:
    """dp.base's reads (its layout among the clients'), checked to hold the round's tensors; without a base
    every tensor must be a float one (integer and bool tensors are copied from the base)."""
    if base is None:
        for t in order:
            if t.dt.kind != "float":
                raise PlanError(
                    f"tensor {t.name!r} is {t.dtype}: a DP round takes integer and bool tensors from dp.base "
                    "(the global model), and the spec gives none; give dp.base or leave the tensor out of "
                    "the updates"
                )
        return None
    header, pin, uri = base
    try:
        check_like_first(first, header, -1, uri, ref)
    except InvalidModelFile as exc:
        raise InvalidModelFile(f"dp.base ({uri}): {exc.reason}", uri=uri, reason=exc.reason) from None
    names = sorted(header.tensors)
    offsets = [header.tensors[name].begin for name in names]
    key = tuple(offsets[position[t.name]] for t in order)
    layout = layouts.setdefault(key, len(layouts))
    return ClientRef(uri, None, header.data_start, layout, pin, None)


MASK_HINT = "write it with client.fedavg.mask_update"


def _secure_terms(
    members: _Round, headers: _Headers, order: list, ref: int, first_header: FileHeader, n: int
) -> dict[str, Any]:
    """A secure round's plan terms: the masked updates' uniform mean, with the round's parameters, the same in
    every masked update, for as many clients as the spec lists (each one's masks cancel only against all the
    others'); every tensor a masked U32 one."""
    uris = members.uris
    for t in order:
        if t.dtype != "U32":
            what = f"tensor {t.name!r} is {t.dtype}, not a masked update's U32 ({MASK_HINT})"
            raise bad_file(ref, uris[ref], what, t.name)
    first: secagg.RoundParams | None = None
    for i in members.live():
        text = headers.metadata[i].get(secagg.METADATA_KEY)
        try:
            params = secagg.RoundParams.from_json(text) if text is not None else None
        except (ValueError, KeyError, TypeError) as exc:
            raise bad_file(i, uris[i], str(exc)) from None
        if params is None:
            what = f"no __metadata__.{secagg.METADATA_KEY}: not a masked update ({MASK_HINT})"
            raise bad_file(i, uris[i], what)
        if first is None:
            first = params
            if params.clients != len(uris) or set(params.dtypes) != {t.name for t in order}:
                what = f"masked for a round of {params.clients} clients and tensors {sorted(params.dtypes)}; "
                what += f"the spec lists {len(uris)} clients: every client whose key was published must be "
                what += "listed"
                raise bad_file(i, uris[i], what)
        elif params != first:
            what = f"masked for another round than client {members.live()[0]} ({params.round!r}, "
            what += f"{params.clients} clients, clip_range {params.clip_range!r})"
            raise bad_file(i, uris[i], what)
    assert first is not None
    doc = json.loads(first.to_json())
    name = f"secure mean (clip_range {doc['clip_range']!r}, scale {doc['scale']})"
    meta = _metadata(first_header, shardfold_aggregator=name, shardfold_clients=str(n))
    return {"uniform": True, "metadata": meta, "secure": doc}


def _with_noise_time(budget: Budget, tensors: list, clients: int) -> Budget:
    """The budget with its read rate lowered to count OpenDP's sampling too, so a DP shard's reads (twice:
    norms, then the mean) and noise fit the same share of the timeout: one element per float byte /
    itemsize, at :data:`dp.NOISE_SAMPLES_PER_S`."""
    floats = [t.dt.itemsize for t in tensors if t.dt.kind == "float"]
    per_byte = 1.0 / min(floats) if floats else 0.0
    seconds_per_byte = 2 * (clients + 1) / budget.read_bytes_per_s + per_byte / dp.NOISE_SAMPLES_PER_S
    return dataclasses.replace(budget, read_bytes_per_s=(clients + 1) / seconds_per_byte)


def _total_weight(spec: FedAvgSpec, weights: list[float], uris: list[str], clients: list[ClientRef]) -> float:
    """The weights' total (``math.fsum``); a :class:`SpecError` naming the largest weight's field when the
    total is beyond float64 (each weight is finite, but N of them near 1e308 are not)."""
    total = kernels.weight_total(weights)
    if math.isfinite(total):
        return total
    k = max(range(len(weights)), key=weights.__getitem__)
    i = clients[k].index
    field = (
        f"clients.{i}.weight"
        if spec.clients[i].weight is not None
        else f"{where(i, uris[i])} __metadata__.num_examples"
    )
    raise SpecError(
        f"the clients' weights add up to more than float64 holds (~1.8e308; the largest is {field} = "
        f"{weights[k]!r}); divide them all by one factor: only their ratios matter",
        [{"field": field, "error": "the weights' total overflows float64"}],
    )


def _weight(spec: FedAvgSpec, metadata: dict[str, str], i: int, uri: str, needed: bool) -> float | None:
    given = spec.clients[i].weight
    if given is not None:
        return float(given)
    if needed:
        return weight_from_metadata(metadata, i, uri)
    try:
        return weight_from_metadata(metadata, i, uri)
    except InvalidModelFile:
        return None  # unweighted job: a missing or odd num_examples does not matter


def prepare(spec: FedAvgSpec, job_id: str, store_root: str, *, budget: Budget | None = None) -> dict:
    """Inspect the clients, write the plan document and the shard work list; return small references.

    Returns ``{"worklist": worklist_ref, "shards", "clients", "tensors", "bytes", "plan", "notes"}``. Refuses
    (:class:`PlanError`) a plan whose aggregate task would not fit ``budget.memory_mb``.
    """
    p = inspect(spec, job_id, store_root, budget=budget)
    peak = task_loads(p, on_s3=is_s3(store_root))["aggregate"].peak_bytes
    if peak > p.budget.memory_mb * 2**20:
        raise PlanError(
            f"an aggregate task would need ~{peak / 2**20:.0f} MiB but the function has "
            f"{p.budget.memory_mb} MiB"
        )
    if p.dp is not None:  # the round's ρ, OpenDP's map: reserved now, spent by commit (which needs no OpenDP)
        _check_dp_shards(p)
        p.dp["rho"] = p.mechanism().rho()
    ledger_summary = _reserve(spec, job_id, store_root, p) if p.dp is not None else None
    store.put_json(plan_uri(store_root, job_id), p.to_doc())
    items = [{"shard": k, "start": p.bounds[k], "end": p.bounds[k + 1]} for k in range(p.shards)]
    wuri = worklist_uri(store_root, job_id)
    store.put_json(wuri, items)
    nuri = norms_worklist_uri(store_root, job_id)  # a DP round's first pass; empty otherwise
    store.put_json(nuri, items if p.dp is not None else [])
    for e in p.excluded:
        logger.warning("client left out of the round", extra={"job_id": job_id, **e})
    logger.info(
        "planned fedavg",
        extra={"job_id": job_id, "clients": p.n_clients, "bytes": p.data_bytes, "shards": p.shards},
    )
    return {
        "worklist": worklist_ref(wuri, p.shards),
        "norms": worklist_ref(nuri, p.shards if p.dp is not None else 0),
        "shards": p.shards,
        "clients": p.n_clients,
        "left_out": len(p.excluded),
        **({"ledger": ledger_summary} if ledger_summary is not None else {}),
        "tensors": len(p.tensors),
        "bytes": p.data_bytes,
        "plan": plan_uri(store_root, job_id),
        "notes": p.notes,
    }


def _check_dp_shards(p: ShardPlan) -> None:
    """Refuse, before any budget is reserved, a DP plan whose shard could not finish: one part is written
    in one conditional PUT, and a shard's reads and noise must fit the share of the timeout that
    :func:`~functions.fedavg.shardplan.choose_shards` allows (a spec's ``shards`` may ask for fewer)."""
    header = len(p.header())
    largest = max(p.bounds[k + 1] - p.bounds[k] + (header if k == 0 else 0) for k in range(p.shards))
    cap = shard_caps(p.n_clients, header, p.budget)[1]
    if largest > min(MAX_SINGLE_PUT, cap + header):
        raise PlanError(
            f"a DP round's shard of {largest / 2**20:.0f} MiB could not be read twice, noised and written "
            f"within its task (at most {min(MAX_SINGLE_PUT, cap) / 2**20:.0f} MiB): raise 'shards' to "
            f"{math.ceil(p.data_bytes / min(MAX_SINGLE_PUT, cap))} or more, or leave it out"
        )


def _reserve(spec: FedAvgSpec, job_id: str, store_root: str, p: ShardPlan) -> dict:
    """Charge the round's ρ (OpenDP's map of its mechanism) to the federation's ledger, before any noise."""
    return ledger.reserve(
        store_root,
        spec.dp.dataset_id,
        job_id,
        p.dp["rho"],
        spec.dp.dataset_budget_rho,
        unit="client",
    )


def load_plan(store_root: str, job_id: str) -> ShardPlan:
    return ShardPlan.from_doc(store.get_json(plan_uri(store_root, job_id)))


# --- aggregate ----------------------------------------------------------------------------------------------


@dataclass
class _Chunk:
    start: int
    end: int
    segs: list[Segment]
    layout_runs: list[list[RunRead]]
    remaining: int  # reads not yet folded in


def aggregate(spec: FedAvgSpec, job_id: str, store_root: str, shard: int) -> dict:
    """Aggregate one shard into its part object ``jobs/<id>/fedavg/parts/<shard>.bin``.

    Returns ``{"shard", "bytes", "reads", "read_bytes", ...}``. A DP round's part is written only if absent:
    its noise is drawn once, and a retried task finds the part and draws none.
    """
    p = load_plan(store_root, job_id)
    uri = part_uri(store_root, job_id, shard)
    if p.dp is not None and store.exists(uri):
        return {"shard": shard, "bytes": None, "reads": 0, "read_bytes": 0, "written_before": True}
    if p.dp is None:  # the same bytes whichever attempt writes them: written in place
        with store.spooled_writer(uri, SPOOL_BYTES) as out:
            stats = aggregate_into(p, shard, out)
    else:
        factors = np.frombuffer(store.get(clip_uri(store_root, job_id)), "<f8")
        if factors.size != p.n_clients or not np.all((factors >= 0) & (factors <= 1)):
            raise PlanError(f"the clip factors hold {factors.size} values, not {p.n_clients} in [0, 1]")
        try:
            with store.spooled_writer(uri, SPOOL_BYTES, if_absent=True) as out:
                stats = aggregate_dp_into(p, shard, out, factors)
        except ObjectExists:
            stats["written_before"] = True  # another attempt's part stands; this one's noise is dropped
    logger.info("aggregated shard", extra={"job_id": job_id, **stats})
    return stats


def scrub(spec: FedAvgSpec, job_id: str, store_root: str) -> dict:
    """A failed round's on_failure task: a DP round's clip factors and partial norms (each client's exact
    update norm, which only the noisy mean may reflect) are deleted, not kept until ``clean``. A resume
    computes them again from the updates."""
    if spec.dp is None:
        return {"removed": 0}
    removed = store.delete_prefix(job_uri(store_root, job_id, STAGE, "norms") + "/")
    for uri in (clip_uri(store_root, job_id), norms_worklist_uri(store_root, job_id)):
        if store.exists(uri):
            store.delete(uri)
            removed += 1
    return {"removed": removed}


def norms(spec: FedAvgSpec, job_id: str, store_root: str, shard: int) -> dict:
    """A DP round's first pass over one shard: each client's partial squared norm of its update there, as
    N float64 (plan order) in ``jobs/<id>/fedavg/norms/<shard>.f64``. Returns read statistics only."""
    p = load_plan(store_root, job_id)
    sums, stats = norms_into(p, shard)
    store.put(norms_uri(store_root, job_id, shard), sums.astype("<f8").tobytes())
    return stats


def clip(spec: FedAvgSpec, job_id: str, store_root: str) -> dict:
    """A DP round's clip factors from every shard's partial norms (``jobs/<id>/fedavg/clip.f64``); nothing
    for a round without DP. Returns no figure that depends on the updates."""
    if spec.dp is None:  # the plan has no DP either (prepare built it from this spec): nothing to read
        return {"clip": False}
    p = load_plan(store_root, job_id)
    out = clip_uri(store_root, job_id)
    if store.exists(out):  # a retry after success: the norms are gone, the factors stand
        return {"clip": True, "clients": p.n_clients}
    total = np.zeros(p.n_clients, np.float64)
    for k in range(p.shards):
        part = np.frombuffer(store.get(norms_uri(store_root, job_id, k)), "<f8")
        if part.size != p.n_clients:
            raise PlanError(f"norms of shard {k} hold {part.size} clients, the plan {p.n_clients}")
        total += part
    factors = dp.clip_factors(total, p.dp["clip_norm"])
    store.put(out, factors.astype("<f8").tobytes())
    # each client's exact norm is no longer needed: it does not stay in the store until commit
    store.delete_prefix(job_uri(store_root, job_id, STAGE, "norms") + "/")
    return {"clip": True, "clients": p.n_clients}


_malloc_tuned = False
M_ARENA_MAX = -8  # glibc mallopt parameter (malloc.h)


def one_malloc_arena() -> None:
    """Make glibc serve every thread from one malloc arena (as ``MALLOC_ARENA_MAX=1`` does).

    GetBatch's reader threads allocate the read buffers; with glibc's default of up to 8 arenas per core,
    each thread's freed 4 MiB buffers linger in its own arena, so the resident size creeps up with the
    number of reads (hundreds of MiB at N = 64) although live data stays constant. With one arena a freed
    buffer is reused by the next read: resident memory stays at what the task holds, and it is faster.
    A no-op where the C library has no ``mallopt``.
    """
    global _malloc_tuned
    if _malloc_tuned:
        return
    _malloc_tuned = True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(M_ARENA_MAX, 1)
    except (OSError, AttributeError):
        pass


BASE = -1  # the position of dp.base's reads in a shard's stream (the clients are 0..N-1)


@dataclass
class _Stream:
    """What a shard's reads came to: reads and bytes taken, GetBatch's peak of buffered bytes."""

    reads: int = 0
    read_bytes: int = 0
    peak_buffered_bytes: int = 0


def _shard_reads(plan: ShardPlan, shard: int, stats: _Stream) -> Iterator[tuple[_Chunk, int, RunRead, bytes]]:
    """Shard ``shard``'s reads, chunk by chunk: ``(chunk, position, run, data)``, the base's reads first
    (position :data:`BASE`), then each client's in plan order; ``chunk.remaining`` is 0 with its last
    read. One GetBatch with a bounded window of ranged reads in flight, pinned to the objects planned."""
    start, end = plan.shard_range(shard)
    geo = Geometry(plan.tensors)
    pending: deque[tuple[_Chunk, int, RunRead]] = deque()
    sources = ([(BASE, plan.base)] if plan.base is not None else []) + list(enumerate(plan.clients))

    def items() -> Iterator[dict[str, Any]]:
        for a, b in geo.chunks(start, end, plan.chunk_bytes):
            segs = geo.segments(a, b)
            layout_runs = [runs(plan.tensors, lay, segs) for lay in plan.layouts]
            total = sum(len(layout_runs[c.layout]) for _, c in sources)
            chunk = _Chunk(a, b, segs, layout_runs, total)
            for i, c in sources:
                for r in layout_runs[c.layout]:
                    pending.append((chunk, i, r))
                    yield {"uri": c.uri, "start": c.data_start + r.start, "length": r.length}

    pins = {c.uri: c.pin for _, c in sources if c.pin is not None}
    # Each read is folded in and dropped before the next is taken: reused aligned buffers (local files)
    # are filled several times faster than new bytes.
    stream = store.get_batch(
        items(),
        window=plan.read_window,
        concurrency=plan.read_window,
        pins=pins,
        buffer_bytes=plan.chunk_bytes,
    )
    last: _Chunk | None = None
    try:
        with stream:
            for entry in stream:
                chunk, i, r = pending.popleft()
                data = entry.data
                del entry
                stats.reads += 1
                stats.read_bytes += len(data)
                chunk.remaining -= 1
                last = chunk
                yield chunk, i, r, data
                del data
        stats.peak_buffered_bytes = stream.stats.peak_buffered_bytes
    except BatchItemError as exc:
        # reads fail in request order, after every read before them was taken: it is the first pending one
        k = pending[0][1]
        if k == BASE:
            raise StoreError(f"dp.base ({plan.base.uri}): {exc.reason}") from None
        c = plan.clients[k]
        what = "shorter than its header says (truncated since the plan?)"
        raise _batch_error(exc, c.place(k), c.uri, what) from None
    if pending or (last is not None and last.remaining):
        raise AssertionError(f"shard {shard}: the read stream ended early")


def _values(plan: ShardPlan, chunk: _Chunk, j: int, data: bytes, off: int) -> np.ndarray:
    """Piece ``j`` of ``chunk`` in one read's bytes, as its tensor's dtype (a view)."""
    s = chunk.segs[j]
    return np.frombuffer(data, dtype=plan.tensors[s.tensor].dt.np, count=s.count, offset=off)


def aggregate_into(plan: ShardPlan, shard: int, out: BinaryIO) -> dict:
    """Write shard ``shard``'s part of a plain or secure round (the header first for shard 0) to ``out``."""
    if plan.dp is not None:
        raise AssertionError("a DP round aggregates through aggregate_dp_into")
    one_malloc_arena()
    start, end = plan.shard_range(shard)
    n = plan.n_clients
    geo = Geometry(plan.tensors)
    rules = plan.rules()
    params = plan.params()
    largest = max(
        (
            sum(kernels.need(rules[s.tensor], s.count, n) for s in geo.segments(a, b))
            for a, b in geo.chunks(start, end, plan.chunk_bytes)
        ),
        default=0,
    )
    arena = kernels.Arena(largest)  # one allocation for the whole shard
    written = 0
    if shard == 0:
        written += out.write(plan.header())
    current: _Chunk | None = None
    reducers: list[kernels.Reducer] = []
    stats = _Stream()
    # Overflow and NaN arithmetic is detected on the results (or allowed), not warned about.
    with np.errstate(over="ignore", invalid="ignore"):
        for chunk, i, r, data in _shard_reads(plan, shard, stats):
            if chunk is not current:
                current = chunk
                arena.reserve(sum(kernels.need(rules[s.tensor], s.count, n) for s in chunk.segs))
                reducers = [kernels.reducer(rules[s.tensor], s.count, params, arena) for s in chunk.segs]
            for j, off in r.pieces:
                reducers[j].add(i, _values(plan, chunk, j, data, off))
            del data
            if chunk.remaining == 0:
                for j, red in enumerate(reducers):
                    try:
                        values = red.finish()
                    except kernels.NonFinite as exc:
                        raise _nonfinite(plan, chunk, j, exc) from None
                    if red.nonfinite is not None:  # never written unless allowed
                        _check_nonfinite_output(plan, chunk, j, red.nonfinite)
                    written += out.write(values.view(np.uint8))
                    del values
                reducers = []
    return {
        "shard": shard,
        "bytes": written,
        "reads": stats.reads,
        "read_bytes": stats.read_bytes,
        "peak_buffered_bytes": stats.peak_buffered_bytes,
        "arena_bytes": arena.peak,
    }


# --- DP-FedAvg: the norms pass, the clip factors, the noisy mean ------------------------------------------


def _float_segments(plan: ShardPlan, chunk: _Chunk) -> list[bool]:
    return [plan.tensors[s.tensor].dt.kind == "float" for s in chunk.segs]


def norms_into(plan: ShardPlan, shard: int) -> tuple[np.ndarray, dict]:
    """Each client's partial ‖xᵢ − base‖² over shard ``shard``'s float elements (float64, plan order;
    NaN or Inf where the update is not finite there), and the read statistics."""
    n = plan.n_clients
    sums = np.zeros(n, np.float64)
    stats = _Stream()
    base: dict[int, np.ndarray] = {}  # the chunk's base values per float segment, as float64
    with np.errstate(over="ignore", invalid="ignore"):
        for chunk, i, r, data in _shard_reads(plan, shard, stats):
            floats = _float_segments(plan, chunk)
            for j, off in r.pieces:
                if not floats[j]:
                    continue
                x = _values(plan, chunk, j, data, off)
                if i == BASE:
                    base[j] = x.astype(np.float64)
                    continue
                d = kernels.difference(x, base.get(j), np.empty(x.size, np.float64))  # as the mean's
                sums[i] += float(np.dot(d, d))
            del data
            if chunk.remaining == 0:
                base = {}
    return sums, {"shard": shard, "reads": stats.reads, "read_bytes": stats.read_bytes}


def aggregate_dp_into(plan: ShardPlan, shard: int, out: BinaryIO, factors: np.ndarray) -> dict:
    """Write shard ``shard``'s part of a DP round: per float element base + Σᵢ cᵢ(xᵢ − base)/m + noise,
    cast to the tensor's dtype; integer and bool elements are the base's."""
    mech = plan.mechanism()
    written = out.write(plan.header()) if shard == 0 else 0
    stats = _Stream()
    acc: list[np.ndarray | None] = []
    base: dict[int, np.ndarray] = {}
    current: _Chunk | None = None
    scratch = np.empty(kernels.BLOCK, np.float64)  # one update's difference, block by block
    with np.errstate(over="ignore", invalid="ignore"):
        for chunk, i, r, data in _shard_reads(plan, shard, stats):
            if chunk is not current:
                current = chunk
                floats = _float_segments(plan, chunk)
                acc = [
                    np.zeros(s.count, np.float64) if f else None
                    for s, f in zip(chunk.segs, floats, strict=True)
                ]
            for j, off in r.pieces:
                x = _values(plan, chunk, j, data, off)
                a = acc[j]
                if i == BASE:
                    base[j] = x.copy()
                    continue
                if a is None or factors[i] == 0.0:  # an integer tensor, or an update that adds nothing
                    continue
                # a += c_i (float64(x) - float64(base)), in one pass
                kernels.axpy_difference(a, x, base.get(j), factors[i], scratch)
            del data
            if chunk.remaining == 0:
                for j, s in enumerate(chunk.segs):
                    dtype = plan.tensors[s.tensor].dt.np
                    a = acc[j]
                    if a is None:
                        values = base[j]  # an integer or bool tensor: the base's (the plan needs a base)
                    else:
                        a /= mech.denominator
                        mech.add_noise(a)
                        if j in base:
                            a += base[j]
                        values = a.astype(dtype)
                    written += out.write(np.ascontiguousarray(values).view(np.uint8))
                acc, base = [], {}
    return {"shard": shard, "bytes": written, "reads": stats.reads, "read_bytes": stats.read_bytes}


def _piece_inputs(plan: ShardPlan, chunk: _Chunk, j: int) -> Iterator[tuple[int, np.ndarray]]:
    """Re-read piece ``j`` of ``chunk`` from every client, in client order: ``(client, values)``, one client's
    values at a time (for the error paths: the reducers no longer hold their inputs)."""
    seg = chunk.segs[j]
    t = plan.tensors[seg.tensor]
    for i, c in enumerate(plan.clients):
        for r in chunk.layout_runs[c.layout]:
            for jj, off in r.pieces:
                if jj == j:
                    data = store.get(c.uri, c.data_start + r.start + off, seg.count * t.dt.itemsize, c.pin)
                    yield i, np.frombuffer(data, dtype=t.dt.np)


def _nonfinite(plan: ShardPlan, chunk: _Chunk, j: int, exc: kernels.NonFinite) -> ShardfoldError:
    """The error for a non-finite piece: name the first client holding NaN/Inf there (re-reading the chunk
    for a weighted sum, whose inputs are gone), or report an overflow."""
    seg = chunk.segs[j]
    t = plan.tensors[seg.tensor]
    if exc.client is not None:
        return _nonfinite_error(plan, exc.client, t.name, seg.first + exc.element)
    for i, x in _piece_inputs(plan, chunk, j):
        bad = np.flatnonzero(~np.isfinite(x))
        if bad.size:
            return _nonfinite_error(plan, i, t.name, seg.first + int(bad[0]))
    acc = plan.rules()[seg.tensor].acc
    element = seg.first + exc.element
    return AggregationOverflow(
        f"tensor {t.name!r}: the weighted sum overflows {acc} at element {element} "
        "although every update is finite; set accumulate='float64', or scale the weights down (only their "
        "ratios matter)",
        tensor=t.name,
        element=element,
    )


def _check_nonfinite_output(plan: ShardPlan, chunk: _Chunk, j: int, bad: np.ndarray) -> None:
    """Raise :class:`NonFiniteAggregate` for piece ``j``'s non-finite output elements ``bad`` (a mask), unless
    the job allows NaN/Inf and an input at each of those elements was itself NaN or Inf."""
    seg = chunk.segs[j]
    t = plan.tensors[seg.tensor]
    if plan.allow_nonfinite:
        unexplained = bad.copy()
        for _, x in _piece_inputs(plan, chunk, j):
            unexplained &= np.isfinite(x)
            if not unexplained.any():
                return
    else:
        unexplained = bad
    element = seg.first + int(np.argmax(unexplained))
    rule = plan.rules()[seg.tensor]
    hint = (
        "; accumulate='float64' may avoid it"
        if rule.acc == kernels.F32 and plan.accumulate == "float32"
        else ""
    )
    raise NonFiniteAggregate(
        f"tensor {t.name!r}: the {plan.aggregator} is NaN or Inf at flat element {element} although every "
        f"update there is finite ({rule.acc} arithmetic); no output was written{hint}",
        tensor=t.name,
        element=element,
    )


def _nonfinite_error(plan: ShardPlan, client: int, tensor: str, element: int) -> NonFiniteUpdate:
    """``client``: the client's place in the plan (its place in the spec is the one named)."""
    c = plan.clients[client]
    return NonFiniteUpdate(
        f"{c.label(client)}: tensor {tensor!r} holds NaN or Inf (first at flat element {element}); fix "
        "the update, or set allow_nonfinite=true to aggregate it anyway",
        client=c.place(client),
        uri=c.uri,
        tensor=tensor,
    )


# --- commit -------------------------------------------------------------------------------------------------


def _spend(spec: FedAvgSpec, job_id: str, store_root: str, p: ShardPlan) -> dict:
    """Record the round's ρ on the ledger; the privacy report of the result."""
    mech = p.mechanism()
    rho = p.dp["rho"]
    summary = ledger.spend(store_root, spec.dp.dataset_id, job_id, rho)
    return {
        "mechanism": "DP-FedAvg: clip each update to clip_norm, mean over expected_clients, Gaussian noise",
        "neighbouring": "add or remove one client (its whole update)",
        "clip_norm": mech.clip_norm,
        "noise_multiplier": mech.noise_multiplier,
        "expected_clients": mech.denominator,
        "noise_std": mech.sigma,
        "rho_spent": rho,
        "epsilon_cks": cdp_eps(rho, REPORT_DELTA),
        "delta": REPORT_DELTA,
        "sampler": dp.sampler_id(mech),
        "ledger": summary,
    }


def commit(spec: FedAvgSpec, job_id: str, store_root: str, shards: int) -> dict:
    """Assemble the parts into the output, write ``jobs/<id>/result.json``, remove the temporaries."""
    result_uri = job_uri(store_root, job_id, "result.json")
    if store.exists(result_uri):  # a retried commit after success: the result stands, scratch goes
        store.delete_prefix(join(store_root, scratch_key(job_id, STAGE)))
        return store.get_json(result_uri)
    p = load_plan(store_root, job_id)
    if shards != p.shards:
        raise PlanError(f"commit was told {shards} shards but the plan has {p.shards}")
    store.assemble([part_uri(store_root, job_id, k) for k in range(p.shards)], p.output)
    header_bytes = len(p.header())
    privacy = _spend(spec, job_id, store_root, p) if p.dp is not None else None
    result = {
        "job_id": job_id,
        "kind": "fedavg",
        "output": p.output,
        "clients": p.n_clients,
        "clients_listed": p.clients_listed if p.clients_listed is not None else p.n_clients,
        "excluded": p.excluded,
        "total_weight": p.total_weight,
        "tensors": len(p.tensors),
        "elements": sum(t.elements for t in p.tensors),
        "bytes": header_bytes + p.data_bytes,
        "data_bytes": p.data_bytes,
        "header_bytes": header_bytes,
        "shards": p.shards,
        "aggregator": p.aggregator,
        "uniform": p.uniform,
        "accumulate": p.accumulate,
        "integer_policy": p.integer_policy,
        "trim_fraction": p.trim_fraction,
        "trimmed_per_side": kernels.trim_count(p.trim_fraction, p.n_clients)
        if p.aggregator == "trimmed_mean"
        else 0,
        "dtypes": p.dtype_counts(),
        "notes": p.notes,
        **({"privacy": privacy} if privacy is not None else {}),
    }
    store.put_json(result_uri, result)
    store.delete_prefix(join(store_root, scratch_key(job_id, STAGE)))
    return result
