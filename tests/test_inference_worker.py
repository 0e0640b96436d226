"""The inference GPU worker (on CPU here): model parity, streaming, kill -9 + repair, user models, OOM.

The worker runs as a real subprocess (``python -m functions.inference.worker``) where the test is about
processes (streaming, kill -9); the test feeds ``pre/`` shards itself (in the contract's format, through
``functions.inference.preprocess.encode_shard``) and waits on store files with a deadline, never on time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from shardfold.functions import store
from shardfold.functions.errors import ModelLoadError, ShardfoldError
from shardfold.functions.inference import compute
from shardfold.functions.inference import shards as layout
from shardfold.functions.inference import worker as W
from shardfold.functions.inference.models import LoadedModel, load_model, minilm_dir
from shardfold.functions.inference.preprocess import ShardRows, encode_shard, tokenize
from shardfold.functions.inference.spec import InferenceSpec
from shardfold.functions.specs import parse_spec

REPO = Path(__file__).resolve().parents[1]
H = "00c0ffee00c0ffee"
MAX_TOKENS = 128
DEADLINE_S = 120.0

WORDS = (
    "the quick brown fox jumps over lazy dog river mountain shard worker token batch budget "
    "überprüfung naïve café 東京 données λόγος 🙂 embeddings inference pipeline streaming"
).split()


def sentences(n: int, seed: int = 0) -> list[str]:
    """Varied sentences: 1 to ~300 words (some past max_tokens, so truncation is exercised), unicode."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        k = int(rng.choice([1, 3, 8, 20, 40], p=[0.1, 0.25, 0.3, 0.25, 0.1]))
        out.append(" ".join(rng.choice(WORDS, size=k)) + ("." if i % 3 else "?"))
    out[0] = ""  # an empty text still embeds ([CLS] [SEP])
    if n > 1:
        out[1] = " ".join(WORDS * 12)  # past max_tokens: truncated
    return out


class Tiny(torch.nn.Module):
    """A user model: masked mean of a small embedding table, ``(ids, mask) -> [B, 8]``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(30522, 8)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        m = attention_mask.unsqueeze(-1).float()
        return (self.emb(input_ids) * m).sum(1) / m.sum(1).clamp(min=1.0)


class SmallVocabulary(Tiny):
    """Tiny with 1,000 embeddings: MiniLM's tokenizer makes ids up to 30,521."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(1000, 8)


class Wrong(torch.nn.Module):
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return torch.zeros(input_ids.shape[0], input_ids.shape[1], 4)  # [B, T, D]: not [B, D]


def save_torchscript(module: torch.nn.Module, path: Path) -> str:
    torch.jit.save(torch.jit.script(module), str(path))
    return "file://" + str(path)


# ---------------------------------------------------------------------------------------------- fixtures


@pytest.fixture()
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "store"))
    return "file://" + str(tmp_path / "store")


@pytest.fixture(scope="module")
def minilm():
    return load_model("minilm", "cpu")


@pytest.fixture()
def tiny_uri(tmp_path):
    return save_torchscript(Tiny(), tmp_path / "tiny.pt")


def make_job(root: str, job_id: str, shards: list[list[str]], model, batch_tokens: int = 256) -> tuple:
    """Write a spec and a plan with ``len(shards)`` shards (no pre/ shards yet); return (spec, spec_uri)."""
    spec_doc = {
        "kind": "inference",
        "inputs": ["corpus.jsonl"],
        "field": "text",
        "model": model,
        "max_tokens": MAX_TOKENS,
        "batch_tokens": batch_tokens,
        "shard_rows": max(len(s) for s in shards),
    }
    spec_uri = store.join(root, "jobs", job_id, "spec.json")
    store.put_json(spec_uri, spec_doc)
    rows = [len(s) for s in shards]
    plan = {
        "config_hash": H,
        "shards": [
            {"shard": k, "input": "corpus.jsonl", "start_row": 0, "rows": n} for k, n in enumerate(rows)
        ],
    }
    store.put_json(layout.plan_uri(root, job_id), plan)
    return parse_spec(json.dumps(spec_doc).encode()), spec_uri


