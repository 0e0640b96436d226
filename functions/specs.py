"""Job specs: pydantic models that round-trip through JSON.

The CLI, the SDK and the bucket trigger all accept the same documents. A spec names its ``kind``; every
other field belongs to that kind. Validation errors become :class:`SpecError` listing every problem.
"""

from __future__ import annotations

import itertools
import json
import math
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from functions.errors import SpecError


class StrictModel(BaseModel):
    """Unknown fields are errors: a typo in a spec must not be silently ignored."""

    model_config = ConfigDict(extra="forbid")


class BatchItem(StrictModel):
    """One entry of a GetBatch request.

    ``uri`` is an object URI (``s3://bucket/key``, ``file:///abs/path``, or a key relative to the store
    root). A byte range is ``start`` plus ``length`` (``None``: to the end of the object). ``archpath``
    names a member of a TAR object; a range then applies to the member. ``name`` overrides the entry's
    name in the output archive (default: the object key, plus ``/archpath``).
    """

    uri: str = Field(min_length=1)
    start: int = Field(default=0, ge=0)
    length: int | None = Field(default=None, ge=0)
    archpath: str | None = Field(default=None, min_length=1)
    name: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _range_is_meaningful(self) -> BatchItem:
        if self.length == 0 and self.start != 0:
            raise ValueError("length 0 with a non-zero start selects nothing; omit length to read to the end")
        return self


class GetBatchJob(StrictModel):
    """Fetch many objects (or ranges, or TAR members) into one ordered TAR in the store."""

    kind: Literal["getbatch"] = "getbatch"
    items: list[BatchItem] | None = Field(default=None, description="the request, in output order")
    manifest: str | None = Field(
        default=None,
        description="URI of a JSON array (or JSON Lines) of items, for requests too big to inline",
    )
    output: str | None = Field(default=None, description="archive URI; default jobs/<id>/output/batch.tar")
    continue_on_error: bool = Field(
        default=False,
        description="missing objects become zero-byte __404__/<name> entries instead of failing",
    )
    max_soft_errors: int | None = Field(
        default=None, ge=0, description="with continue_on_error, abort once more items than this fail"
    )
    items_per_part: int = Field(default=2000, ge=1, le=100_000, description="items gathered by one task")

    @model_validator(mode="after")
    def _exactly_one_source(self) -> GetBatchJob:
        if (self.items is None) == (self.manifest is None):
            raise ValueError("give exactly one of 'items' (inline list) or 'manifest' (URI of an item list)")
        if self.items is not None and not self.items:
            raise ValueError("'items' is empty: a GetBatch request needs at least one item")
        return self


class FedAvgClient(StrictModel):
    """One client's model update: a safetensors object and its weight (number of training examples).

    Without ``weight`` the weight is read from the file's ``__metadata__["num_examples"]``.
    """

    uri: str = Field(min_length=1)
    weight: float | None = Field(default=None, description="> 0; default: __metadata__.num_examples")

    @model_validator(mode="after")
    def _positive_weight(self) -> FedAvgClient:
        if self.weight is not None and not (self.weight > 0 and math.isfinite(self.weight)):
            raise ValueError(f"weight of {self.uri} must be a finite number > 0, got {self.weight}")
        return self


