"""Hugging Face folders in the inference kind: generation with continuous batching (greedy tokens equal
transformers' ``generate`` for each row alone; sampling independent of the batch; stop strings; shared
prefixes computed once; a failing prompt fails alone), classify with labels and text pairs, embed with the
folder's pooling, per-row errors and ``max_error_fraction``, refusals at submit, the plan's memory, resume,
and the moto backend. Tiny random-weight folders (tests/hf_models.py) for plumbing; SmolLM2-135M-Instruct
for coherent text.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_models import WORDS, smollm2, tiny_causal_lm, tiny_classifier, tiny_encoder

from shardfold.client import Client
from shardfold.functions import store
from shardfold.functions.errors import SpecError
from shardfold.functions.inference.generation import Engine, Request, Sampling, prefix_groups, row_seed

WAIT_S = 300  # a deadline, not a timing assumption


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {
        "lm": tiny_causal_lm(root / "lm"),
        "cls": tiny_classifier(root / "cls", ["negative", "neutral", "positive"]),
        "enc": tiny_encoder(root / "enc", pooling="cls", normalize=True),
    }


@pytest.fixture(scope="module")
def lm(folders):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folders["lm"])
    return AutoModelForCausalLM.from_pretrained(folders["lm"]).eval(), tok


@pytest.fixture
def client(local_client):  # tests/conftest.py
    return local_client


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def prompts_with_shared_prefixes(tok, n: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    system = words(random.Random(0), 24)
    return [
        tok((system + " " if i % 2 else "") + words(rng, rng.randint(1, 20)))["input_ids"] for i in range(n)
    ]


def alone(model, prompt: list[int], max_tokens: int, eos: int = 2) -> list[int]:
    """transformers' greedy ``generate`` for one prompt, no padding: the reference."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos
    )
    return out[0, len(prompt) :].tolist()


# --- the engine ------------------------------------------------------------------------------------------


def test_greedy_tokens_equal_generate_per_row_alone_under_continuous_batching(lm):
    model, tok = lm
    prompts = prompts_with_shared_prefixes(tok, 24)
    rng = random.Random(2)
    limits = [rng.choice([1, 3, 9, 40]) for _ in prompts]  # outputs from 1 to 40 tokens: rows leave and join
    engine = Engine(model, eos=[2], batch_tokens=160, max_seqs=6, pad_id=0)
    got = engine.run(
        [
            Request(i, p, Sampling(max_tokens=m, temperature=0))
            for i, (p, m) in enumerate(zip(prompts, limits, strict=True))
        ]
    )
    for i, (p, m) in enumerate(zip(prompts, limits, strict=True)):
        assert got[i].tokens == alone(model, p, m), i
        assert got[i].finish_reason == ("stop" if got[i].tokens[-1] == 2 else "length")
    s = engine.stats
    assert s.peak_batch == 6  # slots full: prompts waited, and joined as others finished
    assert s.prefills > 24 // 6  # joins happened step by step, not in fixed batches
    assert s.prefill_tokens < s.prompt_tokens  # the shared system prompt was computed once per group


def test_sampling_is_the_same_whichever_batch_a_row_runs_in(lm):
    model, tok = lm
    prompts = prompts_with_shared_prefixes(tok, 12, seed=4)

    def run(max_seqs: int, budget: int, seed: int = 7) -> dict:
        reqs = [
            Request(i, p, Sampling(max_tokens=12, temperature=0.9, top_p=0.8), row_seed(seed, i))
            for i, p in enumerate(prompts)
        ]
        return {
            k: c.tokens
            for k, c in Engine(model, eos=[2], batch_tokens=budget, max_seqs=max_seqs).run(reqs).items()
        }

    first = run(12, 4096)
    assert run(2, 64) == first == run(5, 200)
    assert run(12, 4096, seed=8) != first
    # a tiny nucleus keeps only the most likely token: sampling is then greedy
    nucleus = Engine(model, eos=[2], max_seqs=4).run(
        [
            Request(i, p, Sampling(max_tokens=8, temperature=1.0, top_p=1e-6), row_seed(0, i))
            for i, p in enumerate(prompts)
        ]
    )
    assert all(nucleus[i].tokens == alone(model, p, 8) for i, p in enumerate(prompts))


