"""What a worker computes for one shard, by the spec's task: embed and classify (the model's output per
row, batched under a token budget after sorting by length), generate (:mod:`functions.inference.generation`'s
continuous batching), and how it loads the job's model.

Each returns the shard's output arrays, written as ``out/<H>/<k>.npz``: ``embedding`` ``[rows, D]``
float32; ``scores`` ``[rows, labels]`` float32; ``text``, ``finish_reason`` (``[rows, n]`` unicode),
``prompt_tokens`` ``[rows]``, ``completion_tokens`` ``[rows, n]`` int32 and ``error`` ``[rows]`` unicode
(``""`` for none).
"""

from __future__ import annotations

import contextlib
import json
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardfold.functions import access
from shardfold.functions.errors import ShardfoldError
from shardfold.functions.inference import shards as layout
from shardfold.functions.inference.batcher import token_budget_batches
from shardfold.functions.inference.spec import HFModel, InferenceSpec
from shardfold.functions.log import logger
from shardfold.functions.store.pinning import Pin

# cuBLAS and cuDNN report a failed allocation as a RuntimeError with one of these in its text, not as
# torch.cuda.OutOfMemoryError
_OOM_TEXTS = ("CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED", "CUDNN_STATUS_NOT_ENOUGH_WORKSPACE")
GROW_AFTER = 16  # batches without an out-of-memory error before a halved budget doubles back (then 2x more)


