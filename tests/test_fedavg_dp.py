"""DP-FedAvg (``"dp": {...}``): clipping exact against an in-memory reference, the noise's variance by Monte
Carlo, the ledger's entries, a retried task that draws no second noise, and bad input.

The noise is OpenDP's; the exact checks replace :meth:`functions.fedavg.dp.Mechanism.add_noise` in this
process with a no-op (no spec field or handler can), so the clipped mean can be compared bit for bit.
"""

from __future__ import annotations

import json
import math

import ml_dtypes
import numpy as np
import pytest
from test_fedavg_core import encode, load, put_clients

from shardfold.functions import ledger, store
from shardfold.functions.errors import BudgetExceeded, InvalidModelFile, PlanError, SpecError
from shardfold.functions.fedavg import core, dp
from shardfold.functions.fedavg.kind import KIND
from shardfold.functions.fedavg.shardplan import Budget
from shardfold.functions.fedavg.spec import FedAvgSpec
from shardfold.functions.specs import parse_spec

JOB = "fedavg-20260101T000000-0dp0dp"
TINY = Budget(min_shard_bytes=1, chunk_bytes=256, robust_bytes=4096, min_robust_chunk=8)


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "home"))
    return store.uri.store_root()


@pytest.fixture
def no_noise(monkeypatch):
    monkeypatch.setattr(dp.Mechanism, "add_noise", lambda self, mean: None)


FACTORS: dict[str, np.ndarray] = {}  # job id -> the clip factors it used (commit removes them)


def run_dp(spec: FedAvgSpec, root: str, job_id: str = JOB) -> dict:
    """The workflow's steps in order, in this process: prepare, norms per shard, clip, aggregate, commit."""
    planned = core.prepare(spec, job_id, root, budget=TINY)
    for item in store.get_json(planned["norms"]["uri"]):
        core.norms(spec, job_id, root, item["shard"])
    norms = [core.norms_uri(root, job_id, item["shard"]) for item in store.get_json(planned["norms"]["uri"])]
    assert norms and all(store.exists(u) for u in norms)
    core.clip(spec, job_id, root)
    assert not any(store.exists(u) for u in norms)  # each client's exact norm is gone once clipped
    FACTORS[job_id] = np.frombuffer(store.get(core.clip_uri(root, job_id)), "<f8")
    for item in store.get_json(planned["worklist"]["uri"]):
        core.aggregate(spec, job_id, root, item["shard"])
    return core.commit(spec, job_id, root, planned["shards"])


def model(rng: np.random.Generator, scale: float = 1.0) -> dict[str, np.ndarray]:
    return {
        "w": (scale * rng.standard_normal((16, 12))).astype(np.float32),
        "b": (scale * rng.standard_normal(12)).astype(np.float32),
        "h": (scale * rng.standard_normal(40)).astype(np.float64),
        "e": (scale * rng.standard_normal(24)).astype(ml_dtypes.bfloat16),
    }


def dp_reference(updates, base, clip_norm: float, m: int, factors=None) -> tuple[dict, list[float]]:
    """base + Σ cᵢ(xᵢ − base)/m in float64, cᵢ = min(1, C'/‖Δᵢ‖) over the whole model (or ``factors``),
    cast to each dtype; and the cᵢ."""
    names = sorted(updates[0])
    deltas = []
    for u in updates:
        d = {k: u[k].astype(np.float64) - (base[k].astype(np.float64) if base else 0.0) for k in names}
        deltas.append(d)
    target = clip_norm * (1 - dp.clip_margin(len(updates)))
    out = {}
    if factors is None:
        factors = []
        for d in deltas:
            norm = math.sqrt(math.fsum(float(np.dot(v.ravel(), v.ravel())) for v in d.values()))
            factors.append(0.0 if not math.isfinite(norm) else (target / norm if norm > target else 1.0))
    for k in names:
        acc = np.zeros(updates[0][k].shape, np.float64)
        for c, d in zip(factors, deltas, strict=True):
            if c:
                acc += c * d[k]
        acc /= m
        if base:
            acc += base[k]
        out[k] = acc.astype(updates[0][k].dtype)
    return out, factors