def spec_of_tokens(max_tokens: int) -> InferenceSpec:
    return InferenceSpec(inputs=["a.jsonl"], field="text", max_input_tokens=max_tokens)


def write_pre(root: str, job_id: str, k: int, texts: list[str]) -> None:
    rows = ShardRows(texts=list(texts), ids=list(range(len(texts))), row_index=list(range(len(texts))))
    data = encode_shard(rows, spec_of_tokens(MAX_TOKENS), {})
    assert store.put_if_absent(layout.pre_uri(root, job_id, H, k), data)


def cpu_done(root: str, job_id: str) -> None:
    store.put_json(layout.cpu_done_uri(root, job_id), {"done": True})


def out(root: str, job_id: str, k: int) -> np.ndarray:
    import io

    return np.load(io.BytesIO(store.get(layout.out_uri(root, job_id, H, k))))["embedding"]


def markers(root: str, job_id: str) -> set[int]:
    return W._listed(layout.out_prefix(root, job_id, H), ".done")


def claims(root: str, job_id: str, attempt: int) -> set[int]:
    prefix = store.join(layout.job_root(root, job_id), "claims", str(attempt)) + "/"
    return {layout.shard_of(u) for u in store.list_uris(prefix)}


def wait_for(predicate, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(
                f"worker exited ({proc.returncode}) before {what}: {proc.stderr.read()[-3000:]}"
            )
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def start_worker(root: str, job_id: str, spec_uri: str, attempt: int = 0) -> subprocess.Popen:
    env = {
        **os.environ,
        "SHARDFOLD_HOME": root[len("file://") :],
        "SHARDFOLD_INFERENCE_POLL_S": "0.02",
        "HF_HUB_OFFLINE": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "shardfold.functions.inference.worker",
        "--job-id",
        job_id,
        "--spec-uri",
        spec_uri,
    ]
    cmd += ["--store-root", root, "--attempt", str(attempt)]
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


# ---------------------------------------------------------------------------------------------- model


@pytest.mark.slow  # end to end: a job, a model or child processes
def test_minilm_matches_sentence_transformers(minilm):
    from sentence_transformers import SentenceTransformer

    texts = sentences(50, seed=1)
    ids, offsets, _ = tokenize(texts, 256)
    ours, _ = compute.embed_rows(minilm, ids, offsets, budget=2048)
    ref = SentenceTransformer(str(minilm_dir()), device="cpu").encode(texts, batch_size=16)
    cos = (ours * ref).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(ref, axis=1))
    assert ours.shape == (50, 384) and ours.dtype == np.float32
    assert cos.min() > 0.999, cos.min()
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, rtol=1e-5)


@pytest.mark.slow  # end to end: a job, a model or child processes
def test_batching_does_not_change_outputs(minilm):
    texts = sentences(6, seed=2)
    ids, offsets, _ = tokenize(texts, MAX_TOKENS)
    one, _ = compute.embed_rows(minilm, ids, offsets, budget=1)  # every row alone
    many, _ = compute.embed_rows(minilm, ids, offsets, budget=4096)
    np.testing.assert_allclose(one, many, atol=1e-5)


# ---------------------------------------------------------------------------------------------- user models


