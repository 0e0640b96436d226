"""fedavg uses the cores it is given (issue 39, item 2).

* The planner cuts at least one shard per worker that runs aggregate tasks at once (the local executor's
  processes; Lambda's concurrency on S3), in whole waves of them, whenever the 5 MiB floor lets the model
  be split that far, unless the spec fixes ``shards``; more shards never raise a task's planned peak.
* The weighted sum folds each client in one pass (``kernels.axpy``; DP-FedAvg's ``axpy_difference``) with
  the bits of the plain two-pass formula: a product rounded to the accumulator, then the sum rounded (never a
  fused multiply-add), on float32 and float64 accumulators, odd weights and lengths that are not a multiple
  of the block.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save

from shardfold.functions import store
from shardfold.functions.fedavg import core, kernels, shardplan
from shardfold.functions.fedavg.layout import DTYPES
from shardfold.functions.fedavg.shardplan import Budget, MiB, choose_shards, task_loads, workers_for
from shardfold.functions.fedavg.spec import FedAvgSpec

JOB = "fedavg-20260101T000000-0c0c0c"
BF16 = np.dtype(ml_dtypes.bfloat16)
F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
ODD_WEIGHTS = [0.1, 1 / 3, 7.000001, 1e-7, 12345.678, 3 * 2.0**-30, 999983.0, 2.0 / 7]
UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "home"))
    return store.uri.store_root()


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(UINT[a.dtype.itemsize])


# --- the planner --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [1, 2, 3, 4, 7, 16, 64, 500])
def test_every_worker_gets_a_shard_when_the_model_can_be_split(workers):
    budget, plain = Budget(workers=workers), Budget()
    floor = budget.min_shard_bytes + 8  # every shard but the last holds S3's 5 MiB multipart minimum
    sizes = (3 * MiB, 6 * MiB, 11 * MiB, 45 * MiB, 64 * MiB, 100 * MiB + 3, 256 * MiB, 320 * MiB, 5 << 30)
    for data_bytes in sizes:
        for n in (2, 32, 128):
            most = max(1, data_bytes // floor)
            got = choose_shards(data_bytes, n, 4096, budget).shards
            assert got >= min(workers, most), (data_bytes, n, got)  # as many workers busy as the floor allows
            if data_bytes >= workers * floor:
                assert got >= workers, (data_bytes, n, got)
            assert got >= choose_shards(data_bytes, n, 4096, plain).shards  # never fewer than by size alone
            assert got <= most
            assert got == most or got % workers == 0, (data_bytes, n, got)  # whole waves of the workers


def test_the_measured_case_64_mib_and_32_clients_on_two_cores():
    """The issue's run: ONE aggregate task on two cores; now one per core, and a fixed ``shards`` stays."""
    assert choose_shards(64 * MiB, 32, 4096, Budget()).shards == 1  # by size alone
    assert choose_shards(64 * MiB, 32, 4096, Budget(workers=2)).shards == 2
    assert choose_shards(64 * MiB, 32, 4096, Budget(workers=16)).shards == 12  # 5 MiB floor: 12 at most
    assert choose_shards(64 * MiB, 32, 4096, Budget(workers=16), requested=1).shards == 1
    assert choose_shards(64 * MiB, 32, 4096, Budget(workers=2), requested=3).shards == 3


def test_workers_are_the_local_executors_processes_and_lambda_keeps_the_size_rule(monkeypatch):
    monkeypatch.setattr(shardplan.os, "cpu_count", lambda: 6)
    assert workers_for("file:///tmp/home") == 6
    assert shardplan.default_budget("file:///tmp/home").workers == 6
    monkeypatch.setattr(shardplan.os, "cpu_count", lambda: None)
    assert workers_for("file:///tmp/home") == 1
    # Lambda runs every shard at once anyway; more shards would only cost requests
    assert workers_for("s3://bucket") == 1 and shardplan.default_budget("s3://bucket") == Budget()


def sixteen_mib(root: str) -> list[str]:
    rng = np.random.default_rng(3)
    uris = []
    for i in range(2):
        tensors = {
            "a": rng.standard_normal(2 * MiB, dtype=np.float32),  # 8 MiB
            "b": rng.standard_normal(4 * MiB).astype(np.float16),  # 8 MiB
            "c": np.full(1001, i + 0.25, np.float64),
        }
        uri = store.uri.join(root, "round", f"client-{i}.safetensors")
        store.put(uri, save(tensors, metadata={"num_examples": str(10 + 7 * i)}))
        uris.append(uri)
    return uris


def test_a_local_plan_has_a_shard_per_core_and_no_larger_task_peak(root, monkeypatch):
    uris = sixteen_mib(root)
    monkeypatch.setattr(shardplan.os, "cpu_count", lambda: 3)
    spec = FedAvgSpec(clients=[{"uri": u} for u in uris])
    plan = core.inspect(spec, JOB, root)  # the default budget: the deployed sizes, this machine's cores
    assert plan.budget.workers == 3 and plan.shards == 3
    sizes = [b - a for a, b in zip(plan.bounds, plan.bounds[1:], strict=False)]
    assert all(s >= 5 * MiB for s in sizes[:-1])
    one = core.inspect(spec.model_copy(update={"shards": 1}), JOB, root)
    assert one.shards == 1
    for on_s3 in (False, True):  # more shards: the same or smaller buffers per task, never larger
        many, single = (task_loads(p, on_s3)["aggregate"] for p in (plan, one))
        assert many.runtime_bytes == single.runtime_bytes
        for name, value in many.buffers.items():
            # only the plan document, which every task parses, grows: by a manifest row per shard
            slack = 2 * 50 * (plan.shards - 1) if name == "the plan document and read descriptors" else 0
            assert value <= single.buffers[name] + slack, (on_s3, name)
        assert many.peak_bytes <= single.peak_bytes + 2 * 50 * (plan.shards - 1)
    monkeypatch.setattr(shardplan.os, "cpu_count", lambda: 64)
    assert core.inspect(spec, JOB, root).shards == 3  # 16 MiB: three shards of >= 5 MiB at most