def test_row_seed_differs_by_row_and_choice():
    seeds = {row_seed(0, r, c) for r in range(50) for c in range(3)}
    assert len(seeds) == 150 and all(0 <= s < 2**63 for s in seeds)
    assert row_seed(0, 1, 0) == row_seed(0, 1, 0) != row_seed(1, 1, 0)


def test_a_stop_string_cuts_the_text_before_it(lm):
    model, tok = lm
    prompt = tok("the capital of")["input_ids"]
    full = alone(model, prompt, 30)
    text = tok.decode(full, skip_special_tokens=True)
    stop = text.split()[3]  # a word the greedy answer reaches
    decode = lambda t: tok.decode(t, skip_special_tokens=True)  # noqa: E731
    (done,) = (
        Engine(model, eos=[2], decode=decode)
        .run([Request(0, prompt, Sampling(30, 0.0, 1.0, (stop,)))])
        .values()
    )
    assert done.finish_reason == "stop" and stop not in done.text and text.startswith(done.text)
    assert len(done.tokens) < len(full)


def test_prefix_groups_share_the_longest_common_prefix_of_neighbours():
    a = list(range(20))
    prompts = [a + [1], a + [2, 3], a[:9] + [7], [5, 6], a]
    assert prefix_groups(prompts, min_shared=8) == [9, 9, 9, 0, 0]  # neighbours only: sorted input
    assert prefix_groups([a, a], min_shared=8) == [19, 19]  # identical prompts keep one token each
    assert prefix_groups([[1, 2], [3]], min_shared=8) == [0, 0]
    assert prefix_groups([]) == []


def test_a_prompt_the_model_fails_on_fails_alone(lm):
    model, tok = lm
    good = tok("the sea is blue")["input_ids"]
    bad = good[:2] + [10_000]  # a token id past the vocabulary: the embedding lookup raises
    got = Engine(model, eos=[2], max_seqs=4).run(
        [
            Request(0, good, Sampling(5, 0.0)),
            Request(1, bad, Sampling(5, 0.0)),
            Request(2, good, Sampling(5, 0.0)),
        ]
    )
    assert got[1].error and "IndexError" in got[1].error and not got[1].tokens
    assert got[0].tokens == got[2].tokens == alone(model, good, 5) and not got[0].error


# --- jobs -------------------------------------------------------------------------------------------------


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return "file://" + str(path)


def generate_spec(inputs: str, folder: Path, **options) -> dict:
    return {
        "kind": "inference",
        "inputs": [inputs],
        "field": "prompt",
        "id_field": "id",
        "task": "generate",
        "model": {"hf": "file://" + str(folder)},
        "shard_rows": 5,
        **options,
    }


def table_of(client: Client, job):
    return client.inference.table(job.result())