@pytest.mark.slow  # end to end: a job, a model or child processes
def test_torchscript_and_torch_export_models(root, tmp_path, tiny_uri):
    texts = sentences(12, seed=3)
    ids, offsets, _ = tokenize(texts, MAX_TOKENS)
    expected = []
    for r in range(len(texts)):
        t = torch.from_numpy(ids[offsets[r] : offsets[r + 1]].astype(np.int64))[None]
        expected.append(Tiny()(t, torch.ones_like(t))[0].detach().numpy())
    ts = load_model({"torchscript": tiny_uri}, "cpu")
    assert ts.dim == 8
    got, _ = compute.embed_rows(ts, ids, offsets, budget=64)
    np.testing.assert_allclose(got, np.stack(expected), atol=1e-5)

    example = (torch.ones((2, 3), dtype=torch.int64), torch.ones((2, 3), dtype=torch.int64))  # not aliased
    b, t = torch.export.Dim("B"), torch.export.Dim("T")
    ep = torch.export.export(Tiny(), example, dynamic_shapes=({0: b, 1: t}, {0: b, 1: t}))
    torch.export.save(ep, str(tmp_path / "tiny.pt2"))
    exported = load_model({"torchscript": "file://" + str(tmp_path / "tiny.pt2")}, "cpu")
    got2, _ = compute.embed_rows(exported, ids, offsets, budget=64)
    np.testing.assert_allclose(got2, got, atol=1e-5)


def test_worker_runs_a_torchscript_model(root, tiny_uri):
    shards = [sentences(7, seed=10 + k) for k in range(3)]
    spec, _ = make_job(root, "ts", shards, {"torchscript": tiny_uri})
    for k, texts in enumerate(shards):
        write_pre(root, "ts", k, texts)
    cpu_done(root, "ts")
    summary = W.run_worker(spec, "ts", root, poll_s=0.01)
    assert summary["shards"] == 3 and summary["rows"] == 21
    assert markers(root, "ts") == {0, 1, 2}
    assert out(root, "ts", 1).shape == (7, 8)


def test_bad_model_files_give_clear_errors(root, tmp_path):
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"this is not a model")
    with pytest.raises(ModelLoadError) as exc:
        load_model({"torchscript": "file://" + str(garbage)}, "cpu")
    assert str(garbage) in str(exc.value) and "TorchScript" in str(exc.value)
    assert exc.value.uri == "file://" + str(garbage)

    wrong = save_torchscript(Wrong(), tmp_path / "wrong.pt")
    with pytest.raises(ModelLoadError, match=r"expected a float tensor \[2, D\]") as exc:
        load_model({"torchscript": wrong}, "cpu")
    assert "wrong.pt" in str(exc.value)

    small = save_torchscript(SmallVocabulary(), tmp_path / "small.pt")
    with pytest.raises(ModelLoadError, match="vocabulary smaller than the tokenizer's.*30521"):
        load_model({"torchscript": small}, "cpu")  # at load, not as an opaque error in the middle of a job

    with pytest.raises(ModelLoadError, match="missing.pt"):
        load_model({"torchscript": "file://" + str(tmp_path / "missing.pt")}, "cpu")

    # through the worker's entry point: the error fails the job (a ShardfoldError: not retried)
    spec, spec_uri = make_job(root, "bad", [["a b c"]], {"torchscript": "file://" + str(garbage)})
    write_pre(root, "bad", 0, ["a b c"])
    with pytest.raises(ModelLoadError):
        W.handler({"job_id": "bad", "spec_uri": spec_uri, "store_root": root})
    assert issubclass(ModelLoadError, ShardfoldError)


# ---------------------------------------------------------------------------------------------- OOM


class FakeOOM(LoadedModel):
    """Raises CUDA out-of-memory for batches over ``limit`` padded tokens, else runs the real model."""

    def __init__(self, inner: LoadedModel, limit: int):
        super().__init__(inner.fn, inner.device, "fake-oom")
        self._dim = inner.dim
        self.limit = limit
        self.seen: list[int] = []

    def __call__(self, input_ids, attention_mask):
        padded = int(input_ids.shape[0] * input_ids.shape[1])
        if padded > self.limit:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory ({padded} tokens)")
        self.seen.append(padded)
        return super().__call__(input_ids, attention_mask)