def spec_doc(uris, **dp_fields) -> dict:
    fields = {"clip_norm": 1.0, "noise_multiplier": 1.1, "dataset_id": "fed", "dataset_budget_rho": 10.0}
    if "base" not in dp_fields:  # the round's tensors from a public file: here the first client's stands in
        fields["structure"] = uris[0]
    return {"kind": "fedavg", "clients": [{"uri": u} for u in uris], "dp": {**fields, **dp_fields}}


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("with_base", [False, True])
def test_clipping_is_exact_against_an_in_memory_reference(root, no_noise, shards, with_base):
    rng = np.random.default_rng(4)
    base = model(rng) if with_base else None
    updates = []
    for scale in (0.01, 0.05, 1, 3):  # norms from well under to far over C = 2: some clipped, some not
        delta = model(rng, scale)
        updates.append({k: (v + base[k]).astype(v.dtype) if base else v for k, v in delta.items()})
    uris = put_clients(root, updates)
    doc = spec_doc(uris, clip_norm=2.0, expected_clients=5)
    if with_base:
        base_uri = store.uri.join(root, "global.safetensors")
        store.put(base_uri, encode(base))
        doc["dp"]["base"] = base_uri
    spec = FedAvgSpec(**{**doc, "shards": shards})
    result = run_dp(spec, root)
    assert result["shards"] == shards
    # the clip factors: the whole-model norms summed in another order, so equal to float64 rounding
    want, factors = dp_reference(updates, base, 2.0, 5)
    used = FACTORS[JOB]
    assert 0 < min(factors) < 1 == max(factors)  # some clipped, some not
    np.testing.assert_allclose(used, factors, rtol=1e-13, atol=0)
    # the clipped mean: bit for bit the reference's, given the factors the job used
    want, _ = dp_reference(updates, base, 2.0, 5, factors=list(used))
    got = load(result["output"])
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].tobytes() == want[k].tobytes(), k


def test_integer_tensors_are_the_bases_and_need_a_base(root, no_noise):
    rng = np.random.default_rng(5)
    base = {"w": rng.standard_normal(8).astype(np.float32), "steps": np.array(7, np.int64)}
    ups = [{"w": base["w"] + 0.1 * i, "steps": np.array(100 + i, np.int64)} for i in range(3)]
    uris = put_clients(root, ups)
    with pytest.raises(PlanError, match="tensor 'steps' is I64: a DP round takes integer and bool tensors"):
        core.prepare(FedAvgSpec(**spec_doc(uris)), JOB, root, budget=TINY)
    base_uri = store.uri.join(root, "global.safetensors")
    store.put(base_uri, encode(base))
    result = run_dp(FedAvgSpec(**spec_doc(uris, base=base_uri)), root, job_id=JOB.replace("0dp0dp", "1dp1dp"))
    assert load(result["output"])["steps"] == 7


def test_an_update_with_nan_or_inf_counts_as_zero_and_fails_nothing(root, no_noise):
    rng = np.random.default_rng(6)
    updates = [model(rng, 0.1) for _ in range(3)]
    updates[1]["w"][3, 4] = np.nan
    updates[2]["h"][0] = np.inf
    uris = put_clients(root, updates)
    result = run_dp(FedAvgSpec(**spec_doc(uris, clip_norm=100.0)), root)
    want, factors = dp_reference(updates, None, 100.0, 3)
    assert factors == [1.0, 0.0, 0.0]
    got = load(result["output"])
    assert all(got[k].tobytes() == want[k].tobytes() for k in want)


