"""The inference benchmarks on a GPU machine, in one command: how busy the worker keeps the GPU.

    .venv/bin/python bench/gpu.py          # on a machine with an NVIDIA GPU (a few minutes)
    .venv/bin/python bench/gpu.py --dry    # the same code on a CPU, tiny sizes (seconds; the suite runs it)

Four rows, each the project's own code against a competently configured peer on the same device, model
loaded before the clock (both sides):

  encode, worker path   MiniLM over generated sentences (bench/inference.py's, ~46 tokens, a long tail)
                        by :func:`functions.inference.compute.embed_rows`, what the worker runs per shard:
                        length-sorted token-budget batches, bfloat16 autocast and TF32 (precision 'auto'),
                        pinned non-blocking copies, one copy back per shard;
  encode, peer          sentence-transformers ``encode`` on the same model in float16 (``.half()``, its
                        documented GPU setting), batches of 256, length-sorted by ``encode`` itself;
  generate, engine      the continuous-batching engine over SmolLM2-135M-Instruct (``make models``) on
                        bench/generation.py's prompts (answers from a word to a paragraph), greedy, 64
                        sequences in flight;
  generate, peer        transformers' static ``generate`` in batches of 64.

GPU busy % is nvidia-smi's utilization (the share of time a kernel ran), sampled every 100 ms over the
method's clock; "n/a" without nvidia-smi. ``--dry`` runs on the CPU with a few rows and a random-weight
model from a config, to prove the script end to end. Writes ``bench/results/gpu.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for path in (REPO, HERE, REPO / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
from benchutil import table  # noqa: E402
from generation import prompts as chat_prompts  # noqa: E402
from inference import sentences  # noqa: E402

RESULTS = HERE / "results" / "gpu.json"


class Busy:
    """nvidia-smi's GPU utilization, sampled every 100 ms while the block runs; None without a GPU."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Busy:
        try:
            self.proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-lms", "100"],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        except OSError:
            return self
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.samples.append(float(line.split(",")[0]))
            except ValueError:
                pass

    def __exit__(self, *_: Any) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()

    @property
    def percent(self) -> float | None:
        return sum(self.samples) / len(self.samples) if self.samples else None


def timed(fn: Any) -> tuple[Any, float, float | None]:
    """``fn()``'s result, its seconds (the device synchronised at the end) and the GPU's busy %."""
    import torch

    with Busy() as busy:
        t0 = time.perf_counter()
        out = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    return out, seconds, busy.percent


def encode_rows(device: str, n: int, dry: bool) -> list[dict[str, Any]]:
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    from shardfold.functions.inference import compute
    from shardfold.functions.inference.models import load_model, minilm_dir, set_precision
    from shardfold.functions.inference.preprocess import load_tokenizer, tokenize

    texts = sentences(n)
    ids, offsets, _ = tokenize(texts, 256, None, load_tokenizer(256))
    tokens = int(offsets[-1])
    model = load_model("minilm", device)
    set_precision(model, "auto")
    budget = 16384 if device == "cuda" else 2048
    compute.embed_rows(model, ids[: offsets[8]], offsets[:9], budget)  # warm-up: kernels, allocator
    stats = compute.WorkerStats(budget_cap=budget)

    def worker_path() -> np.ndarray:  # tokenizing inside the clock too, as encode does
        ids, offsets, _ = tokenize(texts, 256, None, load_tokenizer(256))
        # np.asarray: a GPU shard's rows come back to the host (the worker does it as it writes the shard)
        return np.asarray(compute.embed_rows(model, ids, offsets, budget, stats)[0])

    out, s, busy = timed(worker_path)
    peer = SentenceTransformer(str(minilm_dir()), device=device)
    if device == "cuda":
        peer.half()
    batch = 256 if device == "cuda" else 32
    peer.encode(texts[:8], batch_size=batch)
    ref, ps, pbusy = timed(lambda: peer.encode(texts, batch_size=batch, convert_to_numpy=True))
    cos = float(np.mean(np.sum(out * ref, axis=1)))  # both L2-normalised
    if device == "cuda":
        torch.cuda.empty_cache()
    return [
        {"method": "encode, worker path", "rows": n, "s": s, "tokens": tokens, "busy": busy, "cosine": cos},
        {
            "method": "encode, peer (sentence-transformers, float16)"
            if device == "cuda"
            else "encode, peer (sentence-transformers)",
            "rows": n,
            "s": ps,
            "tokens": tokens,
            "busy": pbusy,
        },
    ]


