"""``shardfold demo``: every job kind end to end on generated data, with its output verified.

Library code: it returns :class:`DemoResult` rows and never prints; the CLI draws the table.
"""

from __future__ import annotations

import io
import json
import math
import random
import tarfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from shardfold.functions import extras, store
from shardfold.functions.dpquery.spec import marginal_name
from shardfold.functions.errors import ShardfoldError

DEMO_PREFIX = "demo"


@dataclass
class DemoResult:
    kind: str
    job_id: str
    state: str
    items: int
    parts: int
    bytes: int
    errors: int
    seconds: float
    verified: bool
    checks: list[str] = field(default_factory=list)
    items_label: str = "items"  # what ``items`` counts (clients for fedavg)
    parts_label: str = "parts"  # what ``parts`` counts (shards for fedavg)


class DemoFailed(ShardfoldError):
    """The demo's job ran but its output did not match what was generated."""


class _Ran(NamedTuple):
    """A demo's job that succeeded: the job, its final status, seconds from submit to its end, its result."""

    job: Any
    status: Any
    seconds: float
    result: dict


def _run(submit: Callable[[], Any], wait: Callable[[Any], Any] | None) -> _Ran:
    """Submit a demo's job, wait for it and time it; :class:`DemoFailed` unless it succeeded."""
    t0 = time.perf_counter()
    job = submit()
    status = wait(job) if wait else job.wait(progress=False)
    seconds = time.perf_counter() - t0
    if status.state != "SUCCEEDED":
        raise DemoFailed(f"demo job {job.job_id} ended {status.state}: {status.error}")
    return _Ran(job, status, seconds, job.result())


def _verified(
    kind: str, ran: _Ran, checks: list[str], labels: tuple[str, str] = ("items", "parts"), **figures: Any
) -> DemoResult:
    """The row of a demo whose output passed ``checks``: ``figures`` its items, parts, bytes (and errors),
    ``labels`` what its items and parts count."""
    figures = {"errors": 0, **figures, "items_label": labels[0], "parts_label": labels[1]}
    return DemoResult(
        kind, ran.job.job_id, ran.status.state, seconds=ran.seconds, verified=True, checks=checks, **figures
    )


