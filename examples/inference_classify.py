"""A sentiment classifier of your own run over a dataset by an `inference` job with `task: classify`.

Run from anywhere: python examples/inference_classify.py
A classifier is any Hugging Face sequence-classification folder (config.json with id2label, safetensors
weights, tokenizer.json). To keep this offline, the example makes one first: the built-in MiniLM encoder
with a two-label head, fine-tuned for a few seconds on twelve sentences, saved with save_pretrained. The job
then labels sentences it never saw; the output has a `label` and the labels' `scores` per row.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

if not os.environ.get("SHARDFOLD_HOME"):
    os.environ["SHARDFOLD_HOME"] = tempfile.mkdtemp(prefix="shardfold-example-")

from shardfold.client import Client  # noqa: E402  (after SHARDFOLD_HOME is settled)

TRAIN = [
    ("I loved this film, it was wonderful.", 1),
    ("What a great day, everything went well.", 1),
    ("The food was delicious and the staff were kind.", 1),
    ("This is the best book I have read this year.", 1),
    ("A delightful, warm and funny story.", 1),
    ("I am so happy with this purchase.", 1),
    ("I hated this film, it was awful.", 0),
    ("What a terrible day, everything went wrong.", 0),
    ("The food was cold and the staff were rude.", 0),
    ("This is the worst book I have read this year.", 0),
    ("A dull, cold and boring story.", 0),
    ("I am so disappointed with this purchase.", 0),
]
UNSEEN = [
    {"id": 1, "text": "An excellent concert, the band was fantastic."},
    {"id": 2, "text": "The hotel room was dirty and noisy."},
    {"id": 3, "text": "My new phone works beautifully."},
    {"id": 4, "text": "The train was late and the trip was miserable."},
]


def make_classifier(out: Path) -> None:
    """MiniLM with a two-label head, fine-tuned, saved as a Hugging Face folder."""
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification
    from transformers.utils import logging

    from shardfold.functions.inference.shards import minilm_dir

    logging.set_verbosity_error()  # the new head's weights are reported missing: they are trained here
    torch.manual_seed(0)
    labels = {0: "negative", 1: "positive"}
    tok = AutoTokenizer.from_pretrained(minilm_dir())
    model = BertForSequenceClassification.from_pretrained(
        minilm_dir(), num_labels=2, id2label=labels, label2id={v: k for k, v in labels.items()}
    )
    batch = tok([t for t, _ in TRAIN], padding=True, return_tensors="pt")
    target = torch.tensor([y for _, y in TRAIN])
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()
    for _ in range(20):  # enough to label the unseen sentences at 0.97 or more
        optimiser.zero_grad()
        model(**batch, labels=target).loss.backward()
        optimiser.step()
    model.eval().save_pretrained(out)
    tok.save_pretrained(out)


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="shardfold-example-input-") as tmp, Client() as client:
        print(f"store: {client.store_root}")
        folder = Path(tmp) / "sentiment"
        make_classifier(folder)
        sentences = Path(tmp) / "sentences.jsonl"
        sentences.write_text("".join(json.dumps(row) + "\n" for row in UNSEEN))
        result = client.inference.run(
            [sentences.as_uri()], field="text", id_field="id", task="classify", model={"hf": folder.as_uri()}
        )
        print(f"job {result['job_id']}: {result['rows']} rows labelled")
        for row, src in zip(client.inference.table(result).to_pylist(), UNSEEN, strict=True):
            scores = ", ".join(f"{s:.2f}" for s in row["scores"])
            print(f"{row['label']:>8} ({scores})  {src['text']}")


if __name__ == "__main__":
    main()