def generate_rows(device: str, n: int, dry: bool, tmp: Path) -> list[dict[str, Any]]:
    import torch
    from hf_models import smollm2, tiny_causal_lm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardfold.functions.inference.generation import Engine, Request, Sampling

    folder = tiny_causal_lm(tmp / "tiny-lm") if dry else smollm2()
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).to(device).eval()
    # bench/generation.py's prompts: three short questions, then a request for long text, and again
    prompts = [
        list(
            tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)[
                "input_ids"
            ]
        )
        if tok.chat_template
        else tok(m[0]["content"])["input_ids"]
        for m in chat_prompts(n)
    ]
    max_tokens, seqs = (16, 8) if dry else (128, 64)
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    engine = Engine(model, eos=eos, batch_tokens=8192, max_seqs=seqs, decode=tok.decode, pad_id=pad)
    requests = [Request(i, p, Sampling(max_tokens, 0.0, 1.0, ())) for i, p in enumerate(prompts)]
    done, s, busy = timed(lambda: engine.run(requests))
    generated = sum(len(c.tokens) for c in done.values())

    def static() -> int:
        count = 0
        tok.padding_side = "left"
        for b in range(0, n, seqs):
            batch = prompts[b : b + seqs]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
            with torch.inference_mode():
                out = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=max_tokens,
                    do_sample=False,
                    pad_token_id=pad,
                )
            for row in out[:, width:].tolist():
                count += next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        return count

    peer_tokens, ps, pbusy = timed(static)
    return [
        {"method": "generate, engine", "rows": n, "s": s, "tokens": generated, "busy": busy},
        {
            "method": f"generate, peer (static generate, batches of {seqs})",
            "rows": n,
            "s": ps,
            "tokens": peer_tokens,
            "busy": pbusy,
        },
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry", action="store_true", help="on the CPU, tiny sizes: the script end to end")
    ap.add_argument("--rows", type=int, default=None, help="sentences to embed (default 50,000; dry 64)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts to answer (default 512; dry 12)")
    ap.add_argument("--out", default=str(RESULTS), help="JSON output path")
    args = ap.parse_args(argv)
    import tempfile

    import torch

    device = "cpu" if args.dry else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device visible to torch: run on a GPU machine, or with --dry", file=sys.stderr)
        return 2
    rows = args.rows or (64 if args.dry else 50_000)
    prompts = args.prompts or (12 if args.dry else 512)
    with tempfile.TemporaryDirectory() as tmp:
        results = encode_rows(device, rows, args.dry) + generate_rows(device, prompts, args.dry, Path(tmp))
    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "CPU"
    print(f"device: {name}{' (dry run)' if args.dry else ''}; torch {torch.__version__}")
    body = [
        [
            r["method"],
            f"{r['rows']:,}",
            f"{r['s']:.2f}",
            f"{r['rows'] / r['s']:,.0f}",
            f"{r['tokens'] / r['s']:,.0f}",
            "n/a" if r["busy"] is None else f"{r['busy']:.0f}",
        ]
        for r in results
    ]
    print(table(["method", "rows", "s", "rows/s", "tokens/s", "GPU busy %"], body, right={1, 2, 3, 4, 5}))
    encode, peer = results[0], results[1]
    ratio = peer["s"] / encode["s"]
    print(f"encode: worker path {ratio:.2f}x the peer; mean cosine to it {encode['cosine']:.5f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": name, "dry": args.dry, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
