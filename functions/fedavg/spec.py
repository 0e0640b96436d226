"""The fedavg spec: N client updates (safetensors) averaged into one model (GradsSharding)."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from shardfold.functions.ledger import DATASET_ID
from shardfold.functions.privacy import MAX_RHO
from shardfold.functions.specs import InputUri, JobOptions, OutputUri, StrictModel, fail, repeated_uris

# The longest a round waits for late updates (``wait_s``; the workflow's polling step, which looks for them
# every few seconds and bills no Lambda time while it waits).
MAX_WAIT_S = 600
MAX_CLIENTS = (
    10**9
)  # the most clients a round may list or expect (the mean's denominator stays an exact float)


class FedAvgClient(StrictModel):
    """One client's model update: a safetensors object and its weight (number of training examples).

    Without ``weight`` the weight is read from the file's ``__metadata__["num_examples"]``.
    """

    uri: InputUri
    weight: float | None = Field(default=None, description="> 0; default: __metadata__.num_examples")

    @model_validator(mode="after")
    def _positive_weight(self) -> FedAvgClient:
        if self.weight is not None and not (self.weight > 0 and math.isfinite(self.weight)):
            msg = f"weight of {self.uri} must be a finite number > 0, got {self.weight}"
            fail("FedAvgClient", [(("weight",), msg)], self.weight)
        return self


class FedAvgDP(StrictModel):
    """DP-FedAvg with server-side fixed clipping (McMahan et al. 2018): each client's update is clipped to
    L2 norm ``clip_norm`` over the whole model, the clipped updates are averaged over a fixed denominator
    (``expected_clients``) and Gaussian noise of std ``noise_multiplier x clip_norm / expected_clients`` is
    added, drawn by OpenDP. Each round charges ``dataset_id``'s budget ledger (the privacy unit: a client)."""

    clip_norm: float = Field(
        ge=1e-12, le=1e12, allow_inf_nan=False, description="C: the L2 bound of one update"
    )
    noise_multiplier: float = Field(
        gt=0, le=1e6, allow_inf_nan=False, description="z: noise std = z x C / expected_clients"
    )
    dataset_id: str = Field(pattern=DATASET_ID, description="the federation's budget ledger key")
    dataset_budget_rho: float | None = Field(
        default=None,
        gt=0,
        le=MAX_RHO,
        allow_inf_nan=False,
        description="total ρ of dataset_id; required by the first round on it, fixed afterwards",
    )
    expected_clients: int | None = Field(
        default=None,
        ge=1,
        le=MAX_CLIENTS,
        description="m, the mean's fixed denominator; default: the clients listed",
    )
    base: InputUri | None = Field(
        default=None,
        description="the global model the clients trained from: an update is client - base, and the output "
        "base + the noisy mean update (default: the files are the updates themselves)",
    )
    structure: InputUri | None = Field(
        default=None,
        description="a public model file whose tensors (names, dtypes and shapes; not its values) are the "
        "round's; default dp.base. A DP round needs one of the two: which tensors it averages never depends "
        "on which clients sent what, and an update unlike it counts as absent",
    )