@pytest.mark.slow
def test_generate_job_gives_each_row_its_greedy_tokens_and_errors_in_their_rows(
    client, folders, lm, tmp_path
):
    model, tok = lm
    rng = random.Random(5)
    rows = [{"id": f"r{i}", "prompt": words(rng, rng.randint(1, 12))} for i in range(11)]
    rows[3]["prompt"] = words(rng, 60)  # longer than max_input_tokens: an error in its row
    rows[7]["prompt"] = [{"role": "user", "content": "what is the capital of france"}]  # chat messages
    rows[8]["prompt"] = [{"role": "user"}]  # not a message: the row is kept with its error
    spec = generate_spec(
        write_jsonl(tmp_path / "p.jsonl", rows),
        folders["lm"],
        max_input_tokens=40,
        on_bad_row="error",
        max_error_fraction=0.2,
        generation={"max_tokens": 16, "temperature": 0},
    )
    job = client.submit(spec)
    assert job.wait(progress=False, timeout_s=WAIT_S).state == "SUCCEEDED"
    result = job.result()
    assert (result["task"], result["rows"], result["errors"]) == ("generate", 11, 2)
    out = table_of(client, job).to_pylist()
    assert [r["id"] for r in out] == [r["id"] for r in rows]
    assert set(out[0]) == {"id", "text", "finish_reason", "prompt_tokens", "completion_tokens", "error"}
    for row, src in zip(out, rows, strict=True):
        if row["id"] == "r3":
            assert row["text"] is None and "more than max_input_tokens 40" in row["error"]
            continue
        if row["id"] == "r8":
            assert row["text"] is None and "message 0" in row["error"]
            continue
        value = src["prompt"]
        ids = (
            tok.apply_chat_template(value, add_generation_prompt=True, tokenize=True, return_dict=True)[
                "input_ids"
            ]
            if isinstance(value, list)
            else tok(value)["input_ids"]
        )
        ref = alone(model, list(ids), 16)
        assert row["error"] is None and row["prompt_tokens"] == len(ids)
        assert row["text"] == tok.decode(ref, skip_special_tokens=True) and row["completion_tokens"] == len(
            ref
        )
        assert row["finish_reason"] == ("stop" if ref[-1] == 2 else "length")

    # past max_error_fraction the job fails, naming the fraction and the first error, and writes nothing
    strict = client.submit({**spec, "max_error_fraction": 0.1})
    status = strict.wait(progress=False, timeout_s=WAIT_S)
    assert status.state == "FAILED" and "2 of 11 rows ended with an error" in status.error
    assert "id r3" in status.error and not store.exists(
        client.uri(f"jobs/{strict.job_id}/output/generations.parquet")
    )


@pytest.mark.slow
def test_n_choices_are_lists_sampled_per_row_and_a_recomputed_shard_is_identical(client, folders, tmp_path):
    rng = random.Random(6)
    rows = [{"id": i, "prompt": words(rng, 6)} for i in range(8)]
    spec = generate_spec(
        write_jsonl(tmp_path / "p.jsonl", rows),
        folders["lm"],
        generation={"max_tokens": 6, "temperature": 0.8, "n": 3, "seed": 11},
    )
    first = client.submit(spec)
    assert first.wait(progress=False, timeout_s=WAIT_S).state == "SUCCEEDED"
    a = table_of(client, first).to_pylist()
    assert all(len(r["text"]) == 3 and len(r["completion_tokens"]) == 3 for r in a)
    assert any(len(set(r["text"])) > 1 for r in a)  # the choices are sampled, not copies
    # another job, with another shard size and batch: every row samples the same text
    again = client.submit({**spec, "shard_rows": 3, "generation": {**spec["generation"], "max_num_seqs": 2}})
    assert again.wait(progress=False, timeout_s=WAIT_S).state == "SUCCEEDED"
    assert table_of(client, again).to_pylist() == a


@pytest.mark.slow
def test_classify_pairs_equal_transformers_labels_and_scores(client, folders, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    rng = random.Random(7)
    rows = [
        {"id": i, "q": words(rng, rng.randint(1, 9)), "d": words(rng, rng.randint(1, 30))} for i in range(13)
    ]
    spec = {
        "kind": "inference",
        "inputs": [write_jsonl(tmp_path / "pairs.jsonl", rows)],
        "field": "q",
        "pair_field": "d",
        "id_field": "id",
        "task": "classify",
        "model": {"hf": "file://" + str(folders["cls"])},
        "shard_rows": 4,
    }
    job = client.submit(spec)
    assert job.wait(progress=False, timeout_s=WAIT_S).state == "SUCCEEDED"
    out = table_of(client, job)
    assert out.column_names == ["id", "label", "scores"]
    tok = AutoTokenizer.from_pretrained(folders["cls"])
    model = AutoModelForSequenceClassification.from_pretrained(folders["cls"]).eval()
    with torch.inference_mode():
        for row, src in zip(out.to_pylist(), rows, strict=True):
            logits = model(**tok(src["q"], src["d"], return_tensors="pt")).logits[0]
            probs = torch.softmax(logits, -1).numpy()
            assert row["label"] == model.config.id2label[int(probs.argmax())]
            np.testing.assert_allclose(row["scores"], probs, atol=1e-5)


@pytest.mark.slow
def test_embed_with_a_folder_pools_as_sentence_transformers_does(client, folders, tmp_path):
    from sentence_transformers import SentenceTransformer

    from shardfold.functions.inference.shards import minilm_dir

    rng = random.Random(8)
    rows = [{"id": i, "text": words(rng, rng.randint(1, 40))} for i in range(9)]
    inputs = write_jsonl(tmp_path / "t.jsonl", rows)
    texts = [r["text"] for r in rows]
    for folder in (folders["enc"], minilm_dir()):  # CLS pooling + normalise; MiniLM's mean pooling
        result = client.inference.run(
            inputs, field="text", id_field="id", model={"hf": "file://" + str(folder)}
        )
        ids, emb = client.inference.load(result)
        ref = SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_numpy=True)
        assert list(ids) == list(range(9))
        np.testing.assert_allclose(emb, ref, atol=2e-6)


