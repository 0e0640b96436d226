"""fedavg's shard plan: the plan document, shards, chunks, reads and each step's per-task load.

Everything here is pure (no store access): the kind's estimate (:mod:`functions.fedavg.sizing`) and the
benchmarks call :func:`task_loads` on a :class:`ShardPlan` that :func:`functions.fedavg.core.inspect` built
from the headers; the core imports the same rules to run the plan.

**Byte space.** The output's data buffer is the concatenation of the tensors in client 0's data order.
A shard is a byte range ``[bounds[k], bounds[k+1])`` of it; a chunk is a sub-range of a shard; both end on
element boundaries (of whichever tensor they fall in) and may cross tensor boundaries. A chunk cut into
*segments* (one per tensor it touches) maps, for each client, to the ranges of that client's file holding
those segments; ranges that touch are merged, so a client written like client 0 is read in ONE ranged GET
per chunk.

**Shard count** (:func:`choose_shards`). Memory does not bound a shard (a task streams its shard in chunks and
spools its part to ephemeral storage), so the shard size ``S`` is the target size
(``Budget.target_shard_bytes``, for parallelism) capped by

* time: a task reads ``(N + 1) * S`` bytes (N inputs and its own part upload), which must take at most
  ``time_fraction`` of the Lambda timeout at the assumed ``read_bytes_per_s``;
* ephemeral storage: the spooled part (``S`` plus the header for shard 0) must fit ``/tmp`` less a margin;
* S3: at most 5 GiB per copied part is handled by the store, at most 10,000 parts per object.

and floored by S3's 5 MiB multipart minimum (every shard but the last is at least ``min_shard_bytes``, so
commit assembles the output with server-side UploadPartCopy only). ``M = ceil(B / S)``, raised to a whole
number of waves of ``Budget.workers`` (the aggregate tasks that run at once where the job runs, see
:func:`workers_for`: one task per worker at least, so no worker idles while another sums a larger shard),
then lowered to what the 5 MiB floor allows; boundaries ``floor(k B / M)`` aligned down to an element (they
may fall inside a tensor). More shards only shrink each task's part and reads: a task's peak memory is set
by its chunk, not its shard. A ``shards`` given in the spec is used, lowered to what the 5 MiB floor allows;
if it breaks the time or storage cap a note says so.

**Chunks** (:func:`chunk_bytes_for`). The mean reads ``Budget.chunk_bytes`` (4 MiB) per ranged GET.
median/trimmed_mean hold all N values of a chunk, so their chunk is ``robust_bytes / (N * acc_ratio)``
bytes: the matrix stays within ``robust_bytes`` whatever N is (more, smaller GETs as N grows), down to
``min_robust_chunk`` bytes, below which memory grows as ``N * min_robust_chunk * acc_ratio``. A task keeps
``Budget.inflight_bytes`` of reads buffered or in flight (:func:`read_window`): 8 chunks of the mean on S3, 2
on a local store (:data:`LOCAL_INFLIGHT_BYTES`).
"""

from __future__ import annotations

import bisect
import json
import math
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from shardfold.functions import pricing
from shardfold.functions.errors import PlanError
from shardfold.functions.estimate import projected_peak
from shardfold.functions.fedavg import dp, kernels, secagg
from shardfold.functions.fedavg.layout import Tensor, encode_header
from shardfold.functions.store.local import WRITE_BUFFER
from shardfold.functions.store.pinning import Pin
from shardfold.functions.store.s3 import MAX_SINGLE_PUT
from shardfold.functions.store.uri import is_s3

MiB = 1 << 20
S3_MIN_PART = 5 * MiB  # every multipart part but the last
S3_MAX_PARTS = 10_000
S3_MAX_COPY_PART = 5 * 1024**3
MULTIPART_CHUNK = 8 * MiB  # s3transfer: uploads above this go multipart, in parts of this size
UPLOAD_BUFFER_BYTES = 10 * MULTIPART_CHUNK  # s3transfer keeps up to 10 parts in memory
SPOOL_BYTES = 1 * MiB  # a part stays in memory up to this, then spills to ephemeral storage
EPHEMERAL_MARGIN = 64 * MiB  # room left in /tmp for everything else
RUNTIME_BYTES = 160 * MiB  # warm Python with numpy, boto3, awscrt, pydantic, Powertools (assumed)
HEADER_PARSE_FACTOR = 12  # parsed JSON header objects per header byte (plan holds all N headers' tensors)
DELETE_BATCH = 1000  # objects per DeleteObjects call
# Python objects of an aggregate task besides its buffers: read descriptors, GetBatch slots and hedge timers
# (a few thousand), interned paths, the store clients.
OBJECT_BYTES = 4 * MiB