class FedAvgSpec(JobOptions):
    """Average N client updates (safetensors) into one model, sharded by byte range (GradsSharding)."""

    kind: Literal["fedavg"] = "fedavg"
    clients: list[FedAvgClient] = Field(
        min_length=1, max_length=MAX_CLIENTS, description="summed in this order"
    )
    output: OutputUri | None = Field(default=None, description="default jobs/<id>/output/model.safetensors")
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
    shards: int | None = Field(
        default=None,
        ge=1,
        le=10_000,
        description=(
            "aggregate tasks (byte ranges of the model); default: from the model's size, and locally at "
            "least one per CPU (in whole multiples of the CPU count) while every shard keeps 5 MiB"
        ),
    )
    min_clients: int | None = Field(
        default=None,
        ge=1,
        description="leave out missing or invalid updates if at least this many remain (default: all needed)",
    )
    min_fraction: float | None = Field(
        default=None,
        gt=0,
        le=1,
        allow_inf_nan=False,
        description="as min_clients, as a share of the clients listed (with both, the larger count holds)",
    )
    wait_s: float = Field(
        default=0,
        ge=0,
        le=MAX_WAIT_S,
        allow_inf_nan=False,
        description="seconds the round waits for updates not yet uploaded before it starts without them",
    )
    dp: FedAvgDP | None = Field(default=None, description="DP-FedAvg: clip, average and add Gaussian noise")
    secure: bool = Field(
        default=False,
        description="the updates are masked (client.fedavg.mask_update): sum them exactly, output the mean",
    )

    @property
    def tolerant(self) -> bool:
        """Whether missing or invalid updates are left out (``min_clients`` or ``min_fraction`` given)."""
        return self.min_clients is not None or self.min_fraction is not None

    @property
    def required_clients(self) -> int:
        """How many updates the round needs: every one listed unless ``min_clients``/``min_fraction`` say
        fewer (a fraction rounds up, ignoring float noise: 0.3 of 10 is 3)."""
        n = len(self.clients)
        if not self.tolerant:
            return n
        by_fraction = math.ceil(self.min_fraction * n - 1e-9) if self.min_fraction is not None else 1
        return max(self.min_clients or 1, by_fraction, 1)

    @model_validator(mode="after")
    def _enough_clients_listed(self) -> FedAvgSpec:
        if self.min_clients is not None and self.min_clients > len(self.clients):
            fail(
                "FedAvgSpec",
                [
                    (
                        ("min_clients",),
                        f"min_clients {self.min_clients} is more than the {len(self.clients)} client(s) "
                        "listed",
                    )
                ],
                self.min_clients,
            )
        return self

    def _uniform_mean_only(self, why: str) -> list[tuple[tuple, str]]:
        """Client weights and another aggregator than the mean, refused where a round is the uniform mean."""
        problems: list[tuple[tuple, str]] = [
            (("clients", i, "weight"), f"clients.{i}.weight: {why}")
            for i, c in enumerate(self.clients)
            if c.weight is not None
        ]
        if self.aggregator != "mean":
            problems.append((("aggregator",), f"aggregator {self.aggregator!r}: {why}; use 'mean'"))
        return problems

    @model_validator(mode="after")
    def _dp_options(self) -> FedAvgSpec:
        """A DP round is the uniform, clipped mean in float64, its integer and bool tensors the base's:
        weights, another aggregator and allow_nonfinite are refused; ``uniform``, ``accumulate`` and
        ``integer_policy`` do not apply (a dumped spec carries their defaults)."""
        if self.dp is None:
            return self
        problems = self._uniform_mean_only(
            "with dp, clients are averaged uniformly (the noise is sized for one client's clipped update)"
        )
        if self.dp.base is None and self.dp.structure is None:
            problems.append(
                (
                    ("dp", "structure"),
                    "a DP round takes its tensors from a public model, never from the clients' files: give "
                    "dp.base (the global model the clients trained from) or dp.structure",
                )
            )
        if self.allow_nonfinite:
            problems.append(
                (
                    ("allow_nonfinite",),
                    "with dp, an update holding NaN or Inf counts as a zero update (its norm is not finite); "
                    "nothing fails on an update's values",
                )
            )
        if problems:
            fail("FedAvgSpec", problems, self.dp)
        return self

    @model_validator(mode="after")
    def _secure_options(self) -> FedAvgSpec:
        """A secure round sums every masked update: a client's masks cancel only against all the others'."""
        if not self.secure:
            return self
        problems = self._uniform_mean_only("a secure round is the uniform mean of its masked updates")
        if len(self.clients) < 2:
            problems.append(
                (("clients",), "a secure round needs at least two clients: one's masks would hide nothing")
            )
        if self.dp is not None:
            problems.append(
                (("dp",), "DP-FedAvg clips each update on the server, which never sees one in a secure round")
            )
        for name in ("min_clients", "min_fraction"):
            if getattr(self, name) is not None:
                problems.append(
                    (
                        (name,),
                        f"{name}: a secure round needs every masked update (a missing client's masks would "
                        "stay in the sum)",
                    )
                )
        if problems:
            fail("FedAvgSpec", problems, self.secure)
        return self

    @model_validator(mode="after")
    def _distinct_clients(self) -> FedAvgSpec:
        repeats = repeated_uris([c.uri for c in self.clients])
        if repeats:
            fail(
                "FedAvgSpec",
                [
                    (
                        ("clients", i, "uri"),
                        f"clients.{i} repeats clients.{j} ({self.clients[i].uri}); each update counts once",
                    )
                    for i, j in repeats
                ],
                self.clients[repeats[0][0]].uri,
            )
        return self