def test_a_folder_that_cannot_do_the_task_is_refused_at_submit(client, folders, tmp_path):
    inputs = write_jsonl(tmp_path / "p.jsonl", [{"id": 0, "prompt": "the sea"}])
    enc = "file://" + str(folders["enc"])
    with pytest.raises(SpecError, match=r"task generate: model\.hf .* not a causal language model"):
        client.submit(generate_spec(inputs, folders["enc"]))
    with pytest.raises(SpecError, match=r"task classify: model\.hf .* has no labels"):
        client.submit({**generate_spec(inputs, folders["enc"]), "task": "classify", "model": {"hf": enc}})
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (pickled / name).write_text((folders["lm"] / name).read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(
        SpecError, match=r"model\.hf .* no safetensors weights \(pytorch_model\.bin are pickles"
    ):
        client.submit(generate_spec(inputs, pickled))
    with pytest.raises(SpecError, match=r"model\.hf .* no such folder"):
        client.submit(generate_spec(inputs, tmp_path / "nowhere"))
    with pytest.raises(SpecError, match="needs a Hugging Face model folder"):
        client.submit({**generate_spec(inputs, folders["lm"]), "model": "minilm"})
    with pytest.raises(SpecError, match="pair_field is for task 'classify'"):
        client.submit({**generate_spec(inputs, folders["lm"]), "pair_field": "x"})


def test_auto_chooses_vllm_only_on_a_gpu_worker_that_has_it(folders, monkeypatch):
    from shardfold.functions.inference import compute, vllm_engine
    from shardfold.functions.inference.spec import InferenceSpec

    def spec(engine: str) -> InferenceSpec:
        return InferenceSpec.model_validate(
            generate_spec("file:///p.jsonl", folders["lm"], generation={"engine": engine})
        )

    for installed, gpu, chosen in [(True, True, True), (True, False, False), (False, True, False)]:
        monkeypatch.setattr(vllm_engine, "available", lambda installed=installed: installed)
        monkeypatch.setattr(torch.cuda, "is_available", lambda gpu=gpu: gpu)
        assert compute.uses_vllm(spec("auto")) is chosen
        assert compute.uses_vllm(spec("auto"), "cpu") is False
        assert compute.uses_vllm(spec("vllm"), "cpu") is True  # asked for: never replaced silently
        assert compute.uses_vllm(spec("transformers")) is False


@pytest.mark.slow
def test_engine_vllm_on_a_worker_without_it_fails_the_job_naming_the_field(client, folders, tmp_path):
    if vllm_installed():
        pytest.skip("vLLM is installed here: tests/on_vllm runs it")
    inputs = write_jsonl(tmp_path / "p.jsonl", [{"id": 0, "prompt": "the sea"}])
    job = client.submit(generate_spec(inputs, folders["lm"], generation={"engine": "vllm"}))
    status = job.wait(progress=False, timeout_s=WAIT_S)
    assert status.state == "FAILED" and "generation.engine 'vllm' needs the vllm package" in status.error


def vllm_installed() -> bool:
    from shardfold.functions.inference import vllm_engine

    return vllm_engine.available()


def test_the_plan_sizes_the_worker_by_the_folders_weights_and_the_generation_cache(client, folders, tmp_path):
    """A folder's weights (as loaded, by dtype) and every running sequence's keys and values enter the
    worker's peak; a model that cannot fit is refused naming the setting that raises the memory."""
    from shardfold.functions.estimate import estimate
    from shardfold.functions.specs import parse_spec

    inputs = write_jsonl(tmp_path / "p.jsonl", [{"id": 0, "prompt": "the sea"}])
    base = generate_spec(inputs, folders["lm"])

    def peak(spec: dict) -> float:
        return next(
            s for s in estimate(parse_spec(spec), client.store_root).steps if s.name == "infer"
        ).peak_mb

    more = {**base, "generation": {"max_num_seqs": 256, "max_tokens": 1024}}
    # 2 layers x (key, value) x 32 wide x 4 bytes = 512 bytes a token, held twice while a joiner merges in
    kv = lambda seqs, new: 2 * seqs * (256 + new) * 512 / 2**20  # noqa: E731
    assert peak(more) - peak(base) == pytest.approx(kv(256, 1024) - kv(64, 256), rel=1e-3)

    big = tmp_path / "big"
    big.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (big / name).write_text((folders["lm"] / name).read_text())
    with open(big / "model.safetensors", "wb") as f:  # sparse: 40 GB of (absent) float32 weights
        f.truncate(40 * 10**9)
    spec = generate_spec(inputs, big)
    with pytest.raises(Exception, match=r"plan refused: .*infer.*raise it with memory_mb of step 'infer'"):
        client.submit(spec)
    as_bf16 = {**spec, "model": {"hf": "file://" + str(big), "dtype": "bfloat16"}}
    # bfloat16 halves 40 GB of float32 weights, held twice while they load
    assert peak(spec) - peak(as_bf16) == pytest.approx(2 * 20 * 10**9 / 2**20, rel=1e-3)


@pytest.mark.slow
def test_generate_on_moto_equals_local(folders, tmp_path, monkeypatch):
    rng = random.Random(9)
    rows = [{"id": i, "prompt": words(rng, rng.randint(2, 10))} for i in range(7)]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = generate_spec("prompts.jsonl", folders["lm"], generation={"max_tokens": 8, "temperature": 0.7})
    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "moto-home"))
    with Client(backend="moto") as moto:
        store.put(moto.uri("prompts.jsonl"), path.read_bytes())
        for name in sorted(p.name for p in folders["lm"].iterdir()):
            store.put(moto.uri(f"models/lm/{name}"), (folders["lm"] / name).read_bytes())
        job = moto.submit({**spec, "model": {"hf": "models/lm"}})
        assert job.wait(progress=False, timeout_s=WAIT_S).state == "SUCCEEDED"
        on_moto = moto.inference.table(job.result()).to_pylist()
    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "local-home"))
    with Client() as local:
        job = local.submit({**spec, "inputs": ["file://" + str(path)]})
        assert job.wait(progress=False, timeout_s=WAIT_S).state == "SUCCEEDED"
        assert local.inference.table(job.result()).to_pylist() == on_moto