class FedAvgJob(StrictModel):
    """Average N client updates (safetensors) into one model, sharded by byte range (GradsSharding)."""

    kind: Literal["fedavg"] = "fedavg"
    clients: list[FedAvgClient] = Field(min_length=1, description="summed in this order")
    output: str | None = Field(default=None, description="default jobs/<id>/output/model.safetensors")
    aggregator: Literal["mean", "trimmed_mean", "median"] = Field(
        default="mean",
        description="weighted mean (FedAvg), or coordinate-wise robust statistics (unweighted)",
    )
    trim_fraction: float = Field(
        default=0.1,
        ge=0.0,
        lt=0.5,
        description="trimmed_mean: share of clients cut at each end per coordinate",
    )
    uniform: bool = Field(default=False, description="ignore weights: plain mean, as GradsSharding does")
    accumulate: Literal["float32", "float64"] = Field(
        default="float32", description="accumulator of float tensors (F64 tensors always use float64)"
    )
    integer_policy: Literal["mean", "first", "max"] = Field(
        default="mean",
        description=(
            "integer and BOOL tensors: 'mean' applies the aggregator in float64 and rounds half to even "
            "(BOOL: a weighted majority), 'first' keeps client 0's values, 'max' the elementwise maximum"
        ),
    )
    allow_nonfinite: bool = Field(default=False, description="accept NaN/Inf in updates instead of failing")
    shards: int | None = Field(default=None, ge=1, le=10_000, description="default: chosen from model size")

    @model_validator(mode="after")
    def _distinct_clients(self) -> FedAvgJob:
        seen: dict[str, int] = {}
        for i, c in enumerate(self.clients):
            if c.uri in seen:
                raise ValueError(
                    f"clients.{i} repeats clients.{seen[c.uri]} ({c.uri}); each update counts once"
                )
            seen[c.uri] = i
        return self


# --------------------------------------------------------------------------------------------------------
# dpquery: marginal workloads under zCDP (ResidualPlanner)

DATASET_FORMATS = {".csv": "csv", ".parquet": "parquet", ".parq": "parquet", ".pq": "parquet"}
# An attribute's domain may not exceed this many values (a range with bin width 1 over 10^9 is a mistake).
DP_MAX_DOMAIN = 10_000_000
# The expanded workload may not list more marginals than this.
DP_MAX_MARGINALS = 1_000_000
# Reported ε is given at this δ when the budget is a plain ``rho``.
DP_REPORT_DELTA = 1e-9
_DATASET_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


def _fail(title: str, problems: list[tuple[tuple, str]], value) -> None:
    """Raise a ValidationError whose entries name the exact field of each problem (loc is absolute)."""
    from pydantic_core import InitErrorDetails, PydanticCustomError

    raise ValidationError.from_exception_data(
        title,
        [
            InitErrorDetails(type=PydanticCustomError("value_error", msg), loc=loc, input=value)
            for loc, msg in problems
        ],
    )