# A DP round's aggregate task also imports OpenDP's sampler (opendp.prelude and its extras): 109 MiB measured
# over the fedavg runtime.
DP_RUNTIME_BYTES = 128 * MiB
AGGREGATE_MEMORY_MB = 1769  # 1 vCPU: the aggregate is CPU-bound once reads overlap
PLAN_MEMORY_MB = 1024
COMMIT_MEMORY_MB = 512
LAMBDA_TIMEOUT_S = 900


@dataclass(frozen=True)
class Budget:
    """What a plan is sized for. Defaults: the deployed aggregate function and Lambda's limits.

    Tests shrink ``min_shard_bytes``, ``chunk_bytes``, ``robust_bytes`` and ``min_robust_chunk`` to cut tiny
    models into many shards and chunks (the 5 MiB floor only matters for S3 assembly).
    """

    memory_mb: int = AGGREGATE_MEMORY_MB  # the aggregate function's memory
    timeout_s: int = LAMBDA_TIMEOUT_S
    ephemeral_mb: int = 512  # /tmp of the aggregate function (Lambda's default)
    read_bytes_per_s: float = pricing.FEDAVG_READ_BYTES_PER_S  # one function's S3 reads (paper: 45-57 MB/s)
    time_fraction: float = 0.5  # share of the timeout a shard may take by that estimate
    min_shard_bytes: int = S3_MIN_PART
    target_shard_bytes: int = 64 * MiB
    chunk_bytes: int = 4 * MiB  # bytes per ranged GET for the mean
    inflight_bytes: int = 32 * MiB  # reads buffered or in flight per task
    robust_bytes: int = 256 * MiB  # median/trimmed_mean: the N x chunk matrix
    min_robust_chunk: int = 4096
    # aggregate tasks that run at once (:func:`workers_for`): the plan cuts at least this many shards when the
    # floor allows, in whole waves of it
    workers: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            if not getattr(self, f.name) > 0:
                raise PlanError(f"Budget.{f.name} must be > 0, got {getattr(self, f.name)}")

    @classmethod
    def from_doc(cls, doc: dict[str, Any] | None) -> Budget:
        return cls(**(doc or {}))


@dataclass(frozen=True)
class ClientRef:
    """One client in the plan: where its data buffer starts and which layout its offsets follow."""

    uri: str
    weight: float | None  # the resolved weight (None when the job does not use weights and none was found)
    data_start: int  # 8 + its header length
    layout: int  # index into ShardPlan.layouts
    pin: Pin | None = None  # the object read at plan time; the aggregate tasks read only that one
    index: int | None = None  # its place in the spec's list (None: its place in the plan's), for messages

    def place(self, position: int) -> int:
        """The client's place in the spec (``position``: its place in the plan)."""
        return position if self.index is None else self.index

    def label(self, position: int) -> str:
        """``client <i> (<uri>)``, ``i`` being the client's place in the spec."""
        return f"client {self.place(position)} ({self.uri})"


