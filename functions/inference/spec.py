"""The inference spec: a model run over every row of JSONL / Parquet files, output in input order."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

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


class InferenceJob(JobOptions):
    """Run a model over every row of one or more JSONL / Parquet files; output Parquet in input order."""

    kind: Literal["inference"] = "inference"
    inputs: list[InputUri] = Field(
        min_length=1, description="URIs of JSONL or Parquet files (format by extension)"
    )
    field: str = Field(min_length=1, description="the text column (Parquet) or key (JSONL)")
    id_field: str | None = Field(default=None, description="id column; default: row number across inputs")
    model: Literal["minilm"] | TorchScriptModel = Field(
        default="minilm", description="'minilm' (all-MiniLM-L6-v2) or {torchscript: uri, input: token_ids}"
    )
    max_tokens: int = Field(default=256, ge=2, le=8192, description="truncation, special tokens included")
    batch_tokens: int = Field(default=16384, ge=1, description="token budget of one GPU batch")
    shard_rows: int = Field(default=2000, ge=1, le=1_000_000, description="rows per shard")
    gpu_workers: int = Field(
        default=1, ge=1, le=256, description="GPU workers (AWS Batch jobs) claiming shards side by side"
    )
    output: OutputUri | None = Field(
        default=None, description="Parquet URI; default jobs/<id>/output/embeddings.parquet"
    )
    on_bad_row: Literal["fail", "skip"] = Field(
        default="fail", description="'skip' drops bad rows (missing field, bad line) and reports them"
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
    def _budget_fits_a_row(self) -> InferenceJob:
        if self.batch_tokens < self.max_tokens:
            raise ValueError(
                f"batch_tokens {self.batch_tokens} < max_tokens {self.max_tokens}: a full row would not fit"
            )
        return self