def test_oom_halves_the_budget_and_the_shard_completes(tiny_uri):
    model = FakeOOM(load_model({"torchscript": tiny_uri}, "cpu"), limit=300)  # rows have <= 128 tokens
    texts = sentences(40, seed=4)
    ids, offsets, _ = tokenize(texts, MAX_TOKENS)
    stats = W.WorkerStats()
    got, budget = compute.embed_rows(model, ids, offsets, budget=1024, stats=stats)
    assert stats.oom_halvings == 2 and budget == 256  # 1024 -> 512 -> 256, kept for the rest of the shard
    assert model.seen and max(model.seen) <= 256
    ref, _ = compute.embed_rows(load_model({"torchscript": tiny_uri}, "cpu"), ids, offsets, budget=4096)
    np.testing.assert_allclose(got, ref, atol=1e-5)


class TransientOOM(LoadedModel):
    """Fails its first call as cuBLAS does when an allocation fails (a RuntimeError), then runs."""

    def __init__(self, inner: LoadedModel):
        super().__init__(inner.fn, inner.device, "transient-oom")
        self._dim = inner.dim
        self.calls = 0

    def __call__(self, input_ids, attention_mask):
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
        return super().__call__(input_ids, attention_mask)


def test_cublas_and_cudnn_allocation_failures_are_out_of_memory():
    assert compute.is_oom(torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert compute.is_oom(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))
    assert compute.is_oom(RuntimeError("cuDNN error: CUDNN_STATUS_NOT_ENOUGH_WORKSPACE"))
    assert not compute.is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def test_a_halved_budget_grows_back_after_calm_batches(tiny_uri):
    model = TransientOOM(load_model({"torchscript": tiny_uri}, "cpu"))
    ids, offsets, _ = tokenize(sentences(300, seed=5), MAX_TOKENS)
    stats = W.WorkerStats(budget_cap=256)
    got, budget = compute.embed_rows(model, ids, offsets, budget=256, stats=stats)
    assert (stats.oom_halvings, stats.budget_growths, budget) == (1, 1, 256)
    assert stats.grow_after == compute.GROW_AFTER  # doubled only by an out-of-memory after a growth
    ref, _ = compute.embed_rows(load_model({"torchscript": tiny_uri}, "cpu"), ids, offsets, budget=4096)
    np.testing.assert_allclose(got, ref, atol=1e-5)


def test_precision_is_for_eager_embedding_models_and_a_cpu_computes_in_float32(tiny_uri):
    base = {"kind": "inference", "inputs": ["x.jsonl"], "field": "text"}
    assert parse_spec(base).precision == "auto"
    assert parse_spec({**base, "precision": "float16"}).precision == "float16"
    with pytest.raises(Exception, match="precision 'bfloat16' is for embed and classify"):
        parse_spec({**base, "precision": "bfloat16", "model": {"torchscript": tiny_uri}})
    graph = parse_spec({**base, "precision": "float32", "model": {"torchscript": tiny_uri}})
    assert graph.precision == "float32"  # a graph file may still turn TF32 off
    model = load_model({"torchscript": tiny_uri}, "cpu")
    from shardfold.functions.inference.models import set_precision

    set_precision(model, "bfloat16")
    assert model.autocast is None


def test_a_batch_gathered_at_once_equals_one_built_row_by_row():
    """compute._batch pads the batch's rows in one indexing operation; here against the plain loop, over
    random shards with empty rows, pairs' token types and any subset of rows in any order."""
    rng = np.random.default_rng(0)
    for trial in range(300):
        rows = int(rng.integers(1, 30))
        lengths = rng.integers(0, 20, rows)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        input_ids = rng.integers(1, 30000, offsets[-1]).astype(np.int32)
        types = rng.integers(0, 2, offsets[-1]).astype(np.int32) if trial % 2 else None
        idx = rng.permutation(rows)[: rng.integers(1, rows + 1)]
        t = int(np.maximum(lengths[idx], 1).max())
        want = [np.zeros((len(idx), t), np.int64) for _ in range(3 if types is not None else 2)]
        for j, r in enumerate(idx):
            n = int(lengths[r])
            want[0][j, :n] = input_ids[offsets[r] : offsets[r] + n]
            want[1][j, : max(n, 1)] = 1
            if types is not None:
                want[2][j, :n] = types[offsets[r] : offsets[r] + n]
        got, width = compute._batch(idx, lengths, input_ids, offsets, types)
        assert width == t and len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == np.int64 and np.array_equal(g, w), trial


