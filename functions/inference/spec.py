"""The inference spec: a model run over every row of JSONL / Parquet files, output in input order."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, Field, StrictStr, field_validator, model_validator

from shardfold.functions.specs import InputUri, JobOptions, OutputUri, StrictModel, repeated_uris

INFERENCE_FORMATS = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".parq": "parquet",
    ".pq": "parquet",
}


def inference_input_format(uri: str) -> str | None:
    """``"jsonl"`` or ``"parquet"`` from a URI's extension, or ``None`` when it is neither."""
    path = uri.split("?", 1)[0].lower()
    return next((f for e, f in INFERENCE_FORMATS.items() if path.endswith(e)), None)


class TorchScriptModel(StrictModel):
    """A user's TorchScript or ``torch.export`` file in the store, taking ``(input_ids, attention_mask)``
    (int64 ``[B, T]``) and returning ``[B, D]`` floats."""

    torchscript: InputUri = Field(description="URI of the .pt / .pt2 file")
    input: Literal["token_ids"] = Field(default="token_ids", description="the declared input signature")


class HFModel(StrictModel):
    """A Hugging Face model folder in the store, as ``save_pretrained`` writes it: ``config.json``,
    safetensors weights, ``tokenizer.json`` (and ``tokenizer_config.json``), for chat models the chat
    template, for sentence-transformers models ``modules.json`` and the pooling config. Loaded offline."""

    hf: InputUri = Field(description="URI of the folder")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="weights' type on the worker; 'auto': as the folder's config.json says"
    )


class JsonSchema(StrictModel):
    """OpenAI's ``response_format.json_schema``: the schema the output follows."""

    name: str = Field(default="response", min_length=1, max_length=64)
    schema_: dict[str, Any] = Field(alias="schema", description="a JSON Schema")
    strict: bool = True
    description: str | None = None

    model_config = {**StrictModel.model_config, "validate_by_name": True, "serialize_by_alias": True}


class ResponseFormat(StrictModel):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema goes with type 'json_schema', and only with it")
        return self


class Generation(StrictModel):
    """Decoding options of ``task: generate``, with the OpenAI / vLLM names."""

    max_tokens: int = Field(default=256, ge=1, le=32768, description="tokens generated at most per choice")
    temperature: float = Field(
        default=1.0, ge=0, le=2, description="0: greedy (the most likely token); higher: more random"
    )
    top_p: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="nucleus sampling: the smallest set of tokens whose probability reaches top_p",
    )
    seed: int = Field(
        default=0, ge=0, lt=2**63, description="sampling seed; each row and choice draws from its own stream"
    )
    stop: list[StrictStr] = Field(
        default_factory=list,
        max_length=16,
        description="strings that end a choice (not included in its text)",
    )
    n: int = Field(default=1, ge=1, le=16, description="choices per row (columns become lists when n > 1)")
    max_num_seqs: int = Field(
        default=64, ge=1, le=4096, description="sequences decoded side by side (continuous batching)"
    )
    engine: Literal["auto", "transformers", "vllm"] = Field(
        default="auto",
        description="'auto': vLLM where the worker has it and a GPU, else transformers",
    )
    response_format: ResponseFormat | None = Field(
        default=None, description="structured output: {type: json_object} or {type: json_schema, json_schema}"
    )

    @field_validator("stop")
    @classmethod
    def _non_empty(cls, value: list[str]) -> list[str]:
        if any(not s for s in value):
            raise ValueError("a stop string may not be empty")
        return value


TASKS = ("embed", "classify", "generate")


