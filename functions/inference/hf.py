"""Hugging Face model folders in the store: what the plan reads of them, and loading them on a worker.

A folder is what ``save_pretrained`` writes: ``config.json``, safetensors weights (one file, or shards and
their index), ``tokenizer.json`` (a fast tokenizer: the CPU stage tokenizes with the ``tokenizers``
library, no torch) and ``tokenizer_config.json``, for chat models ``chat_template.jinja`` (or the template
inside ``tokenizer_config.json``), for sentence-transformers models ``modules.json`` and the pooling
config. Pickled weights (``pytorch_model.bin``) are refused: loading a pickle runs code.

The first part reads only JSON and sizes (the plan and the CPU stage, on Lambda, without torch); the second
(``load_*``) imports torch and transformers on the worker, from a local copy of the pinned files, offline.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardfold.functions import jsontext, store
from shardfold.functions.errors import BadInputError, InputChanged, ModelLoadError, SpecError
from shardfold.functions.store.pinning import Pin
from shardfold.functions.store.retry import TransientError

MAX_FILES = 1000  # a model folder's files (a large sharded model has a few hundred at most)
MAX_JSON_BYTES = 64 * 1024 * 1024  # tokenizer.json of a large vocabulary is tens of MB
COPY_CHUNK = 64 * 1024 * 1024  # a local copy is written in ranged reads of this size
COPIES_KEPT = 2  # model copies a host keeps (each may be gigabytes)
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int8": 1, "uint8": 1}
POOLING_MODES = ("cls_token", "mean_tokens", "max_tokens", "lasttoken")
ST_MODULES = {"Transformer", "Pooling", "Normalize"}
FIELD = "model.hf"


# ---------------------------------------------------------------------------------------------- folder


@dataclass(frozen=True)
class Folder:
    """A model folder's files: relative name → full URI."""

    uri: str
    files: dict[str, str]

    def file(self, name: str) -> str | None:
        return self.files.get(name)


def list_folder(uri: str) -> Folder:
    """The folder's files, checked for what every task needs; :class:`SpecError` naming ``model.hf``."""
    prefix = uri.rstrip("/") + "/"
    try:
        found = store.list_uris(prefix)
    except (TransientError, OSError):
        raise
    except Exception as exc:
        raise SpecError(f"{FIELD} {uri}: cannot list it ({exc})") from exc
    files = {u[len(prefix) :]: u for u in found if u.startswith(prefix)}
    if not files:
        raise SpecError(f"{FIELD} {uri}: no such folder (nothing under it)")
    if len(files) > MAX_FILES:
        raise SpecError(f"{FIELD} {uri}: {len(files)} files, more than a model folder holds ({MAX_FILES})")
    missing = [n for n in ("config.json", "tokenizer.json") if n not in files]
    if not any(n.endswith(".safetensors") for n in files):
        pickled = [n for n in files if n.endswith((".bin", ".pt", ".pth", ".ckpt"))]
        why = (
            f" ({', '.join(sorted(pickled)[:3])} are pickles, which run code when loaded)" if pickled else ""
        )
        missing.append(f"safetensors weights{why}")
    if missing:
        raise SpecError(
            f"{FIELD} {uri}: the folder has no {', no '.join(missing)}; save the model and its fast "
            "tokenizer with save_pretrained (safe_serialization, the default)"
        )
    return Folder(uri.rstrip("/"), files)


def read_json(folder: Folder, name: str, pin: Pin | None = None) -> Any:
    """A JSON file of the folder (None when absent), parsed as untrusted text."""
    uri = folder.file(name)
    if uri is None:
        return None
    try:
        data = store.get(uri, pin=pin)
        if len(data) > MAX_JSON_BYTES:
            raise ValueError(f"{len(data):,} bytes, more than {MAX_JSON_BYTES:,}")
        return jsontext.loads(data)
    except (InputChanged, TransientError, OSError):
        raise
    except Exception as exc:
        raise SpecError(f"{FIELD} {folder.uri}: {name} is not readable JSON ({exc})") from exc