@dataclass
class WorkerStats:
    attempt: int = 0
    computed: list[int] = field(default_factory=list)  # shards this worker committed
    skipped: list[int] = field(default_factory=list)  # committed by someone else before we got to them
    rows: int = 0
    batches: int = 0
    padded_tokens: int = 0
    real_tokens: int = 0
    oom_halvings: int = 0
    budget: int = 0
    budget_cap: int = 0  # the budget it started with: a halved one grows back to it
    budget_growths: int = 0
    calm_batches: int = 0  # batches since the last out-of-memory error or growth
    grow_after: int = GROW_AFTER
    first_commit_s: float | None = None
    wall_s: float = 0.0
    shard_s: dict[int, float] = field(default_factory=dict)  # embedding seconds per committed shard
    device: str = ""
    threads: int = 0  # a CPU worker's intra-op threads (0: on a GPU)
    generated_tokens: int = 0  # generate: tokens produced
    prompt_tokens: int = 0  # generate: prompt tokens of the requests
    prefix_saved_tokens: int = 0  # generate: prompt tokens not computed (shared prefixes)

    def summary(self) -> dict[str, Any]:
        pad = 1.0 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0
        return {
            "attempt": self.attempt,
            "device": self.device,
            "threads": self.threads,
            "shards": len(self.computed),
            "computed": sorted(self.computed),
            "skipped": sorted(self.skipped),
            "rows": self.rows,
            "batches": self.batches,
            "real_tokens": self.real_tokens,
            "padded_tokens": self.padded_tokens,
            "padding_fraction": round(pad, 4),
            "oom_halvings": self.oom_halvings,
            "budget_growths": self.budget_growths,
            "budget": self.budget,
            "first_commit_s": self.first_commit_s,
            "compute_s": round(sum(self.shard_s.values()), 3),
            "shard_s": {str(k): round(v, 4) for k, v in sorted(self.shard_s.items())},
            "wall_s": round(self.wall_s, 3),
            **(
                {
                    "generated_tokens": self.generated_tokens,
                    "prompt_tokens": self.prompt_tokens,
                    "prefix_saved_tokens": self.prefix_saved_tokens,
                }
                if self.generated_tokens
                else {}
            ),
        }


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is the device running out of memory: PyTorch's own error, or cuBLAS/cuDNN's."""
    import torch

    oom = getattr(torch.cuda, "OutOfMemoryError", None) or getattr(torch, "OutOfMemoryError", None)
    if oom is not None and isinstance(exc, oom):
        return True
    return isinstance(exc, RuntimeError) and any(t in str(exc) for t in _OOM_TEXTS)


def _batch(
    idx: np.ndarray, lengths: np.ndarray, input_ids: np.ndarray, offsets: np.ndarray, type_ids: Any
) -> tuple[list[np.ndarray], int]:
    """A batch's ``[ids, mask(, types)]`` int64 arrays, padded to its longest row; and that length. Gathered
    in one indexing operation, not row by row: on a GPU the host cuts batches while the device computes."""
    n = lengths[idx]
    t = int(max(int(n.max()), 1))
    cols = np.arange(t)
    mask = cols[None, :] < n[:, None]
    # a pad position reads the row's first token (or token 0 of the shard) and is then zeroed
    pos = np.where(mask, offsets[idx][:, None] + cols[None, :], 0)
    ids = np.where(mask, input_ids[pos] if len(input_ids) else 0, 0).astype(np.int64)
    types = None
    if type_ids is not None:
        types = np.where(mask, type_ids[pos] if len(type_ids) else 0, 0).astype(np.int64)
    mask[:, 0] = True  # an empty row still attends to one (pad) token
    return [a for a in (ids, mask.astype(np.int64), types) if a is not None], t


def embed_rows(
    model: Any,
    input_ids: np.ndarray,
    offsets: np.ndarray,
    budget: int,
    stats: WorkerStats | None = None,
    type_ids: np.ndarray | None = None,
) -> tuple[Any, int]:
    """The model's ``[rows, D]`` float32 output (embeddings, or class probabilities) of a shard's rows in
    row order, ``type_ids`` (pairs) passed as token type ids; returns ``(out, budget)``.

    On a GPU nothing waits for a batch to finish: its inputs go from pinned memory without blocking, its
    output stays on the device, and the host cuts the next batch while the GPU computes; ``out`` is then a
    :class:`DeviceRows`, copied to the host in one go when the shard is written.

    Out of memory (PyTorch's error or cuBLAS/cuDNN's) halves the budget, frees the failed batch and the
    allocator's cache, and re-cuts what is left; after ``stats.grow_after`` batches without one the budget
    doubles back toward ``stats.budget_cap``, and an out-of-memory after such a growth doubles that wait."""
    import torch

    stats = stats if stats is not None else WorkerStats()
    lengths = np.diff(offsets).astype(np.int64)
    rows, dim = len(lengths), model.dim
    out = np.zeros((rows, dim), dtype=np.float32)
    if rows == 0:
        return out, budget
    cap = max(stats.budget_cap, budget)
    device = model.device
    cuda = getattr(device, "type", str(device)) == "cuda"
    queue = deque(token_budget_batches(lengths, budget))
    if cuda:  # the shard's rows, filled batch by batch on the device; timed there too (events)
        out = DeviceRows(torch.empty((rows, dim), dtype=torch.float32, device=device))
    precision = getattr(model, "precision", contextlib.nullcontext)
    with torch.inference_mode(), precision():
        while queue:
            idx = queue.popleft()
            arrays, t = _batch(idx, lengths, input_ids, offsets, type_ids)
            tensors = [torch.from_numpy(a) for a in arrays]
            if cuda:
                tensors = [a.pin_memory().to(device, non_blocking=True) for a in tensors]
            failure = None
            try:
                y = model(*tensors)
            except Exception as exc:
                if not is_oom(exc):
                    raise
                failure = exc  # handled past the except block, which holds the batch's frames
            if failure is not None:
                _refuse_single_row(failure, budget, idx, t)
                del tensors, failure  # the batch (and the frames the error holds) before the cache is freed
                budget = _halved(budget, stats, cuda)
                # re-cut the failed batch and every batch still queued (cut under the old budget)
                queue = _recut([idx, *queue], lengths, budget)
                continue
            _keep(model, y, idx, dim, out)
            grown = _fitted(stats, idx, lengths, t, budget, cap)
            if grown != budget:
                budget, queue = grown, _recut(list(queue), lengths, grown)
    if isinstance(out, DeviceRows):
        out.finish()
    return out, budget


def _refuse_single_row(failure: BaseException, budget: int, idx: np.ndarray, t: int) -> None:
    """Raise when halving the budget cannot help: it is 1, or the batch is one row longer than it."""
    if budget <= 1 or (len(idx) == 1 and budget < t):
        raise ShardfoldError(
            f"out of memory on a single row of {t} tokens even at a budget of {budget} tokens; "
            "lower max_tokens or use a device with more memory"
        ) from failure


def _halved(budget: int, stats: WorkerStats, cuda: bool) -> int:
    """The budget after an out-of-memory error, the allocator's cache freed; a budget that had grown back
    waits twice as long before it grows again."""
    import torch

    if cuda:
        torch.cuda.empty_cache()
    budget = max(1, budget // 2)
    stats.oom_halvings += 1
    if stats.budget_growths:  # it grew back into trouble: wait twice as long next time
        stats.grow_after *= 2
    stats.calm_batches = 0
    logger.warning("out of memory: halving the token budget", extra={"budget": budget})
    return budget


def _fitted(stats: WorkerStats, idx: np.ndarray, lengths: np.ndarray, t: int, budget: int, cap: int) -> int:
    """Count a batch that fit (``t`` tokens wide); the budget after it, doubled back toward ``cap`` after
    ``stats.grow_after`` calm batches."""
    stats.batches += 1
    stats.padded_tokens += len(idx) * t
    stats.real_tokens += int(np.maximum(lengths[idx], 1).sum())
    stats.calm_batches += 1
    if budget < cap and stats.calm_batches >= stats.grow_after:
        budget, stats.calm_batches = min(cap, budget * 2), 0
        stats.budget_growths += 1
    return budget


def _recut(parts: list[np.ndarray], lengths: np.ndarray, budget: int) -> deque[np.ndarray]:
    """The rows of ``parts`` (batches of row indices) cut again into batches under ``budget``."""
    left = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return deque(left[b] for b in token_budget_batches(lengths[left], budget))


def _keep(model: Any, y: Any, idx: np.ndarray, dim: int, out: Any) -> None:
    """Check a batch's output is ``[len(idx), D]`` and write it into the shard's rows ``out``."""
    if y.dim() != 2 or y.shape[0] != len(idx) or y.shape[1] != dim:
        raise ShardfoldError(
            f"model {getattr(model, 'name', '?')} returned shape {list(y.shape)} for a batch of "
            f"{len(idx)} rows; expected [{len(idx)}, {dim}]"
        )
    if isinstance(out, DeviceRows):
        import torch

        # copied into the shard's rows: a view (a [CLS] slice) would keep the batch's activations
        out.rows[torch.as_tensor(idx, device=model.device)] = y.detach().float()
    else:
        out[idx] = y.detach().float().numpy()


class DeviceRows:
    """A shard's ``[rows, D]`` outputs on the GPU, copied to the host when numpy asks for them
    (``np.asarray``, ``np.savez``): on the worker's commit thread, so the compute thread never waits for the
    GPU to finish a shard before it queues the next one's batches. :meth:`seconds` is the GPU's time on the
    shard, read once the copy has waited for it."""

    def __init__(self, rows: Any):
        import torch

        self.rows = rows
        self.shape = tuple(rows.shape)
        self.start = self.end = None
        if rows.is_cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)
            self.start.record()

    def finish(self) -> None:
        """Mark the end of the shard's work on the device (after its last batch is queued)."""
        if self.end is not None:
            self.end.record()

    def __len__(self) -> int:
        return self.shape[0]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self.rows.cpu().numpy()
        return out if dtype is None else out.astype(dtype, copy=False)

    def seconds(self) -> float | None:
        if self.start is None or self.end is None:
            return None
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1000