class DPAttribute(StrictModel):
    """One attribute (a column of the dataset) and its domain, given one of two ways:

    * ``categories``: the list of values, in output order. Rows are matched by equality with a value.
    * ``range: [lo, hi]`` (integers, both inclusive) with ``bin_width`` (default 1): bins
      ``[lo, lo+w−1], [lo+w, lo+2w−1], …``; the last bin ends at ``hi`` (it may be narrower). A value v
      falls in bin ``(v − lo) // w``; values outside [lo, hi] are domain errors, never clipped.

    A domain needs at least 2 values: a one-valued attribute carries no information (drop the column).
    """

    name: str = Field(min_length=1, description="column name in the dataset")
    categories: list[StrictStr | StrictBool | StrictInt] | None = Field(
        default=None, description="the domain's values, in output order"
    )
    range: tuple[StrictInt, StrictInt] | None = Field(default=None, description="[lo, hi], both inclusive")
    bin_width: StrictInt | None = Field(default=None, ge=1, description="with range; default 1")

    @model_validator(mode="after")
    def _one_domain(self) -> DPAttribute:
        if (self.categories is None) == (self.range is None):
            raise ValueError(f"attribute {self.name!r}: give exactly one of 'categories' or 'range'")
        if self.categories is not None:
            if self.bin_width is not None:
                raise ValueError(f"attribute {self.name!r}: 'bin_width' only applies to a 'range'")
            seen: dict[tuple, int] = {}
            for i, c in enumerate(self.categories):
                key = (type(c).__name__, c)
                if key in seen:
                    raise ValueError(
                        f"attribute {self.name!r}: categories.{i} repeats categories.{seen[key]} ({c!r})"
                    )
                seen[key] = i
        else:
            lo, hi = self.range
            if lo > hi:
                raise ValueError(f"attribute {self.name!r}: range [{lo}, {hi}] is empty (lo > hi)")
            if self.bin_width is None:
                self.bin_width = 1
        n = self.size
        if n < 2:
            raise ValueError(
                f"attribute {self.name!r}: the domain has {n} value; at least 2 are needed "
                "(a one-valued attribute carries no information: drop it)"
            )
        if n > DP_MAX_DOMAIN:
            raise ValueError(f"attribute {self.name!r}: {n:,} values exceeds the limit of {DP_MAX_DOMAIN:,}")
        return self

    @property
    def size(self) -> int:
        """n_i, the number of values (bins) of the domain."""
        if self.categories is not None:
            return len(self.categories)
        lo, hi = self.range
        return -(-(hi - lo + 1) // (self.bin_width or 1))

    def labels(self) -> list:
        """One label per domain value, in order: the categories, or for a range each bin's lower bound
        (bin width 1) or ``"a..b"`` (both inclusive)."""
        if self.categories is not None:
            return list(self.categories)
        lo, hi = self.range
        w = self.bin_width or 1
        if w == 1:
            return list(range(lo, hi + 1))
        return [f"{a}..{min(a + w - 1, hi)}" for a in range(lo, hi + 1, w)]


class DPMarginal(StrictModel):
    """One marginal of the workload: the counts of every combination of values of ``attributes``.

    ``attributes: []`` is the total count. ``weight`` (> 0) is its importance in the loss: its per-cell
    variances count ``weight`` times in ``sum_of_variances``; ``max_variance`` minimises max weight·Var.
    """

    attributes: list[str] = Field(description="attribute names (any order; output uses schema order)")
    weight: float = Field(default=1.0, gt=0, allow_inf_nan=False)


class DPMarginalGenerator(StrictModel):
    """All marginals over at most ``all_marginals_up_to`` attributes (the 0-way total included) of
    ``attributes`` (default: every attribute of the schema), each with ``weight``."""

    all_marginals_up_to: int = Field(ge=0, description="k: every marginal of 0, 1, …, k attributes")
    attributes: list[str] | None = Field(default=None, description="default: every schema attribute")
    weight: float = Field(default=1.0, gt=0, allow_inf_nan=False)


class DPBudget(StrictModel):
    """The job's privacy budget: ``{"rho": ρ}`` (zCDP), or ``{"epsilon": ε, "delta": δ}`` converted to the
    largest ρ whose CKS bound gives (ε, δ)-DP. With ``rho``, an optional ``delta`` only sets the δ at
    which the report states ε (default 1e-9)."""

    rho: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    epsilon: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    delta: float | None = Field(default=None, gt=0, lt=1)

    @model_validator(mode="after")
    def _one_budget(self) -> DPBudget:
        if (self.rho is None) == (self.epsilon is None):
            raise ValueError("give exactly one of 'rho' (zCDP) or 'epsilon' with 'delta'")
        if self.epsilon is not None and self.delta is None:
            raise ValueError("'epsilon' needs 'delta' in (0, 1) (the budget is (epsilon, delta)-DP)")
        return self

    def zcdp_rho(self) -> float:
        """The budget as ρ-zCDP (what the ledger counts)."""
        if self.rho is not None:
            return self.rho
        from functions.dpquery.privacy import cdp_rho

        return cdp_rho(self.epsilon, self.delta)

    def report_delta(self) -> float:
        return self.delta if self.delta is not None else DP_REPORT_DELTA


class DPQueryJob(StrictModel):
    """Answer a workload of marginals of a dataset under zCDP (ResidualPlanner), with per-cell error bars.

    Budget ledger rule (per ``dataset_id``, append-only in the store): the first job that names a dataset
    id registers its total budget, ``dataset_budget_rho``, which that first job must give. Later jobs may
    omit it; if they give it, it must equal the registered total (a total never changes). A job whose ρ
    would take the ledger's sum past the total is refused before any measurement.
    """

    kind: Literal["dpquery"] = "dpquery"
    dataset: str = Field(min_length=1, description="URI of one CSV (with a header row) or Parquet object")
    format: Literal["csv", "parquet"] | None = Field(
        default=None, description="default: from the extension (.csv; .parquet, .parq, .pq)"
    )
    schema_: list[DPAttribute] = Field(
        alias="schema", min_length=1, description="the attributes, in order (axes of every output table)"
    )
    workload: list[DPMarginal] | DPMarginalGenerator = Field(
        description="a list of marginals, or {all_marginals_up_to: k, attributes?}"
    )
    budget: DPBudget
    loss: Literal["sum_of_variances", "max_variance"] = Field(
        default="sum_of_variances",
        description="weighted sum of per-cell variances (closed form), or the largest weighted variance",
    )
    dataset_id: str = Field(
        pattern=_DATASET_ID, description="ledger key: letters, digits, '.', '_', '-' (at most 128)"
    )
    dataset_budget_rho: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        description="total ρ of dataset_id; required by the first job on it, fixed afterwards",
    )
    output: str | None = Field(
        default=None, description="URI prefix of the tables; default jobs/<id>/output/"
    )
    noise_samples_per_task: int | None = Field(
        default=None, ge=1, le=1_000_000_000, description="measure fan-out size; default chosen by the plan"
    )
    cells_per_task: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000_000,
        description="reconstruct fan-out size; default chosen by the plan",
    )

    # ``schema`` shadows a BaseModel attribute, so the field is ``schema_`` with alias "schema", and dumps
    # use the alias, so a dumped spec parses again.
    model_config = ConfigDict(extra="forbid", populate_by_name=True, serialize_by_alias=True)

    @property
    def attributes(self) -> list[DPAttribute]:
        """The schema (``schema`` is a pydantic name, hence the ``schema_`` field)."""
        return self.schema_

    @field_validator("workload")
    @classmethod
    def _nonempty_workload(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("the workload is empty: list at least one marginal")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> DPQueryJob:
        problems: list[tuple[tuple, str]] = []
        if self.format is None:
            path = self.dataset.split("?", 1)[0].lower()
            ext = next((e for e in DATASET_FORMATS if path.endswith(e)), None)
            if ext is None:
                problems.append(
                    (
                        ("format",),
                        f"cannot infer the format of {self.dataset!r} from its extension; "
                        "set 'format' to 'csv' or 'parquet'",
                    )
                )
            else:
                self.format = DATASET_FORMATS[ext]
        index: dict[str, int] = {}
        for j, a in enumerate(self.schema_):
            if a.name in index:
                problems.append(
                    (("schema", j, "name"), f"attribute {a.name!r} repeats schema.{index[a.name]}")
                )
            else:
                index[a.name] = j
        if isinstance(self.workload, DPMarginalGenerator):
            g = self.workload
            names = g.attributes if g.attributes is not None else [a.name for a in self.schema_]
            for i, name in enumerate(names):
                if name not in index:
                    problems.append((("workload", "attributes", i), f"unknown attribute {name!r}"))
            if g.attributes is not None and len(set(g.attributes)) != len(g.attributes):
                problems.append((("workload", "attributes"), "lists an attribute more than once"))
            d = len(set(names))
            count = sum(math.comb(d, k) for k in range(min(g.all_marginals_up_to, d) + 1))
            if count > DP_MAX_MARGINALS:
                problems.append(
                    (
                        ("workload", "all_marginals_up_to"),
                        f"{g.all_marginals_up_to} over {d} attributes gives {count:,} marginals; "
                        f"the limit is {DP_MAX_MARGINALS:,}",
                    )
                )
        else:
            if len(self.workload) > DP_MAX_MARGINALS:
                problems.append(
                    (("workload",), f"{len(self.workload):,} marginals; the limit is {DP_MAX_MARGINALS:,}")
                )
            seen: dict[frozenset, int] = {}
            for i, m in enumerate(self.workload):
                bad = False
                for k, name in enumerate(m.attributes):
                    if name not in index:
                        problems.append((("workload", i, "attributes", k), f"unknown attribute {name!r}"))
                        bad = True
                if len(set(m.attributes)) != len(m.attributes):
                    problems.append((("workload", i, "attributes"), "lists an attribute more than once"))
                    bad = True
                key = frozenset(m.attributes)
                if not bad:
                    if key in seen:
                        problems.append(
                            (
                                ("workload", i, "attributes"),
                                f"the same marginal as workload.{seen[key]}; list each marginal once "
                                "(raise its weight instead)",
                            )
                        )
                    else:
                        seen[key] = i
        if self.dataset_budget_rho is not None and self.budget.rho is not None:
            if self.budget.rho > self.dataset_budget_rho:
                problems.append(
                    (
                        ("budget", "rho"),
                        f"rho {self.budget.rho} exceeds dataset_budget_rho {self.dataset_budget_rho}",
                    )
                )
        if problems:
            _fail("DPQueryJob", problems, self.dataset)
        if self.dataset_budget_rho is not None and self.budget.rho is None:
            rho = self.budget.zcdp_rho()
            if rho > self.dataset_budget_rho:
                _fail(
                    "DPQueryJob",
                    [
                        (
                            ("budget",),
                            f"(epsilon {self.budget.epsilon}, delta {self.budget.delta}) is rho {rho:.6g}, "
                            f"more than dataset_budget_rho {self.dataset_budget_rho}",
                        )
                    ],
                    self.dataset,
                )
        return self

    def domains(self) -> list[int]:
        """n_i of every schema attribute, in schema order."""
        return [a.size for a in self.schema_]

    def marginals(self) -> list[tuple[tuple[int, ...], float]]:
        """The expanded workload: (sorted schema indices, weight) per marginal, in a deterministic order
        (a list: in the given order; a generator: by size, then lexicographically)."""
        index = {a.name: j for j, a in enumerate(self.schema_)}
        if isinstance(self.workload, DPMarginalGenerator):
            g = self.workload
            names = g.attributes if g.attributes is not None else [a.name for a in self.schema_]
            idx = sorted(index[n] for n in names)
            return [
                (combo, g.weight)
                for k in range(min(g.all_marginals_up_to, len(idx)) + 1)
                for combo in itertools.combinations(idx, k)
            ]
        return [(tuple(sorted(index[n] for n in m.attributes)), m.weight) for m in self.workload]

    def rho(self) -> float:
        """The job's budget as ρ-zCDP."""
        return self.budget.zcdp_rho()


# --------------------------------------------------------------------------------------------------------
# inference: streaming batch inference (CPU preprocessing on Lambda, GPU inference on Batch)

INFERENCE_FORMATS = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".parq": "parquet",
    ".pq": "parquet",
}


