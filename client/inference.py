"""``client.inference``: the user's side of the ``inference`` job kind.

Embed a corpus from the SDK::

    from shardfold.client import Client

    with Client() as client:
        result = client.inference.run(["data/corpus.jsonl"], field="text", id_field="id")
        ids, embeddings = client.inference.load(result)   # embeddings: float32 [rows, 384], input order

Classify or generate with a Hugging Face model folder from the store, and read the output as a table::

        result = client.inference.run(["data/questions.jsonl"], field="messages", task="generate",
                                      model={"hf": "models/smollm2"}, generation={"max_tokens": 64})
        table = client.inference.table(result)   # pyarrow: id, text, finish_reason, ..., error

(``from client import inference`` gives the same functions unbound: ``inference.run(..., client=c)``.)

``run`` builds an ``InferenceSpec`` spec from its arguments, submits it on a :class:`client.Client` (the local
executor unless ``client=`` or ``backend=`` says otherwise), waits for it and returns the job's result
(``output`` is the Parquet URI, ``manifest`` its manifest JSON). ``load`` reads that Parquet back: the id
column and the ``embedding`` list<float32> column as one ``[rows, dim]`` array; ``table`` reads any task's
output as a ``pyarrow.Table``.
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from typing import Any

import numpy as np

from shardfold.functions import store
from shardfold.functions.errors import ShardfoldError, SpecError
from shardfold.functions.inference.spec import InferenceSpec
from shardfold.functions.specs import parse_spec
from shardfold.functions.store.uri import resolve

WAIT_S = 24 * 3600.0


def spec(
    inputs: str | Iterable[str], field: str, model: Any = "minilm", output: str | None = None, **options: Any
):
    """The validated ``InferenceSpec`` for these arguments (``options``: task, id_field, pair_field,
    max_input_tokens, generation, batch_tokens, shard_rows, on_bad_row, max_error_fraction, …)."""
    uris = [inputs] if isinstance(inputs, str) else list(inputs)
    doc: dict[str, Any] = {"kind": "inference", "inputs": uris, "field": field, "model": model, **options}
    if output is not None:
        doc["output"] = output
    job = parse_spec(doc)
    if not isinstance(job, InferenceSpec):  # parse_spec dispatches on kind; kept as a guard
        raise SpecError(f"expected an inference spec, got {type(job).__name__}")
    return job


def run(
    inputs: str | Iterable[str],
    field: str,
    model: Any = "minilm",
    output: str | None = None,
    *,
    client: Any = None,
    backend: str = "local",
    progress: bool = False,
    timeout_s: float | None = WAIT_S,
    **options: Any,
) -> dict[str, Any]:
    """Run an ``inference`` job over ``inputs`` (JSONL / Parquet URIs or store keys) and return its result.

    Raises the job's error (a :class:`functions.errors.ShardfoldError` naming the file and line for bad
    input) when the job fails.
    """
    job_spec = spec(inputs, field, model, output, **options)
    doc = job_spec.model_dump(mode="json", exclude_none=True)
    if client is not None:
        return _run_on(client, doc, progress, timeout_s)
    from shardfold.client import Client

    with Client(backend=backend) as c:
        return _run_on(c, doc, progress, timeout_s)


def _run_on(client: Any, doc: dict[str, Any], progress: bool, timeout_s: float | None) -> dict[str, Any]:
    job = client.submit(doc)
    job.wait(progress=progress, timeout_s=timeout_s)
    return job.result()


class Inference:
    """The ``inference`` helpers bound to one client (``client.inference``), as ``client.fedavg`` and
    ``client.dpquery`` are for theirs."""

    def __init__(self, client: Any):
        self.client = client

    spec = staticmethod(spec)  # the validated InferenceSpec (no client needed)

    def submit(
        self,
        inputs: str | Iterable[str],
        field: str,
        model: Any = "minilm",
        output: str | None = None,
        **options: Any,
    ) -> Any:
        """Start an ``inference`` job on this client and return its :class:`client.Job` at once."""
        job_spec = spec(inputs, field, model, output, **options)
        return self.client.submit(job_spec.model_dump(mode="json", exclude_none=True))

    def run(
        self,
        inputs: str | Iterable[str],
        field: str,
        model: Any = "minilm",
        output: str | None = None,
        *,
        progress: bool = False,
        timeout_s: float | None = WAIT_S,
        **options: Any,
    ) -> dict[str, Any]:
        """Run an ``inference`` job on this client, wait, and return its result (see :func:`run`)."""
        return run(
            inputs,
            field,
            model,
            output,
            client=self.client,
            progress=progress,
            timeout_s=timeout_s,
            **options,
        )

    def load(self, result: dict[str, Any] | str) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, embeddings)`` of a result of this client's store (see :func:`load`)."""
        return load(result, store_root=self.client.store_root)

    def table(self, result: dict[str, Any] | str) -> Any:
        """The output of a result of this client's store as a ``pyarrow.Table`` (see :func:`table`)."""
        return table(result, store_root=self.client.store_root)


def _output_uri(result: dict[str, Any] | str, root: str | None) -> str:
    if isinstance(result, dict):
        if "output" not in result:
            raise ShardfoldError(f"not an inference result (no 'output'): {sorted(result)}")
        uri = result["output"]
    else:
        uri = result
    return resolve(uri, root=root) if root else uri


def table(result: dict[str, Any] | str, *, store_root: str | None = None) -> Any:
    """The output of an inference result (or its output Parquet URI) as a ``pyarrow.Table``: ``id`` and the
    task's columns, rows in input order."""
    import pyarrow.parquet as pq

    return pq.read_table(io.BytesIO(store.get(_output_uri(result, store_root))))


def load(result: dict[str, Any] | str, *, store_root: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, embeddings)`` from an embed result (or its output Parquet URI): ids as a numpy array
    (int64 or str), embeddings float32 ``[rows, dim]``, rows in input order; a row that ended with an error
    (``on_bad_row: error``) is NaN."""
    uri = _output_uri(result, store_root)
    out = table(uri)
    if "id" not in out.column_names or "embedding" not in out.column_names:
        raise ShardfoldError(f"{uri}: expected columns 'id' and 'embedding', found {out.column_names}")
    ids = out.column("id").to_numpy(zero_copy_only=False)
    col = out.column("embedding").combine_chunks()
    n = len(col)
    if n == 0:
        return ids, np.zeros((0, 0), dtype=np.float32)
    values = col.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    if col.null_count:  # a null row's slot still holds its width of values in a fixed-size list
        values = col.values.to_numpy(zero_copy_only=False).astype(np.float32)
    if values.size % n:
        raise ShardfoldError(f"{uri}: embeddings of unequal width")
    emb = values.reshape(n, values.size // n)
    if col.null_count:
        emb[col.is_null().to_numpy(zero_copy_only=False)] = np.nan
    return ids, emb