def load_runner(spec: InferenceSpec, store_root: str, plan: dict[str, Any], device: Any = None) -> Any:
    """The job's model on ``device``: a :class:`~functions.inference.models.LoadedModel` (embed,
    classify) or a :class:`~functions.inference.models.CausalLM` (generate), a Hugging Face folder read
    as the plan pinned it (:func:`~functions.inference.hf.model_folder`)."""
    from shardfold.functions.inference import models

    if isinstance(spec.model, HFModel):
        from shardfold.functions.inference import hf

        entry = plan["model"]
        pins = {entry["files"][n]: Pin.from_doc(d) for n, d in entry["pins"].items()}
        folder = access.input_uri(spec.model.hf, store_root, "model.hf")
        path, in_place = hf.model_folder(folder, entry["files"], pins)
        if spec.task == "generate" and uses_vllm(spec, device):
            from shardfold.functions.inference.vllm_engine import VLLMModel

            gen = spec.generation
            length = min(entry.get("max_positions") or 10**9, entry["input_tokens"] + gen.max_tokens)
            # 'auto' is the weights' stored type for both engines (vLLM's own 'auto' is bfloat16 on a CPU)
            dtype = entry["dtype"] if spec.model.dtype == "auto" else spec.model.dtype
            loaded = VLLMModel(path, _PlanFacts(entry), dtype, gen.max_num_seqs, spec.batch_tokens, length)
        else:
            loaded = models.load_hf(spec.task, path, _PlanFacts(entry), device, spec.model.dtype)
            if spec.task != "generate":
                models.set_precision(loaded, spec.precision)
        if in_place:  # read where it lies: still the files the plan pinned, after loading too
            hf.check_unchanged(entry["files"], pins)
        return loaded
    if spec.model == "minilm":
        loaded = models.load_model("minilm", device)
    else:
        uri = access.input_uri(spec.model.torchscript, store_root, "model.torchscript")
        loaded = models.load_model({"torchscript": uri}, device, layout.plan_pin(plan, uri))
    models.set_precision(loaded, spec.precision)
    return loaded


