"""Every task type's projected peak memory against a measurement, for every built-in kind.

Each measured task runs in a fresh interpreter (``tests/memchild.py``, started by ``bench/benchutil``'s
``Children``): the child imports the task's modules (its handler, its kind, and what the task would import on
first use), reads its resident size — the *runtime baseline*: that process, having done no work — resets the
kernel's peak (``benchutil.PeakRSS``) and calls the handler with the event the workflow would give it; the
measured peak is then read from the task's own telemetry record (:mod:`functions.telemetry`, what ``shardfold
report`` shows), except for the steps a kind keeps private (dpquery's), whose records withhold it. The
projection is what ``shardfold plan`` prints (:func:`functions.estimate.estimate`, from each kind's
``sizing.loads``). For every case::

    measured peak  <=  projected  <=  2 x measured peak + runtime baseline

Left: the plan never lets a task run out of memory; right: it refuses no job that fits with room to spare.
A projection outside is a wrong model, fixed in the kind's ``sizing.py``, never here. Every kind runs on a
small and a larger input in a temporary local store; the tasks that are not measured (the other parts,
shards and groups a later step needs) run in this process. Linux only (``/proc/self/clear_refs``).

``pytest -s tests/test_memory.py`` prints every case as one table when the module ends.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardfold.functions import store, telemetry
from shardfold.functions.estimate import estimate
from shardfold.functions.jobs import new_job_id
from shardfold.functions.specs import dump_spec, parse_spec
from shardfold.functions.store.uri import join

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
import benchutil  # noqa: E402

MiB = 1 << 20
CHILD = Path(__file__).with_name("memchild.py")
CHILD_TIMEOUT_S = 300  # a deadline, not a timing assumption

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc"),
]

# What tasks import on first use, imported before the baseline is read: pyarrow's readers and writers;
# OpenDP's sampler (its prelude loads OpenDP's extras); torch, transformers and the BERT code the MiniLM
# model runs on.
ARROW = ("pyarrow.parquet", "pyarrow.csv")
# What the deployed images lack (no dependency of ours requires it) but a developer's environment may hold
# (`make bench` installs it): pyarrow loads pandas where it can, to convert numpy arrays (+33 MiB), so the
# child measures as if it were not installed.
ABSENT = ("pandas",)
OPENDP = (*ARROW, "opendp.prelude")
TORCH = ("torch", "transformers", "transformers.models.bert.modeling_bert")

ROWS: list[list[str]] = []  # every case, printed as one table when the module ends


@pytest.fixture(scope="module")
def children():
    kids = benchutil.Children(CHILD, env={**os.environ, "POWERTOOLS_LOG_LEVEL": "WARNING"})
    yield kids
    kids.close()
    headers = ["kind", "task", "input", "measured MiB", "projected MiB", "baseline MiB", "ratio"]
    print("\n" + benchutil.table(headers, ROWS, right={3, 4, 5, 6}))


@pytest.fixture
def root(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "home"))
    return store.uri.store_root()


@dataclass
class Job:
    """A job written to a temporary store (its spec at ``jobs/<id>/spec.json``) and its estimate."""

    label: str
    root: str
    job_id: str
    spec: Any
    steps: dict[str, Any]  # step name -> functions.estimate.StepEstimate
    failures: list[str] = field(default_factory=list)

    @classmethod
    def create(cls, root: str, doc: dict[str, Any], label: str) -> Job:
        spec = parse_spec(doc)
        job_id = new_job_id(spec.kind)
        store.put_json(join(root, "jobs", job_id, "spec.json"), dump_spec(spec))
        steps = {s.name: s for s in estimate(spec, root).steps}
        return cls(label=label, root=root, job_id=job_id, spec=spec, steps=steps)

    @property
    def kind(self) -> str:
        return self.spec.kind

    def event(self, **extra: Any) -> dict[str, Any]:
        spec_uri = join(self.root, "jobs", self.job_id, "spec.json")
        return {"job_id": self.job_id, "spec_uri": spec_uri, "store_root": self.root, **extra}

    def measure(
        self, children, step: str, handler: str, event: dict[str, Any], imports: tuple[str, ...] = ()
    ) -> Any:
        """Run ``handler(event)`` in a fresh child; record the case and check it against the projection.
        Returns the handler's result."""
        req = {
            "op": "task",
            "imports": [f"functions.{self.kind}.kind", *imports],
            "absent": ABSENT,
            "handler": handler,
            "event": event,
        }
        run = children.run(req, CHILD_TIMEOUT_S)
        assert run.ok, f"{self.kind} {step} ({self.label}): {run.note}"
        peak, base = run.result["peak_rss"], run.result["baseline_rss"]
        # the measured peak is the one users see: the task's own telemetry record (its handler reset the
        # process's peak as it began, so it is at most the child's), except where a private step
        # withholds it (dpquery), where the child's own reading stands in
        task = event.get("index")
        (record,) = [
            r
            for r in telemetry.read_records(self.root, self.job_id)
            if r["step"] == step and r["task"] == task and r["outcome"] == "succeeded"
        ][-1:]
        if not record.get("withheld"):
            assert record["memory_scope"] == "task" and record["peak_memory_mib"] * MiB <= peak + MiB, record
            peak = int(record["peak_memory_mib"] * MiB)
        projected = self.steps[step].peak_mb * MiB
        ROWS.append(
            [
                self.kind,
                step,
                self.label,
                f"{peak / MiB:.0f}",
                f"{projected / MiB:.0f}",
                f"{base / MiB:.0f}",
                f"{projected / peak:.2f}",
            ]
        )
        if not peak <= projected <= 2 * peak + base:
            self.failures.append(
                f"{self.kind} {step} ({self.label}): measured {peak / MiB:.1f} MiB over a runtime of "
                f"{base / MiB:.1f} MiB, projected {projected / MiB:.1f} MiB ({self.steps[step].why}); "
                f"imported during the task: {run.result['late_imports']}"
            )
        return run.result["result"]

    def check(self) -> None:
        assert not self.failures, "\n".join(self.failures)