@dataclass
class ShardPlan:
    """The plan document (``jobs/<id>/fedavg/plan.json``): everything an aggregate task needs.

    ``layouts[j][t]`` is where tensor ``t`` (output order) begins in the data buffer of clients whose
    ``layout`` is ``j``; clients written like client 0 share layout 0, so the document stays O(N + T).
    """

    job_id: str
    output: str
    tensors: list[Tensor]
    clients: list[ClientRef]
    layouts: list[list[int]]
    bounds: list[int]  # shard k covers output data bytes [bounds[k], bounds[k+1])
    chunk_bytes: int
    read_window: int
    aggregator: str
    uniform: bool
    accumulate: str
    integer_policy: str
    trim_fraction: float
    allow_nonfinite: bool
    metadata: dict[str, str]
    total_weight: float | None
    budget: Budget = field(default_factory=Budget)
    notes: list[str] = field(default_factory=list)
    # clients listed in the spec and those left out of the round ({"client", "uri", "reason"}: min_clients)
    clients_listed: int | None = None
    excluded: list[dict[str, Any]] = field(default_factory=list)
    # DP-FedAvg: {"clip_norm", "noise_multiplier", "denominator"}, and the base model's reads (None: none)
    dp: dict[str, Any] | None = None
    base: ClientRef | None = None
    # secure aggregation: the round's parameters (functions.fedavg.secagg.RoundParams); None: a plain round
    secure: dict[str, Any] | None = None
    version: int = 1

    # --- derived ---------------------------------------------------------------------------------------

    @property
    def shards(self) -> int:
        return len(self.bounds) - 1

    @property
    def data_bytes(self) -> int:
        return self.tensors[-1].end if self.tensors else 0

    @property
    def n_clients(self) -> int:
        return len(self.clients)

    def header(self) -> bytes:
        """The output's length prefix and header (shard 0's part starts with it). A secure round's masked
        U32 tensors come out as float32 means: the same size, so the same offsets."""
        tensors = self.tensors
        if self.secure is not None:
            tensors = [Tensor(t.name, "F32", t.shape, t.begin, t.end) for t in tensors]
        return encode_header(tensors, self.metadata)

    def shard_range(self, shard: int) -> tuple[int, int]:
        if not 0 <= shard < self.shards:
            raise PlanError(
                f"shard {shard} does not exist; the plan has {self.shards} (0..{self.shards - 1})"
            )
        return self.bounds[shard], self.bounds[shard + 1]

    def robust(self) -> bool:
        return self.aggregator in ("median", "trimmed_mean")

    def weighted(self) -> bool:
        return self.aggregator == "mean" and not self.uniform

    def rules(self) -> list[kernels.Rule]:
        if self.secure is not None:
            return [kernels.SECURE_SUM] * len(self.tensors)
        return [
            kernels.rule_for(
                t.dt,
                aggregator=self.aggregator,
                uniform=self.uniform,
                accumulate=self.accumulate,
                integer_policy=self.integer_policy,
                allow_nonfinite=self.allow_nonfinite,
            )
            for t in self.tensors
        ]

    def params(self) -> kernels.Params:
        n = self.n_clients
        if self.weighted():
            weights = [float(c.weight) for c in self.clients]  # type: ignore[arg-type]
            total = float(self.total_weight)  # type: ignore[arg-type]
        else:
            weights, total = [1.0] * n, float(n)
        secure = secagg.RoundParams.from_json(json.dumps(self.secure)) if self.secure is not None else None
        trim = kernels.trim_count(self.trim_fraction, n)
        return kernels.Params(weights=weights, total=total, n_clients=n, trim=trim, secure=secure)

    def mechanism(self) -> dp.Mechanism:
        """The round's noise; a DP plan only."""
        if self.dp is None:
            raise PlanError("not a DP round")
        elements = sum(t.elements for t in self.tensors if t.dt.kind == "float")
        return dp.Mechanism(
            self.dp["clip_norm"], self.dp["denominator"], self.dp["noise_multiplier"], elements
        )

    def dtype_counts(self) -> dict[str, int]:
        """The output's tensors by dtype (a secure round's are float32)."""
        out: dict[str, int] = {}
        for t in self.tensors:
            dtype = "F32" if self.secure is not None else t.dtype
            out[dtype] = out.get(dtype, 0) + 1
        return dict(sorted(out.items()))

    # --- JSON ------------------------------------------------------------------------------------------

    def to_doc(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["tensors"] = [[t.name, t.dtype, list(t.shape), t.begin, t.end] for t in self.tensors]
        doc["clients"] = [_client_row(c) for c in self.clients]
        doc["base"] = _client_row(self.base) if self.base is not None else None
        return doc

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> ShardPlan:
        doc = dict(doc)
        if doc.get("version") != 1:
            raise PlanError(f"plan document version {doc.get('version')!r} is not supported (expected 1)")
        doc["tensors"] = [Tensor(n, d, tuple(s), b, e) for n, d, s, b, e in doc["tensors"]]
        doc["clients"] = [_client_ref(c) for c in doc["clients"]]
        doc["base"] = _client_ref(doc["base"]) if doc.get("base") else None
        doc["budget"] = Budget.from_doc(doc.get("budget"))
        return cls(**doc)


def _client_row(c: ClientRef) -> list[Any]:
    return [c.uri, c.weight, c.data_start, c.layout, c.pin.to_doc() if c.pin else None, c.index]


def _client_ref(row: list[Any]) -> ClientRef:
    return ClientRef(*row[:4], Pin.from_doc(row[4]) if len(row) > 4 and row[4] else None, *row[5:6])


# --- shard count ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardChoice:
    shards: int
    notes: tuple[str, ...] = ()


def workers_for(store_root: str) -> int:
    """How many aggregate tasks the plan keeps busy at once where a job on ``store_root`` runs.

    A local store: the local executor's worker processes (``os.cpu_count()``, as
    :class:`~orchestrator.local.LocalExecutor` sizes its pool): fewer shards than that leave cores idle
    while the job runs. S3 (Lambda, and the moto backend that stands in for it): 1, the size rule alone.
    Lambda runs every shard at once in any case (its concurrency, 1,000 per region by default, is far above
    a round's shards), so no worker waits; cutting the model down to 5 MiB shards to fill that concurrency
    would cut a round's time 4-10x but raise its bill 1.4-3.3x (more GETs, PUTs and Map transitions;
    ``bench/fedavg_cost.py`` at 43 MB-5 GB, N = 20 and 100), against a design whose point is its cost."""
    if is_s3(store_root):
        return 1
    return max(1, os.cpu_count() or 1)


# A local task's reads buffered or in flight: two chunks. A local range comes from the page cache in well
# under a millisecond, so two reads ahead keep the fold fed; and the fewer buffers rotate, the likelier
# the one folded is still in cache from its read (reader threads write it, the task's thread reads it):
# with 9 buffers of 4 MiB (the S3 window) a shard's reads and fold took 0.29-0.31 CPU-s per GB, with 3
# 0.26-0.28 (256 MiB x 32 clients from the page cache, 2 cores, interleaved in one process), and the whole
# job 15-20 % less CPU. On S3 a read waits tens of milliseconds for its first byte: a deeper window there.
LOCAL_INFLIGHT_BYTES = 8 * MiB


def default_budget(store_root: str) -> Budget:
    """The deployed functions' :class:`Budget`, with ``workers`` for where a job on ``store_root`` runs and,
    locally, :data:`LOCAL_INFLIGHT_BYTES` of reads in flight."""
    if is_s3(store_root):
        return Budget(workers=workers_for(store_root))
    return Budget(workers=workers_for(store_root), inflight_bytes=LOCAL_INFLIGHT_BYTES)


def shard_caps(n_clients: int, header_bytes: int, budget: Budget) -> tuple[int, int]:
    """(smallest, largest) shard size in bytes the budget allows (see the module docstring)."""
    by_time = budget.time_fraction * budget.timeout_s * budget.read_bytes_per_s / (n_clients + 1)
    by_disk = budget.ephemeral_mb * MiB - EPHEMERAL_MARGIN - header_bytes
    largest = int(min(by_time, by_disk, S3_MAX_COPY_PART * 1.0))
    # +8: boundaries are aligned down by up to an element (8 bytes), and must stay >= the floor.
    return budget.min_shard_bytes + 8, max(largest, 1)


def choose_shards(
    data_bytes: int, n_clients: int, header_bytes: int, budget: Budget, requested: int | None = None
) -> ShardChoice:
    """How many shards to cut ``data_bytes`` into (see the module docstring for the rule)."""
    if data_bytes == 0:
        return ShardChoice(1)
    smallest, largest = shard_caps(n_clients, header_bytes, budget)
    most = max(1, data_bytes // smallest)  # more shards would make one smaller than the floor
    fewest = max(1, math.ceil(data_bytes / largest))
    notes: list[str] = []
    if requested is not None:
        shards = requested
        if shards > most:
            notes.append(
                f"shards={requested} lowered to {most}: every shard but the last must hold at least "
                f"{budget.min_shard_bytes / MiB:g} MiB (S3's multipart minimum) of the "
                f"{data_bytes / MiB:.1f} MiB model"
            )
            shards = most
        if shards < fewest:
            notes.append(
                f"shards={shards} makes {data_bytes / shards / MiB:.0f} MiB shards; with {n_clients} clients "
                f"a shard task may exceed {budget.time_fraction:.0%} of the {budget.timeout_s} s timeout or "
                f"the {budget.ephemeral_mb} MiB of ephemeral storage; {fewest} or more shards would not"
            )
    else:
        if fewest > most:
            raise PlanError(
                f"cannot shard a {data_bytes / MiB:.1f} MiB model over {n_clients} clients: a shard of at "
                f"least {budget.min_shard_bytes / MiB:g} MiB (S3's multipart minimum) would need reading "
                f"{(n_clients + 1) * smallest / MiB:.0f} MiB, more than fits {budget.time_fraction:.0%} of "
                f"the {budget.timeout_s} s timeout at {budget.read_bytes_per_s / MiB:.0f} MiB/s; aggregate "
                "the clients in groups (a tree of jobs, passing each group's num_examples on)"
            )
        target = min(max(budget.target_shard_bytes, smallest), largest)
        shards = max(math.ceil(data_bytes / target), fewest)
        shards = -(-shards // budget.workers) * budget.workers  # whole waves: every worker busy to the end
        shards = min(shards, most)
    if shards > S3_MAX_PARTS:
        raise PlanError(
            f"{shards} shards exceed S3's {S3_MAX_PARTS} parts per object; raise Budget.target_shard_bytes"
        )
    return ShardChoice(shards, tuple(notes))


# --- geometry ---------------------------------------------------------------------------------------------


class Geometry:
    """Element-aligned positions in the output data buffer, and segments of byte ranges."""

    def __init__(self, tensors: list[Tensor]):
        self.tensors = tensors
        self.nonempty = [i for i, t in enumerate(tensors) if t.nbytes > 0]
        self.begins = [tensors[i].begin for i in self.nonempty]
        self.data_bytes = tensors[-1].end if tensors else 0

    def _at(self, pos: int) -> int:
        """Index (in ``nonempty``) of the tensor holding byte ``pos`` (0 <= pos < data_bytes)."""
        return bisect.bisect_right(self.begins, pos) - 1

    def align_down(self, pos: int) -> int:
        if pos <= 0:
            return 0
        if pos >= self.data_bytes:
            return self.data_bytes
        t = self.tensors[self.nonempty[self._at(pos)]]
        size = t.dt.itemsize
        return t.begin + (pos - t.begin) // size * size

    def next_boundary(self, pos: int) -> int:
        """The first element boundary after ``pos`` (``pos`` itself aligned)."""
        t = self.tensors[self.nonempty[self._at(pos)]]
        return min(pos + t.dt.itemsize, self.data_bytes)

    def shard_bounds(self, shards: int) -> list[int]:
        """``shards + 1`` increasing boundaries (fewer when tiny shards collapse on one element)."""
        b = self.data_bytes
        raw = [self.align_down(k * b // shards) for k in range(shards)] + [b]
        out = [raw[0]]
        for x in raw[1:]:
            if x > out[-1]:
                out.append(x)
        if len(out) == 1:
            out.append(b)
        return out

    def chunks(self, start: int, end: int, chunk: int) -> Iterator[tuple[int, int]]:
        """Element-aligned ``[a, b)`` pieces of at most ``chunk`` bytes (at least one element) covering
        ``[start, end)``."""
        a = start
        while a < end:
            b = min(end, self.align_down(a + chunk))
            if b <= a:
                b = min(end, self.next_boundary(a))
            yield a, b
            a = b

    def segments(self, start: int, end: int) -> list[Segment]:
        """The pieces of the tensors overlapping ``[start, end)``, in output order."""
        out: list[Segment] = []
        if start >= end:
            return out
        k = self._at(start)
        while k < len(self.nonempty):
            i = self.nonempty[k]
            t = self.tensors[i]
            if t.begin >= end:
                break
            a, b = max(start, t.begin), min(end, t.end)
            size = t.dt.itemsize
            out.append(Segment(i, (a - t.begin) // size, (b - a) // size, a))
            k += 1
        return out


@dataclass(frozen=True)
class Segment:
    """Elements ``[first, first + count)`` of tensor ``tensor``; ``out`` is their output byte offset."""

    tensor: int
    first: int
    count: int
    out: int


@dataclass(frozen=True)
class RunRead:
    """One ranged read relative to a client's data buffer, covering whole segments.

    ``pieces``: (segment index in the chunk, byte offset of the segment within the read).
    """

    start: int
    length: int
    pieces: tuple[tuple[int, int], ...]


def runs(tensors: list[Tensor], layout: list[int], segs: list[Segment]) -> list[RunRead]:
    """Group a chunk's segments into reads of one client's data buffer, merging ranges that touch."""
    out: list[RunRead] = []
    cur_start = cur_end = -1
    pieces: list[tuple[int, int]] = []
    for j, s in enumerate(segs):
        t = tensors[s.tensor]
        size = t.dt.itemsize
        a = layout[s.tensor] + s.first * size
        n = s.count * size
        if pieces and a == cur_end:
            pieces.append((j, a - cur_start))
            cur_end = a + n
            continue
        if pieces:
            out.append(RunRead(cur_start, cur_end - cur_start, tuple(pieces)))
        cur_start, cur_end, pieces = a, a + n, [(j, 0)]
    if pieces:
        out.append(RunRead(cur_start, cur_end - cur_start, tuple(pieces)))
    return out


def chunk_bytes_for(aggregator: str, n_clients: int, tensors: list[Tensor], budget: Budget) -> int:
    """Output bytes per chunk: ``chunk_bytes`` for the mean; for median/trimmed_mean, what keeps the
    N x chunk accumulator matrix within ``robust_bytes`` (at least ``min_robust_chunk``)."""
    if aggregator not in ("median", "trimmed_mean"):
        return budget.chunk_bytes
    ratio = max((8 / t.dt.itemsize for t in tensors if t.nbytes), default=1.0)  # worst case: F64 acc
    fit = int(budget.robust_bytes / (n_clients * ratio))
    return min(budget.chunk_bytes, max(budget.min_robust_chunk, fit))


def read_window(chunk_bytes: int, budget: Budget) -> int:
    """Reads buffered or in flight per task: ``inflight_bytes`` worth, between 1 and 64."""
    return max(1, min(64, budget.inflight_bytes // max(chunk_bytes, 1)))


def cut_shards(plan: ShardPlan, requested: int | None) -> None:
    """Set ``plan``'s shards (``requested``: the spec's ``shards``; with the choice's notes), chunk and read
    window by the rules for its clients and budget."""
    n = plan.n_clients
    choice = choose_shards(plan.data_bytes, n, len(plan.header()), plan.budget, requested)
    plan.bounds = Geometry(plan.tensors).shard_bounds(choice.shards)
    plan.chunk_bytes = chunk_bytes_for(plan.aggregator, n, plan.tensors, plan.budget)
    plan.read_window = read_window(plan.chunk_bytes, plan.budget)
    plan.notes = list(choice.notes)


# --- loads -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepLoad:
    """What one step of a fedavg plan does.

    Memory as every kind states it (:class:`functions.estimate.TaskLoad`): ``runtime_bytes`` and the
    ``buffers`` its largest task holds; ``gets``/``puts``: S3 requests summed over the step's ``tasks``
    (``gets`` counts GET and HEAD; ``puts`` counts PUT, multipart create/part/copy/complete, LIST and
    DeleteObjects); ``read_bytes``/``write_bytes``: the largest per-task bytes read from/written to the store.
    """

    tasks: int
    runtime_bytes: int
    gets: int = 0
    puts: int = 0
    read_bytes: int = 0
    write_bytes: int = 0
    buffers: dict[str, int] = field(default_factory=dict)

    @property
    def peak_bytes(self) -> int:
        return projected_peak(self.runtime_bytes, self.buffers)


def _upload_puts(nbytes: int) -> int:
    """Requests of ``store.put_file`` on S3: one PUT up to its single-PUT limit, else create + parts +
    complete."""
    if nbytes <= MAX_SINGLE_PUT:
        return 1
    return 2 + math.ceil(nbytes / MULTIPART_CHUNK)


def _plan_doc_bytes(plan: ShardPlan) -> int:
    """About the plan document's size: 200 bytes a tensor per layout (and one), a client; 50 a shard."""
    return 200 * (len(plan.tensors) * (1 + len(plan.layouts)) + plan.n_clients) + 50 * plan.shards


def task_loads(plan: ShardPlan, on_s3: bool = True) -> dict[str, StepLoad]:
    """Per-step loads of ``plan``: ``{"prepare": ..., "aggregate": ..., "commit": ...}``.

    Exact request counts (the same chunk and read geometry the aggregate tasks use, computed per distinct
    client layout, so it costs O(chunks x layouts), not O(chunks x N)); memory from the buffers a task
    holds, plus :data:`RUNTIME_BYTES`. ``on_s3=False``: the local store, where a part is written in place
    (no spool, no upload buffers).
    """
    header_bytes = len(plan.header())
    doc_bytes = _plan_doc_bytes(plan)
    aggregate = _aggregate_load(plan, on_s3, header_bytes, doc_bytes)
    steps = {
        "prepare": _prepare_load(plan, doc_bytes),
        "aggregate": aggregate,
        "commit": _commit_load(plan, header_bytes, doc_bytes),
    }
    if plan.dp is not None:
        # prepare asks OpenDP for the round's ρ (the ledger's charge)
        steps["prepare"] = replace(steps["prepare"], runtime_bytes=RUNTIME_BYTES + DP_RUNTIME_BYTES)
        steps.update(_dp_loads(plan, aggregate, on_s3))
    else:  # the DP steps run empty: no norms task, a clip task that reads the plan
        steps["norms"] = StepLoad(tasks=0, runtime_bytes=0)
        steps["clip"] = StepLoad(tasks=1, runtime_bytes=RUNTIME_BYTES, gets=1)  # reads only the spec
    return steps


def _aggregate_load(plan: ShardPlan, on_s3: bool, header_bytes: int, doc_bytes: int) -> StepLoad:
    """The aggregate step: every shard's reads and part upload, and the buffers of its largest task."""
    n = plan.n_clients
    geo = Geometry(plan.tensors)
    rules = plan.rules()
    per_layout = [0] * len(plan.layouts)
    for c in plan.clients:
        per_layout[c.layout] += 1
    gets = puts = max_read = max_write = 0
    comps: dict[str, int] = {}
    for k in range(plan.shards):
        start, end = plan.shard_range(k)
        reads, arena, transient = _shard_chunks(plan, geo, rules, per_layout, start, end)
        part = (end - start) + (header_bytes if k == 0 else 0)
        phases = _shard_buffers(plan, on_s3, part, arena, transient, doc_bytes)
        comps = max(comps, *phases, key=lambda buffers: sum(buffers.values()))  # the largest task's phase
        gets += 2 + reads  # spec + plan document + the ranged reads
        puts += _upload_puts(part)
        max_read = max(max_read, n * (end - start))
        max_write = max(max_write, part)
    return StepLoad(
        tasks=plan.shards,
        runtime_bytes=RUNTIME_BYTES,
        gets=gets,
        puts=puts,
        read_bytes=max_read,
        write_bytes=max_write,
        buffers=comps,
    )


def _shard_chunks(
    plan: ShardPlan, geo: Geometry, rules: list[kernels.Rule], per_layout: list[int], start: int, end: int
) -> tuple[int, int, int]:
    """A shard's ranged reads (all clients), and the largest of its chunks' reducer arenas and input masks."""
    n = plan.n_clients
    reads = arena = transient = 0
    for a, b in geo.chunks(start, end, plan.chunk_bytes):
        segs = geo.segments(a, b)
        for j, count in enumerate(per_layout):
            if count:
                reads += count * len(runs(plan.tensors, plan.layouts[j], segs))
        arena = max(arena, sum(kernels.need(rules[s.tensor], s.count, n) for s in segs))
        # a bool mask per element: the robust reducers' input check (N per element); for the mean only
        # where a result is not finite (its checks run block by block), counted all the same
        transient = max(transient, (n if plan.robust() else 1) * max((s.count for s in segs), default=0))
    return reads, arena, transient


def _shard_buffers(
    plan: ShardPlan, on_s3: bool, part: int, arena: int, transient: int, doc_bytes: int
) -> tuple[dict[str, int], dict[str, int]]:
    """The buffers of a shard task's two phases: its reads and fold, then (S3) its part's upload."""
    objects = OBJECT_BYTES + 2 * doc_bytes  # the parsed plan document, read descriptors, slots
    # S3: the spool holds up to SPOOL_BYTES plus one write, and copies it once when it rolls over to
    # disk. Locally the part is written in place through the writer's buffer.
    spool = 2 * min(part, SPOOL_BYTES + plan.chunk_bytes) if on_s3 else min(part, WRITE_BUFFER)
    fold = {
        "the reads in flight": (plan.read_window + 1) * plan.chunk_bytes,
        "the reducers' accumulators": arena,
        "the kernels' scratch": 2 * kernels.BLOCK * 8 + transient,
        "the part's spool in memory": spool,
        "the plan document and read descriptors": objects,
    }
    # then S3's upload of the spool: s3transfer holds up to 10 parts (one PUT streams the file)
    upload = {
        "the upload's buffers": min(part, UPLOAD_BUFFER_BYTES) if on_s3 else 0,
        "the plan document and read descriptors": objects,
    }
    return fold, upload


def _prepare_load(plan: ShardPlan, doc_bytes: int) -> StepLoad:
    """The prepare step: every client's length prefix, header and HEAD; the plan document written."""
    return StepLoad(
        tasks=1,
        runtime_bytes=RUNTIME_BYTES,
        gets=1 + 3 * plan.n_clients,  # spec; per client: length prefix, header, HEAD
        puts=2,  # plan document, work list
        read_bytes=sum(c.data_start for c in plan.clients),
        write_bytes=doc_bytes,
        buffers={
            "client 0's parsed header and one other": 2 * HEADER_PARSE_FACTOR * plan.clients[0].data_start,
            "the plan document with its layouts": 2 * doc_bytes,
        },
    )


def _commit_load(plan: ShardPlan, header_bytes: int, doc_bytes: int) -> StepLoad:
    """The commit step: the parts assembled (copied server-side, or joined in memory when small)."""
    m = plan.shards
    out_bytes = header_bytes + plan.data_bytes
    if out_bytes >= S3_MIN_PART:
        copies = sum(
            max(1, math.ceil((geo_end - geo_start + (header_bytes if k == 0 else 0)) / S3_MAX_COPY_PART))
            for k, (geo_start, geo_end) in enumerate(zip(plan.bounds, plan.bounds[1:], strict=False))
        )
        assemble_puts, assemble_gets = 2 + copies, m
    else:
        assemble_puts, assemble_gets = 1, 2 * m  # HEAD and GET of each part, one PUT
    return StepLoad(
        tasks=1,
        runtime_bytes=RUNTIME_BYTES,
        gets=3 + assemble_gets,  # spec, result (HEAD), plan document, the parts
        puts=assemble_puts + 1 + 1 + math.ceil((m + 2) / DELETE_BATCH),  # + result, LIST, deletes
        read_bytes=doc_bytes,
        write_bytes=out_bytes,
        buffers={
            "the plan document": 2 * doc_bytes,
            # below S3's multipart minimum the parts are joined in memory, not copied server-side
            "the output joined in memory": 0 if out_bytes >= S3_MIN_PART else out_bytes,
        },
    )


def _dp_loads(plan: ShardPlan, agg: StepLoad, on_s3: bool) -> dict[str, StepLoad]:
    """A DP round's norms, clip and aggregate tasks (:func:`functions.fedavg.core.norms_into`, ``clip``,
    ``aggregate_dp_into``): float64 copies of a chunk take the place of the reducers' accumulators."""
    n = plan.n_clients
    floats = [t.dt.itemsize for t in plan.tensors if t.dt.kind == "float"]
    widen = 8 // min(floats) if floats else 1  # float64 bytes per input byte, at the narrowest float
    largest = max(b - a for a, b in zip(plan.bounds, plan.bounds[1:], strict=False))
    chunk = min(plan.chunk_bytes, largest)  # a chunk, and a read, never spans more than its shard
    buffers = (plan.read_window + 1) * chunk
    plan_doc_bytes = _plan_doc_bytes(plan)
    objects = OBJECT_BYTES + 2 * plan_doc_bytes
    sources = n + (plan.base is not None)
    gets = 2 * plan.shards + (agg.gets - 2 * plan.shards) * sources // max(n, 1)  # + the base's reads
    norms = StepLoad(
        tasks=plan.shards,
        runtime_bytes=RUNTIME_BYTES,
        gets=gets,
        puts=plan.shards,
        read_bytes=agg.read_bytes * sources // max(n, 1),
        write_bytes=8 * n,
        buffers={
            "the reads in flight": buffers,
            "the chunk's base values and one update's difference in float64": 2 * widen * chunk,
            "the plan document and read descriptors": objects,
        },
    )
    clip = StepLoad(
        tasks=1,
        runtime_bytes=RUNTIME_BYTES,
        gets=2 + plan.shards,
        puts=1 + 1 + math.ceil(plan.shards / DELETE_BATCH),  # the factors; then LIST and delete the norms
        read_bytes=8 * n * plan.shards,
        write_bytes=8 * n,
        buffers={"every client's norms and clip factor": 3 * 8 * n, "the plan document": 2 * plan_doc_bytes},
    )
    spool = 2 * min(largest, SPOOL_BYTES + chunk) if on_s3 else min(largest, WRITE_BUFFER)  # as task_loads
    # the mean's float64 accumulators, one update's difference (a block at a time: kernels.axpy_difference),
    # the base's values, OpenDP's working block and the cast of the noisy chunk
    working = widen * chunk + 8 * kernels.BLOCK + 2 * chunk + dp.NOISE_BLOCK_BYTES
    aggregate = StepLoad(
        tasks=plan.shards,
        runtime_bytes=RUNTIME_BYTES + DP_RUNTIME_BYTES,
        gets=gets + 1,  # + the clip factors
        puts=agg.puts,
        read_bytes=agg.read_bytes * sources // max(n, 1),
        write_bytes=agg.write_bytes,
        buffers={
            "the reads in flight": buffers,
            "the float64 mean and its noise": working,
            "the part's spool in memory": spool,
            "the plan document and read descriptors": objects,
        },
    )
    return {"norms": norms, "clip": clip, "aggregate": aggregate}