def uses_vllm(spec: InferenceSpec, device: Any = None) -> bool:
    """Whether ``generate`` runs on vLLM: asked for, or ``auto`` where vLLM is installed and a GPU is
    there (on a CPU, vLLM's start-up costs more than it saves on a worker's shards)."""
    from shardfold.functions.inference import vllm_engine

    engine = spec.generation.engine if spec.generation else "transformers"
    if engine != "auto":
        return engine == "vllm"
    if not vllm_engine.available() or (device is not None and str(device).startswith("cpu")):
        return False
    import torch

    return torch.cuda.is_available()


class _PlanFacts:
    """The plan's record of a folder, read as :class:`~functions.inference.hf.ModelFacts` is."""

    def __init__(self, entry: dict[str, Any]):
        self.labels = tuple(entry["labels"])
        self.multi_label = bool(entry["multi_label"])
        self.pooling = entry["pooling"]
        self.normalize = bool(entry["normalize"])
        self.max_positions = entry.get("max_positions")


def compute(
    spec: InferenceSpec, plan: dict[str, Any], model: Any, shard: dict[str, np.ndarray], stats: WorkerStats
) -> dict[str, np.ndarray]:
    """The shard's output arrays (see the module doc)."""
    if spec.task == "generate":
        return generate_rows(spec, plan, model, shard, stats)
    out, stats.budget = embed_rows(
        model, shard["input_ids"], shard["offsets"], stats.budget, stats, shard.get("type_ids")
    )
    return {"scores" if spec.task == "classify" else "embedding": out}


