"""The fedavg job from the user's side: end to end on the local and moto executors (byte-identical output,
equal to a plain numpy FedAvg), the SDK's ``client.fedavg`` helpers (numpy and torch round trips), the plan
estimator, the shipped example spec and handler events, and bad input through the job."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner
from outsider import outside_the_task

from shardfold.client import Client
from shardfold.client.cli import cli
from shardfold.client.demo import fedavg_reference, fedavg_updates
from shardfold.client.fedavg import UpdateError, decode_update, encode_update
from shardfold.functions import store
from shardfold.functions.errors import PlanError, SpecError
from shardfold.functions.jobs import new_job_id, spec_key
from shardfold.functions.store.uri import local_path

REPO = Path(__file__).resolve().parent.parent
EVENTS = REPO / "events"
WAIT_S = 180  # a deadline, not a timing assumption
MiB = 1 << 20

# Just over 10 MiB: with shards=2 both shards hold S3's 5 MiB multipart minimum, and the boundary falls
# inside fc.weight.
MODEL = {
    "fc.weight": ((1024, 2568), np.float32),
    "fc.bias": ((1024,), np.float32),
    "bn.running_mean": ((1024,), np.float32),
    "bn.num_batches_tracked": ((), np.int64),
    "proj.weight": ((64, 128), ml_dtypes.bfloat16),
}
SMALL = {
    "w": ((8, 6), np.float32),
    "b": ((6,), ml_dtypes.bfloat16),
    "steps": ((), np.int64),
}
# events/data/fedavg/client-<i>.safetensors were written by encode_update(*fedavg_updates(EVENTS_MODEL, 3,
# seed=2026)[i]); test_shipped_sample_updates checks they still are.
EVENTS_MODEL = {
    "linear.weight": ((16, 24), np.float32),
    "linear.bias": ((16,), np.float32),
    "norm.weight": ((16,), ml_dtypes.bfloat16),
    "norm.running_mean": ((16,), np.float32),
    "norm.num_batches_tracked": ((), np.int64),
}


@pytest.fixture(scope="module")
def moto_client(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SHARDFOLD_HOME", str(tmp_path_factory.mktemp("moto-home")))
        with Client(backend="moto") as c:
            yield c


@pytest.fixture
def local_client(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "home"))
    with Client() as c:
        yield c


def save_all(client: Client, prefix: str, updates: list) -> list[str]:
    keys = [f"{prefix}/client-{i}.safetensors" for i in range(len(updates))]
    for key, (tensors, n) in zip(keys, updates, strict=True):
        client.fedavg.save_update(tensors, key, num_examples=n)
    return keys


def start_as(client: Client, job_id: str, spec: dict) -> dict:
    """Start ``spec`` under a chosen job id (the output header records the id, so both executors must use the
    same one for byte-identical outputs) and return the result."""
    spec_uri = client.uri(spec_key(job_id))
    store.put_json(spec_uri, spec)
    client.executor.start(job_id, "fedavg", spec_uri)
    job = client.job(job_id)
    status = job.wait(progress=False, timeout_s=WAIT_S)
    assert status.state == "SUCCEEDED", status.error
    return job.result()


def assert_tensors_equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, ref in want.items():
        assert got[name].dtype == ref.dtype and got[name].shape == ref.shape, name
        assert got[name].tobytes() == ref.tobytes(), name


# --- the job end to end -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_local_and_moto_executors_give_the_identical_model(moto_client, tmp_path, monkeypatch):
    """Both executors, one round, a client among them that never uploaded (left out: min_clients)."""
    updates = fedavg_updates(MODEL, 3, seed=11)
    keys = save_all(moto_client, "rounds/1", updates)  # relative keys: under the moto bucket
    keys.insert(1, "rounds/1/client-dropped.safetensors")
    spec = moto_client.fedavg.spec(keys, shards=2, min_clients=3).model_dump(mode="json", exclude_none=True)
    assert all(c["uri"].startswith(moto_client.store_root + "/rounds/1/") for c in spec["clients"])
    job_id = new_job_id("fedavg")

    on_moto = start_as(moto_client, job_id, spec)
    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "local-home"))
    with Client() as local:  # local store and executor; the updates still live in the moto bucket
        on_local = start_as(local, job_id, spec)

    assert on_moto["output"].startswith("s3://") and on_local["output"].startswith("file://")
    assert on_moto["shards"] == on_local["shards"] == 2
    moto_bytes, local_bytes = store.get(on_moto["output"]), store.get(on_local["output"])
    assert hashlib.sha256(moto_bytes).hexdigest() == hashlib.sha256(local_bytes).hexdigest()
    for key in ("clients", "total_weight", "bytes", "tensors", "dtypes"):
        assert on_moto[key] == on_local[key]
    assert on_moto["clients"] == 3 and on_moto["clients_listed"] == on_local["clients_listed"] == 4
    for left in (on_moto["excluded"], on_local["excluded"]):
        dropped = spec["clients"][1]["uri"]
        assert [(e["client"], e["reason"]) for e in left] == [(1, f"no object at {dropped}")]

    weights = [n for _, n in updates]
    assert_tensors_equal(decode_update(local_bytes), fedavg_reference([u for u, _ in updates], weights))
    assert moto_client.fedavg.metadata(on_moto["output"])["num_examples"] == str(sum(weights))
    # temporaries are gone: only the spec, result and output remain under the job
    left = store.list_uris(moto_client.uri(f"jobs/{job_id}/"))
    assert not [u for u in left if "/fedavg/" in u]


@pytest.mark.slow
def test_sdk_run_with_relative_keys_and_weights_on_moto(moto_client):
    updates = fedavg_updates(SMALL, 4, seed=3)
    keys = save_all(moto_client, "rounds/2", updates)
    result = moto_client.fedavg.run(
        [keys[0], (keys[1], 2.5), {"uri": keys[2]}, {"uri": keys[3], "weight": 1}],
        output="results/round-2.safetensors",
        integer_policy="first",
    )
    assert result["output"] == moto_client.uri("results/round-2.safetensors")
    assert result["clients"] == 4 and result["shards"] == 1
    weights = [updates[0][1], 2.5, updates[2][1], 1]
    want = fedavg_reference([u for u, _ in updates], weights)
    want["steps"] = updates[0][0]["steps"]  # integer_policy="first": client 0's value
    assert_tensors_equal(moto_client.fedavg.load("results/round-2.safetensors"), want)


@pytest.mark.slow
def test_missing_client_fails_the_job_naming_it_and_writes_no_output(moto_client):
    keys = save_all(moto_client, "rounds/3", fedavg_updates(SMALL, 2, seed=5))
    missing = "rounds/3/client-gone.safetensors"
    with pytest.raises(SpecError, match=r"clients: client 1 .*client-gone\.safetensors"):  # at submit
        moto_client.fedavg.submit([keys[0], missing, keys[1]], output="results/never.safetensors")
    # started without submit's look (the client deleted after it): the prepare step checks again
    from shardfold.functions.jobs import new_job_id, spec_key
    from shardfold.functions.specs import dump_spec, parse_spec

    doc = {"kind": "fedavg", "clients": [{"uri": k} for k in (keys[0], missing, keys[1])]}
    job_id = new_job_id("fedavg")
    spec_uri = moto_client.uri(spec_key(job_id))
    store.put_json(spec_uri, dump_spec(parse_spec({**doc, "output": "results/never.safetensors"})))
    moto_client.executor.start(job_id, "fedavg", spec_uri)
    status = moto_client.executor.wait(job_id, timeout_s=WAIT_S)
    assert status.state == "FAILED"
    assert "client 1" in status.error and "client-gone.safetensors" in status.error
    assert not store.exists(moto_client.uri("results/never.safetensors"))


@pytest.mark.slow  # end to end: a job, a model or child processes
@pytest.mark.parametrize("accumulate", ["float32", "float64"])
def test_a_round_with_tiny_weights_succeeds_with_a_finite_model(local_client, accumulate):
    """Weights of 1e-50 (float32 casts them to 0) used to give an all-NaN model and SUCCEEDED."""
    updates = fedavg_updates(SMALL, 3, seed=7)
    keys = save_all(local_client, "rounds/tiny", updates)
    weights = [1e-50 * (i + 1) for i in range(3)]
    result = local_client.fedavg.run(list(zip(keys, weights, strict=True)), accumulate=accumulate)
    got = local_client.fedavg.load(result["output"])
    w = np.array(weights) / max(weights)
    for name in ("w", "b"):
        assert np.isfinite(got[name].astype(np.float64)).all(), name
        xs = [u[name].astype(np.float64) for u, _ in updates]
        want = sum(wi * x for wi, x in zip(w, xs, strict=True)) / w.sum()
        np.testing.assert_allclose(got[name].astype(np.float64), want, rtol=1e-2, atol=1e-6, err_msg=name)


@pytest.mark.slow  # end to end: a job, a model or child processes
def test_a_round_whose_mean_is_nan_fails_naming_the_tensor(local_client):
    """Finite updates whose float32 weighted sum is Inf + -Inf = NaN: with allow_nonfinite (which admits
    NaN/Inf *updates*) the NaN model used to be written and the job SUCCEEDED."""
    updates = fedavg_updates(SMALL, 3, seed=8)
    for (tensors, _), v in zip(updates, [3e38, 3e38, -3e38], strict=True):
        tensors["w"][2, 3] = v
    keys = save_all(local_client, "rounds/nan", updates)
    job = local_client.fedavg.submit(
        list(zip(keys, [1, 1, 2], strict=True)), output="models/nan.safetensors", allow_nonfinite=True
    )
    status = job.wait(progress=False, timeout_s=WAIT_S)
    assert status.state == "FAILED"
    assert "tensor 'w'" in status.error and "NaN or Inf at flat element 15" in status.error, status.error
    assert not store.exists(local_client.uri("models/nan.safetensors"))


def test_plan_reports_shards_memory_requests_and_refuses_what_does_not_fit(local_client, monkeypatch):
    keys = save_all(local_client, "rounds/p", fedavg_updates(MODEL, 3, seed=1))
    report = local_client.plan(local_client.fedavg.spec(keys, shards=2))
    steps = {s.name: s for s in report.steps}
    assert report.kind == "fedavg" and report.items == 3
    assert steps["aggregate_shard"].tasks == 2 and steps["prepare"].tasks == steps["commit"].tasks == 1
    assert all(s.fits and (s.peak_mb > 0 or s.tasks == 0) for s in report.steps)
    assert steps["norms_shard"].tasks == 0  # DP-FedAvg's first pass: no task in a round without DP
    agg = steps["aggregate_shard"]
    assert agg.gets >= 2 * 3 and agg.puts >= 2  # at least one ranged GET per client per shard, a part each
    assert report.cost_usd["total"] > 0 and report.output_bytes > 10 * MiB
    assert any("2 shard(s)" in n for n in report.notes)

    # a missing update does not stop the estimate (the job fails at its prepare step, naming the client)
    lost = local_client.plan(local_client.fedavg.spec([keys[0], "rounds/p/nope.safetensors"]))
    assert any("client 1" in n and "nope.safetensors" in n for n in lost.notes)

    # a task that cannot fit its function's memory: plan and submit refuse, nothing is recorded
    from shardfold.functions.fedavg import shardplan as sizing

    monkeypatch.setattr(sizing, "RUNTIME_BYTES", 4096 * MiB)
    with pytest.raises(PlanError, match="aggregate_shard"):
        local_client.plan(local_client.fedavg.spec(keys))
    with pytest.raises(PlanError):
        local_client.fedavg.submit(keys)
    assert not store.list_uris(local_client.uri("jobs/"))


# --- the SDK helpers ----------------------------------------------------------------------------------------


def test_save_update_and_load_round_trip_numpy(local_client):
    rng = np.random.default_rng(0)
    tensors = {
        "f32": rng.standard_normal((3, 5)).astype(np.float32),
        "f16": rng.standard_normal(7).astype(np.float16),
        "bf16": rng.standard_normal((2, 2)).astype(ml_dtypes.bfloat16),
        "f64_transposed": rng.standard_normal((4, 3)).T,  # not C-contiguous
        "i64_scalar": np.int64(12345),
        "u8": np.arange(10, dtype=np.uint8),
        "mask": np.array([True, False, True]),
        "empty": np.zeros((0, 4), np.float32),
    }
    uri = local_client.fedavg.save_update(tensors, "u/np.safetensors", num_examples=42)
    assert uri == local_client.uri("u/np.safetensors")
    assert local_client.fedavg.metadata("u/np.safetensors") == {"num_examples": "42"}
    got = local_client.fedavg.load(uri)
    want = {k: np.asarray(v) for k, v in tensors.items()}
    assert_tensors_equal(got, {k: np.ascontiguousarray(v) if v.ndim else v for k, v in want.items()})

    for bad, match in [
        ({}, "at least one tensor"),
        ({"x": [1.0, 2.0]}, "numpy arrays or torch tensors"),
        ({"x": np.array([object()])}, "safetensors cannot store"),
    ]:
        with pytest.raises(UpdateError, match=match):
            local_client.fedavg.save_update(bad, "u/bad.safetensors", num_examples=1)
    for n in (0, -3, 2.5, True):
        with pytest.raises(UpdateError, match="num_examples"):
            encode_update({"x": np.ones(2, np.float32)}, n)
    with pytest.raises(UpdateError, match="not a valid safetensors"):
        decode_update(b"\x00" * 16)


@pytest.mark.slow
def test_save_update_and_load_round_trip_torch_state_dict(local_client):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    model[2].to(torch.bfloat16)
    with torch.no_grad():
        model[1].running_mean.normal_()
        model[1].num_batches_tracked.fill_(17)
    state = model.state_dict()
    assert state["2.weight"].dtype == torch.bfloat16

    local_client.fedavg.save_update(state, "u/torch.safetensors", num_examples=8)
    back = local_client.fedavg.load("u/torch.safetensors", framework="torch")
    assert sorted(back) == sorted(state)
    for name, t in state.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    assert back["1.num_batches_tracked"].shape == () and int(back["1.num_batches_tracked"]) == 17

    as_np = local_client.fedavg.load("u/torch.safetensors")
    assert as_np["2.weight"].dtype == ml_dtypes.bfloat16
    assert as_np["2.weight"].view(np.int16).tobytes() == state["2.weight"].view(torch.int16).numpy().tobytes()
    # the same update written from numpy is byte-identical
    again = encode_update(as_np, 8)
    assert again == store.get(local_client.uri("u/torch.safetensors"))

    # a job over torch-written updates, read back as a state_dict that loads into the model
    local_client.fedavg.save_update(state, "u/torch-2.safetensors", num_examples=24)
    result = local_client.fedavg.run(["u/torch.safetensors", "u/torch-2.safetensors"])
    avg = local_client.fedavg.load(result["output"], framework="torch")
    model.load_state_dict(avg)
    assert torch.equal(avg["0.bias"], state["0.bias"])  # the mean of two equal updates is the update


@pytest.mark.slow  # end to end: a job, a model or child processes
def test_numpy_only_use_never_imports_torch(tmp_path):
    code = (
        "import sys, numpy as np\n"
        "from shardfold.client import Client\n"
        "c = Client()\n"
        "c.fedavg.save_update({'x': np.ones(3, np.float32)}, 'u/x.safetensors', num_examples=2)\n"
        "c.fedavg.load('u/x.safetensors'); c.fedavg.metadata('u/x.safetensors')\n"
        "c.close()\n"
        "print('torch' in sys.modules)\n"
    )
    env = {"SHARDFOLD_HOME": str(tmp_path / "home"), "POWERTOOLS_LOG_LEVEL": "ERROR", "PATH": ""}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# --- the shipped example and the CLI ------------------------------------------------------------------------


def invoke(*args: str, ok: bool = True):
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    if ok:
        assert result.exit_code == 0, result.output
    return result


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.delenv("SHARDFOLD_BACKEND", raising=False)
    return tmp_path / "home"


def test_shipped_sample_updates():
    for i, (tensors, n) in enumerate(fedavg_updates(EVENTS_MODEL, 3, seed=2026)):
        data = (EVENTS / "data" / "fedavg" / f"client-{i}.safetensors").read_bytes()
        assert len(data) < 4096
        assert_tensors_equal(decode_update(data), tensors)
        header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
        assert header["__metadata__"] == {"num_examples": str(n)}


@pytest.mark.slow
def test_cli_run_and_plan_the_example_spec(home):
    out = invoke("run", str(EVENTS / "fedavg.json")).output
    assert "SUCCEEDED" in out
    job_id = next(w for w in out.split() if w.startswith("fedavg-"))
    result = Client().job(job_id).result()
    updates = [
        decode_update((EVENTS / "data" / "fedavg" / f"client-{i}.safetensors").read_bytes()) for i in range(3)
    ]
    spec = json.loads((EVENTS / "fedavg.json").read_text())
    weights = [433, 271, spec["clients"][2]["weight"]]  # clients 0 and 1: num_examples; client 2: the spec
    want = fedavg_reference(updates, weights)
    want["norm.num_batches_tracked"] = np.max([u["norm.num_batches_tracked"] for u in updates], axis=0)
    assert_tensors_equal(decode_update(local_path(result["output"]).read_bytes()), want)

    out = invoke("plan", str(EVENTS / "fedavg.json")).output
    for word in ("aggregate_shard", "commit", "total", "3 client(s)"):
        assert word in out
    data = json.loads(invoke("plan", str(EVENTS / "fedavg.json"), "--json").output)
    assert data["items"] == 3 and {s["name"]: s["tasks"] for s in data["steps"]}["aggregate_shard"] == 1


@pytest.mark.slow
def test_cli_plans_and_runs_a_round_with_a_client_missing_and_says_who_was_left_out(home, tmp_path):
    spec = json.loads((EVENTS / "fedavg.json").read_text())
    for c in spec["clients"]:
        c["uri"] = (EVENTS / c["uri"]).resolve().as_uri()
    spec["clients"].insert(2, {"uri": (tmp_path / "late.safetensors").as_uri()})
    spec["min_clients"] = 3
    path = tmp_path / "round.json"
    path.write_text(json.dumps(spec))
    out = invoke("plan", str(path)).output
    assert "1 of the 4 updates read would be left out now (client 2: no object at" in out
    assert "the round needs 3 of 4" in out
    out = invoke("run", str(path)).output
    assert "SUCCEEDED" in out and "left out of the round: 1 of 4 clients" in out
    assert "late.safetensors" in out and "no object at" in out
    spec["min_clients"] = 4
    path.write_text(json.dumps(spec))
    out = invoke("run", str(path), ok=False).output
    assert "needs 4 of its 4 client updates but only 3 can be aggregated" in out


def test_cli_invoke_steps_through_a_job_by_hand(home):
    planned = json.loads(invoke("invoke", "fedavg.prepare", "fedavg_prepare").output)
    assert planned["shards"] == 1 and planned["clients"] == 3
    event = json.loads((EVENTS / "fedavg_aggregate.json").read_text())
    assert event["item"]["end"] == planned["bytes"]  # the sample matches the plan it follows
    part = json.loads(invoke("invoke", "fedavg.aggregate", "fedavg_aggregate").output)
    assert part["shard"] == 0 and part["reads"] == 3
    committed = json.loads(invoke("invoke", "fedavg.commit", "fedavg_commit").output)
    assert committed["clients"] == 3 and committed["output"].endswith("output/model.safetensors")
    assert local_path(committed["output"]).stat().st_size == committed["bytes"]


# --- inputs pinned at plan ----------------------------------------------------------------------------------


def replace_after_prepare(monkeypatch, key_uri: str, data: bytes) -> None:
    """Let the job plan, then put ``data`` at ``key_uri`` before any aggregate task reads it."""
    from shardfold.functions.fedavg import core

    real = core.prepare

    def prepare_then_change(*args, **kwargs):
        out = real(*args, **kwargs)
        with outside_the_task():
            store.put(key_uri, data)
        return out

    monkeypatch.setattr(core, "prepare", prepare_then_change)


@pytest.mark.parametrize("backend", ["local", pytest.param("moto", marks=pytest.mark.slow)])
def test_a_client_replaced_after_the_plan_fails_the_job_naming_it(backend, request, monkeypatch):
    """A client replaced after plan used to be read at the planned offsets (its header 333 bytes longer:
    values near 1e34) and the job SUCCEEDED. Here the new file is even the same size: only the pin (ETag, or
    inode and mtime) tells, and the job fails naming the client."""
    client = request.getfixturevalue(f"{backend}_client")
    updates = fedavg_updates(SMALL, 3, seed=11)
    keys = save_all(client, f"rounds/pin-{backend}", updates)
    other = encode_update(fedavg_updates(SMALL, 1, seed=12)[0][0], updates[1][1])
    assert len(other) == store.size(client.uri(keys[1])) and other != store.get(client.uri(keys[1]))
    replace_after_prepare(monkeypatch, client.uri(keys[1]), other)
    job = client.fedavg.submit(keys, output=f"results/pin-{backend}.safetensors")
    status = job.wait(progress=False, timeout_s=WAIT_S)
    assert status.state == "FAILED", status.error
    assert "InputChanged" in status.error or "changed since the job was planned" in status.error
    assert "client 1" in status.error and keys[1] in status.error, status.error
    assert not store.exists(client.uri(f"results/pin-{backend}.safetensors"))