def inference_input_format(uri: str) -> str | None:
    """``"jsonl"`` or ``"parquet"`` from a URI's extension, or ``None`` when it is neither."""
    path = uri.split("?", 1)[0].lower()
    return next((f for e, f in INFERENCE_FORMATS.items() if path.endswith(e)), None)


class TorchScriptModel(StrictModel):
    """A user's TorchScript or ``torch.export`` file in the store, taking ``(input_ids, attention_mask)``
    (int64 ``[B, T]``) and returning ``[B, D]`` floats."""

    torchscript: str = Field(min_length=1, description="URI of the .pt / .pt2 file")
    input: Literal["token_ids"] = Field(default="token_ids", description="the declared input signature")


class InferenceJob(StrictModel):
    """Run a model over every row of one or more JSONL / Parquet files; output Parquet in input order."""

    kind: Literal["inference"] = "inference"
    inputs: list[str] = Field(
        min_length=1, description="URIs of JSONL or Parquet files (format by extension)"
    )
    field: str = Field(min_length=1, description="the text column (Parquet) or key (JSONL)")
    id_field: str | None = Field(default=None, description="id column; default: row number across inputs")
    model: Literal["minilm"] | TorchScriptModel = Field(
        default="minilm", description="'minilm' (all-MiniLM-L6-v2) or {torchscript: uri, input: token_ids}"
    )
    max_tokens: int = Field(default=256, ge=2, le=8192, description="truncation, special tokens included")
    batch_tokens: int = Field(default=16384, ge=1, description="token budget of one GPU batch")
    shard_rows: int = Field(default=2000, ge=1, le=1_000_000, description="rows per shard")
    gpu_workers: int = Field(
        default=1, ge=1, le=256, description="GPU workers (AWS Batch jobs) claiming shards side by side"
    )
    output: str | None = Field(
        default=None, description="Parquet URI; default jobs/<id>/output/embeddings.parquet"
    )
    on_bad_row: Literal["fail", "skip"] = Field(
        default="fail", description="'skip' drops bad rows (missing field, bad line) and reports them"
    )

    @field_validator("inputs")
    @classmethod
    def _known_formats(cls, value: list[str]) -> list[str]:
        problems = [
            f"inputs.{i}: cannot infer the format of {u!r}; use .jsonl/.ndjson or .parquet/.parq/.pq"
            for i, u in enumerate(value)
            if inference_input_format(u) is None
        ]
        if problems:
            raise ValueError("; ".join(problems))
        seen: dict[str, int] = {}
        for i, u in enumerate(value):
            if u in seen:
                raise ValueError(f"inputs.{i} repeats inputs.{seen[u]} ({u})")
            seen[u] = i
        return value

    @model_validator(mode="after")
    def _budget_fits_a_row(self) -> InferenceJob:
        if self.batch_tokens < self.max_tokens:
            raise ValueError(
                f"batch_tokens {self.batch_tokens} < max_tokens {self.max_tokens}: a full row would not fit"
            )
        return self