def encode_prompt(model: Any, value: Any) -> list[int]:
    """A row's prompt as token ids: a string as the tokenizer encodes it (its special tokens included), a
    list of chat messages rendered by the folder's chat template, ready for the assistant's answer."""
    tok = model.tokenizer
    if isinstance(value, str):
        return list(tok(value)["input_ids"])
    if not getattr(tok, "chat_template", None):
        raise ValueError("the model folder has no chat template, so chat messages cannot be rendered")
    ids = tok.apply_chat_template(value, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(ids["input_ids"])


def schema_of(fmt: Any) -> dict[str, Any] | None:
    """The JSON schema a ``ResponseFormat`` asks the output to follow; None for plain text."""
    if fmt is None or fmt.type == "text":
        return None
    return fmt.json_schema.schema_ if fmt.type == "json_schema" else {"type": "object"}


def structured(model: Any, schema: dict[str, Any]) -> Any:
    """A fresh llguidance matcher for ``schema`` over ``model``'s tokens; :class:`ValueError` when
    llguidance refuses the schema."""
    import llguidance

    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    matcher = llguidance.LLMatcher(model.guidance_tokenizer(), grammar, log_level=0)
    if matcher.is_error():
        raise ValueError(f"generation.response_format: the schema cannot be followed: {matcher.get_error()}")
    return matcher


def generate_rows(
    spec: InferenceSpec, plan: dict[str, Any], model: Any, shard: dict[str, np.ndarray], stats: WorkerStats
) -> dict[str, np.ndarray]:
    """Every row's ``n`` choices, generated with continuous batching; a row that cannot be generated gets
    its error and the others go on."""
    from shardfold.functions.inference import openai_batch
    from shardfold.functions.inference.generation import Request, Sampling, row_seed

    gen = spec.generation
    assert gen is not None
    rows = len(shard["prompts"])
    params = [json.loads(str(p)) for p in shard["params"]] if "params" in shard else [{}] * rows
    max_in = plan["model"]["input_tokens"]
    errors = [str(e) for e in shard["errors"]]
    prompt_tokens = np.zeros(rows, dtype=np.int32)
    requests = []
    for r, raw in enumerate(shard["prompts"]):
        if errors[r]:
            continue
        try:
            ids = encode_prompt(model, json.loads(str(raw)))
        except Exception as exc:  # noqa: BLE001 - a template or tokenizer failure is this row's error
            errors[r] = f"cannot tokenize the prompt: {type(exc).__name__}: {exc}"
            continue
        prompt_tokens[r] = len(ids)
        try:
            max_tokens, temperature, top_p, stop, seed, n, fmt = openai_batch.sampling(params[r], gen)
        except ValueError as exc:  # an OpenAI Batch request's own option
            errors[r] = str(exc)
            continue
        room = (model.max_positions or len(ids) + max_tokens) - len(ids)
        if len(ids) > max_in or room < 1:
            errors[r] = (
                f"the prompt has {len(ids)} tokens, more than max_input_tokens {max_in}"
                if len(ids) > max_in
                else f"the prompt has {len(ids)} tokens, all of the model's {model.max_positions} positions"
            )
            continue
        sampling = Sampling(min(max_tokens, room), temperature, top_p, stop)
        row = int(shard["row_index"][r])
        schema = schema_of(fmt)
        requests += [Request((r, c), ids, sampling, row_seed(seed, row, c), schema) for c in range(n)]
    engine = model.engine(batch_tokens=max(stats.budget, max_in + 1), max_seqs=gen.max_num_seqs)
    results = engine.run(requests)
    text = np.full((rows, gen.n), "", dtype=object)
    finish = np.full((rows, gen.n), "", dtype=object)
    completion = np.zeros((rows, gen.n), dtype=np.int32)
    for (r, c), done in sorted(results.items()):
        if done.error:
            errors[r] = errors[r] or f"generation failed: {done.error}"
            continue
        text[r, c] = done.text if done.text is not None else model.decode(done.tokens)
        finish[r, c] = done.finish_reason
        completion[r, c] = len(done.tokens)
    s = engine.stats
    stats.batches += s.steps + s.prefills
    stats.real_tokens += s.prefill_tokens + s.decode_tokens
    stats.padded_tokens += s.padded_prefill_tokens + s.decode_tokens
    stats.generated_tokens += sum(len(done.tokens) for done in results.values())
    stats.prompt_tokens += s.prompt_tokens
    stats.prefix_saved_tokens += s.prompt_tokens - s.prefill_tokens
    return {
        "text": text.astype(np.str_),
        "finish_reason": finish.astype(np.str_),
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "error": np.asarray(errors, dtype=np.str_),
    }