def test_precision_on_a_gpu_autocasts_eager_models_and_sets_tf32(tiny_uri, monkeypatch):
    """What set_precision decides for a model on a CUDA device (a torch.device object needs no GPU):
    'auto' is bfloat16 autocast where the GPU has it, else float16, with TF32; 'float32' is neither; a
    graph file is never autocast."""
    from shardfold.functions.inference.models import set_precision

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32  # process-wide flags
    cuda = torch.device("cuda")
    try:
        for bf16, precision, eager, dtype, tf32 in [
            (True, "auto", True, torch.bfloat16, True),
            (False, "auto", True, torch.float16, True),
            (True, "float16", True, torch.float16, True),
            (True, "float32", True, None, False),
            (True, "auto", False, None, True),
        ]:
            monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda bf16=bf16: bf16)
            model = LoadedModel(lambda ids, mask: ids, cuda, "m", eager=eager)
            set_precision(model, precision)
            assert model.autocast == dtype and torch.backends.cuda.matmul.allow_tf32 is tf32, precision
            assert torch.backends.cudnn.allow_tf32 is tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_device_rows_come_back_in_row_order_when_numpy_asks():
    """A GPU shard's outputs are filled batch by batch into one [rows, D] tensor on the device and copied
    back when np.savez on the commit thread asks (a CPU tensor stands in for the device here)."""
    import io

    rows = compute.DeviceRows(torch.zeros((3, 2)))
    rows.rows[torch.as_tensor(np.array([2, 0]))] = torch.tensor([[2.0, 2.5], [0.0, 0.5]])
    rows.rows[torch.as_tensor(np.array([1]))] = torch.tensor([[1.0, 1.5]])
    rows.finish()
    assert len(rows) == 3 and rows.shape == (3, 2) and rows.seconds() is None  # CUDA events time a GPU's
    buf = io.BytesIO()
    np.savez(buf, embedding=rows)
    buf.seek(0)
    np.testing.assert_array_equal(np.load(buf)["embedding"], [[0.0, 0.5], [1.0, 1.5], [2.0, 2.5]])


def test_a_cpu_worker_takes_its_share_of_the_cores_it_may_use(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(W, "CGROUP_CPU_MAX", tmp_path / "absent")
    assert (W.cpu_threads(), W.cpu_threads(2), W.cpu_threads(16)) == (8, 4, 1)
    quota = tmp_path / "cpu.max"
    monkeypatch.setattr(W, "CGROUP_CPU_MAX", quota)
    quota.write_text("250000 100000\n")  # a container limited to 2.5 CPUs of the host's 8
    assert (W.cpu_threads(), W.cpu_threads(2)) == (3, 1)
    quota.write_text("max 100000\n")
    assert W.cpu_threads() == 8


def test_oom_on_a_single_row_at_the_smallest_budget_is_an_error(tiny_uri):
    model = FakeOOM(load_model({"torchscript": tiny_uri}, "cpu"), limit=0)
    ids, offsets, _ = tokenize(["hello there"], MAX_TOKENS)
    with pytest.raises(ShardfoldError, match="out of memory on a single row"):
        compute.embed_rows(model, ids, offsets, budget=8)


# ---------------------------------------------------------------------------------------------- claims


def test_concurrent_workers_split_the_shards(root, tiny_uri):
    shards = [sentences(5, seed=20 + k) for k in range(8)]
    spec, _ = make_job(root, "two", shards, {"torchscript": tiny_uri})
    for k, texts in enumerate(shards):
        write_pre(root, "two", k, texts)
    cpu_done(root, "two")
    model = load_model({"torchscript": tiny_uri}, "cpu")
    results: list[dict] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(W.run_worker(spec, "two", root, model=model, poll_s=0.01))
        )
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(r["shards"] for r in results) == 8
    assert markers(root, "two") == set(range(8)) == claims(root, "two", 0)


