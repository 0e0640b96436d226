"""Task loads of a dpquery job: the planner's own noise plan and fan-out, without reading the data.

The estimate runs :func:`functions.dpquery.planner.plan` on the spec (pure: no data), so the residual sets,
the measure and reconstruct groups (the job's Map children), the predicted per-cell variances and the
privacy report are exactly the ones the job will use. From the store it reads only the dataset's size (one
HEAD, for the scan time) and the dataset's budget ledger (to say whether the job fits the remaining
budget); neither is required: a missing dataset or an unreadable ledger becomes a note, and the job itself
would fail at its prepare step, naming the cause, before any budget is spent.

Besides the step table it returns two detail tables: the privacy and accuracy plan (ρ, ε at δ by CKS and
by the exact Gaussian curve, workload RMSE) and the predicted per-cell error of each workload marginal
(the largest ones first when the workload has more than :data:`MAX_MARGINAL_ROWS`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from shardfold.functions import pricing
from shardfold.functions.dpquery.spec import QUERY_TYPES, WHOLE_TYPES, DPQuerySpec, marginal_name
from shardfold.functions.dpquery.workflow import (
    FINALIZE,
    MEASURE,
    MEASURE_GROUP,
    PREPARE,
    RECONSTRUCT,
    RECONSTRUCT_GROUP,
)
from shardfold.functions.errors import AccessDenied, NoCredentials, ObjectNotFound, SpecError, StoreError
from shardfold.functions.estimate import Loads, MiB, Probe, ProbeBudget, TaskLoad
from shardfold.functions.tables import Table

# --- memory model (per task; what one function holds at its peak) -------------------------------------------
# Python + numpy + pyarrow (with pandas, which pyarrow loads to convert arrays): 138 MiB measured after
# importing functions.dpquery.* and pyarrow's CSV and Parquet modules (tests/test_memory.py).
RUNTIME_BYTES = 160 * MiB
# A measure task also imports OpenDP's sampler through ``opendp.prelude``, which loads OpenDP's extras and
# what they import where installed (scipy, scikit-learn): 240 MiB measured, as above (tests/test_memory.py).
MEASURE_RUNTIME_BYTES = 256 * MiB
# One streaming pass over the dataset's columns: pyarrow's CSV reader keeps a few 8 MiB blocks in flight with
# their decoded columns (~100 MiB measured), Parquet one record batch of 2^17 rows (~60 MiB measured), and on
# S3 an 8 MiB read buffer.
SCAN_BYTES = {"csv": 128 * MiB, "parquet": 64 * MiB}
# Planning holds about this much per (marginal, subset) pair (97-108 B measured at d = 50, 100, <=3-way).
PLAN_BYTES_PER_PAIR = 128
# A reconstructed marginal: the estimate and its temporaries (float64), the table's label columns, its
# std_error and variance columns (float64 each) and the Parquet buffer, per cell (plus 16 bytes per attribute
# for its label column, and as much again for each of a range attribute's lo/hi columns: counted for all).
RECON_BYTES_PER_CELL = 64
# A marginal of prefix or range queries holds, per answer, more: its variance (an outer product per residual
# set, summed), the prefix sums that make the answers, their std_error column, and the Parquet writer's
# pages, which the allocator keeps after the table is written (tests/test_memory.py, "general": 55,188
# answers in the largest marginal; the task adds 64-65 MiB to its runtime, whose own size varied from 107
# to 148 MiB between runs, so the runtime allowance cannot absorb any of it).
RECON_BYTES_PER_ANSWER = 800
# The plan document once loaded in a task: its JSON text, the decoded arrays and their copies.
PLAN_DOC_FACTOR = 3
# What writing the first Arrow table to Parquet takes on top of the arrays: pyarrow's memory pool (mimalloc)
# and the writer's buffers (~10 MiB measured; a reconstruct task measured 11-19 MiB above its runtime with
# tables of a few thousand cells; tests/test_memory.py).
ARROW_WRITE_BYTES = 16 * MiB

# --- duration model (assumed per-core rates, measured on a dev box; bench/dpquery.py measures them) ---------
SAMPLER_SAMPLES_PER_S = 19_000  # OpenDP 0.16 float-vector make_gaussian, one core
SCAN_BYTES_PER_S = {"csv": 40 * MiB, "parquet": 12 * MiB}  # parse + map to domain indices, one core
PLAN_S_PER_PAIR = 0.5e-6  # d = 100, <=3-way: 1.3 M pairs planned in 0.65 s
# A residual set solved whole (2-way types) runs convex solves of eigendecompositions of its dimension:
# 0.5-2.8 µs per dim³ measured (12 x 12, 20 x 20 and 21 x 21 affine pairs: 5 to 72 s), one per distinct
# strategy the plan stores
PLAN_S_PER_SOLVED_DIM3 = 1.5e-6
# Past smasher.MAX_SET_DIM a set is solved in its queries' row space (smasher.low_rank_strategy): 3.8, 12
# and 26 s for 20 x 20, 30 x 30 and 40 x 40 affine pairs measured, ~4.5e-4 s per dim^1.5
PLAN_S_PER_LOW_RANK_DIM15 = 4.5e-4
# ... and for an explicit query matrix, whose pieces may span the whole set (rank up to dim, not
# n_a + n_b − 1): 1.7, 5.1 and 8.0 s for 100, 200 and 1,000 random 0/1 rows on 21 x 21 (ranks 100, 200,
# 400), against 3.7 s for affine there; a plan holding one prices every set it solves whole at this rate
PLAN_S_PER_FULL_RANK_DIM15 = 1.0e-3
# ... holding up to ~21 matrices of the set's cells x cells at once (its Grams, the residual bases, both
# strategies): 394-414 MiB traced for 40 x 40 (tracemalloc), 129 MiB for 30 x 30; 24 leaves a margin
SOLVE_MATRICES = 24
RECON_S_PER_CELL_TERM = 0.15e-6  # one Kronecker-vector term of one cell
TABLE_S_PER_CELL = 1.5e-6  # labels, Arrow table and Parquet encoding
OUTPUT_BYTES_PER_CELL = 12  # Parquet: float64 estimate (noisy: incompressible) + dictionary-coded labels
TABLE_OVERHEAD_BYTES = 2048  # Parquet footer and schema metadata per table
JSON_BYTES_PER_CELL = 40
READ_CHUNK_BYTES = 8 * MiB  # the data path's ranged-GET size on S3 (functions.dpquery.data)
# The ledger's content fingerprint: sha256 of every byte of the dataset at plan time (one more read).
HASH_BYTES_PER_S = 400 * MiB
# A privacy unit (functions.dpquery.unit) keeps a dict entry, a row count and a 64-bit key per DISTINCT id in
# every task that counts (plan: one pass over the id column; measure: two), and 8·k bytes per person with
# more than k rows. The number of distinct ids is data, unknown to the plan: it is stated, not added to the
# peak; size the function memory for it (10^6 ids ≈ 200 MB).
UNIT_BYTES_PER_ID = 200

MAX_MARGINAL_ROWS = 20  # rows of the per-marginal table; beyond, the largest per-cell variances


def _residual_cells(pl: Any) -> np.ndarray:
    """∏_{i∈S} n_i for every residual set S (the histogram a measure task counts for it)."""
    log_n = np.log(pl.domains.astype(np.float64))
    cs = np.concatenate([[0.0], np.cumsum(log_n[pl.res_attrs])])
    return np.rint(np.exp(cs[pl.res_ptr[1:]] - cs[pl.res_ptr[:-1]]))


def _names(spec: Any, pl: Any, j: int) -> str:
    """The marginal's name as ``client.dpquery.tables`` keys it (``"sex,region"``, ``"(total)"``), with the
    query type of each attribute not asked cell by cell (``"sex,age (age: prefix)"``), or its 2-way type
    (``"region,age (affine)"``)."""
    names = [spec.attributes[i].name for i in pl.marginal(j)]
    kinds = pl.marginal_types(j)
    if kinds and kinds[0] in WHOLE_TYPES:
        return f"{marginal_name(names)} ({kinds[0]})"
    asked = [f"{n}: {t}" for n, t in zip(names, kinds, strict=True) if t != "identity"]
    return marginal_name(names) + (f" ({', '.join(asked)})" if asked else "")


def _dataset_size(spec: Any, store_root: str, refuse: bool) -> tuple[int | None, str | None]:
    """The dataset's size; with ``refuse`` (at submit), after the public facts its prepare step checks
    first (it exists; its header or Parquet schema has the schema's columns, of types that hold them:
    :func:`data.check_schema`), so a spec that names a missing dataset or column is refused, naming it.
    Without, a missing dataset is a note (a plan made ahead of the data). A lookup this process may not
    make (the job's role may read what the submitter cannot) is a note, not a refusal."""
    from shardfold.functions import access, store
    from shardfold.functions.dpquery import data

    uri = access.input_uri(spec.dataset, store_root, "dataset")
    try:
        size = store.size(uri)
    except ObjectNotFound as exc:
        if not refuse:
            return None, f"dataset {uri}: {exc}; the job will fail at its prepare step (nothing is spent)"
        raise SpecError(
            f"dataset: no object at {uri}", [{"field": "dataset", "error": f"no object at {uri}"}]
        ) from exc
    except StoreError as exc:  # no permission here: the job's prepare step reads it with its own role
        return None, f"dataset {uri}: {exc}; its prepare step fails too if the job's role cannot read it"
    if refuse:
        try:
            data.check_schema(uri, spec.format, spec.attributes)
        except (AccessDenied, NoCredentials):
            pass  # as above: the job's role decides
    return size, None


def _ledger(spec: Any, store_root: str) -> tuple[Any, str | None]:
    from shardfold.functions import ledger

    try:
        return ledger.read(store_root, spec.dataset_id), None
    except StoreError as exc:
        return None, f"budget ledger of {spec.dataset_id!r} could not be read ({exc})"


def _budget_rows(spec: Any, state: Any) -> tuple[list[list[Any]], list[str]]:
    """Ledger rows of the privacy table, and notes when the job would be refused."""
    rho = spec.rho()
    if state is None:
        return [], []
    if state.total_rho is None:
        if spec.dataset_budget_rho is None:
            return [["dataset budget", f"{spec.dataset_id!r} has no ledger yet"]], [
                f"dataset {spec.dataset_id!r} has no budget ledger yet: the first job on it must give "
                "'dataset_budget_rho'; this one would fail at its prepare step"
            ]
        total, committed = spec.dataset_budget_rho, 0.0
        opened = " (this job opens the ledger)"
    else:
        total, committed = state.total_rho, state.committed()
        opened = ""
    remaining = max(0.0, total - committed)
    fits = math.fsum([committed, rho]) <= total
    rows = [
        [
            "dataset budget ρ",
            f"{total:.6g} total{opened}, {committed:.6g} committed by {len(state.reserved)} job(s)",
        ],
        ["remaining ρ", f"{remaining:.6g} before this job, {max(0.0, remaining - rho):.6g} after"]
        if fits
        else ["remaining ρ", f"{remaining:.6g}: this job's {rho:.6g} does NOT fit"],
    ]
    notes = []
    if not fits:
        notes.append(
            f"dataset {spec.dataset_id!r} has ρ {remaining:.6g} left; this job asks for {rho:.6g} and would "
            "be refused at its prepare step (BudgetExceeded) before any measurement"
        )
    if state.total_rho is not None and spec.dataset_budget_rho not in (None, state.total_rho):
        notes.append(
            f"dataset_budget_rho {spec.dataset_budget_rho} differs from the registered total "
            f"{state.total_rho}; the job would fail at its prepare step"
        )
    return rows, notes


def privacy_rows(spec: Any, pl: Any) -> list[list[Any]]:
    """The privacy and accuracy plan as (quantity, value) rows."""
    rep = pl.privacy_report()
    b = spec.budget
    source = (
        f" (from ε {b.epsilon:g}, δ {b.delta:g} by CKS)" if b.epsilon is not None else " (zCDP, as given)"
    )
    delta = rep["delta"]
    what, one = ("cells", "cell") if pl.marg_types is None else ("answers", "answer")
    rows: list[list[Any]] = [
        ["ρ (zCDP)", f"{rep['rho']:.6g}{source}; the plan allocates ρ·(1 − 1e-9)"],
        [f"ε at δ = {delta:g}, CKS", f"{rep['epsilon_cks']:.6g} (any ρ-zCDP mechanism; use across jobs)"],
        [
            f"ε at δ = {delta:g}, exact Gaussian",
            f"{rep['epsilon_gaussian']:.6g} (this release as one Gaussian mechanism, this job alone)",
        ],
        ["neighbouring datasets", rep["neighbouring"]],
        [
            "sensitivity charged",
            f"{rep['unit_rows']} row(s) per unit, transform rounding for at most {rep['rows_bound']:,} rows"
            if rep["rows_bound"] is not None
            else f"{rep['unit_rows']} row(s) per unit, rounding not charged",
        ],
        ["loss", pl.loss + (f" ({pl.solver.get('solver')}, {pl.solver.get('status')})" if pl.solver else "")],
        ["workload", f"{pl.num_marginals:,} marginal(s), {pl.num_queries:,} {what}"],
        ["residual sets", f"{pl.num_residuals:,} ({pl.total_noise_samples:,} noise samples)"],
        [
            f"workload RMSE (per {one})",
            f"{pl.rmse:.6g} (expected squared error {pl.sse:.6g} over all {what})",
        ],
        *rmse_by_query_type(pl),
        [
            f"largest {'per-cell std error' if pl.marg_types is None else 'RMSE of a marginal'}",
            f"{math.sqrt(float(pl.var.max())):.6g}",
        ],
    ]
    return rows


def rmse_by_query_type(pl: Any) -> list[list[str]]:
    """Under general query types, the RMSE of the answers of each kind of marginal: those whose attributes
    are all asked cell by cell (``identity``), and those asking prefixes, ranges, ... along some attribute
    (a marginal asking two kinds counts in both)."""
    if pl.marg_types is None:
        return []
    sse: dict[str, float] = {}
    count: dict[str, int] = {}
    for j in range(pl.num_marginals):
        kinds = sorted({t for t in pl.marginal_types(j) if t != "identity"}) or ["identity"]
        for kind in kinds:
            sse[kind] = sse.get(kind, 0.0) + float(pl.queries[j]) * float(pl.var[j])
            count[kind] = count.get(kind, 0) + int(pl.queries[j])
    return [
        [f"RMSE of {kind} answers", f"{math.sqrt(sse[kind] / count[kind]):.6g} ({count[kind]:,} answers)"]
        for kind in sorted(sse, key=lambda k: (k != "identity", k))
    ]


def marginal_rows(spec: Any, pl: Any) -> tuple[str, list[list[Any]]]:
    """The per-marginal table's title and rows (marginal, cells, weight, variance, std error)."""
    m = pl.num_marginals
    var = pl.var
    alike = (
        "every cell of a marginal alike"
        if pl.marg_types is None
        else "a marginal of prefixes or ranges: the mean over its answers; each answer's own is in the table"
    )
    if m <= MAX_MARGINAL_ROWS:
        order = list(range(m))
        title = f"predicted error per marginal (unbiased estimates; {alike})"
    else:
        order = np.argsort(-var, kind="stable")[:MAX_MARGINAL_ROWS].tolist()
        title = (
            f"predicted error: the {MAX_MARGINAL_ROWS} of {m:,} marginals with the largest per-cell variance"
        )
    rows = [
        [
            _names(spec, pl, j),
            int(pl.queries[j]),
            float(pl.weights[j]),
            float(var[j]),
            math.sqrt(float(var[j])),
        ]
        for j in order
    ]
    return title, rows


def probe(spec: DPQuerySpec, store_root: str, budget: ProbeBudget) -> Probe:
    """The dataset's size (one HEAD) and the budget ledger; the noise plan itself needs no data."""
    from shardfold.functions.dpquery import planner

    pl = planner.plan(spec)  # a PlanError (a marginal too large, ...) is the job's own refusal
    notes: list[str] = []
    size, problem = _dataset_size(spec, store_root, budget.refuse)
    if problem:
        notes.append(problem)
    state, problem = _ledger(spec, store_root)
    if problem:
        notes.append(problem)
    # The size stays in memory (the model), never in ``facts``: facts are recorded in jobs/<id>/probe.json,
    # which more people may read than may read the dataset, and a dataset's byte size is a proxy of its
    # row count. It sizes only the scan's requests and duration (memory does not depend on it), and the
    # notes shown to whoever runs the plan: they named the dataset and looked it up with their own access.
    return Probe(facts={"dataset_found": size is not None}, notes=notes, model=(pl, state, size))


def loads(spec: DPQuerySpec, probed: Probe) -> Loads:
    from shardfold.functions.dpquery import planner
    from shardfold.functions.dpquery import reconstruct as rc

    pl, state, size = probed.model
    fmt = spec.format
    mgroups = pl.residual_groups(spec.noise_samples_per_task)
    rgroups = pl.marginal_groups(spec.cells_per_task)
    n_r = len(rgroups)
    ledger_entries = len(state.entries) if state is not None else 0
    data_bytes = size or 0
    # a streaming pass over the dataset: (bytes, requests: HEADs + header/footer + 8 MiB ranges, seconds)
    scan = (data_bytes, 3 + max(1, -(-data_bytes // READ_CHUNK_BYTES)), data_bytes / SCAN_BYTES_PER_S[fmt])
    arrays_bytes = sum(getattr(pl, name).nbytes for name in planner.Plan._ARRAYS)
    arrays_bytes += sum(b.nbytes for b in pl.strategies.values())  # general queries' strategy matrices
    doc = PLAN_DOC_FACTOR * arrays_bytes
    samples = max(int(pl.noise_count[s:t].sum()) for s, t in mgroups)
    output_bytes = int(
        pl.num_queries * OUTPUT_BYTES_PER_CELL
        + pl.num_marginals * TABLE_OVERHEAD_BYTES
        + float(pl.queries[pl.queries <= rc.JSON_MAX_CELLS].sum()) * JSON_BYTES_PER_CELL
    )
    budget_rows, budget_notes = _budget_rows(spec, state)
    answers = "cells" if pl.marg_types is None else "answers"
    notes = [
        f"{pl.num_residuals:,} residual set(s), {pl.total_noise_samples:,} noise samples in "
        f"{len(mgroups)} measure task(s) (up to {samples:,} samples each); "
        f"{pl.num_marginals:,} marginal(s), {pl.num_queries:,} {answers} in {n_r} reconstruct task(s)",
        f"the dataset ({'unknown size' if size is None else f'{data_bytes / MiB:,.1f} MiB'}, {fmt}) is read "
        f"once by plan (validation) and once by each measure task (its columns only)",
        *budget_notes,
    ]
    if spec.privacy_unit is not None:
        notes.append(
            f"privacy unit: at most {spec.privacy_unit.max_rows} row(s) per {spec.privacy_unit.id_column!r}; "
            f"plan and measure tasks also hold about {UNIT_BYTES_PER_ID} bytes per distinct id (not in the "
            "peaks above: the number of ids is data the plan does not read)"
        )
    title, rows = marginal_rows(spec, pl)
    return Loads(
        items=pl.num_marginals,
        tasks={
            PREPARE: _plan_load(spec, pl, state, scan, doc),
            MEASURE_GROUP: _measure_load(spec, pl, mgroups, scan, doc, samples),
            RECONSTRUCT_GROUP: _reconstruct_load(pl, mgroups, rgroups, doc),
            # the measurements' trailers, the ledger's spend entry, the tables index and the result
            FINALIZE: TaskLoad(
                RUNTIME_BYTES,
                {
                    "the plan document": doc,
                    "every measurement's trailer": 100 * pl.num_residuals,
                    "every table's index entry": 400 * pl.num_marginals,
                },
                gets=2 + len(mgroups) + n_r + 1 + ledger_entries + 1,
                puts=3,
                duration_s=pricing.TASK_OVERHEAD_S + (6 + ledger_entries) * pricing.S3_GET_LATENCY_S,
            ),
        },
        map_items={MEASURE: len(mgroups), RECONSTRUCT: n_r},
        notes=notes,
        output_bytes=output_bytes,
        details=[
            Table("privacy and accuracy plan", ["quantity", "value"], privacy_rows(spec, pl) + budget_rows),
            Table(title, ["marginal", "cells", "weight", "variance", "std error"], rows),
        ],
    )


def _plan_load(spec: DPQuerySpec, pl: Any, state: Any, scan: tuple[int, int, float], doc: int) -> TaskLoad:
    """plan: allocate, scan once (and the privacy unit's id column), hash the dataset for the ledger, reserve
    on it, write the plan document and two work lists."""
    from shardfold.functions.dpquery import smasher

    data_bytes, scan_gets, scan_s = scan
    ledger_entries = len(state.entries) if state is not None else 0
    unit_scans = 1 if spec.privacy_unit is not None else 0  # the id column, at plan and again in measure
    pairs = int(pl.sub_ptr[-1])
    # the strategies 2-way types' sets were solved for (a Kronecker set's per-attribute ones are cheap)
    solved = [b for name, b in pl.strategies.items() if name.startswith("dense:")]
    matrices = pl.marg_types is not None and bool(np.any(pl.marg_types >= len(QUERY_TYPES)))
    low_rank = PLAN_S_PER_FULL_RANK_DIM15 if matrices else PLAN_S_PER_LOW_RANK_DIM15
    solve_s = sum(
        PLAN_S_PER_SOLVED_DIM3 * b.shape[0] ** 3
        if b.shape[0] <= smasher.MAX_SET_DIM
        else low_rank * b.shape[0] ** 1.5
        for b in solved
    )
    solve_bytes = max((SOLVE_MATRICES * 8 * b.shape[1] ** 2 for b in solved), default=0)
    return TaskLoad(
        RUNTIME_BYTES,
        {
            f"the noise plan ({pairs:,} marginal-subset pairs)": PLAN_BYTES_PER_PAIR * pairs,
            "the plan document": doc,
            f"one streaming scan of the {spec.format} dataset": SCAN_BYTES[spec.format],
            "the strategy solver's matrices": solve_bytes,
        },
        # + the fingerprint's reads, the ledger's LIST and entries, the fingerprint index
        gets=(2 + unit_scans) * scan_gets + 2 + ledger_entries,
        puts=4 + (1 if state is not None and state.total_rho is None else 0) + 1,
        duration_s=pricing.TASK_OVERHEAD_S
        + PLAN_S_PER_PAIR * pairs
        + solve_s
        + (1 + unit_scans) * scan_s
        + data_bytes / HASH_BYTES_PER_S
        + (5 + ledger_entries) * pricing.S3_GET_LATENCY_S,
    )


def _measure_load(spec: DPQuerySpec, pl: Any, mgroups: list, scan: tuple, doc: int, samples: int) -> TaskLoad:
    """measure: per group, its residual sets' histograms, their residuals and the noisy payload."""
    _, scan_gets, scan_s = scan
    unit_scans = 1 if spec.privacy_unit is not None else 0
    res_cells = _residual_cells(pl)
    hist_bytes = max(8 * float(res_cells[s:t].sum()) for s, t in mgroups)
    return TaskLoad(
        MEASURE_RUNTIME_BYTES,
        {
            "the plan document": doc,
            f"one streaming scan of the {spec.format} dataset": SCAN_BYTES[spec.format],
            "the group's histograms": int(hist_bytes),
            f"{samples:,} noise samples": 24 * samples,
        },
        gets=(1 + unit_scans) * scan_gets + 2,  # + the plan document, + the measurement's check
        puts=1,
        duration_s=pricing.TASK_OVERHEAD_S
        + (1 + unit_scans) * scan_s
        + samples / SAMPLER_SAMPLES_PER_S
        + 3 * pricing.S3_GET_LATENCY_S,
    )


def _reconstruct_load(pl: Any, mgroups: list, rgroups: list, doc: int) -> TaskLoad:
    """reconstruct: per group, the measurements it needs and its largest marginal's table; the largest group
    sets the peak, the slowest the duration."""
    from shardfold.functions.dpquery import planner
    from shardfold.functions.dpquery import reconstruct as rc

    sizes = np.diff(pl.marg_ptr)
    terms = np.diff(pl.sub_ptr)
    latency = pricing.S3_GET_LATENCY_S
    held = (0.0, 0.0)  # the largest group's measured residuals and table
    worst_s = 0.0
    recon_gets = 0
    for s, t in rgroups:
        needed = pl.needed_residuals(s, t)
        owners = np.unique(planner.Plan.group_of(needed, mgroups))
        recon_gets += 1 + int(owners.size)
        # a marginal of prefixes or ranges holds its cells and, larger, its answers and their variances
        cells = np.maximum(pl.cells[s:t], pl.queries[s:t]).astype(np.float64)
        biggest = int(np.argmax(cells))
        per_cell = RECON_BYTES_PER_CELL + 48 * int(sizes[s + biggest])
        if pl.marg_types is not None:
            per_cell += RECON_BYTES_PER_ANSWER
        group = (16 * float(pl.noise_count[needed].sum()), float(cells[biggest]) * per_cell)
        held = group if sum(group) > sum(held) else held
        work = (
            float(np.sum(cells * terms[s:t])) * RECON_S_PER_CELL_TERM + float(cells.sum()) * TABLE_S_PER_CELL
        )
        worst_s = max(worst_s, work + (1 + owners.size + 2 * (t - s)) * latency)
    n_r = len(rgroups)
    recon_puts = pl.num_marginals + int(np.count_nonzero(pl.queries <= rc.JSON_MAX_CELLS)) + n_r
    return TaskLoad(
        RUNTIME_BYTES,
        {
            "the plan document": doc,
            "the group's measured residuals": held[0],
            "its largest marginal's table": held[1],
            "the Parquet writer": ARROW_WRITE_BYTES,
        },
        gets=-(-recon_gets // n_r),
        puts=-(-recon_puts // n_r),
        duration_s=pricing.TASK_OVERHEAD_S + worst_s,
        total_gets=recon_gets,
        total_puts=recon_puts,
    )