def read_text(folder: Folder, name: str, pin: Pin | None = None) -> str | None:
    uri = folder.file(name)
    return None if uri is None else store.get(uri, pin=pin).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class ModelFacts:
    """What the plan and the worker need of a folder, read from ``config.json`` and the files' sizes."""

    architectures: tuple[str, ...]
    model_type: str
    dtype: str  # the weights' type as stored
    weight_bytes: int
    layers: int
    kv_dim: int  # key (= value) width per token and layer: kv heads × head dim
    hidden: int
    max_positions: int | None
    labels: tuple[str, ...]  # id2label in id order (classifiers)
    multi_label: bool
    type_ids: bool = False  # the model has segment (token type) embeddings: a pair's second text is type 1
    pooling: str | None = None  # a sentence-transformers folder's pooling mode
    normalize: bool = False
    max_seq_length: int | None = None  # sentence-transformers' truncation
    chat_template: bool = False
    notes: list[str] = field(default_factory=list)

    def bytes_as(self, dtype: str) -> int:
        """The weights' bytes once loaded as ``dtype`` (``auto``: as stored)."""
        stored = DTYPE_BYTES.get(self.dtype, 4)
        target = stored if dtype == "auto" else DTYPE_BYTES[dtype]
        return self.weight_bytes * target // stored