def test_the_output_is_the_same_bits_with_a_shard_per_core(root, monkeypatch):
    uris = sixteen_mib(root)
    spec = FedAvgSpec(clients=[{"uri": u} for u in uris])
    outs = []
    for cores, job in ((1, JOB), (3, JOB.replace("0c0c0c", "0d0d0d"))):
        monkeypatch.setattr(shardplan.os, "cpu_count", lambda cores=cores: cores)
        planned = core.prepare(spec.model_copy(update={"output": f"out/{cores}.safetensors"}), job, root)
        assert planned["shards"] == cores
        for item in store.get_json(planned["worklist"]["uri"]):
            core.aggregate(spec, job, root, item["shard"])
        outs.append(store.get(core.commit(spec, job, root, planned["shards"])["output"]))
    assert outs[0] == outs[1]


# --- the one-pass weighted sum ------------------------------------------------------------------------------


def inputs(dtype: np.dtype, count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(count) * 10.0 ** rng.uniform(-2, 2)).astype(dtype) for _ in ODD_WEIGHTS]


CASES = [(F32, F16), (F32, BF16), (F32, F32), (F64, F16), (F64, BF16), (F64, F32), (F64, F64)]


@pytest.mark.parametrize(("acc", "dtype"), CASES, ids=[f"{a.name}-{d.name}" for a, d in CASES])
def test_axpy_gives_the_bits_of_the_two_pass_formula(acc, dtype):
    count = 2 * kernels.BLOCK + 12_345  # a tail shorter than the block
    xs = inputs(dtype, count, seed=5)
    ws = [acc.type(w) for w in ODD_WEIGHTS]
    want = np.multiply(xs[0], ws[0], dtype=acc)
    for w, x in zip(ws[1:], xs[1:], strict=True):
        want = want + w * x  # the old formula: a temporary w*x, then +=
    assert want.dtype == acc
    for block in (kernels.BLOCK, 1000, 1):
        got = np.empty(count, acc)
        np.multiply(xs[0], ws[0], out=got, casting="unsafe")
        scratch = np.empty(block, acc)
        for w, x in zip(ws[1:], xs[1:], strict=True):
            kernels.axpy(got, x, w, scratch)
        assert np.array_equal(bits(got), bits(want)), (acc, dtype, block)
    # a fused multiply-add (one rounding) would give other bits: the comparison above would see it
    wide = np.longdouble if acc == F32 else None
    if wide is not None:
        fused = np.multiply(xs[0], ws[0], dtype=acc)
        for w, x in zip(ws[1:], xs[1:], strict=True):
            fused = (fused.astype(np.float64) + np.float64(w) * x.astype(np.float64)).astype(acc)
        assert not np.array_equal(bits(fused), bits(want))


@pytest.mark.parametrize("accumulate", ["float32", "float64"])
@pytest.mark.parametrize("name", ["F32", "BF16", "F16", "F64"])
def test_the_mean_reducer_is_the_plain_weighted_mean(accumulate, name):
    dt = DTYPES[name]
    count = kernels.BLOCK + 777
    xs = inputs(np.dtype(dt.np), count, seed=11)
    options = {"integer_policy": "mean", "allow_nonfinite": False}
    rule = kernels.rule_for(dt, aggregator="mean", uniform=False, accumulate=accumulate, **options)
    total = kernels.weight_total(ODD_WEIGHTS)
    params = kernels.Params(weights=list(ODD_WEIGHTS), total=total, n_clients=len(ODD_WEIGHTS))
    arena = kernels.Arena(kernels.need(rule, count, len(xs)))
    red = kernels.reducer(rule, count, params, arena)
    for i, x in enumerate(xs):
        red.add(i, x)
    got = red.finish()
    ws = [rule.acc.type(w) for w in ODD_WEIGHTS]
    want = np.multiply(xs[0], ws[0], dtype=rule.acc)
    for w, x in zip(ws[1:], xs[1:], strict=True):
        want = want + w * x
    want = (want / rule.acc.type(total)).astype(dt.np)
    assert got.dtype == want.dtype and np.array_equal(bits(got), bits(want))


@pytest.mark.parametrize("base_dtype", [None, F32, BF16, F16])
def test_dp_axpy_difference_gives_the_bits_of_the_plain_formula(base_dtype):
    count = kernels.BLOCK + 4097
    dtype = base_dtype or F32
    xs = inputs(dtype, count, seed=13)
    base = inputs(dtype, count, seed=17)[0] if base_dtype is not None else None
    factors = [np.float64(w / 7) for w in ODD_WEIGHTS]
    want = np.zeros(count, np.float64)
    for f, x in zip(factors, xs, strict=True):
        d = x.astype(np.float64)
        if base is not None:
            d -= base
        d *= f
        want += d
    got = np.zeros(count, np.float64)
    for block in (kernels.BLOCK, 999):
        got[:] = 0
        scratch = np.empty(block, np.float64)
        for f, x in zip(factors, xs, strict=True):
            kernels.axpy_difference(got, x, base, f, scratch)
        assert np.array_equal(bits(got), bits(want)), block