def _tar_bytes(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def seed_getbatch(client: Any, n: int, seed: int = 0) -> tuple[dict, list[bytes | None]]:
    """Write ``n`` objects (plus a TAR shard) under ``demo/getbatch/`` and build a request over them.

    The request mixes whole objects, a byte range, two TAR members and one missing object, with
    ``continue_on_error`` so the missing one becomes a ``__404__`` placeholder. Returns the spec and the
    bytes each entry must hold (None for the placeholder).
    """
    rng = random.Random(seed)
    prefix = f"{DEMO_PREFIX}/getbatch"
    items: list[dict] = []
    expected: list[bytes | None] = []
    for i in range(n):
        data = rng.randbytes(rng.randint(64, 4096))
        key = f"{prefix}/obj-{i:05d}.bin"
        store.put(client.uri(key), data)
        items.append({"uri": key})
        expected.append(data)
    members = {f"sample-{k}.txt": f"member {k} of the demo shard\n".encode() * (k + 1) for k in range(4)}
    store.put(client.uri(f"{prefix}/shard-0000.tar"), _tar_bytes(members))
    # a byte range, two TAR members (one ranged), and one object that does not exist
    extras: list[tuple[int, dict, bytes | None]] = [
        (n // 3, {"uri": items[0]["uri"], "start": 10, "length": 32}, expected[0][10:42]),
        (n // 2, {"uri": f"{prefix}/shard-0000.tar", "archpath": "sample-2.txt"}, members["sample-2.txt"]),
        (
            2 * n // 3,
            {"uri": f"{prefix}/shard-0000.tar", "archpath": "sample-3.txt", "start": 7, "length": 9},
            members["sample-3.txt"][7:16],
        ),
        (n - n // 4, {"uri": f"{prefix}/missing-object.bin"}, None),
    ]
    for pos, item, data in sorted(extras, key=lambda e: e[0], reverse=True):
        items.insert(pos, item)
        expected.insert(pos, data)
    spec = {
        "kind": "getbatch",
        "items": items,
        "continue_on_error": True,
        "items_per_part": max(1, len(items) // 4 + 1),  # a few parts, so the Map really fans out
    }
    return spec, expected


def verify_getbatch(result: dict, expected: list[bytes | None]) -> list[str]:
    """Check the archive entry by entry against what was generated; returns the checks passed."""
    archive = store.get(result["archive"])
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:") as tar:
        members = tar.getmembers()
        if len(members) != len(expected):
            raise DemoFailed(f"archive has {len(members)} entries, expected {len(expected)}")
        for i, (member, want) in enumerate(zip(members, expected, strict=True)):
            got = tar.extractfile(member).read() if member.isfile() else b""
            if want is None:
                if not member.name.startswith("__404__/") or got:
                    raise DemoFailed(f"entry {i} ({member.name}) should be a zero-byte __404__ placeholder")
            elif got != want:
                raise DemoFailed(f"entry {i} ({member.name}) does not hold the bytes that were written")
    checks = [f"{len(expected)} entries in request order, bytes identical"]
    rows = [json.loads(line) for line in store.get(result["status"]).decode().splitlines() if line.strip()]
    failed = [r for r in rows if r.get("error")]
    if len(rows) != len(expected) or len(failed) != 1:
        raise DemoFailed(f"status file has {len(rows)} rows and {len(failed)} errors; expected 1 error")
    checks.append("missing object reported once, as a __404__ placeholder")
    return checks


def demo_getbatch(client: Any, items: int = 300, wait: Callable[[Any], Any] | None = None) -> DemoResult:
    """Seed, run and verify one getbatch job on ``client``'s backend."""
    spec, expected = seed_getbatch(client, items)
    ran = _run(lambda: client.submit(spec), wait)
    result = ran.result
    return _verified(
        "getbatch",
        ran,
        verify_getbatch(result, expected),
        items=result.get("items", len(expected)),
        parts=result.get("parts", 0),
        bytes=result.get("bytes", 0),
        errors=result.get("errors", 0),
    )


# --- fedavg -------------------------------------------------------------------------------------------------

# name -> (shape, dtype): an MLP with BatchNorm, ~10.6 MiB per update (so the demo job really has 2 shards:
# every shard but the last holds at least S3's 5 MiB multipart minimum).
DEMO_MODEL: dict[str, tuple[tuple[int, ...], Any]] = {
    "fc1.weight": ((1024, 2560), np.float32),
    "fc1.bias": ((1024,), np.float32),
    "bn1.weight": ((1024,), np.float32),
    "bn1.bias": ((1024,), np.float32),
    "bn1.running_mean": ((1024,), np.float32),
    "bn1.running_var": ((1024,), np.float32),
    "bn1.num_batches_tracked": ((), np.int64),
    "fc2.weight": ((256, 1024), ml_dtypes.bfloat16),
    "fc2.bias": ((256,), ml_dtypes.bfloat16),
    "head.weight": ((10, 256), np.float32),
}
DEMO_CLIENTS = 8
DEMO_SHARDS = 2


def fedavg_updates(
    model: dict[str, tuple[tuple[int, ...], Any]], clients: int, seed: int = 0
) -> list[tuple[dict[str, np.ndarray], int]]:
    """``clients`` generated updates of ``model`` (name -> (shape, dtype)) with their ``num_examples``.

    Floats are normal around a per-tensor mean; integer tensors (``num_batches_tracked``) are step counts
    that differ per client. Deterministic in ``seed``.
    """
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(clients):
        num_examples = int(rng.integers(50, 500))
        tensors: dict[str, np.ndarray] = {}
        for name, (shape, dtype) in model.items():
            if np.issubdtype(np.dtype(dtype), np.integer):
                tensors[name] = rng.integers(100, 1000, size=shape).astype(dtype)
            else:
                tensors[name] = (rng.standard_normal(shape, dtype=np.float32) * 0.05 + 0.01).astype(dtype)
        out.append((tensors, num_examples))
    return out


def fedavg_reference(updates: list[dict[str, np.ndarray]], weights: list[float]) -> dict[str, np.ndarray]:
    """The weighted mean the job computes, written plainly over whole tensors in numpy.

    Floats: ``acc = w_0 x_0; acc = acc + w_i x_i`` in float32 in client order, ``/ W`` (``W = fsum(w)``),
    cast back; integers: the same in float64, rounded half to even.
    """
    total = math.fsum(weights)
    out: dict[str, np.ndarray] = {}
    for name, first in updates[0].items():
        acc_t = np.float64 if np.issubdtype(first.dtype, np.integer) else np.float32
        acc = first.astype(acc_t) * acc_t(weights[0])
        for u, w in zip(updates[1:], weights[1:], strict=True):
            acc = acc + u[name].astype(acc_t) * acc_t(w)
        acc = acc / acc_t(total)
        if acc_t is np.float64:
            acc = np.rint(acc)
        out[name] = acc.astype(first.dtype)
    return out


def demo_fedavg(client: Any, items: int = 0, wait: Callable[[Any], Any] | None = None) -> DemoResult:
    """Write 8 generated updates under ``demo/fedavg/``, average them with a fedavg job and check the output
    byte for byte against :func:`fedavg_reference` (``items`` is getbatch's; the client count is fixed)."""
    updates = fedavg_updates(DEMO_MODEL, DEMO_CLIENTS, seed=7)
    keys = [f"{DEMO_PREFIX}/fedavg/client-{i:02d}.safetensors" for i in range(len(updates))]
    for key, (tensors, n) in zip(keys, updates, strict=True):
        client.fedavg.save_update(tensors, key, num_examples=n)
    ran = _run(lambda: client.fedavg.submit(keys, shards=DEMO_SHARDS), wait)
    result = ran.result
    got = client.fedavg.load(result["output"])
    weights = [n for _, n in updates]
    want = fedavg_reference([u for u, _ in updates], weights)
    if list(got) != list(want) and sorted(got) != sorted(want):
        raise DemoFailed(f"output tensors {sorted(got)} differ from the model's {sorted(want)}")
    for name, ref in want.items():
        g = got[name]
        if g.dtype != ref.dtype or g.shape != ref.shape or g.tobytes() != ref.tobytes():
            raise DemoFailed(f"tensor {name!r} of the output differs from the numpy reference")
    meta = client.fedavg.metadata(result["output"])
    if float(meta.get("num_examples", "nan")) != sum(weights):
        raise DemoFailed(f"output num_examples {meta.get('num_examples')} != {sum(weights)}")
    dtypes = ", ".join(sorted(result.get("dtypes", {})))
    checks = [
        f"{len(want)} tensors ({dtypes}) byte-identical to a whole-tensor numpy FedAvg of the "
        f"{len(updates)} clients",
        f"output num_examples = {sum(weights)} (the clients' total)",
    ]
    figures = {"items": result["clients"], "parts": result["shards"], "bytes": result["bytes"]}
    return _verified("fedavg", ran, checks, ("clients", "shards"), **figures)


# --- dpquery ------------------------------------------------------------------------------------------------

PEOPLE_REGIONS = ["north", "south", "east", "west", "centre"]
PEOPLE_EDUCATION = ["none", "primary", "secondary", "vocational", "bachelor", "master", "doctorate"]
# The schema of the generated people data (the demo uses all six attributes, events/dpquery.json five).
PEOPLE_SCHEMA: list[dict[str, Any]] = [
    {"name": "age", "range": [18, 89], "bin_width": 10},
    {"name": "sex", "categories": ["female", "male"]},
    {"name": "region", "categories": PEOPLE_REGIONS},
    {"name": "education", "categories": PEOPLE_EDUCATION},
    {"name": "hours_per_week", "range": [0, 99], "bin_width": 20},
    {"name": "household_size", "range": [1, 8]},
]
DEMO_DP_ROWS = 100_000
DEMO_DP_RHO = 0.1


def synthetic_people(rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A synthetic population of ``rows`` people (no real person in it), with correlated attributes:
    ``age`` 18-89, ``sex``, ``region``, ``education`` (older people and some regions more schooled),
    ``hours_per_week`` 0-99 (fewer past 60), ``household_size`` 1-8. Deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    age = np.clip(np.rint(rng.normal(44, 15, rows)), 18, 89).astype(np.int64)
    sex = rng.integers(0, 2, rows)
    region = rng.choice(len(PEOPLE_REGIONS), rows, p=[0.25, 0.2, 0.2, 0.15, 0.2])
    level = rng.normal(2.5, 1.3, rows) + 0.6 * (age < 35) + 0.5 * (region == 4) - 0.3 * (region == 1)
    education = np.clip(np.rint(level), 0, len(PEOPLE_EDUCATION) - 1).astype(np.int64)
    working = (age < 66) & (rng.random(rows) < 0.85)
    hours = np.where(working, np.clip(np.rint(rng.normal(38, 9, rows)), 1, 99), rng.integers(0, 12, rows))
    household = np.clip(rng.poisson(1.6, rows) + 1 + (age < 50) * rng.integers(0, 2, rows), 1, 8)
    return {
        "age": age,
        "sex": np.array(["female", "male"])[sex],
        "region": np.array(PEOPLE_REGIONS)[region],
        "education": np.array(PEOPLE_EDUCATION)[education],
        "hours_per_week": hours.astype(np.int64),
        "household_size": household.astype(np.int64),
    }


def people_csv(columns: dict[str, np.ndarray], names: list[str]) -> bytes:
    """The columns ``names`` as CSV text with a header row (plain, unquoted: no value holds a comma)."""
    lines = [",".join(names)]
    lines += [
        ",".join(str(v) for v in row) for row in zip(*(columns[n].tolist() for n in names), strict=True)
    ]
    return ("\n".join(lines) + "\n").encode()


def people_indices(columns: dict[str, np.ndarray], schema: list[dict[str, Any]]) -> np.ndarray:
    """Every row's domain index per schema attribute, (attributes, rows): the demo's ground truth."""
    out = []
    for a in schema:
        v = columns[a["name"]]
        if "categories" in a:
            lookup = {c: i for i, c in enumerate(a["categories"])}
            out.append(np.array([lookup[x] for x in v.tolist()], dtype=np.int64))
        else:
            lo, _hi = a["range"]
            out.append((v - lo) // a.get("bin_width", 1))
    return np.stack(out)


def true_marginal(idx: np.ndarray, sizes: list[int], attrs: list[int]) -> np.ndarray:
    """The exact counts of the marginal on ``attrs`` (schema indices, ascending). Demo-side only: used to
    measure the released tables' error, never logged or returned."""
    shape = [sizes[a] for a in attrs]
    flat = np.ravel_multi_index(tuple(idx[a] for a in attrs), shape) if attrs else np.zeros(idx.shape[1], int)
    return np.bincount(flat, minlength=math.prod(shape)).reshape(shape).astype(np.float64)


def demo_dpquery(client: Any, items: int = 0, wait: Callable[[Any], Any] | None = None) -> DemoResult:
    """Release every marginal of at most 2 of 6 attributes of a fresh 100,000-row synthetic population
    under ρ = 1 zCDP, then compare the released tables with the true counts (computed here, in the demo
    process, only for that comparison): the observed workload RMSE against the plan's prediction, and the
    standardised per-cell errors. ``items`` is getbatch's; the row count is fixed.

    Each run is a new synthetic dataset with its own ledger id (``demo-people-<run>``) and a total budget
    of one job, so the demo never runs out of budget and never re-spends a dataset's."""
    extras.require("dp", "the dpquery demo")
    run = uuid.uuid4().hex[:12]
    columns = synthetic_people(DEMO_DP_ROWS, seed=int(run, 16) % 2**32)
    spec = _people_release(client, columns, run)
    ran = _run(lambda: client.dpquery.submit(spec), wait)
    result, report = ran.result, ran.result["report"]
    arrays = client.dpquery.arrays(result)
    std = client.dpquery.std_errors(result)
    idx = people_indices(columns, PEOPLE_SCHEMA)
    del columns
    sq_err, z2, max_z, cells = _release_errors(
        result["tables"], arrays, std, idx, [a.size for a in spec.attributes]
    )
    del idx
    observed = math.sqrt(sq_err / cells)
    predicted = float(report["predicted_rmse"])
    ratio = observed / predicted
    # The squared error of one release is a sum of many independent Gaussian terms: its ratio to the
    # prediction stays well inside [0.5, 2]; a |z| beyond 7 is impossible for honest Gaussian noise.
    if not (0.5 <= ratio <= 2.0) or max_z > 7.0 or len(arrays) != len(result["tables"]):
        raise DemoFailed(
            f"released tables do not match the plan: observed RMSE {observed:.4g} vs predicted "
            f"{predicted:.4g}, max |z| {max_z:.2f}"
        )
    out_bytes = sum(store.size(e["parquet"]) for e in result["tables"])
    checks = [
        f"{len(arrays)} marginals (every ≤2-way of {len(PEOPLE_SCHEMA)} attributes), {cells:,} cells: "
        f"workload RMSE predicted {predicted:.4g}, observed {observed:.4g} (ratio {ratio:.2f}) against the "
        "true counts",
        f"standardised errors (estimate − truth) / predicted std error: mean square {z2 / cells:.2f} "
        f"(expected 1), max |z| {max_z:.2f}",
        f"ρ {report['rho_spent']:.6g} spent of {DEMO_DP_RHO:g} (OpenDP's map): ε {report['epsilon_cks']:.4g} "
        f"(CKS) / {report['epsilon_gaussian']:.4g} (exact Gaussian) at δ {report['delta']:g}",
    ]
    figures = {"items": DEMO_DP_ROWS, "parts": len(arrays), "bytes": out_bytes}
    return _verified("dpquery", ran, checks, ("rows", "marginals"), **figures)


def _people_release(client: Any, columns: dict[str, np.ndarray], run: str) -> Any:
    """Write the population as Parquet under ``demo/dpquery/``; the spec releasing its ≤2-way marginals."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.table(columns), buf)
    key = f"{DEMO_PREFIX}/dpquery/people.parquet"
    store.put(client.uri(key), buf.getvalue())
    return client.dpquery.spec(
        {
            "kind": "dpquery",
            "dataset": client.uri(key),
            "schema": PEOPLE_SCHEMA,
            "workload": {"all_marginals_up_to": 2},
            "budget": {"rho": DEMO_DP_RHO},
            "dataset_id": f"demo-people-{run}",
            "dataset_budget_rho": DEMO_DP_RHO,
        }
    )


def _release_errors(
    tables: list[dict], arrays: dict, std: dict[str, float], idx: np.ndarray, sizes: list[int]
) -> tuple[float, float, float, int]:
    """The released marginals against the true counts: Σ error², Σ z², the largest |z| and the cells."""
    names = [a["name"] for a in PEOPLE_SCHEMA]
    sq_err = z2 = max_z = 0.0
    cells = 0
    for entry in tables:
        attrs = [names.index(n) for n in entry["attributes"]]
        name = marginal_name(entry["attributes"])
        values, labels = arrays[name]
        if list(labels) != entry["attributes"]:
            raise DemoFailed(f"marginal {name}: axes {list(labels)} differ from {entry['attributes']}")
        err = values - true_marginal(idx, sizes, attrs)
        sq_err += float(np.sum(err * err))
        z = err / std[name]
        z2 += float(np.sum(z * z))
        max_z = max(max_z, float(np.max(np.abs(z))))
        cells += int(err.size)
    return sq_err, z2, max_z, cells


# --- inference ---------------------------------------------------------------------------------------------

CORPUS_WORDS = (
    "the of and to in is that for it as was with be by on not this are or from at which but have an they "
    "were there would their we been has when who will more no if out so said what up its about into than "
    "them can only other new some could time these two may then do first any now such like our over even "
    "most made after also did many before must through back years where much way well down should because "
    "each just those people how too little state good very make world still own see men work long get here "
    "between both life being under never day same another know while last might great old year off come "
    "since against go came right used take river model cloud batch shard token vector signal market garden "
    "window engine paper music water light story"
).split()
DEMO_INFERENCE_ROWS = 200
DEMO_INFERENCE_SHARD_ROWS = 50
# sentences of 5-20 words: a third of the embedding CPU of up to 60, still of mixed lengths
DEMO_INFERENCE_MAX_WORDS = 20


def inference_corpus(n: int, seed: int = 0, min_words: int = 5, max_words: int = 60) -> list[dict[str, Any]]:
    """``n`` deterministic JSONL rows ``{"id": "doc-00000", "text": ...}`` of ``min_words``..``max_words``
    words from a fixed vocabulary."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        words = [rng.choice(CORPUS_WORDS) for _ in range(rng.randint(min_words, max_words))]
        rows.append({"id": f"doc-{i:05d}", "text": " ".join(words).capitalize() + "."})
    return rows


def demo_inference(client: Any, items: int = 0, wait: Callable[[Any], Any] | None = None) -> DemoResult:
    """Embed a generated corpus of :data:`DEMO_INFERENCE_ROWS` sentences (of at most
    :data:`DEMO_INFERENCE_MAX_WORDS` words) with the built-in ``minilm`` model
    (``items`` is getbatch's) and check the output: every id once, in input order, unit-norm embeddings."""
    extras.require("inference", "the inference demo")
    from shardfold.client.inference import load

    rows = inference_corpus(DEMO_INFERENCE_ROWS, seed=5, max_words=DEMO_INFERENCE_MAX_WORDS)
    key = f"{DEMO_PREFIX}/inference/corpus.jsonl"
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    store.put(client.uri(key), data)
    spec = {
        "kind": "inference",
        "inputs": [key],
        "field": "text",
        "id_field": "id",
        "model": "minilm",
        "shard_rows": DEMO_INFERENCE_SHARD_ROWS,
    }
    ran = _run(lambda: client.submit(spec), wait)
    result, seconds = ran.result, ran.seconds
    ids, emb = load(result)
    want = [r["id"] for r in rows]
    if [str(i) for i in ids] != want:
        raise DemoFailed("output ids are not the corpus ids in input order")
    norms = np.linalg.norm(emb, axis=1)
    if emb.shape != (len(rows), 384) or not np.allclose(norms, 1.0, atol=1e-3):
        raise DemoFailed(f"embeddings of shape {emb.shape}, norms {norms.min():.4f}..{norms.max():.4f}")
    checks = [
        f"{len(rows)} sentences embedded in input order, {emb.shape[1]}-d unit vectors",
        f"{len(rows) / seconds:,.1f} rows/s end to end (job start to commit, {seconds:.1f} s)",
    ]
    figures = {"items": result["rows"], "parts": result["shards"], "bytes": len(data)}
    return _verified("inference", ran, checks, ("rows", "shards"), **figures, errors=result.get("skipped", 0))


# Every job kind's demo; a new kind registers here.
DEMOS: dict[str, Callable[..., DemoResult]] = {
    "getbatch": demo_getbatch,
    "fedavg": demo_fedavg,
    "dpquery": demo_dpquery,
    "inference": demo_inference,
}