# --- getbatch -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("count", "size", "per_part"),
    [(1, 5 * MiB, 2000), (2000, 10 * 1024, 2000), (6000, 1024, 2000)],
    ids=["1x5MiB", "2000x10KiB", "6000x1KiB-3parts"],
)
def test_getbatch(children, root, count, size, per_part):
    rng = np.random.default_rng(0)
    uris = [join(root, "data", f"obj-{i:05d}.bin") for i in range(count)]
    blob = rng.bytes(size)
    for uri in uris:
        store.put(uri, blob)
    label = f"{count:,} x {size / MiB:g} MiB" if size >= MiB else f"{count:,} x {size // 1024} KiB"
    doc = {"kind": "getbatch", "items": [{"uri": u} for u in uris], "items_per_part": per_part}
    job = Job.create(root, doc, label)
    h = "shardfold.functions.getbatch.handlers"
    planned = job.measure(children, "prepare", f"{h}:prepare", job.event())
    parts = store.get_json(planned["worklist"]["uri"])
    assert len(parts) == planned["parts"] == -(-count // per_part)
    for i, part in enumerate(parts):
        job.measure(children, "gather_part", f"{h}:gather", job.event(item=part, index=i))
    result = job.measure(children, "assemble", f"{h}:assemble", job.event(prepare=planned))
    assert result["items"] == count and result["bytes"] == count * size
    job.check()


# --- fedavg -------------------------------------------------------------------------------------------------

FEDAVG_SMALL = {"w": ((256, 512), "float32"), "b": ((512,), "float32"), "steps": ((), "int64")}
FEDAVG_LARGE = {  # ~26 MiB per update, a bfloat16 tensor among float32 ones
    "fc1.weight": ((2048, 3072), "float32"),
    "fc1.bias": ((3072,), "float32"),
    "fc2.weight": ((1024, 1024), "bfloat16"),
    "bn.num_batches_tracked": ((), "int64"),
}


@pytest.mark.parametrize(
    ("model", "clients", "aggregator", "label"),
    [
        (FEDAVG_SMALL, 3, "mean", "3 clients x 0.5 MiB, mean"),
        (FEDAVG_LARGE, 16, "mean", "16 clients x 26 MiB, mean"),
        (FEDAVG_LARGE, 16, "median", "16 clients x 26 MiB, median"),
    ],
    ids=["small-mean", "large-mean", "large-median"],
)
def test_fedavg(children, root, model, clients, aggregator, label):
    import ml_dtypes

    from shardfold.client import Client
    from shardfold.client.demo import fedavg_updates
    from shardfold.functions.fedavg import handlers

    model = {k: (s, ml_dtypes.bfloat16 if d == "bfloat16" else np.dtype(d)) for k, (s, d) in model.items()}
    # two distinct updates; the other clients are hard links of them (the page cache serves them all)
    with Client() as c:
        saved = [
            c.fedavg.save_update(t, f"data/client-{i:03d}.safetensors", num_examples=n)
            for i, (t, n) in enumerate(fedavg_updates(model, 2))
        ]
    uris = list(saved)
    for i in range(2, clients):
        path = store.uri.local_path(saved[0]).with_name(f"client-{i:03d}.safetensors")
        os.link(store.uri.local_path(saved[i % 2]), path)
        uris.append(path.as_uri())
    doc = {"kind": "fedavg", "clients": [{"uri": u} for u in uris], "aggregator": aggregator}
    job = Job.create(root, doc, label)
    h = "shardfold.functions.fedavg.handlers"
    planned = job.measure(children, "prepare", f"{h}:prepare", job.event())
    shards = store.get_json(planned["worklist"]["uri"])
    stats = job.measure(children, "aggregate_shard", f"{h}:aggregate", job.event(item=shards[0], index=0))
    assert stats["reads"] >= clients
    for k, item in enumerate(shards[1:], 1):
        handlers.aggregate(job.event(item=item, index=k))
    result = job.measure(children, "commit", f"{h}:commit", job.event(prepare=planned))
    assert result["clients"] == clients
    job.check()


def test_fedavg_dp(children, root):
    """A DP round's tasks (norms, clip, the noisy aggregate), with a base model: 4 clients x 0.1 MiB (float32
    and bfloat16 tensors, and an integer one taken from the base). OpenDP draws 32,768 samples of noise
    (~0.6 s: the sampler's own speed sets the size)."""
    import ml_dtypes

    from shardfold.client import Client
    from shardfold.client.demo import fedavg_updates

    model = {"w": ((128, 128), np.float32), "e": ((128, 128), "bfloat16"), "steps": ((), np.int64)}
    model = {k: (sh, ml_dtypes.bfloat16 if d == "bfloat16" else np.dtype(d)) for k, (sh, d) in model.items()}
    with Client() as c:
        saved = [
            c.fedavg.save_update(t, f"data/client-{i}.safetensors")
            for i, (t, _) in enumerate(fedavg_updates(model, 5, seed=3))
        ]
    doc = {
        "kind": "fedavg",
        "clients": [{"uri": u} for u in saved[1:]],
        "dp": {"clip_norm": 1.0, "noise_multiplier": 1.0, "dataset_id": "fed", "dataset_budget_rho": 1.0,
               "base": saved[0]},
    }  # fmt: skip
    job = Job.create(root, doc, "4 clients x 0.1 MiB, dp, base")
    h = "shardfold.functions.fedavg.handlers"
    planned = job.measure(children, "prepare", f"{h}:prepare", job.event())
    shards = store.get_json(planned["worklist"]["uri"])
    assert len(shards) == 1
    job.measure(children, "norms_shard", f"{h}:norms", job.event(item=shards[0], index=0))
    job.measure(children, "clip", f"{h}:clip", job.event())
    job.measure(children, "aggregate_shard", f"{h}:aggregate", job.event(item=shards[0], index=0))
    result = job.measure(children, "commit", f"{h}:commit", job.event(prepare=planned))
    assert result["clients"] == 4 and result["privacy"]["rho_spent"] > 0
    job.check()


def test_fedavg_secure(children, root):
    """A secure round's tasks: 3 masked updates of 1.5 MiB (U32), summed mod 2^32 and dequantised."""
    from shardfold.client import Client

    rng = np.random.default_rng(2)
    with Client() as c:
        keys = {f"c{i}": c.fedavg.secure_keys("data/round", f"c{i}") for i in range(3)}
        saved = [
            c.fedavg.mask_update(
                {"w": rng.standard_normal((384, 1024)).astype(np.float32)},
                f"data/round/{cid}.safetensors", round_prefix="data/round", client_id=cid, private_key=key,
                roster=list(keys),
            )
            for cid, key in keys.items()
        ]  # fmt: skip
    job = Job.create(
        root, {"kind": "fedavg", "clients": [{"uri": u} for u in saved], "secure": True}, "3 x 1.5 MiB"
    )
    h = "shardfold.functions.fedavg.handlers"
    planned = job.measure(children, "prepare", f"{h}:prepare", job.event())
    shards = store.get_json(planned["worklist"]["uri"])
    job.measure(children, "aggregate_shard", f"{h}:aggregate", job.event(item=shards[0], index=0))
    result = job.measure(children, "commit", f"{h}:commit", job.event(prepare=planned))
    assert result["clients"] == 3
    job.check()


# --- dpquery ------------------------------------------------------------------------------------------------


def dpquery_small(root: str) -> tuple[dict, str]:
    from test_dpquery_job import make_dataset, spec_doc

    uri, _ = make_dataset(root, rows=4000)
    return spec_doc(uri), "4,000 rows Parquet, 3 marginals"


def dpquery_large(root: str, rows: int = 200_000) -> tuple[dict, str]:
    from shardfold.client.demo import PEOPLE_SCHEMA, people_csv, synthetic_people

    schema = [dict(a) for a in PEOPLE_SCHEMA]
    schema[0] = {"name": "age", "range": [18, 89]}  # 72 ages: 3-way marginals of up to 4,032 cells
    uri = join(root, "data", "people.csv")
    store.put(uri, people_csv(synthetic_people(rows), [a["name"] for a in schema]))
    doc = {
        "kind": "dpquery",
        "dataset": uri,
        "schema": schema,
        "workload": {"all_marginals_up_to": 3},
        "budget": {"rho": 0.5},
        "dataset_id": "people",
        "dataset_budget_rho": 1.0,
    }
    return doc, "200,000 rows CSV, all <=3-way of 6"


def dpquery_general(root: str) -> tuple[dict, str]:
    """General queries (QuerySmasher): every range of 72 ages, prefixes of household size and arcs of the
    hours bins, crossed with the other attributes: 2-way marginals of up to 55,188 answers (every range of
    ages × every arc of the 5 hours bins). Its answers, not its rows, make reconstruct's peak: 20,000 rows
    (the scan's memory is the large case's)."""
    doc, _ = dpquery_large(root, rows=20_000)
    doc["workload"] = {
        "all_marginals_up_to": 2,
        "queries": {"age": "range", "household_size": "prefix", "hours_per_week": "circular_range"},
    }
    return doc, "20,000 rows CSV, all <=2-way of 6, range/prefix/circular queries"


def dpquery_pair(root: str) -> tuple[dict, str]:
    """A 2-way type past the full convex solver's reach: affine queries on 72 ages x 8 household sizes
    (497 dimensions, the low-rank strategy), whose solve holds matrices of its 576 cells squared at plan."""
    doc, _ = dpquery_large(root, rows=20_000)
    doc["workload"] = [
        {"attributes": ["age", "household_size"], "queries": "affine"},
        {"attributes": ["sex", "region"]},
    ]
    return doc, "20,000 rows CSV, affine on 72 x 8 bins"


@pytest.mark.parametrize(
    "make",
    [dpquery_small, dpquery_large, dpquery_general, dpquery_pair],
    ids=["small", "large", "general", "pair"],
)
def test_dpquery(children, root, make):
    from shardfold.functions.dpquery import handlers

    doc, label = make(root)
    job = Job.create(root, doc, label)
    h = "shardfold.functions.dpquery.handlers"
    planned = job.measure(children, "prepare", f"{h}:prepare", job.event(), imports=ARROW)

    groups = store.get_json(planned["measure"]["uri"])
    big = max(range(len(groups)), key=lambda g: groups[g]["samples"])
    event = job.event(item=groups[big], index=big)
    job.measure(children, "measure_group", f"{h}:measure", event, imports=OPENDP)
    for g, item in enumerate(groups):
        if g != big:
            handlers.measure(job.event(item=item, index=g))

    groups = store.get_json(planned["reconstruct"]["uri"])
    big = max(range(len(groups)), key=lambda g: groups[g]["cells"])
    event = job.event(item=groups[big], index=big)
    job.measure(children, "reconstruct_group", f"{h}:reconstruct", event, imports=ARROW)
    for g, item in enumerate(groups):
        if g != big:
            handlers.reconstruct(job.event(item=item, index=g))

    result = job.measure(children, "finalize", f"{h}:finalize", job.event())
    assert result["marginals"] == planned["marginals"]
    job.check()


# --- inference ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rows", "shard_rows", "words", "label"),
    [(40, 40, (5, 30), "40 short rows, 1 shard"), (32, 16, (150, 250), "32 rows of 256 tokens, 2 shards")],
    ids=["small", "large"],
)
def test_inference(children, root, rows, shard_rows, words, label):
    from shardfold.client.demo import inference_corpus
    from shardfold.functions.inference import handlers

    corpus = inference_corpus(rows, seed=1, min_words=words[0], max_words=words[1])
    uri = join(root, "data", "corpus.jsonl")
    store.put(uri, "".join(json.dumps(r) + "\n" for r in corpus).encode())
    doc = {
        "kind": "inference",
        "inputs": [uri],
        "field": "text",
        "id_field": "id",
        "model": "minilm",
        "shard_rows": shard_rows,
    }
    job = Job.create(root, doc, label)
    h = "shardfold.functions.inference.handlers"
    planned = job.measure(children, "prepare", f"{h}:prepare", job.event())
    shards = store.get_json(planned["worklist"]["uri"])
    event = job.event(item=shards[0], index=0)
    job.measure(children, "preprocess_shard", f"{h}:preprocess", event, imports=("tokenizers",))
    for k, item in enumerate(shards[1:], 1):
        handlers.preprocess(job.event(item=item, index=k))
    handlers.cpu_done(job.event())
    # the GPU worker (the BatchJob step "infer"), on this machine's device: the CPU without a GPU
    summary = job.measure(
        children, "infer", "shardfold.functions.inference.worker:handler", job.event(), imports=TORCH
    )
    assert summary["rows"] == rows and summary["shards"] == len(shards)
    result = job.measure(children, "commit", f"{h}:commit", job.event(), imports=ARROW)
    assert result["rows"] == rows
    job.check()