def test_a_worker_lists_each_key_a_bounded_number_of_times(root, tiny_uri, monkeypatch):
    # shards arriving in order while the worker runs: it lists from the first unfinished shard, and only
    # when nothing listed is left to claim, so the keys it lists grow with N, not N^2
    n = 120
    spec, _ = make_job(root, "many", [["a b"]] * n, {"torchscript": tiny_uri})
    listed: list[int] = []
    real_list = store.list_uris

    def list_uris(prefix: str, start_after: str | None = None) -> list[str]:
        found = real_list(prefix, start_after)
        listed.append(len(found))
        return found

    monkeypatch.setattr(store, "list_uris", list_uris)
    model = load_model({"torchscript": tiny_uri}, "cpu")
    real_process = W._process

    def process_and_preprocess_more(*args, **kwargs):  # the CPU stage keeps two shards ahead
        k = args[4]
        for j in range(k + 1, min(n, k + 3)):
            if not store.exists(layout.pre_uri(root, "many", H, j)):
                write_pre(root, "many", j, ["a b"])
        if k + 3 >= n:
            store.put_json(layout.cpu_done_uri(root, "many"), {"done": True})
        return real_process(*args, **kwargs)

    monkeypatch.setattr(W, "_process", process_and_preprocess_more)
    write_pre(root, "many", 0, ["a b"])
    summary = W.run_worker(spec, "many", root, model=model, poll_s=0.001, prefetch=1)
    assert summary["shards"] == n and markers(root, "many") == set(range(n))
    assert sum(listed) < 8 * n, (len(listed), sum(listed))


def test_repair_attempt_without_missing_exits_at_once(root, tiny_uri):
    spec, spec_uri = make_job(root, "none", [["a"]], {"torchscript": tiny_uri})
    store.put_json(layout.missing_uri(root, "none"), [])
    # the repair round's worker, a Map child whose item names its attempt (still safe if run with nothing
    # missing: a resumed job may get here after the missing shards were committed)
    event = {"job_id": "none", "spec_uri": spec_uri, "store_root": root, "item": {"worker": 0, "attempt": 1}}
    assert W.attempt_of(event) == 1 and W.attempt_of({**event, "item": {"worker": 0}}) == 0
    assert W.handler(event)["shards"] == 0
    assert claims(root, "none", 1) == set()


# ---------------------------------------------------------------------------------------------- processes


@pytest.mark.slow  # end to end: a job, a model or child processes
def test_streaming_first_commit_lands_before_the_cpu_stage_ends(root, tiny_uri):
    shards = [sentences(6, seed=30 + k) for k in range(4)]
    _, spec_uri = make_job(root, "stream", shards, {"torchscript": tiny_uri})
    proc = start_worker(root, "stream", spec_uri)
    try:
        write_pre(root, "stream", 0, shards[0])
        wait_for(lambda: store.exists(layout.done_uri(root, "stream", H, 0)), "the first commit", proc)
        assert not store.exists(layout.cpu_done_uri(root, "stream"))  # the CPU stage is still running
        for k in range(1, 4):
            write_pre(root, "stream", k, shards[k])
        cpu_done(root, "stream")
        assert proc.wait(timeout=DEADLINE_S) == 0, proc.stderr.read()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert markers(root, "stream") == {0, 1, 2, 3}