def test_the_output_holds_nothing_that_depends_on_the_clients_but_the_noisy_mean(root, no_noise):
    uris = put_clients(root, [model(np.random.default_rng(i)) for i in range(3)], num_examples=[5, 6, 7])
    result = run_dp(FedAvgSpec(**spec_doc(uris)), root)
    raw = store.get(result["output"])
    meta = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])["__metadata__"]
    assert "num_examples" not in meta and "shardfold_clients" not in meta
    assert meta["shardfold_aggregator"].startswith("dp-fedavg (clip_norm 1.0, noise_multiplier 1.1")
    assert result["total_weight"] is None


def test_the_noise_has_the_mechanisms_variance(root):
    """All updates zero: the output is the noise alone, 20,000 independent draws of N(0, σ²)."""
    n_el = 20_000
    zeros = {"w": np.zeros(n_el, np.float64)}
    uris = put_clients(root, [zeros, zeros])
    spec = FedAvgSpec(**spec_doc(uris, clip_norm=3.0, noise_multiplier=0.7, expected_clients=4), shards=2)
    result = run_dp(spec, root)
    noise = load(result["output"])["w"]
    sigma = 0.7 * 3.0 / 4
    assert result["privacy"]["noise_std"] == pytest.approx(sigma)
    # the sample mean and variance, each within 5 standard errors of the mechanism's
    assert abs(noise.mean()) < 5 * sigma / math.sqrt(n_el)
    assert abs(noise.var() / sigma**2 - 1) < 5 * math.sqrt(2 / n_el)
    # the two shards drew different noise (no shared seed): their halves are uncorrelated
    half = n_el // 2
    assert abs(np.corrcoef(noise[:half], noise[half : 2 * half])[0, 1]) < 5 / math.sqrt(half)


def clipped_round(root: str) -> FedAvgSpec:
    """A 2-client, 2-shard DP round taken up to its aggregate step; its spec."""
    uris = put_clients(root, [model(np.random.default_rng(i)) for i in range(2)])
    spec = FedAvgSpec(**spec_doc(uris), shards=2)
    planned = core.prepare(spec, JOB, root, budget=TINY)
    for k in range(planned["shards"]):
        core.norms(spec, JOB, root, k)
    core.clip(spec, JOB, root)
    return spec


def test_a_failed_rounds_scrub_deletes_every_clients_clip_factor(root):
    """The workflow's on_failure task (fedavg.scrub): what a failed DP round must not keep until `clean`."""
    spec = clipped_round(root)
    assert store.exists(core.clip_uri(root, JOB))
    assert core.scrub(spec, JOB, root)["removed"] >= 1
    assert not store.exists(core.clip_uri(root, JOB))
    assert not store.list_uris(core.job_uri(root, JOB, core.STAGE, "norms") + "/")
    plain = FedAvgSpec(clients=spec.clients)  # a round without DP has nothing to scrub
    assert core.scrub(plain, JOB, root) == {"removed": 0}


def test_a_retried_aggregate_task_draws_no_second_noise(root):
    spec = clipped_round(root)
    first = core.aggregate(spec, JOB, root, 1)
    part = store.get(core.part_uri(root, JOB, 1))
    again = core.aggregate(spec, JOB, root, 1)  # a retry after success: the part stands
    assert again["written_before"] and not first.get("written_before")
    assert store.get(core.part_uri(root, JOB, 1)) == part


def test_of_two_concurrent_aggregate_attempts_one_part_stands(root, monkeypatch):
    spec = clipped_round(root)
    core.aggregate(spec, JOB, root, 0)
    part = store.get(core.part_uri(root, JOB, 0))
    # the other attempt wrote its part after this one looked: this one's write (other noise) is refused
    monkeypatch.setattr(core.store, "exists", lambda uri: False)
    late = core.aggregate(spec, JOB, root, 0)
    assert late["written_before"]
    assert store.get(core.part_uri(root, JOB, 0)) == part