# Every job kind's spec model, by its ``kind`` tag. A new kind registers here.
KINDS: dict[str, type[StrictModel]] = {
    "getbatch": GetBatchJob,
    "fedavg": FedAvgJob,
    "dpquery": DPQueryJob,
    "inference": InferenceJob,
}
JobSpec = GetBatchJob | FedAvgJob | DPQueryJob | InferenceJob  # the union of KINDS' models, for type hints


def _describe(err: ValidationError) -> list[dict]:
    out = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<spec>"
        out.append({"field": loc, "error": e["msg"]})
    return out


def parse_spec(doc: dict | str | bytes) -> JobSpec:
    """Validate a job spec given as a dict or JSON text; raise :class:`SpecError` naming every bad field."""
    if isinstance(doc, bytes | str):
        try:
            doc = json.loads(doc)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise SpecError(
                f"spec is not valid JSON: {exc}", [{"field": "<spec>", "error": str(exc)}]
            ) from exc
    if not isinstance(doc, dict):
        raise SpecError("spec must be a JSON object", [{"field": "<spec>", "error": "not an object"}])
    kind = doc.get("kind")
    if kind not in KINDS:
        msg = f"unknown job kind {kind!r}; expected one of {sorted(KINDS)}"
        raise SpecError(msg, [{"field": "kind", "error": msg}])
    try:
        return KINDS[kind].model_validate(doc)
    except ValidationError as exc:
        errors = _describe(exc)
        summary = "; ".join(f"{e['field']}: {e['error']}" for e in errors)
        raise SpecError(f"invalid {kind} spec: {summary}", errors) from exc
