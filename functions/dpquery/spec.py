"""The dpquery spec: a workload of marginals of a dataset answered under zCDP (ResidualPlanner)."""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Sequence
from typing import Any, Literal, get_args

import numpy as np
from pydantic import (
    ConfigDict,
    Field,
    FiniteFloat,
    PrivateAttr,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from shardfold.functions.ledger import DATASET_ID
from shardfold.functions.privacy import MAX_RHO, MIN_RHO, REPORT_DELTA, cdp_rho
from shardfold.functions.specs import InputUri, JobOptions, OutputPrefix, StrictModel, fail

DATASET_FORMATS = {".csv": "csv", ".parquet": "parquet", ".parq": "parquet", ".pq": "parquet"}
# An attribute's domain may not exceed this many values (a range with bin width 1 over 10^9 is a mistake).
DP_MAX_DOMAIN = 10_000_000
# The expanded workload may not list more marginals than this.
DP_MAX_MARGINALS = 1_000_000
TOTAL_NAME = "(total)"  # the name of the 0-way marginal (the total count)
# What happens to a value outside an attribute's domain (or missing): see DPAttribute.
OutOfDomain = Literal["drop", "clip", "other"]
OTHER_LABEL = "(other)"  # the label of the extra category of an attribute with out_of_domain "other"
# The public bound on the rows counted (``max_rows_total``) when a spec gives none, and the least a spec may
# give: the float64 rounding of the residual transform is charged for this many rows
# (functions.dpquery.measure), and prepare refuses a dataset that may hold more. 2^32 costs a relative
# ~1e-5 in sensitivity at 10-valued 3-way sets. It may not be set lower: the refusal depends on the row
# count, and a bound the analyst could set anywhere would let them find the count by bisection.
DEFAULT_MAX_ROWS_TOTAL = 2**32
MAX_ROWS_TOTAL = 2**53  # counts above 2^53 are not exact in float64
MAX_RANGE_VALUE = 2**53  # a range's bounds and bin width, as exact float64 integers
MAX_UNIT_ROWS = 1_000_000
# Query types other than identity solve a convex problem per attribute, with n × n eigendecompositions
# (functions.dpquery.smasher), on domains up to this size.
MAX_QUERY_DOMAIN = 1024


def marginal_name(attributes: Sequence[str]) -> str:
    """The key of a marginal in results and ``client.dpquery`` tables: attribute names in schema order
    joined with ``,``; ``"(total)"`` for the total count."""
    return ",".join(attributes) if attributes else TOTAL_NAME


class DPAttribute(StrictModel):
    """One attribute (a column of the dataset) and its domain, given one of two ways:

    * ``categories``: the list of values, in output order. Rows are matched by equality with a value.
    * ``range: [lo, hi]`` (integers, both inclusive) with ``bin_width`` (default 1): bins
      ``[lo, lo+w−1], [lo+w, lo+2w−1], …``; the last bin ends at ``hi`` (it may be narrower). A value v
      falls in bin ``(v − lo) // w``.

    A value outside the domain, or a missing one, follows ``out_of_domain`` (default: the job's, whose
    default is ``drop``), never an error (whether a job fails must not depend on the data):

    * ``drop``: the record is left out of every marginal (a filter: sound under add/remove neighbours).
    * ``clip`` (ranges only): an integer below ``lo`` counts in the first bin, above ``hi`` in the last; a
      value that is not an integer (missing, text, a fraction) drops the record.
    * ``other``: one more category, labelled ``"(other)"``, appended after the declared values, so the
      domain has n + 1 values and the count of such values is released (noisy) like any other cell.

    A domain needs at least 2 values: a one-valued attribute carries no information (drop the column).
    """

    name: str = Field(min_length=1, description="column name in the dataset")
    categories: list[StrictStr | StrictBool | StrictInt] | None = Field(
        default=None, description="the domain's values, in output order"
    )
    # a JSON list [lo, hi]: strict mode would take only a Python tuple, so the field is lax, its ints strict
    range: tuple[StrictInt, StrictInt] | None = Field(
        default=None, strict=False, description="[lo, hi], both inclusive"
    )
    bin_width: StrictInt | None = Field(default=None, ge=1, description="with range; default 1")
    out_of_domain: OutOfDomain | None = Field(
        default=None,
        description="drop (the record), clip (ranges: to the first/last bin) or other (one more category); "
        "default: the job's out_of_domain",
    )
    # the job's out_of_domain, set by DPQuerySpec for an attribute that gives none (not part of the spec)
    _inherited: OutOfDomain = PrivateAttr(default="drop")

    @property
    def policy(self) -> OutOfDomain:
        """The effective out-of-domain policy: the attribute's own, else the job's (default ``drop``)."""
        return self.out_of_domain or self._inherited

    @model_validator(mode="after")
    def _one_domain(self) -> DPAttribute:
        if (self.categories is None) == (self.range is None):
            raise ValueError(f"attribute {self.name!r}: give exactly one of 'categories' or 'range'")
        if self.categories is not None:
            if self.out_of_domain == "clip":
                raise ValueError(
                    f"attribute {self.name!r}: out_of_domain 'clip' applies to a 'range'; "
                    "use 'drop' or 'other' for categories"
                )
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
            if max(abs(lo), abs(hi), self.bin_width or 1) > MAX_RANGE_VALUE:
                raise ValueError(
                    f"attribute {self.name!r}: range [{lo}, {hi}] and bin_width must lie within ±2^53 (the "
                    "integers a float64 holds exactly, which the tables' bin bounds are)"
                )
            if self.bin_width is None:
                self.bin_width = 1
        n = self.declared_size
        if n < 2:
            raise ValueError(
                f"attribute {self.name!r}: the domain has {n} value; at least 2 are needed "
                "(a one-valued attribute carries no information: drop it)"
            )
        if n > DP_MAX_DOMAIN:
            raise ValueError(f"attribute {self.name!r}: {n:,} values exceeds the limit of {DP_MAX_DOMAIN:,}")
        return self

    @property
    def declared_size(self) -> int:
        """The number of declared values (categories, or bins of the range)."""
        if self.categories is not None:
            return len(self.categories)
        lo, hi = self.range
        return -(-(hi - lo + 1) // (self.bin_width or 1))

    @property
    def size(self) -> int:
        """n_i, the number of values (bins) of the domain: the declared ones, plus the ``"(other)"``
        category when ``out_of_domain`` is ``other``."""
        return self.declared_size + (1 if self.policy == "other" else 0)

    def labels(self) -> list:
        """One label per domain value, in order: the categories, or for a range each bin's lower bound
        (bin width 1) or ``"a..b"`` (both inclusive); then ``"(other)"`` under ``out_of_domain: other``."""
        extra = [OTHER_LABEL] if self.policy == "other" else []
        if self.categories is not None:
            return list(self.categories) + extra
        lo, hi = self.range
        w = self.bin_width or 1
        if w == 1:
            return list(range(lo, hi + 1)) + extra
        return [f"{a}..{min(a + w - 1, hi)}" for a in range(lo, hi + 1, w)] + extra


QueryType = Literal["identity", "prefix", "range", "circular_range"]  # along one attribute
PairType = Literal["affine", "abs_diff"]  # over a 2-way marginal of two ordered attributes
ATTRIBUTE_TYPES: tuple[str, ...] = get_args(QueryType)
PAIR_TYPES: tuple[str, ...] = get_args(PairType)
QUERY_TYPES: tuple[str, ...] = ATTRIBUTE_TYPES + PAIR_TYPES  # a type's code in a plan is its index here
# A 2-way query type's queries are not a product of per-attribute queries: its residual set is measured
# through one matrix over the marginal's cells, solved from the Gram of its pieces over the set's
# (n_a − 1)(n_b − 1) dimensions (functions.dpquery.smasher.set_strategy), at most this many: 40 × 40
# bins, a Gram of 20 MB and a plan of ~20 s for each pair of its own structure.
MAX_PAIR_DIM = 1600
# An explicit query matrix (a marginal's ``queries`` given as rows of numbers, one per cell) is solved as a
# 2-way type is, on a marginal of one or two attributes within MAX_PAIR_DIM; the spec carries its entries.
MATRIX = "matrix"  # its query type's name in plans, tables and `shardfold plan`
WHOLE_TYPES: tuple[str, ...] = (*PAIR_TYPES, MATRIX)  # types that name a marginal's queries as a whole
MAX_MATRIX_ROWS = 10_000
MAX_MATRIX_ENTRIES = 1_000_000
MAX_MATRICES = 100  # distinct explicit matrices in one workload (each is a query type code of the plan)
# A matrix's nonzero weights lie within these magnitudes: their Grams (squares, sums of squares) stay normal
# float64 numbers with room to spare, so no piece underflows to zero or overflows
MATRIX_MIN_WEIGHT, MATRIX_MAX_WEIGHT = 1e-12, 1e12


def _weight_ok(x: int | float) -> bool:
    """0, or a finite number within [MATRIX_MIN_WEIGHT, MATRIX_MAX_WEIGHT] in magnitude (an integer too
    large for a float is not)."""
    try:
        m = abs(float(x))
    except OverflowError:
        return False
    return m == 0 or MATRIX_MIN_WEIGHT <= m <= MATRIX_MAX_WEIGHT


class QueryMatrix:
    """An explicit query matrix of a marginal, one row per query over its cells in C order of its attributes
    in schema order (read-only ``rows``); equal and hashed by its entries, so the planner's caches of a
    type's Grams key it as they key a named type."""

    __slots__ = ("digest", "rows")

    def __init__(self, rows: Any):
        a = np.array(rows, dtype=np.float64)
        a.setflags(write=False)
        self.rows = a
        self.digest = hashlib.blake2b(repr(a.shape).encode() + a.tobytes(), digest_size=16).hexdigest()

    def __hash__(self) -> int:
        return hash(self.digest)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, QueryMatrix) and other.digest == self.digest

    def __repr__(self) -> str:
        return f"QueryMatrix({self.rows.shape[0]} x {self.rows.shape[1]})"


ATTRIBUTE_QUERIES_DESCRIPTION = (
    "per ordered attribute (a range), what to count along it: identity (each bin, the default), prefix "
    "(bins up to each one), range (every interval of bins) or circular_range (every arc of the bins on a "
    "circle)"
)
QUERIES_DESCRIPTION = (
    ATTRIBUTE_QUERIES_DESCRIPTION + "; or, for a marginal of two ordered attributes, one 2-way type: affine "
    "(the rows whose bins i, j have i + j <= c, for every c) or abs_diff (|i - j| <= c, for every c); or, "
    "for a marginal of one or two attributes, an explicit query matrix: a list of rows, each one weight per "
    "cell of the marginal (C order of its attributes as listed: the last varies fastest)"
)


class DPMarginal(StrictModel):
    """One marginal of the workload: the counts of every combination of values of ``attributes``.

    ``attributes: []`` is the total count. ``weight`` (> 0) is its importance in the loss: its per-cell
    variances count ``weight`` times in ``sum_of_variances``; ``max_variance`` minimises max weight·Var.
    ``queries`` asks, along an ordered attribute, for sums of bins instead of each bin: e.g.
    ``{"age": "prefix"}`` answers "age ≤ t" for every t, crossed with the marginal's other attributes.
    A 2-way type names the marginal's queries as a whole: ``"affine"`` on ``["age", "tenure"]`` answers
    "age bin + tenure bin ≤ c" for every c (bins counted from 0, in schema order).
    """

    attributes: list[str] = Field(description="attribute names (any order; output uses schema order)")
    weight: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    queries: dict[str, QueryType] | PairType | list[list[FiniteFloat]] | None = Field(
        default=None, description=QUERIES_DESCRIPTION
    )

    @field_validator("queries", mode="before")
    @classmethod
    def _pair_type_as_a_whole(cls, v: Any) -> Any:
        if isinstance(v, dict) and any(k in PAIR_TYPES for k in v.values()):
            kind = next(k for k in v.values() if k in PAIR_TYPES)
            raise ValueError(f'a 2-way type names the marginal\'s queries as a whole: "queries": "{kind}"')
        if isinstance(v, list):  # an explicit matrix: one message, not one per member of the union
            for r, row in enumerate(v):
                if not isinstance(row, list):
                    raise ValueError(f"an explicit query matrix is a list of rows; row {r} is not a list")
                for c, x in enumerate(row):
                    if isinstance(x, bool) or not isinstance(x, int | float) or not _weight_ok(x):
                        raise ValueError(
                            f"explicit query matrix: row {r}, entry {c} is not 0 or a number of magnitude "
                            f"{MATRIX_MIN_WEIGHT:g} to {MATRIX_MAX_WEIGHT:g}"
                        )
        return v


class DPMarginalGenerator(StrictModel):
    """All marginals over at most ``all_marginals_up_to`` attributes (the 0-way total included) of
    ``attributes`` (default: every attribute of the schema), each with ``weight``."""

    all_marginals_up_to: int = Field(ge=0, description="k: every marginal of 0, 1, …, k attributes")
    attributes: list[str] | None = Field(default=None, description="default: every schema attribute")
    weight: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    queries: dict[str, QueryType] | None = Field(
        default=None,
        description=ATTRIBUTE_QUERIES_DESCRIPTION + "; applies to every marginal holding the attribute",
    )


class DPBudget(StrictModel):
    """The job's privacy budget: ``{"rho": ρ}`` (zCDP), or ``{"epsilon": ε, "delta": δ}`` converted to the
    largest ρ whose CKS bound gives (ε, δ)-DP. With ``rho``, an optional ``delta`` only sets the δ at
    which the report states ε (default 1e-9)."""

    rho: float | None = Field(default=None, ge=MIN_RHO, allow_inf_nan=False)
    epsilon: float | None = Field(default=None, ge=MIN_RHO, allow_inf_nan=False)
    delta: float | None = Field(default=None, gt=0, lt=1)

    @field_validator("rho", "epsilon")
    @classmethod
    def _not_beyond_any_privacy(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value is not None and value > MAX_RHO:
            raise ValueError(
                f"{info.field_name} {value:g} is more than {MAX_RHO:g}, the largest budget a job may spend: "
                "a budget that large leaves no privacy to account for; give a smaller one"
            )
        return value

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
        return cdp_rho(self.epsilon, self.delta)

    def report_delta(self) -> float:
        return self.delta if self.delta is not None else REPORT_DELTA


class DPPrivacyUnit(StrictModel):
    """Who is protected: a person is a distinct value of ``id_column``, and at most ``max_rows`` (k) of
    their rows are counted, chosen data-independently from the job's seed (:mod:`functions.dpquery.unit`).
    Neighbouring datasets then differ by one person, and every measurement's sensitivity is k times the
    one-row value (charged in full: the noise std grows by k at the same ρ)."""

    id_column: str = Field(min_length=1, description="the column that identifies a person")
    max_rows: StrictInt = Field(ge=1, le=MAX_UNIT_ROWS, description="k: rows counted per person at most")


class DPQuerySpec(JobOptions):
    """Answer a workload of marginals of a dataset under zCDP (ResidualPlanner), with per-cell error bars.

    Budget ledger rule (per ``dataset_id``, append-only in the store): the first job that names a dataset
    id registers its total budget, ``dataset_budget_rho``, which that first job must give. Later jobs may
    omit it; if they give it, it must equal the registered total (a total never changes). A job whose ρ
    would take the ledger's sum past the total is refused before any measurement.
    """

    kind: Literal["dpquery"] = "dpquery"
    dataset: InputUri = Field(description="URI of one CSV (with a header row) or Parquet object")
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
    out_of_domain: OutOfDomain = Field(
        default="drop",
        description="what a value outside its attribute's domain (or missing) does, for every attribute "
        "that gives none: drop the record, clip (ranges) or count it in an extra 'other' category",
    )
    loss: Literal["sum_of_variances", "max_variance"] = Field(
        default="sum_of_variances",
        description="weighted sum of per-cell variances (closed form), or the largest weighted variance",
    )
    dataset_id: str = Field(
        pattern=DATASET_ID, description="ledger key: letters, digits, '.', '_', '-' (at most 128)"
    )
    dataset_budget_rho: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        description="total ρ of dataset_id; required by the first job on it, fixed afterwards",
    )
    dataset_version: str | None = Field(
        default=None,
        pattern=DATASET_ID,
        description="a deliberately new version of dataset_id's data (shares its budget); default: the "
        "content the ledger was opened with",
    )
    privacy_unit: DPPrivacyUnit | None = Field(
        default=None, description="{id_column, max_rows}: protect persons of up to k rows; default one row"
    )
    max_rows_total: StrictInt | None = Field(
        default=None,
        ge=DEFAULT_MAX_ROWS_TOTAL,
        le=MAX_ROWS_TOTAL,
        description="public upper bound on the dataset's rows, for a dataset of more than 2^32 (the "
        "transform's rounding is charged for it): at least the default, 2^32, and at most 2^53",
    )
    output: OutputPrefix | None = Field(
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
    def _consistent(self) -> DPQuerySpec:
        """The checks across fields, every problem found reported at once; then the budget's ρ when it is
        given as (ε, δ), against dataset_budget_rho."""
        index: dict[str, int] = {}  # attribute name -> its schema index
        problems = self._format_problems() + self._schema_problems(index)
        if isinstance(self.workload, DPMarginalGenerator):
            problems += self._generator_problems(index)
        else:
            problems += self._list_problems(index)
        over = self.dataset_budget_rho is not None and self.budget.rho is not None
        if over and self.budget.rho > self.dataset_budget_rho:
            message = f"rho {self.budget.rho} exceeds dataset_budget_rho {self.dataset_budget_rho}"
            problems.append((("budget", "rho"), message))
        if problems:
            fail("DPQuerySpec", problems, self.dataset)
        if self.dataset_budget_rho is not None and self.budget.rho is None:
            rho = self.budget.zcdp_rho()
            if rho > self.dataset_budget_rho:
                message = (
                    f"(epsilon {self.budget.epsilon}, delta {self.budget.delta}) is rho {rho:.6g}, "
                    f"more than dataset_budget_rho {self.dataset_budget_rho}"
                )
                fail("DPQuerySpec", [(("budget",), message)], self.dataset)
        return self

    def _format_problems(self) -> list[tuple[tuple, str]]:
        """An unset ``format`` inferred from the dataset's extension, or the problem that it cannot be."""
        if self.format is not None:
            return []
        path = self.dataset.split("?", 1)[0].lower()
        ext = next((e for e in DATASET_FORMATS if path.endswith(e)), None)
        if ext is None:
            return [
                (
                    ("format",),
                    f"cannot infer the format of {self.dataset!r} from its extension; "
                    "set 'format' to 'csv' or 'parquet'",
                )
            ]
        self.format = DATASET_FORMATS[ext]
        return []

    def _schema_problems(self, index: dict[str, int]) -> list[tuple[tuple, str]]:
        """What is wrong with the schema's attributes (a policy their kind cannot take, a repeated name),
        each given the job's out_of_domain to inherit and entered in ``index``."""
        problems: list[tuple[tuple, str]] = []
        for j, a in enumerate(self.schema_):
            a._inherited = self.out_of_domain
            if a.policy == "clip" and a.categories is not None:
                problems.append(
                    (
                        ("schema", j, "out_of_domain"),
                        f"attribute {a.name!r} has categories: the job's out_of_domain 'clip' applies only "
                        "to ranges; give this attribute out_of_domain 'drop' or 'other'",
                    )
                )
            if a.policy == "other" and a.categories is not None and OTHER_LABEL in a.categories:
                problems.append(
                    (
                        ("schema", j, "categories"),
                        f"attribute {a.name!r}: {OTHER_LABEL!r} is the label of the out-of-domain category; "
                        "rename that category",
                    )
                )
            if a.name in index:
                problems.append(
                    (("schema", j, "name"), f"attribute {a.name!r} repeats schema.{index[a.name]}")
                )
            else:
                index[a.name] = j
        return problems

    def _generator_problems(self, index: dict[str, int]) -> list[tuple[tuple, str]]:
        """What is wrong with a generated workload: its attributes, its queries, the marginals it makes."""
        g = self.workload
        names = g.attributes if g.attributes is not None else [a.name for a in self.schema_]
        problems: list[tuple[tuple, str]] = []
        for i, name in enumerate(names):
            if name not in index:
                problems.append((("workload", "attributes", i), f"unknown attribute {name!r}"))
        if g.attributes is not None and len(set(g.attributes)) != len(g.attributes):
            problems.append((("workload", "attributes"), "lists an attribute more than once"))
        problems += self._query_problems(g.queries, names, ("workload", "queries"))
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
        return problems

    def _list_problems(self, index: dict[str, int]) -> list[tuple[tuple, str]]:
        """What is wrong with a listed workload: its length, each marginal (:meth:`_marginal_problems`), a
        marginal listed twice, too many explicit matrices."""
        problems: list[tuple[tuple, str]] = []
        if len(self.workload) > DP_MAX_MARGINALS:
            problems.append(
                (("workload",), f"{len(self.workload):,} marginals; the limit is {DP_MAX_MARGINALS:,}")
            )
        seen: dict[frozenset, int] = {}
        for i, m in enumerate(self.workload):
            found, bad = self._marginal_problems(i, m, index)
            problems += found
            key = frozenset(m.attributes)
            if bad:
                continue
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
        matrices = sum(isinstance(m.queries, list) for m in self.workload)
        if matrices > MAX_MATRICES:
            problems.append(
                (("workload",), f"{matrices} explicit query matrices; the limit is {MAX_MATRICES}")
            )
        return problems

    def _marginal_problems(self, i: int, m: DPMarginal, index: dict[str, int]) -> tuple[list, bool]:
        """What is wrong with workload marginal i (its attributes, its queries), and whether its attributes
        are at fault (then its explicit matrix is not checked, nor whether it repeats another)."""
        at = ("workload", i)
        problems: list[tuple[tuple, str]] = []
        for k, name in enumerate(m.attributes):
            if name not in index:
                problems.append(((*at, "attributes", k), f"unknown attribute {name!r}"))
        if len(set(m.attributes)) != len(m.attributes):
            problems.append(((*at, "attributes"), "lists an attribute more than once"))
        bad = bool(problems)
        if isinstance(m.queries, str):
            problems += self._pair_problems(m.queries, m.attributes, (*at, "queries"))
        elif isinstance(m.queries, list):
            if not bad:
                problems += self._matrix_problems(m.queries, m.attributes, (*at, "queries"))
        else:
            problems += self._query_problems(m.queries, m.attributes, (*at, "queries"))
        return problems, bad

    def _query_problems(
        self, queries: dict[str, str] | None, attributes: Sequence[str], at: tuple
    ) -> list[tuple[tuple, str]]:
        """What is wrong with a marginal's (or the generator's) ``queries``: each names an attribute of the
        marginal, ordered (a ``range``, without an ``"(other)"`` value), of at most MAX_QUERY_DOMAIN bins."""
        problems: list[tuple[tuple, str]] = []
        schema = {a.name: a for a in self.schema_}
        for name, kind in (queries or {}).items():
            where = (*at, name)
            a = schema.get(name)
            if name not in attributes or a is None:
                problems.append((where, f"{name!r} is not one of the marginal's attributes"))
            elif kind == "identity":
                continue
            elif a.range is None:
                problems.append(
                    (
                        where,
                        f"{kind!r} needs ordered values: attribute {name!r} has categories; give it a range",
                    )
                )
            elif a.policy == "other":
                problems.append(
                    (
                        where,
                        f"{kind!r} needs ordered values: attribute {name!r} counts out-of-domain values "
                        f"in an {OTHER_LABEL!r} bin, which has no place in the order; use out_of_domain "
                        "'drop' or 'clip' for it",
                    )
                )
            elif a.size > MAX_QUERY_DOMAIN:
                problems.append(
                    (
                        where,
                        f"{kind!r} on {a.size:,} bins: query types other than identity take at most "
                        f"{MAX_QUERY_DOMAIN:,} (raise the attribute's bin_width)",
                    )
                )
        return problems

    def _pair_problems(self, kind: str, attributes: Sequence[str], at: tuple) -> list[tuple[tuple, str]]:
        """What is wrong with a 2-way query type on a marginal: it needs exactly two attributes, both
        ordered (as :meth:`_query_problems` checks), whose residual space is small enough to solve whole."""
        if len(attributes) != 2:
            return [(at, f"{kind!r} asks about two attributes; the marginal has {len(attributes)}")]
        problems = self._query_problems({name: kind for name in attributes}, attributes, at)
        if problems:
            return [(at, msg) for _, msg in problems]
        schema = {a.name: a for a in self.schema_}
        dim = math.prod(schema[name].size - 1 for name in attributes)
        if dim > MAX_PAIR_DIM:
            sizes = " x ".join(str(schema[name].size) for name in attributes)
            problems.append(
                (
                    at,
                    f"{kind!r} on {sizes} bins: a 2-way query type takes at most {MAX_PAIR_DIM} for "
                    f"(bins - 1) x (bins - 1), here {dim:,} (raise the attributes' bin_width)",
                )
            )
        return problems

    def _matrix_problems(
        self, rows: list[list[float]], attributes: Sequence[str], at: tuple
    ) -> list[tuple[tuple, str]]:
        """What is wrong with an explicit query matrix: a marginal of one or two attributes whose residual
        space is small enough to solve whole (as a 2-way type's), one weight per cell in every row, not all
        zero, and within the size limits."""
        if len(attributes) not in (1, 2):
            return [
                (
                    at,
                    "an explicit query matrix is for one or two attributes; the marginal has "
                    f"{len(attributes)}",
                )
            ]
        schema = {a.name: a for a in self.schema_}
        sizes = [schema[name].size for name in attributes]
        cells = math.prod(sizes)
        dim = math.prod(n - 1 for n in sizes)
        shape = " x ".join(map(str, sizes))
        if dim > MAX_PAIR_DIM:
            return [
                (
                    at,
                    f"an explicit query matrix on {shape} values takes at most {MAX_PAIR_DIM} for the "
                    f"product of (values - 1), here {dim:,} (coarsen the attributes' bins)",
                )
            ]
        if not rows:
            return [(at, "an explicit query matrix needs at least one row")]
        if len(rows) > MAX_MATRIX_ROWS or len(rows) * cells > MAX_MATRIX_ENTRIES:
            return [
                (
                    at,
                    f"{len(rows):,} rows of {cells:,} cells; an explicit query matrix may have at most "
                    f"{MAX_MATRIX_ROWS:,} rows and {MAX_MATRIX_ENTRIES:,} entries",
                )
            ]
        for r, row in enumerate(rows):
            if len(row) != cells:
                return [
                    (
                        at + (r,),
                        f"{len(row)} entries; the marginal has {cells} cells ({shape}, the last attribute "
                        f"listed varying fastest)",
                    )
                ]
        if not any(x for row in rows for x in row):
            return [(at, "every entry of the explicit query matrix is zero: it asks nothing")]
        return []

    def marginal_queries(self) -> list[dict[int, Any]]:
        """Beside :meth:`marginals`, each marginal's ``{schema index: query type}`` (identity omitted; a
        2-way type is given for both of its attributes, and so is an explicit matrix, as a
        :class:`QueryMatrix` over the cells in schema order)."""
        index = {a.name: j for j, a in enumerate(self.schema_)}
        if isinstance(self.workload, DPMarginalGenerator):
            asked = {index[n]: k for n, k in (self.workload.queries or {}).items() if k != "identity"}
            return [{i: asked[i] for i in attrs if i in asked} for attrs, _ in self.marginals()]
        out = []
        for m in self.workload:
            if isinstance(m.queries, str):
                out.append({index[n]: m.queries for n in m.attributes})
            elif isinstance(m.queries, list):
                _, rows = schema_order(m.queries, [index[n] for n in m.attributes], self.domains())
                matrix = QueryMatrix(rows)
                out.append({index[n]: matrix for n in m.attributes})
            else:
                out.append({index[n]: k for n, k in (m.queries or {}).items() if k != "identity"})
        return out

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

    def unit_rows(self) -> int:
        """k: rows one person may contribute (1 without a privacy unit)."""
        return self.privacy_unit.max_rows if self.privacy_unit is not None else 1

    def rows_bound(self) -> int:
        """N: the public bound on the rows counted (``max_rows_total`` or its default)."""
        return self.max_rows_total if self.max_rows_total is not None else DEFAULT_MAX_ROWS_TOTAL


def schema_order(
    rows: Any, attrs: Sequence[int], domains: Sequence[int]
) -> tuple[tuple[int, ...], np.ndarray]:
    """Queries over the cells of ``attrs`` as listed (``rows``: one row per query, or one array per query
    shaped by those attributes), re-ordered to the cells of the same attributes in schema order (the
    planner's and the tables' order): (the attributes sorted, one row per query over their cells)."""
    a = np.asarray(rows, dtype=np.float64)
    a = a.reshape([a.shape[0], *(domains[i] for i in attrs)])
    order = sorted(range(len(attrs)), key=lambda p: attrs[p])
    ordered = np.transpose(a, [0, *(p + 1 for p in order)]).reshape(a.shape[0], -1)
    return tuple(attrs[p] for p in order), ordered