def test_each_round_charges_the_federations_ledger_once(root):
    uris = put_clients(root, [model(np.random.default_rng(i)) for i in range(2)])
    z = 2.0
    spec = FedAvgSpec(**spec_doc(uris, noise_multiplier=z, dataset_budget_rho=0.3))
    result = run_dp(spec, root)
    rho = result["privacy"]["rho_spent"]
    assert 1 / (2 * z**2) <= rho <= 1 / (2 * z**2) * 1.001  # OpenDP's map: the ideal plus its grid's rounding
    state = ledger.read(root, "fed")
    assert state.unit == "client" and state.total_rho == 0.3
    assert [e["type"] for e in state.entries] == ["open", "reserve", "spend"]
    assert state.reserved[JOB] == state.spent[JOB] == rho
    assert result["privacy"]["ledger"]["remaining_rho"] == pytest.approx(0.3 - rho)
    view = KIND.result_view(result).summary  # what `shardfold run` / `result` print
    assert view["ledger"] == f"fed: total ρ 0.3, committed {rho:.6g}, remaining {0.3 - rho:.6g} (1 round(s))"
    # a retried commit does not charge again; a third round would pass the total and is refused at prepare
    core.commit(spec, JOB, root, result["shards"])
    assert len(ledger.read(root, "fed").entries) == 3
    run_dp(spec, root, job_id=JOB.replace("0dp0dp", "2dp2dp"))
    third = JOB.replace("0dp0dp", "3dp3dp")
    with pytest.raises(BudgetExceeded, match="exceeds the remaining budget"):
        core.prepare(spec, third, root, budget=TINY)
    assert not store.exists(core.plan_uri(root, third))


def test_a_dpquery_ledger_is_not_a_federations(root):
    ledger.reserve(root, "people", "dpquery-job", 0.1, 1.0)  # a dataset's ledger (rows)
    uris = put_clients(root, [model(np.random.default_rng(i)) for i in range(2)])
    with pytest.raises(SpecError, match="budget ledger of a dataset's rows") as exc:
        core.prepare(FedAvgSpec(**spec_doc(uris, dataset_id="people")), JOB, root, budget=TINY)
    assert exc.value.errors[0]["field"] == "dataset_id"


def test_the_rounds_tensors_are_the_bases_and_a_client_unlike_it_is_the_odd_one(root):
    """The base is public and fixes the round's tensors: a client unlike it is refused (or, with
    min_clients, left out) whatever the others sent; a majority never decides it (issue 33, item 4)."""
    rng = np.random.default_rng(1)
    uris = put_clients(root, [model(rng) for _ in range(2)])
    base_uri = store.uri.join(root, "global.safetensors")
    store.put(base_uri, encode({"w": np.zeros((16, 12), np.float32)}))
    with pytest.raises(InvalidModelFile, match=r"client 0 \(.*\): its tensors are not the round's"):
        core.prepare(FedAvgSpec(**spec_doc(uris, base=base_uri)), JOB, root, budget=TINY)


@pytest.mark.parametrize(
    ("change", "field", "fragment"),
    [
        ({"dp": {"clip_norm": 0}}, "dp.clip_norm", "greater than or equal to 0.000000000001"),
        ({"dp": {"clip_norm": 1e-13}}, "dp.clip_norm", "greater than or equal to 0.000000000001"),
        ({"dp": {"clip_norm": float("inf")}}, "dp.clip_norm", "finite"),
        ({"dp": {"noise_multiplier": -1}}, "dp.noise_multiplier", "greater than 0"),
        ({"dp": {"noise_multiplier": "1"}}, "dp.noise_multiplier", "valid number"),
        ({"dp": {"dataset_id": "../x"}}, "dp.dataset_id", "pattern"),
        ({"dp": {"dataset_budget_rho": 0}}, "dp.dataset_budget_rho", "greater than 0"),
        ({"dp": {"expected_clients": 0}}, "dp.expected_clients", "greater than or equal to 1"),
        ({"dp": {"base": ""}}, "dp.base", "at least 1 character"),
        ({"dp": {"sigma": 1}}, "dp.sigma", "Extra inputs"),
        ({"aggregator": "median"}, "aggregator", "averaged uniformly"),
        ({"allow_nonfinite": True}, "allow_nonfinite", "zero update"),
        ({"clients": [{"uri": "a", "weight": 2}, {"uri": "b"}]}, "clients.0.weight", "averaged uniformly"),
    ],
)
def test_bad_dp_specs_are_refused_naming_the_field(change, field, fragment):
    doc = spec_doc(["a", "b"])
    for key, value in change.items():
        doc[key] = {**doc[key], **value} if key == "dp" else value
    with pytest.raises(SpecError) as exc:
        parse_spec(doc)
    fields = [e["field"] for e in exc.value.errors]
    assert field in fields, exc.value.errors
    assert fragment in str(exc.value), str(exc.value)