@pytest.mark.slow  # end to end: a job, a model or child processes
def test_kill_9_then_repair_recomputes_only_uncommitted_shards(root, tiny_uri):
    shards = [sentences(6, seed=40 + k) for k in range(6)]
    spec, spec_uri = make_job(root, "kill", shards, {"torchscript": tiny_uri})
    proc = start_worker(root, "kill", spec_uri)
    try:
        for k in range(3):  # half the CPU stage; the rest arrives after the kill
            write_pre(root, "kill", k, shards[k])
        wait_for(lambda: markers(root, "kill"), "a first commit", proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=DEADLINE_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    committed = markers(root, "kill")
    assert 1 <= len(committed) <= 3
    before = {k: store.get(layout.done_uri(root, "kill", H, k)) for k in committed}
    for k in range(3, 6):
        write_pre(root, "kill", k, shards[k])
    cpu_done(root, "kill")
    missing = sorted(set(range(6)) - committed)  # what reconcile writes
    store.put_json(layout.missing_uri(root, "kill"), [{"shard": k} for k in missing])

    summary = W.run_worker(spec, "kill", root, attempt=1, poll_s=0.01)
    assert sorted(claims(root, "kill", 1)) == missing  # only the uncommitted shards were claimed
    assert summary["shards"] == len(missing)
    assert markers(root, "kill") == set(range(6))
    assert {k: store.get(layout.done_uri(root, "kill", H, k)) for k in committed} == before

    clean, _ = make_job(root, "clean", shards, {"torchscript": tiny_uri})
    for k in range(6):
        write_pre(root, "clean", k, shards[k])
    cpu_done(root, "clean")
    W.run_worker(clean, "clean", root, poll_s=0.01)
    for k in range(6):
        np.testing.assert_allclose(out(root, "kill", k), out(root, "clean", k), rtol=1e-6, atol=1e-7)


def test_worker_gives_up_when_the_cpu_stage_never_finishes(root, tiny_uri):
    spec, _ = make_job(root, "stall", [["a"], ["b"]], {"torchscript": tiny_uri})
    write_pre(root, "stall", 0, ["a"])  # shard 1 never arrives and cpu_done.json is never written
    with pytest.raises(ShardfoldError, match=r"no preprocessed shard appeared .* 1 shard\(s\) left"):
        W.run_worker(spec, "stall", root, poll_s=0.01, idle_s=0.05)
    assert markers(root, "stall") == {0}


def test_worker_stops_when_the_cpu_stage_failed(root, tiny_uri):
    spec, _ = make_job(root, "cpufail", [["a"], ["b"]], {"torchscript": tiny_uri})
    write_pre(root, "cpufail", 0, ["a"])
    failure = {"shard": 1, "error": "bad.jsonl line 4: no 'text'"}
    store.put_json(layout.cpu_failed_uri(root, "cpufail"), failure)
    with pytest.raises(ShardfoldError, match="CPU stage failed: bad.jsonl line 4"):
        W.run_worker(spec, "cpufail", root, poll_s=0.01, idle_s=3600)


class FakeBatch:
    """``describe_jobs`` as AWS Batch answers it, from a table of job statuses; raises for "boom"."""

    def __init__(self, statuses):
        self.statuses = statuses
        self.asked = []

    def describe_jobs(self, jobs):
        self.asked.extend(jobs)
        if "boom" in jobs:
            raise RuntimeError("AccessDenied")
        return {"jobs": [{"jobId": j, "status": self.statuses[j]} for j in jobs if j in self.statuses]}


def test_batch_claims_are_taken_over_only_from_ended_jobs(root, tiny_uri, monkeypatch):
    from types import SimpleNamespace

    from shardfold.functions import credentials

    shards = [["a b"], ["c d"], ["e f"], ["g h"], ["i j"], ["k l"]]
    spec, _ = make_job(root, "retry", shards, {"torchscript": tiny_uri})
    for k, texts in enumerate(shards):
        write_pre(root, "retry", k, texts)
    cpu_done(root, "retry")
    holders = {
        1: {"batch_job": "j:0", "batch_attempt": 1},  # an earlier attempt of this very job: dead
        2: {"batch_job": "j:1", "batch_attempt": 1},  # a peer Batch reports RUNNING: alive
        3: {"batch_job": "j:2", "batch_attempt": 1},  # a peer Batch reports FAILED: dead
        4: {"batch_job": "gone", "batch_attempt": 1},  # Batch no longer lists it: unknown, left alone
        5: {"batch_job": "boom", "batch_attempt": 1},  # DescribeJobs fails: unknown, left alone
    }
    for k, holder in holders.items():
        store.put_json(layout.claim_uri(root, "retry", 0, k), holder)
    fake = FakeBatch({"j:1": "RUNNING", "j:2": "FAILED"})
    monkeypatch.setattr(credentials, "session", lambda: SimpleNamespace(client=lambda service, **kw: fake))
    monkeypatch.setenv("AWS_BATCH_JOB_ID", "j:0")
    monkeypatch.setenv("AWS_BATCH_JOB_ATTEMPT", "2")
    summary = W.run_worker(spec, "retry", root, poll_s=0.01)
    assert summary["computed"] == [0, 1, 3] and markers(root, "retry") == {0, 1, 3}
    assert store.get_json(layout.claim_uri(root, "retry", 0, 1))["batch_attempt"] == 2
    assert store.get_json(layout.claim_uri(root, "retry", 0, 3))["batch_job"] == "j:0"
    assert sorted(fake.asked) == ["boom", "gone", "j:1", "j:2"]  # never asked about its own job


def test_a_resumed_local_worker_takes_over_claims_of_dead_processes_only(root, tiny_uri):
    import socket
    import subprocess
    import sys

    shards = [["a b"], ["c d"], ["e f"], ["g h"]]
    spec, _ = make_job(root, "dead", shards, {"torchscript": tiny_uri})
    for k, texts in enumerate(shards):
        write_pre(root, "dead", k, texts)
    cpu_done(root, "dead")
    host = socket.gethostname()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = W._process_start(alive.pid)
        store.put_json(layout.claim_uri(root, "dead", 0, 0), {"host": host, "pid": gone.pid})  # killed
        store.put_json(
            layout.claim_uri(root, "dead", 0, 1), {"host": host, "pid": alive.pid, "pid_start": start}
        )
        # the pid is alive but names another process than the one that claimed (pid reuse)
        store.put_json(
            layout.claim_uri(root, "dead", 0, 2), {"host": host, "pid": alive.pid, "pid_start": -1}
        )
        store.put_json(layout.claim_uri(root, "dead", 0, 3), {"host": "elsewhere", "pid": gone.pid})
        summary = W.run_worker(spec, "dead", root, poll_s=0.01)
    finally:
        alive.kill()
    assert summary["computed"] == [0, 2] and markers(root, "dead") == {0, 2}
    assert store.get_json(layout.claim_uri(root, "dead", 0, 0))["pid"] == os.getpid()
    reports = store.list_uris(layout.worker_reports_prefix(root, "dead") + "/")
    (report,) = [store.get_json(u) for u in reports]
    assert report["computed"] == [0, 2] and set(report["shard_s"]) == {"0", "2"}
    assert report["rows"] == 2 and 0 <= report["padding_fraction"] < 1


def test_cli_exit_codes(monkeypatch):
    from shardfold.functions.store.retry import TransientError

    def transient(event, context=None):
        raise TransientError("S3 throttled")

    def broken(event, context=None):
        raise ModelLoadError("bad model", uri="s3://b/m.pt")

    seen = {}

    def ok(event, context=None):
        seen.update(event)

    monkeypatch.setattr(W, "handler", transient)
    assert W.main(["--job-id", "j"]) == 75
    monkeypatch.setattr(W, "handler", broken)
    assert W.main(["--job-id", "j"]) == 1
    monkeypatch.setattr(W, "handler", ok)
    monkeypatch.setenv("SHARDFOLD_EVENT", json.dumps({"job_id": "j", "spec_uri": "s", "store_root": "r"}))
    assert W.main(["--attempt", "1"]) == 0
    assert seen == {"job_id": "j", "spec_uri": "s", "store_root": "r", "attempt": 1}