class InferenceSpec(JobOptions):
    """Run a model over every row of one or more JSONL / Parquet files; output Parquet in input order."""

    kind: Literal["inference"] = "inference"
    inputs: list[InputUri] = Field(
        min_length=1, description="URIs of JSONL or Parquet files (format by extension)"
    )
    task: Literal["embed", "classify", "generate"] = Field(
        default="embed", description="embed (vectors), classify (label and scores) or generate (text)"
    )
    field: str | None = Field(
        default=None,
        min_length=1,
        description="the input column (Parquet) or key (JSONL): text, or for generate a prompt or a list of "
        "chat messages (not with input_format 'openai')",
    )
    input_format: Literal["rows", "openai"] = Field(
        default="rows",
        description="'openai': each JSONL line is an OpenAI Batch request (custom_id, url, body); generate",
    )
    output_format: Literal["parquet", "openai"] = Field(
        default="parquet",
        description="'openai': OpenAI Batch output JSONL (custom_id, response or error), generate only",
    )
    pair_field: str | None = Field(
        default=None, min_length=1, description="classify: the second text of each pair (cross-encoders)"
    )
    id_field: str | None = Field(default=None, description="id column; default: row number across inputs")
    model: Literal["minilm"] | TorchScriptModel | HFModel = Field(
        default="minilm",
        description="'minilm' (all-MiniLM-L6-v2), {torchscript: uri} or {hf: folder uri, dtype}",
    )
    max_input_tokens: int = Field(
        default=256,
        ge=2,
        le=32768,
        validation_alias=AliasChoices("max_input_tokens", "max_tokens"),
        description="input tokens per row, special tokens included: embed and classify truncate to it, "
        "generate gives a longer prompt an error row (alias: max_tokens)",
    )
    generation: Generation | None = Field(default=None, description="decoding options of task generate")
    max_error_fraction: float = Field(
        default=0.1,
        ge=0,
        le=1,
        description="fail the job when more than this fraction of rows end with an error",
    )
    precision: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description="embed and classify on a GPU: 'auto' computes in bfloat16 (float16 where the GPU lacks "
        "it) with TF32 matmuls; 'float32' exactly; on a CPU always float32",
    )
    batch_tokens: int = Field(default=16384, ge=1, description="token budget of one GPU batch")
    shard_rows: int = Field(default=2000, ge=1, le=1_000_000, description="rows per shard")
    gpu_workers: int = Field(
        default=1, ge=1, le=256, description="GPU workers (AWS Batch jobs) claiming shards side by side"
    )
    output: OutputUri | None = Field(
        default=None, description="Parquet URI; default jobs/<id>/output/embeddings.parquet"
    )
    on_bad_row: Literal["fail", "skip", "error"] = Field(
        default="fail",
        description="a bad row (missing field, bad line): 'fail' the job, 'skip' it (reported), or keep it "
        "with its 'error' column set",
    )

    @field_validator("inputs")
    @classmethod
    def _known_formats(cls, value: list[str]) -> list[str]:
        problems = [
            f"inputs.{i}: cannot infer the format of {u!r}; use .jsonl/.ndjson or .parquet/.parq/.pq"
            for i, u in enumerate(value)
            if inference_input_format(u) is None
        ]
        problems += [f"inputs.{i} repeats inputs.{j} ({value[i]})" for i, j in repeated_uris(value)]
        if problems:
            raise ValueError("; ".join(problems))
        return value

    @model_validator(mode="after")
    def _consistent(self) -> InferenceSpec:
        """The fields checked against each other; generate's decoding options default."""
        self._check_rows()
        self._check_task()
        if self.task == "generate" and self.generation is None:
            self.generation = Generation()
        return self

    def _check_rows(self) -> None:
        """Refuse rows the batches cannot hold, and an input or output format at odds with the fields."""
        if self.batch_tokens < self.max_input_tokens:
            raise ValueError(
                f"batch_tokens {self.batch_tokens} < max_input_tokens {self.max_input_tokens}: a full row "
                "would not fit"
            )
        if self.input_format == "rows" and self.field is None:
            raise ValueError("field is required: the column (key) the model reads")
        if self.input_format == "openai":
            if self.field is not None or self.id_field is not None:
                raise ValueError(
                    "input_format 'openai' reads each line's body and custom_id: leave out field and id_field"
                )
            if any(inference_input_format(u) != "jsonl" for u in self.inputs):
                raise ValueError("input_format 'openai' reads JSONL inputs (.jsonl, .ndjson)")
        for name in ("input_format", "output_format"):
            if getattr(self, name) == "openai" and self.task != "generate":
                raise ValueError(f"{name} 'openai' is for task 'generate'")

    def _check_task(self) -> None:
        """Refuse a model, or options (pair_field, precision, generation), the task does not take."""
        if self.task != "embed" and not isinstance(self.model, HFModel):
            raise ValueError(f"task {self.task!r} needs a Hugging Face model folder: model {{hf: uri}}")
        if self.pair_field is not None and self.task != "classify":
            raise ValueError("pair_field is for task 'classify' (cross-encoders)")
        graph = isinstance(self.model, TorchScriptModel)
        if self.precision != "auto" and (self.task == "generate" or graph and self.precision != "float32"):
            raise ValueError(
                f"precision {self.precision!r} is for embed and classify with model 'minilm' or {{hf}}: a "
                "TorchScript or export file computes in the types it was exported with ('float32' only turns "
                "TF32 off), and generate computes in the folder's model.dtype"
            )
        if self.generation is not None and self.task != "generate":
            raise ValueError("generation options are for task 'generate'")

    @property
    def errors_column(self) -> bool:
        """Whether the output has an ``error`` column: always for generate, else with on_bad_row 'error'."""
        return self.task == "generate" or self.on_bad_row == "error"