def test_dp_base_is_an_input_the_submit_policy_checks():
    """A field declared InputUri is walked like every other: a local file on the S3 store is refused, and
    the output may not overwrite the base."""
    from shardfold.functions.submit import check_policy

    doc = spec_doc(["rounds/1/a.safetensors", "rounds/1/b.safetensors"], base="file:///etc/passwd")
    with pytest.raises(SpecError) as refused:
        check_policy(parse_spec(doc), "s3://bucket")
    assert [e["field"] for e in refused.value.errors] == ["dp.base"]
    doc = spec_doc(["a.safetensors", "b.safetensors"], base="global.safetensors")
    doc["output"] = "global.safetensors"
    with pytest.raises(SpecError, match="may not overwrite what it reads") as refused:
        check_policy(parse_spec(doc), "s3://bucket")
    assert refused.value.errors[0]["field"] == "output"


@pytest.mark.parametrize("elements", [1, 65_536, 10**8, 7 * 10**9])
def test_the_charge_bounds_every_noise_block_whatever_the_models_size(elements):
    """The ledger's ρ is OpenDP's map over all D coordinates, which bounds the sum of the maps of the
    blocks the noise is drawn in (each at its share of the sensitivity), and stays within a few parts per
    million of 1/(2z²) at any D: the grid shrinks with √D."""
    z = 2.0
    mech = dp.Mechanism(clip_norm=2.0, denominator=10, noise_multiplier=z, elements=elements)
    ideal = 1 / (2 * z**2)
    assert ideal <= mech.rho() <= ideal * (1 + 1e-5)
    assert mech.sigma / 2**mech.grid >= 2**dp.GRID_BITS * math.sqrt(elements) / 2
    blocks = min(elements, 50)  # the split of the sensitivity between blocks that costs the most
    size = min(elements, dp.NOISE_BLOCK)
    share = mech.sensitivity / math.sqrt(blocks)
    per_block = float(dp._gaussian(size, mech.sigma, mech.grid).map(share))
    if elements >= blocks * size:
        assert blocks * per_block <= mech.rho()


def test_the_mechanism():
    mech = dp.Mechanism(clip_norm=2.0, denominator=10, noise_multiplier=1.5)
    assert mech.sigma == pytest.approx(0.3) and mech.sensitivity == pytest.approx(0.2)
    assert mech.sigma / 2**mech.grid >= 2**dp.GRID_BITS
    assert 1 / (2 * 1.5**2) <= mech.rho() <= 1 / (2 * 1.5**2) * 1.001
    assert dp.clip_margin(3) < 1e-8 and dp.clip_margin(100_000) > 4e-6
    f = dp.clip_factors(np.array([0.0, 1.0, 16.0, np.nan, np.inf]), 2.0)
    assert f[0] == f[1] == 1.0 and f[2] == pytest.approx(0.5) and f[2] < 0.5 and f[3] == f[4] == 0.0


