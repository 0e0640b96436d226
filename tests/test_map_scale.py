"""Every job kind with a Map of 10,000 children on the moto backend (issue 12, item 2): the compiled ASL on
moto's Step Functions interpreter with the real handlers, each job's result checked, and each Map's gathered
result (every child's output, which AWS holds to 256 KiB even under ``ResultPath: null``) read back from the
harness (:func:`shardfold.dryrun.gathered_results`) and checked to stay small.

Inputs are tiny and shaped only to fan out: getbatch one item per part; fedavg a 160 KB model cut into
10,000 shards (the 5 MiB shard floor lowered, as the fedavg core tests do: it only matters for S3's
multipart assembly); dpquery 141 binary attributes whose 0-, 1- and 2-way marginals are 10,012 residual
sets and 10,012 marginals, one per measure and reconstruct task; inference one-row shards.

**Opt-in** (``SHARDFOLD_SCALE_TESTS=1``, or ``make test-scale``): each test takes minutes on a 2-core machine,
too long for ``make test`` (measured, before per-task telemetry added its records: getbatch 19 min, fedavg 13
min, dpquery 25 min, inference 36 min). What costs is not the interpreter (the harness runs 10,000 no-op
children in about 30 s) but the handlers' own S3 requests, each a real HTTP round trip through botocore and
moto's server (~8-10 ms of CPU): a child makes several (getbatch: 9 per item in all)."""

from __future__ import annotations

import functools
import io
import json
import os
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardfold import dryrun
from shardfold.client import Client, inference
from shardfold.client.demo import fedavg_reference, fedavg_updates, inference_corpus
from shardfold.functions import kinds, store
from shardfold.functions.store.uri import join

OPT_IN = pytest.mark.skipif(
    os.environ.get("SHARDFOLD_SCALE_TESTS") != "1",
    reason="jobs of 10,000 Map children take 13-36 min each on moto: set SHARDFOLD_SCALE_TESTS=1",
)
pytestmark = [pytest.mark.slow, OPT_IN]  # one line: conftest's test-fast skips importing a slow module

CHILDREN = 10_000
WAIT_S = 3600  # a deadline, not a timing assumption
LIMIT = 256 * 1024  # Step Functions' payload limit, which a Map's gathered result must fit


@pytest.fixture
def moto_client(tmp_path, monkeypatch):
    """A moto stack of its own per test: moto lists a prefix by scanning every key of the bucket, so one
    job's 10,000 leftovers would slow the next one's listings."""
    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "moto-home"))
    with Client(backend="moto") as c:
        yield c


def succeeded(job):
    status = job.wait(progress=False, timeout_s=WAIT_S)
    assert status.state == "SUCCEEDED", status.error
    return status


def assert_gathered_small(status, maps: dict[str, int]) -> None:
    """Each Map in ``maps`` (state name -> children) gathered exactly that many outputs of ``{}``."""
    gathered = dryrun.gathered_results(status.execution_arn)
    for name, children in maps.items():
        assert gathered[name] == {"children": children, "bytes": len(json.dumps([{}] * children))}, name
        assert gathered[name]["bytes"] < LIMIT
    workflow = kinds.find(status.kind).workflow  # status shows a Map of one task under that task's name
    shown = {workflow.shown_name(name): n for name, n in maps.items()}
    assert status.steps and all(status.steps[name]["done"] == n for name, n in shown.items()), status.steps


def test_getbatch_with_10000_parts(moto_client):
    root = moto_client.store_root
    objects = [bytes([65 + i]) * (i + 1) for i in range(10)]
    for i, body in enumerate(objects):
        store.put(join(root, "scale", "data", f"o{i}"), body)
    manifest = join(root, "scale", "items.jsonl")  # the item list stays out of the spec every task reads
    store.put(manifest, b"".join(b'"scale/data/o%d"\n' % (i % 10) for i in range(CHILDREN)))

    job = moto_client.submit({"kind": "getbatch", "manifest": manifest, "items_per_part": 1})
    status = succeeded(job)
    result = job.result()
    assert (result["items"], result["parts"], result["errors"]) == (CHILDREN, CHILDREN, 0)
    assert result["bytes"] == sum(len(objects[i % 10]) for i in range(CHILDREN))
    with tarfile.open(fileobj=io.BytesIO(store.get(result["archive"]))) as tf:
        members = [tf.extractfile(m).read() for m in tf.getmembers()]
    assert members == [objects[i % 10] for i in range(CHILDREN)]  # every item, in request order
    assert_gathered_small(status, {"gather": CHILDREN})