@pytest.mark.slow
def test_smollm2_answers_coherently_and_greedy_equals_generate(client, tmp_path):
    """The real model through the whole job: its chat template, its tokenizer, greedy tokens equal to
    transformers' for each row alone, and answers a reader recognises."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smollm2()
    questions = [
        "What is the capital of France? Answer in one sentence.",
        "What is 2+2?",
        "Name three colours.",
    ]
    rows = [{"id": i, "prompt": [{"role": "user", "content": q}]} for i, q in enumerate(questions)]
    spec = generate_spec(
        write_jsonl(tmp_path / "q.jsonl", rows), folder, generation={"max_tokens": 20, "temperature": 0}
    )
    job = client.submit(spec)
    assert job.wait(progress=False, timeout_s=WAIT_S).state == "SUCCEEDED"
    out = table_of(client, job).to_pylist()
    assert "Paris" in out[0]["text"] and "4" in out[1]["text"]
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    for row, src in zip(out, rows, strict=True):
        ids = tok.apply_chat_template(
            src["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True
        )
        ref = alone(model, list(ids["input_ids"]), 20, eos=tok.eos_token_id)
        assert row["text"] == tok.decode(ref, skip_special_tokens=True)


@pytest.mark.slow
def test_kill_9_the_generating_worker_then_resume_recomputes_only_uncommitted_shards(
    client, folders, tmp_path, monkeypatch
):
    import time

    from test_inference_job import _worker_container

    from shardfold.functions.inference import shards as layout
    from shardfold.functions.inference.pipeline import worker_reports

    monkeypatch.setattr(store, "delete_prefix", lambda prefix: 0)  # keep the scratch to see who did what
    rng = random.Random(10)
    rows = [{"id": i, "prompt": words(rng, rng.randint(2, 12))} for i in range(60)]
    spec = generate_spec(
        write_jsonl(tmp_path / "p.jsonl", rows),
        folders["lm"],
        shard_rows=3,
        generation={"max_tokens": 40, "temperature": 0.8, "max_num_seqs": 2},
    )
    job = client.submit(spec)
    root = client.store_root
    worker = _worker_container()
    markers: list[str] = []
    deadline = time.monotonic() + WAIT_S
    while len(markers) < 2 and time.monotonic() < deadline:  # kill once two shards are committed
        markers = [u for u in store.list_uris(layout.job_root(root, job.job_id) + "/") if u.endswith(".done")]
        time.sleep(0.01)
    worker.kill()
    status = job.wait(progress=False, timeout_s=WAIT_S)
    assert status.state == "FAILED" and "killed by SIGKILL" in status.error
    h = layout.load_plan(root, job.job_id)["config_hash"]
    committed = {k for k in range(20) if store.exists(layout.done_uri(root, job.job_id, h, k))}
    assert 2 <= len(committed) < 20, "the worker finished before the kill; the test needs a slower shard"
    before = {k: store.get(layout.out_uri(root, job.job_id, h, k)) for k in committed}

    assert job.resume().wait(progress=False, timeout_s=WAIT_S).state == "SUCCEEDED"
    (report,) = worker_reports(root, job.job_id)  # only the resumed worker reports
    assert sorted(report["computed"]) == sorted(set(range(20)) - committed)
    assert {k: store.get(layout.out_uri(root, job.job_id, h, k)) for k in committed} == before
    clean = client.submit(spec)  # a clean run samples the same text for every row
    assert clean.wait(progress=False, timeout_s=WAIT_S).state == "SUCCEEDED"
    assert table_of(client, job).to_pylist() == table_of(client, clean).to_pylist()


# --- the OpenAI Batch format ------------------------------------------------------------------------------


def request(custom_id: str, content, url: str = "/v1/chat/completions", **body) -> dict:
    key = "messages" if url == "/v1/chat/completions" else "prompt"
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": url,
        "body": {"model": "tiny", key: content, **body},
    }


@pytest.mark.slow
def test_openai_batch_requests_in_responses_out_with_per_request_options(client, folders, lm, tmp_path):
    model, tok = lm
    lines = [
        request("chat-1", [{"role": "user", "content": "what is the capital of france"}], max_tokens=5),
        request("text-1", "the sea is", url="/v1/completions", max_completion_tokens=3, temperature=0),
        request("bad-url", "x", url="/v1/embeddings"),
        request("bad-n", "the sea", url="/v1/completions", n=2),
        request("chat-2", [{"role": "user", "content": "red green blue"}], temperature=0, stop=["the"]),
    ]
    spec = {
        "kind": "inference",
        "inputs": [write_jsonl(tmp_path / "batch.jsonl", lines)],
        "input_format": "openai",
        "output_format": "openai",
        "task": "generate",
        "model": {"hf": "file://" + str(folders["lm"])},
        "on_bad_row": "error",
        "max_error_fraction": 0.5,
        "generation": {"max_tokens": 8, "temperature": 0},
    }
    job = client.submit(spec)
    assert job.wait(progress=False, timeout_s=WAIT_S).state == "SUCCEEDED"
    result = job.result()
    assert result["output"].endswith("/generations.jsonl") and result["errors"] == 2
    out = [json.loads(line) for line in store.get(result["output"]).decode().splitlines()]
    assert [o["custom_id"] for o in out] == ["chat-1", "text-1", "bad-url", "bad-n", "chat-2"]
    by_id = {o["custom_id"]: o for o in out}
    assert (
        by_id["bad-url"]["response"] is None
        and "url '/v1/embeddings'" in by_id["bad-url"]["error"]["message"]
    )
    assert "body.n 2" in by_id["bad-n"]["error"]["message"]

    chat = by_id["chat-1"]["response"]
    assert (
        chat["status_code"] == 200
        and chat["body"]["object"] == "chat.completion"
        and by_id["chat-1"]["error"] is None
    )
    ids = tok.apply_chat_template(
        lines[0]["body"]["messages"], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    ref = alone(model, list(ids), 5)  # the request's max_tokens, not the job's 8
    (choice,) = chat["body"]["choices"]
    assert choice["message"] == {"role": "assistant", "content": tok.decode(ref, skip_special_tokens=True)}
    assert chat["body"]["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": len(ref),
        "total_tokens": len(ids) + len(ref),
    }
    assert chat["body"]["model"] == "tiny"  # echoed from the request
    text = by_id["text-1"]["response"]["body"]
    assert text["object"] == "text_completion" and text["usage"]["completion_tokens"] <= 3
    assert text["choices"][0]["text"] == tok.decode(
        alone(model, tok("the sea is")["input_ids"], 3), skip_special_tokens=True
    )
    assert "the" not in by_id["chat-2"]["response"]["body"]["choices"][0]["message"]["content"].split()


def test_openai_formats_are_refused_where_they_cannot_apply(client, folders):
    base = {"kind": "inference", "inputs": ["batch.jsonl"], "model": {"hf": "file://" + str(folders["lm"])}}
    with pytest.raises(SpecError, match="input_format 'openai' is for task 'generate'"):
        client.plan({**base, "input_format": "openai"})
    with pytest.raises(SpecError, match="leave out field and id_field"):
        client.plan({**base, "task": "generate", "input_format": "openai", "field": "prompt"})
    with pytest.raises(SpecError, match="reads JSONL inputs"):
        client.plan({**base, "task": "generate", "input_format": "openai", "inputs": ["b.parquet"]})
    with pytest.raises(SpecError, match="field is required"):
        client.plan({**base, "task": "generate"})


@pytest.mark.slow
def test_structured_output_follows_the_json_schema(client, tmp_path):
    """SmolLM2 answers in JSON that follows the schema (llguidance masks every other token); a schema it
    cannot follow is an error in the row, not a crash."""
    import jsonschema

    schema = {
        "type": "object",
        "properties": {
            "answer": {"type": "string", "enum": ["yes", "no"]},
            "confidence": {"type": "integer"},
        },
        "required": ["answer", "confidence"],
        "additionalProperties": False,
    }
    questions = ["Is the sky blue?", "Is fire cold?", "Is water wet?"]
    rows = [{"id": i, "prompt": [{"role": "user", "content": q}]} for i, q in enumerate(questions)]
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}}
    spec = generate_spec(
        write_jsonl(tmp_path / "q.jsonl", rows),
        smollm2(),
        generation={"max_tokens": 40, "temperature": 0, "response_format": fmt},
    )
    job = client.submit(spec)
    assert job.wait(progress=False, timeout_s=WAIT_S).state == "SUCCEEDED"
    for row in table_of(client, job).to_pylist():
        assert row["finish_reason"] == "stop", row
        jsonschema.validate(json.loads(row["text"]), schema)

    impossible = {"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "(?=a)"}}}
    bad = client.submit(
        {**spec, "max_error_fraction": 1, "generation": {"max_tokens": 5, "response_format": impossible}}
    )
    assert bad.wait(progress=False, timeout_s=WAIT_S).state == "SUCCEEDED"
    out = table_of(client, bad).to_pylist()
    assert all(r["text"] is None and "response_format" in r["error"] for r in out), out