def facts(folder: Folder, config: dict[str, Any], sizes: dict[str, int | None], pins=None) -> ModelFacts:
    """The folder's :class:`ModelFacts` (``sizes``: bytes of each file URI)."""
    if not isinstance(config, dict):
        raise SpecError(f"{FIELD} {folder.uri}: config.json is not a JSON object")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    heads = _int(text.get("num_attention_heads"), 1)
    hidden = _int(text.get("hidden_size") or text.get("d_model"), 0)
    head_dim = _int(text.get("head_dim"), hidden // heads if heads else 0)
    labels = _labels(folder, config)
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    pooling, normalize, max_seq = _sentence_transformers(folder, pins or {})
    archs = config.get("architectures") or []
    return ModelFacts(
        architectures=tuple(str(a) for a in archs) if isinstance(archs, list) else (),
        model_type=str(config.get("model_type") or "?"),
        dtype=dtype if dtype in DTYPE_BYTES else "float32",
        weight_bytes=sum(sizes.get(u) or 0 for n, u in folder.files.items() if n.endswith(".safetensors")),
        layers=_int(text.get("num_hidden_layers"), 0),
        kv_dim=_int(text.get("num_key_value_heads"), heads) * head_dim,
        hidden=hidden,
        max_positions=_int(text.get("max_position_embeddings"), 0) or None,
        labels=labels,
        multi_label=config.get("problem_type") == "multi_label_classification",
        type_ids=_int(text.get("type_vocab_size"), 0) > 1,
        pooling=pooling,
        normalize=normalize,
        max_seq_length=max_seq,
        chat_template=_has_chat_template(folder, pins or {}),
    )


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else default


def _labels(folder: Folder, config: dict[str, Any]) -> tuple[str, ...]:
    """A classifier's labels, ``id2label`` in id order; none for another model."""
    id2label = config.get("id2label") if isinstance(config.get("id2label"), dict) else {}
    try:
        return tuple(str(id2label[k]) for k in sorted(id2label, key=int))
    except (TypeError, ValueError):
        raise SpecError(f"{FIELD} {folder.uri}: config.json id2label has keys that are not numbers") from None


def _pinned_json(folder: Folder, name: str, pins: dict[str, Pin]) -> Any:
    """:func:`read_json` of the folder's file ``name`` under its pin in ``pins`` (file URI → pin)."""
    return read_json(folder, name, pins.get(folder.file(name)))


def _has_chat_template(folder: Folder, pins: dict[str, Pin]) -> bool:
    """Whether the folder has a chat template: ``chat_template.jinja``, or one in its tokenizer config."""
    tok_config = _pinned_json(folder, "tokenizer_config.json", pins)  # read (and checked) either way
    return "chat_template.jinja" in folder.files or bool(
        isinstance(tok_config, dict) and tok_config.get("chat_template")
    )


def _sentence_transformers(folder: Folder, pins: dict[str, Pin]) -> tuple[str | None, bool, int | None]:
    """(pooling mode, normalize, max_seq_length) from a sentence-transformers folder's ``modules.json``;
    (None, False, None) without one. A module this worker does not run (Dense, …) is refused."""
    modules = _pinned_json(folder, "modules.json", pins)
    if modules is None:
        return None, False, None
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise SpecError(f"{FIELD} {folder.uri}: modules.json is not a list of modules")
    pooling, normalize = None, False
    for m in modules:
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        if kind not in ST_MODULES:
            raise SpecError(
                f"{FIELD} {folder.uri}: modules.json has a {kind or '?'} module; the embed task runs "
                f"{', '.join(sorted(ST_MODULES))} modules only"
            )
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            pooling = _pooling_mode(folder, m, pins)
    st_config = _pinned_json(folder, "sentence_bert_config.json", pins)
    max_seq = (_int(st_config.get("max_seq_length"), 0) or None) if isinstance(st_config, dict) else None
    return pooling, normalize, max_seq


def _pooling_mode(folder: Folder, module: dict[str, Any], pins: dict[str, Pin]) -> str:
    """The one pooling mode a Pooling module's ``config.json`` asks for."""
    path = str(module.get("path") or "").strip("/")
    name = f"{path}/config.json" if path else "config.json"
    cfg = _pinned_json(folder, name, pins) or {}
    modes = [mode for mode in POOLING_MODES if cfg.get(f"pooling_mode_{mode}")]
    if len(modes) != 1:
        raise SpecError(
            f"{FIELD} {folder.uri}: {name} asks for pooling {modes or 'none'}; one of "
            f"{', '.join(POOLING_MODES)} is supported"
        )
    return modes[0]


def check_task(task: str, f: ModelFacts, uri: str) -> None:
    """Refuse a task the folder's model cannot do, naming ``task`` and the architecture."""
    archs = ", ".join(f.architectures) or f.model_type
    if task == "generate" and not any(
        a.endswith(("ForCausalLM", "ForConditionalGeneration")) for a in f.architectures
    ):
        raise SpecError(
            f"task generate: {FIELD} {uri} is a {archs}, not a causal language model (…ForCausalLM)"
        )
    if task == "classify" and not f.labels:
        raise SpecError(
            f"task classify: {FIELD} {uri} ({archs}) has no labels (config.json id2label); is it a "
            "…ForSequenceClassification model?"
        )


def input_tokens(spec_max: int, f: ModelFacts, task: str) -> int:
    """Input tokens per row: the spec's, within the model's positions and, for a sentence-transformers
    embedder, its ``max_seq_length`` (what sentence-transformers truncates to)."""
    limit = spec_max
    if f.max_positions:
        limit = min(limit, f.max_positions)
    if task == "embed" and f.max_seq_length:
        limit = min(limit, f.max_seq_length)
    return limit


@functools.lru_cache(maxsize=8)
def tokenizer_from_text(text: str, max_tokens: int):
    """A ``tokenizers.Tokenizer`` from a tokenizer.json's text, truncating to ``max_tokens``, unpadded."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(text)
    tok.no_padding()
    tok.enable_truncation(max_length=max_tokens)
    return tok


def load_tokenizer(uri: str, pin: Pin | None, max_tokens: int):
    """The folder's ``tokenizer.json`` (a ``tokenizers.Tokenizer``), truncating to ``max_tokens`` (pairs:
    the longest first, as transformers does), without padding."""
    try:
        text = store.get(uri, pin=pin).decode("utf-8")
        return tokenizer_from_text(text, max_tokens)
    except (InputChanged, TransientError, OSError):
        raise
    except Exception as exc:
        raise BadInputError(
            f"{FIELD}: {uri} is not a tokenizer the tokenizers library reads ({exc})"
        ) from exc


# ---------------------------------------------------------------------------------------------- worker


def model_folder(folder_uri: str, files: dict[str, str], pins: dict[str, Pin]) -> tuple[Path, bool]:
    """Where a worker loads the folder from. A ``file://`` folder is loaded in place (each file checked
    against its pin here, and again by :func:`check_unchanged` once loaded). Any other is copied, as
    pinned, in ranged reads, to this host's model cache under a name made of the files' pins, so later
    jobs of the same model reuse it; the least recently used copies beyond :data:`COPIES_KEPT` go.
    Returns ``(path, in_place)``."""
    if all(u.startswith("file://") for u in [folder_uri, *files.values()]):
        check_unchanged(files, pins)
        return Path(folder_uri[len("file://") :]), True
    identity = json.dumps(sorted((n, pins[u].fingerprint()) for n, u in files.items()))
    cache = Path(tempfile.gettempdir()) / "shardfold-models"
    dest = cache / hashlib.sha256(identity.encode()).hexdigest()[:20]
    if not dest.is_dir():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".part-", dir=cache))
        try:
            for name, uri in files.items():
                if ".." in Path(name).parts or name.startswith("/"):
                    raise ModelLoadError(f"{FIELD}: file name {name!r} escapes the folder", uri=uri)
                target = tmp / name
                target.parent.mkdir(parents=True, exist_ok=True)
                with open(target, "wb") as fh:
                    for start in range(0, pins[uri].size, COPY_CHUNK):
                        fh.write(store.get(uri, start, min(COPY_CHUNK, pins[uri].size - start), pins[uri]))
            os.rename(tmp, dest)  # whole, or not at all; a worker beside us may have won the race
        except OSError:
            if not dest.is_dir():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    os.utime(dest)  # most recently used
    copies = sorted(
        (p for p in cache.iterdir() if p.is_dir() and ".part-" not in p.name), key=os.path.getmtime
    )
    for old in copies[:-COPIES_KEPT]:
        if old != dest:
            shutil.rmtree(old, ignore_errors=True)
    return dest, False


def check_unchanged(files: dict[str, str], pins: dict[str, Pin]) -> None:
    """:class:`InputChanged` when a file of a folder read in place is no longer the one the plan pinned."""
    for uri in files.values():
        store.verify(uri, pins[uri])


def torch_dtype(name: str) -> Any:
    import torch

    return "auto" if name == "auto" else getattr(torch, name)


def _auto(cls_name: str) -> Any:
    from shardfold.functions.inference.models import import_transformers

    import_transformers()
    import transformers

    return getattr(transformers, cls_name)


def load_backbone(path: Path, device: Any, dtype: str, cls_name: str = "AutoModel") -> Any:
    try:
        model = _auto(cls_name).from_pretrained(str(path), local_files_only=True, dtype=torch_dtype(dtype))
    except Exception as exc:
        raise ModelLoadError(f"{FIELD}: cannot load the model ({type(exc).__name__}: {exc})") from exc
    return model.to(device).eval()


def pool(hidden: Any, mask: Any, mode: str) -> Any:
    """Sentence-transformers' pooling of ``hidden`` [B, T, H] under the attention ``mask`` [B, T]."""
    import torch

    m = mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "cls_token":
        return hidden[:, 0]
    if mode == "max_tokens":
        return hidden.masked_fill(m == 0, torch.finfo(hidden.dtype).min).max(dim=1).values
    if mode == "lasttoken":
        last = mask.sum(dim=1) - 1  # right-padded rows: the last real token
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    return (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)