def test_fedavg_with_10000_shards(moto_client, monkeypatch):
    from shardfold.functions.fedavg import core
    from shardfold.functions.fedavg.shardplan import Budget

    # moto runs the prepare handler in this process: lower its 5 MiB shard floor to cut a tiny model
    monkeypatch.setattr(core, "prepare", functools.partial(core.prepare, budget=Budget(min_shard_bytes=1)))
    updates = fedavg_updates({"w": ((40_000,), np.float32), "steps": ((), np.int64)}, 2, seed=12)
    keys = [f"scale/fedavg/client-{i}.safetensors" for i in range(len(updates))]
    for key, (tensors, n) in zip(keys, updates, strict=True):
        moto_client.fedavg.save_update(tensors, key, num_examples=n)

    job = moto_client.submit(moto_client.fedavg.spec(keys, shards=CHILDREN))
    status = succeeded(job)
    result = job.result()
    assert result["shards"] == CHILDREN
    want = fedavg_reference([t for t, _ in updates], [float(n) for _, n in updates])
    got = moto_client.fedavg.load(result["output"])
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].tobytes() == want[name].tobytes(), name
    assert_gathered_small(status, {"aggregate": CHILDREN})


DP_ATTRIBUTES = 141  # 1 + 141 + C(141, 2) = 10,012 marginals of up to 2 attributes, and as many residual sets
DP_SETS = 1 + DP_ATTRIBUTES + DP_ATTRIBUTES * (DP_ATTRIBUTES - 1) // 2


def test_dpquery_with_10012_measure_and_reconstruct_tasks(moto_client, monkeypatch):
    from shardfold.functions.dpquery import core

    assert DP_SETS >= CHILDREN
    monkeypatch.setattr(core, "measure", functools.partial(core.measure, noise=False))  # exact counts
    rows = 24
    data = np.random.default_rng(7).integers(0, 2, size=(rows, DP_ATTRIBUTES))
    names = [f"a{j:03d}" for j in range(DP_ATTRIBUTES)]
    buf = io.BytesIO()
    pq.write_table(pa.table({n: data[:, j] for j, n in enumerate(names)}), buf)
    dataset = join(moto_client.store_root, "scale", "dp.parquet")
    store.put(dataset, buf.getvalue())
    spec = {
        "kind": "dpquery",
        "dataset": dataset,
        "schema": [{"name": n, "categories": [0, 1]} for n in names],
        "workload": {"all_marginals_up_to": 2},
        "budget": {"rho": 1.0},
        "dataset_id": "scale-dp",
        "dataset_budget_rho": 1.0,
        "noise_samples_per_task": 1,
        "cells_per_task": 1,
    }
    job = moto_client.submit(spec)
    status = succeeded(job)
    result = job.result()
    assert "tables" not in result  # too many to list inline: the index lists them
    tables = store.get_json(result["tables_index"])
    assert result["report"]["residual_sets"] == DP_SETS and len(tables) == DP_SETS
    # exact with the noise seam: spot-check the total, a 1-way and some 2-way tables against numpy
    by_attrs = {tuple(t["attributes"]): t for t in tables}
    assert by_attrs[()]["cells"] == 1
    for attrs in [("a000",), ("a000", "a001"), ("a070", "a140"), ("a139", "a140")]:
        table = pq.read_table(io.BytesIO(store.get(by_attrs[attrs]["parquet"]))).to_pydict()
        cols = [names.index(a) for a in attrs]
        for i in range(len(table["estimate"])):
            match = np.all([data[:, c] == table[a][i] for c, a in zip(cols, attrs, strict=True)], axis=0)
            assert table["estimate"][i] == pytest.approx(match.sum(), abs=1e-6), (attrs, i)
    assert_gathered_small(status, {"measure": DP_SETS, "reconstruct": DP_SETS})


def test_inference_with_10000_shards(moto_client, monkeypatch):
    monkeypatch.setenv("SHARDFOLD_INFERENCE_POLL_S", "0.05")
    texts = [r["text"] for r in inference_corpus(10, seed=4, max_words=8)]
    rows = [{"id": f"r{i:05d}", "text": texts[i % 10]} for i in range(CHILDREN)]
    key = "scale/corpus.jsonl"
    store.put(moto_client.uri(key), "".join(json.dumps(r) + "\n" for r in rows).encode())

    job = moto_client.submit(
        inference.spec(moto_client.uri(key), field="text", id_field="id", shard_rows=1, gpu_workers=1)
    )
    status = succeeded(job)
    result = job.result()
    assert (result["rows"], result["shards"]) == (CHILDREN, CHILDREN)
    ids, emb = inference.load(result)
    assert [str(i) for i in ids] == [r["id"] for r in rows]  # in input order
    assert emb.shape == (CHILDREN, 384)
    # the same text gives the same embedding, whichever shard and batch it ran in
    for i in range(10):
        assert np.allclose(emb[i::10], emb[i], atol=1e-5), i
    assert_gathered_small(status, {"preprocess": CHILDREN, "infer_workers": 1})