def test_inference_generate(children, root):
    """The generating worker with SmolLM2-135M (538 MB of float32 weights): the weights twice over while
    they load, then every running sequence's keys and values at their longest."""
    from hf_models import smollm2

    from shardfold.functions.inference import handlers

    questions = ["What is 2+2?", "Name three colours.", "Write a haiku about the sea.", "Is fire hot?"] * 2
    rows = [{"id": i, "messages": [{"role": "user", "content": q}]} for i, q in enumerate(questions)]
    uri = join(root, "data", "questions.jsonl")
    store.put(uri, "".join(json.dumps(r) + "\n" for r in rows).encode())
    doc = {
        "kind": "inference",
        "task": "generate",
        "inputs": [uri],
        "field": "messages",
        "id_field": "id",
        "model": {"hf": "file://" + str(smollm2())},
        "max_input_tokens": 64,
        "generation": {"max_tokens": 24, "temperature": 0, "max_num_seqs": 4},
    }
    job = Job.create(root, doc, "8 chat rows, SmolLM2-135M")
    h = "shardfold.functions.inference.handlers"
    planned = job.measure(children, "prepare", f"{h}:prepare", job.event())
    for k, item in enumerate(store.get_json(planned["worklist"]["uri"])):
        handlers.preprocess(job.event(item=item, index=k))
    handlers.cpu_done(job.event())
    summary = job.measure(
        children, "infer", "shardfold.functions.inference.worker:handler", job.event(), imports=TORCH
    )
    assert summary["rows"] == 8
    job.check()