@pytest.mark.slow  # end to end: a job on each executor
def test_a_dp_round_runs_on_the_local_and_moto_executors(tmp_path, monkeypatch):
    from shardfold.client import Client

    rng = np.random.default_rng(9)
    base = model(rng)
    updates = [{k: (v + 0.01 * i).astype(v.dtype) for k, v in base.items()} for i in range(3)]
    for backend in ("local", "moto"):
        monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / backend))
        with Client(backend=backend) as client:
            keys = [f"rounds/1/client-{i}.safetensors" for i in range(3)]
            for key, u in zip(keys, updates, strict=True):
                client.fedavg.save_update(u, key)
            client.fedavg.save_update(base, "rounds/0/global.safetensors")
            dp_block = {
                "clip_norm": 0.5,
                "noise_multiplier": 1.0,
                "dataset_id": "fed",
                "dataset_budget_rho": 5.0,
                "base": "rounds/0/global.safetensors",
            }
            late = "rounds/1/client-late.safetensors"
            result = client.fedavg.run([*keys, late], min_clients=3, dp=dp_block)
            assert result["clients"] == 3 and [e["client"] for e in result["excluded"]] == [3]
            privacy = result["privacy"]
            assert privacy["expected_clients"] == 4 and privacy["noise_std"] == pytest.approx(0.125)
            assert privacy["ledger"]["unit"] == "client" and privacy["ledger"]["jobs"] == 1
            out = client.fedavg.load(result["output"])
            assert sorted(out) == sorted(base)
            assert all(np.isfinite(out[k].astype(np.float64)).all() for k in out)
            # the noise is there: the output is not the clipped mean (which is within 0.5/4 of the base)
            w = out["w"].astype(np.float64) - base["w"]
            assert 0.05 < w.std() < 0.2


def test_dp_shards_leave_time_for_the_noise():
    """A DP shard's two passes of reads and its noise fit the share of the timeout a plain shard's reads do:
    at 40,000 samples a second, 64 MiB shards of float32 would take 420 s of noise alone."""
    from shardfold.functions.fedavg.layout import Tensor
    from shardfold.functions.fedavg.shardplan import choose_shards, shard_caps

    tensors = [Tensor("w", "F32", (1 << 28,), 0, 1 << 30)]  # 1 GiB of float32
    n, budget = 10, Budget()
    plain = choose_shards(1 << 30, n, 100, budget).shards
    dp_budget = core._with_noise_time(budget, tensors, n)
    shards = choose_shards(1 << 30, n, 100, dp_budget).shards
    assert shards > plain
    largest = shard_caps(n, 100, dp_budget)[1]
    seconds = 2 * (n + 1) * largest / budget.read_bytes_per_s + largest / 4 / dp.NOISE_SAMPLES_PER_S
    assert seconds <= budget.time_fraction * budget.timeout_s * (1 + 1e-9)
    assert (1 << 30) / shards <= largest


def test_a_dp_shard_that_could_not_finish_is_refused_before_any_budget_is_reserved(root, monkeypatch):
    """shards=1 on a model whose one shard's noise would outlast its share of the timeout."""
    monkeypatch.setattr(dp, "NOISE_SAMPLES_PER_S", 0.1)  # as if OpenDP drew a sample in 10 s
    uris = put_clients(root, [model(np.random.default_rng(i)) for i in range(2)])
    spec = FedAvgSpec(**spec_doc(uris), shards=1)
    with pytest.raises(PlanError, match="raise 'shards' to"):
        core.prepare(spec, JOB, root, budget=TINY)
    assert ledger.read(root, "fed").entries == []


def test_the_aggregate_task_checks_the_clip_factors_it_reads(root):
    """A clip document of the wrong length, or a factor above 1 (an unclipped update), is refused before
    any noise is drawn or part written."""
    uris = put_clients(root, [model(np.random.default_rng(i)) for i in range(2)])
    spec = FedAvgSpec(**spec_doc(uris))
    core.prepare(spec, JOB, root, budget=TINY)
    core.norms(spec, JOB, root, 0)
    core.clip(spec, JOB, root)
    for bad in (np.ones(3), np.array([1.0, 2.0])):
        store.put(core.clip_uri(root, JOB), bad.astype("<f8").tobytes())
        with pytest.raises(PlanError, match="clip factors"):
            core.aggregate(spec, JOB, root, 0)
        assert not store.exists(core.part_uri(root, JOB, 0))