@pytest.mark.early  # tens of seconds: started last, it was the suite's tail (tests/conftest.py)
def test_inference_a_million_rows(children, root):
    """A million short rows through every step: prepare keeps each shard's byte range, not an index of
    every line; the worker holds a bounded number of shards; commit streams the merged Parquet (1.5 GB of
    384-wide vectors) to the store one shard at a time; each within its projection whatever the row
    count. The model is a user's TorchScript file, a random 384-wide embedding table mean-pooled (MiniLM
    would take this CPU an hour over a million rows; the worker's memory with MiniLM is measured above)."""
    import io

    import torch

    from shardfold.functions.inference import handlers

    class Table(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.emb = torch.nn.Embedding(30522, 384)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            m = attention_mask.unsqueeze(-1).float()
            return (self.emb(input_ids) * m).sum(1) / m.sum(1).clamp(min=1.0)

    rows, dim = 1_000_000, 384
    model = join(root, "data", "table.pt")
    buf = io.BytesIO()
    torch.jit.save(torch.jit.script(Table()), buf)
    store.put(model, buf.getvalue())
    uri = join(root, "data", "million.jsonl")
    with store.writer(uri) as f:
        for start in range(0, rows, 100_000):
            f.write(
                "".join(
                    f'{{"id": {i}, "text": "row {i} of many"}}\n' for i in range(start, start + 100_000)
                ).encode()
            )
    doc = {
        "kind": "inference",
        "inputs": [uri],
        "field": "text",
        "id_field": "id",
        "model": {"torchscript": model},
        "shard_rows": 20_000,
    }
    job = Job.create(root, doc, "1,000,000 short rows")
    h = "shardfold.functions.inference.handlers"
    planned = job.measure(children, "prepare", f"{h}:prepare", job.event())
    shards = store.get_json(planned["worklist"]["uri"])
    assert planned["rows"] == rows and len(shards) == 50
    job.measure(
        children,
        "preprocess_shard",
        f"{h}:preprocess",
        job.event(item=shards[0], index=0),
        imports=("tokenizers",),
    )
    for k, item in enumerate(shards[1:], 1):
        handlers.preprocess(job.event(item=item, index=k))
    handlers.cpu_done(job.event())
    summary = job.measure(
        children, "infer", "shardfold.functions.inference.worker:handler", job.event(), imports=TORCH
    )
    assert summary["rows"] == rows and summary["shards"] == 50
    result = job.measure(children, "commit", f"{h}:commit", job.event(), imports=ARROW)
    assert (result["rows"], result["dim"]) == (rows, dim)
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(store.uri.local_path(result["output"])).metadata
    assert meta.num_rows == rows and meta.num_row_groups == 50
    job.check()
