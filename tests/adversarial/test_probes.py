"""Hostile and careless specs, per kind, on the local and the moto backend (the bucket trigger on AWS goes
through the same submit path as the SDK used here). Every probe must end in a clear error — refused at submit
naming the field, or a FAILED job whose error names what is wrong — or in a safe result; and after every
probe no object that was in the store before has changed or gone.

A probe's ``expect``:

* ``Refused(field, pattern)``: submit raises, naming the field, with a message matching ``pattern``;
* ``Fails(pattern)``: submit accepts (it cannot see inside a manifest or a file), the job ends FAILED;
* ``Clear(pattern)``: either of the two;
* ``Safe(check)``: the job succeeds and ``check(env, result)`` holds.

The probes that need a job stopped halfway live beside the code they exercise: inputs changed after the plan
(``tests/test_pinning.py`` and each kind's job tests, local and moto), two resumes at once, kill -9 and a
failing final status write (``tests/test_ownership.py``), Rich markup in spec fields (``tests/test_cli.py``),
duplicate bucket events and oversized specs in the trigger (``tests/test_trigger.py``), and scratch left by
a crash after the result (``tests/test_getbatch_core.py``; ``shardfold clean``: ``tests/test_submit.py``).
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from probekit import Env, snapshot

from shardfold.client.fedavg import decode_update
from shardfold.functions.errors import ShardfoldError, SpecError
from shardfold.functions.trigger import dispatch

pytestmark = pytest.mark.slow

WAIT_S = 300  # a deadline, not a timing assumption
SECRET = "4111-1111-1111-1111"  # a value in a private dataset's bad row: no error may quote it


@dataclass
class Refused:
    field: str
    pattern: str


@dataclass
class Fails:
    pattern: str


@dataclass
class Clear:
    pattern: str


@dataclass
class Safe:
    check: Callable[[Env, dict[str, Any]], None]


@dataclass
class Probe:
    name: str
    spec: Callable[[Env], dict[str, Any]]
    expect: Refused | Fails | Clear | Safe
    backends: tuple[str, ...] = ("local", "moto")
    notes: list[str] = field(default_factory=list)
    as_text: Refused | None = None  # where the spec as JSON text (the trigger's) is refused otherwise


# ------------------------------------------------------------------------------------------------ getbatch


def gb(*items: dict[str, Any], **extra: Any) -> Callable[[Env], dict[str, Any]]:
    return lambda env: {"kind": "getbatch", "items": list(items), **extra}


def gb_manifest(lines: bytes) -> Callable[[Env], dict[str, Any]]:
    def spec(env: Env) -> dict[str, Any]:
        key = f"requests/{hashlib.sha256(lines).hexdigest()[:12]}.jsonl"
        env.put(key, lines)
        return {"kind": "getbatch", "manifest": key}

    return spec


def gb_symlink(env: Env) -> dict[str, Any]:
    outside = env.home / "outside"
    outside.mkdir(exist_ok=True)
    (outside / "secret.txt").write_text("not the store's\n")
    link = env.home / "store" / "data" / "linked"
    if not link.is_symlink():
        link.symlink_to(outside)
    return {"kind": "getbatch", "items": [{"uri": "data/linked/secret.txt"}]}


def gb_output_via_symlink(env: Env) -> dict[str, Any]:
    outside = env.home / "outside"
    outside.mkdir(exist_ok=True)
    link = env.home / "store" / "exports"
    if not link.is_symlink():
        link.symlink_to(outside)
    return {"kind": "getbatch", "items": [{"uri": "data/hello.txt"}], "output": "exports/batch.tar"}


def archive_is_inside(env: Env, result: dict[str, Any]) -> None:
    from shardfold.functions import store

    with tarfile.open(fileobj=io.BytesIO(store.get(result["archive"]))) as tf:
        for name in tf.getnames():
            assert not name.startswith("/") and ".." not in name.split("/") and "\x00" not in name


HELLO = {"uri": "data/hello.txt"}
GETBATCH = [
    Probe(
        "local file as an item",
        gb({"uri": "file:///proc/self/environ"}),
        Refused("items.0.uri", "local file"),
        ("moto",),
    ),
    Probe(
        "local file inside a manifest",
        gb_manifest(b'{"uri": "file:///proc/self/environ"}\n'),
        Clear("local file"),
        ("moto",),
    ),
    Probe("tar slip ../../x", gb({**HELLO, "name": "../../x"}), Refused("items.0.name", r"\.\.")),
    Probe("tar slip /etc/evil", gb({**HELLO, "name": "/etc/evil"}), Refused("items.0.name", "/")),
    Probe("tar slip a/../../../y", gb({**HELLO, "name": "a/../../../y"}), Refused("items.0.name", r"\.\.")),
    Probe("NUL in a name", gb({**HELLO, "name": "a\x00b"}), Refused("items.0.name", r"U\+0000")),
    Probe(
        "archpath with ..",
        gb({"uri": "data/shard-000.tar", "archpath": "../x"}),
        Refused("items.0.archpath", r"\.\."),
    ),
    Probe(
        "output over a ledger entry",
        gb(HELLO, output="ledger/example-people/entries/00000001.json"),
        Refused("output", "system prefix"),
    ),
    Probe(
        "output over another job's folder",
        gb(HELLO, output="jobs/someone-else/result.json"),
        Refused("output", "system prefix"),
    ),
    Probe(
        "output is an input",
        gb({"uri": "results/kept.bin"}, output="results/kept.bin"),
        Refused("output", "may not overwrite"),
    ),
    Probe(
        "output is an input, spelled differently",
        gb({"uri": "results/./kept.bin"}, output="results//kept.bin"),
        Refused("output", "may not overwrite"),
    ),
    Probe(
        "output outside the deployment's prefixes",
        gb(HELLO, output="elsewhere/batch.tar"),
        Refused("output", "outputPrefixes"),
        ("moto",),
    ),
    Probe(
        "input in a bucket not granted",
        gb({"uri": "s3://someone-elses-bucket/data.bin"}),
        Refused("items.0.uri", "readBuckets"),
        ("moto",),
    ),
    Probe("key with ..", gb({"uri": "data/../../etc/passwd"}), Refused("items.0.uri", r"\.\.")),
    Probe("key with NUL", gb({"uri": "data/hello\x00.txt"}), Refused("items.0.uri", "NUL")),
    Probe(
        "key through a symbolic link out of the store",
        gb_symlink,
        Refused("items.0.uri", "symbolic link"),
        ("local",),
    ),
    Probe(
        "output through a symbolic link out of the store",
        gb_output_via_symlink,
        Refused("output", "symbolic link"),
        ("local",),
    ),
    Probe("a string for a number", gb({**HELLO, "start": "2"}), Refused("items.0.start", "integer")),
    Probe("a misspelt field", gb(HELLO, itmes_per_part=3), Refused("itmes_per_part", "[Ee]xtra")),
    Probe(
        "an inline spec over 4 MiB",
        gb(*[{"uri": f"data/{i:08d}-{'x' * 40}.bin"} for i in range(80_000)]),
        Refused("<spec>", "manifest"),
    ),
    Probe(
        "a manifest line that is not UTF-8",
        gb_manifest(b'{"uri": "data/hello.txt"}\n{"uri": "\xff\xfe"}\n'),
        Clear("line 2"),
    ),
    Probe(
        "a manifest item of the wrong type",
        gb_manifest(b'{"uri": "data/hello.txt"}\n{"uri": 5}\n'),
        Clear("line 2"),
    ),
    Probe("a missing object", gb(HELLO, {"uri": "data/missing.bin"}), Fails("missing.bin")),
    Probe("names that are safe stay as given", gb({**HELLO, "name": "dir/ok.txt"}), Safe(archive_is_inside)),
]


# -------------------------------------------------------------------------------------------------- fedavg

CLIENTS = [{"uri": f"data/fedavg/client-{i}.safetensors"} for i in range(3)]


def fa(*clients: dict[str, Any], **extra: Any) -> Callable[[Env], dict[str, Any]]:
    return lambda env: {"kind": "fedavg", "clients": list(clients), "integer_policy": "max", **extra}


def weighted(*weights: float) -> list[dict[str, Any]]:
    return [{**c, "weight": w} for c, w in zip(CLIENTS, weights, strict=False)]


def model_is_finite(env: Env, result: dict[str, Any]) -> None:
    from shardfold.functions import store

    tensors = decode_update(store.get(result["output"]))
    floats = [np.asarray(t, dtype=np.float64) for t in tensors.values() if np.asarray(t).dtype.kind in "fV"]
    assert floats and all(np.isfinite(t).all() for t in floats)


def fa_output_is_client(env: Env) -> dict[str, Any]:
    from shardfold.functions import store

    env.put("results/client-1.safetensors", store.get(env.uri(CLIENTS[1]["uri"])))
    clients = [CLIENTS[0], {"uri": "results/client-1.safetensors"}]
    return fa(*clients, output="results/client-1.safetensors")(env)


FEDAVG = [
    Probe(
        "local file as a client",
        fa({"uri": "file:///proc/self/environ"}),
        Refused("clients.0.uri", "local file"),
        ("moto",),
    ),
    Probe("output is a client", fa_output_is_client, Refused("output", "may not overwrite")),
    Probe(
        "output over a ledger entry",
        fa(*CLIENTS, output="ledger/x/entries/00000001.json"),
        Refused("output", "system prefix"),
    ),
    Probe(
        "the same client twice, spelled differently",
        fa(CLIENTS[0], {"uri": CLIENTS[0]["uri"].replace("/", "//", 1)}),
        Refused("clients.1.uri", "repeats clients.0"),
    ),
    Probe("a weight as a string", fa({**CLIENTS[0], "weight": "5"}), Refused("clients.0.weight", "number")),
    Probe(
        "a NaN weight",
        fa({**CLIENTS[0], "weight": float("nan")}),
        Refused("clients.0.weight", "finite"),
        as_text=Refused("<spec>", "NaN is not a JSON value"),  # json.dumps writes NaN, which is no JSON
    ),
    Probe(
        "weights of 1e308",
        fa(*weighted(1e308, 1e308, 1e308)),
        Refused("clients.0.weight", "only their ratios"),
    ),
    Probe(
        "weights of 5e-324",
        fa(*weighted(5e-324, 5e-324, 5e-324), accumulate="float32"),
        Safe(model_is_finite),
    ),
    Probe("weights from 1e-300 to 1e300", fa(*weighted(1e-300, 1.0, 1e300)), Safe(model_is_finite)),
]


# ------------------------------------------------------------------------------------------------- dpquery


def dp(**changes: Any) -> Callable[[Env], dict[str, Any]]:
    from pathlib import Path

    base = json.loads((Path(__file__).resolve().parents[2] / "events" / "dpquery.json").read_text())
    base["dataset"] = "data/dpquery/people.csv"
    base["dataset_id"] = "adversarial-people"
    return lambda env: {**base, **changes}


def dp_bad_row(env: Env) -> dict[str, Any]:
    from shardfold.functions import store

    rows = store.get(env.uri("data/dpquery/people.csv")).decode().splitlines()
    rows.insert(3, rows[3] + f",{SECRET}")  # one row with a field too many, holding a private value
    env.put("data/dpquery/bad.csv", ("\n".join(rows) + "\n").encode())
    return {**dp()(env), "dataset": "data/dpquery/bad.csv", "dataset_id": "adversarial-bad"}


def dp_result_quotes_no_row(env: Env, result: dict[str, Any]) -> None:
    assert SECRET not in json.dumps(result)


DPQUERY = [
    Probe(
        "local file as the dataset",
        dp(dataset="file:///proc/self/environ.csv"),
        Refused("dataset", "local file"),
        ("moto",),
    ),
    Probe(
        "output prefix under ledger/", dp(output="ledger/example-people/"), Refused("output", "system prefix")
    ),
    Probe("rho as a string", dp(budget={"rho": "0.1"}), Refused("budget.rho", "number")),
    Probe("rho of 1e308", dp(budget={"rho": 1e308}), Refused("budget.rho", "")),
    Probe("a malformed row is skipped, never fatal", dp_bad_row, Safe(dp_result_quotes_no_row)),
]


# ----------------------------------------------------------------------------------------------- inference


def inf(**changes: Any) -> Callable[[Env], dict[str, Any]]:
    base = {
        "kind": "inference",
        "inputs": ["data/inference/corpus.jsonl"],
        "field": "text",
        "model": "minilm",
    }
    return lambda env: {**base, **changes}


def inf_corrupt_parquet(env: Env) -> dict[str, Any]:
    env.put("data/inference/junk.parquet", b"PAR1 not a parquet file" * 20)
    return inf(inputs=["data/inference/junk.parquet"])(env)


INFERENCE = [
    Probe(
        "local file as an input",
        inf(inputs=["file:///proc/self/environ.jsonl"]),
        Refused("inputs.0", "local file"),
        ("moto",),
    ),
    Probe(
        "local file as the model",
        inf(model={"torchscript": "file:///etc/passwd"}),
        Refused("model.torchscript", "local file"),
        ("moto",),
    ),
    Probe(
        "output is an input",
        inf(output="data/inference/corpus.jsonl"),
        Refused("output", "may not overwrite"),
        ("local",),
    ),
    Probe(
        "output over a ledger entry",
        inf(output="ledger/x/entries/00000001.json"),
        Refused("output", "system prefix"),
    ),
    Probe("a corrupt Parquet input", inf_corrupt_parquet, Clear("not a readable Parquet file")),
]


PROBES = GETBATCH + FEDAVG + DPQUERY + INFERENCE


def _outcome(env: Env, spec: dict[str, Any]) -> tuple[str, str, list[dict[str, Any]], Any]:
    """``("refused", message, errors, None)`` or ``(final state, error, [], job)``."""
    try:
        job = env.client.submit(spec)
    except SpecError as exc:
        return "refused", str(exc), exc.errors, None
    except ShardfoldError as exc:
        return "refused", str(exc), [], None
    status = job.wait(progress=False, timeout_s=WAIT_S)
    return status.state, status.error or "", [], job


@pytest.mark.parametrize("probe", PROBES, ids=lambda p: p.name)
def test_probe(env: Env, probe: Probe):
    spec = probe.spec(env)  # plants what the probe needs first: those objects are committed too
    before = snapshot(env.root)
    state, message, errors, job = _outcome(env, spec)
    expect = probe.expect
    if isinstance(expect, Refused):
        assert state == "refused", (
            f"{probe.name}: expected a refusal naming {expect.field}, got {state} {message}"
        )
        named = [e.get("field") for e in errors] if errors else [message]
        assert any(expect.field == n or expect.field in (n or "") for n in named), (named, message)
        assert re.search(expect.pattern, message), message
    elif isinstance(expect, Fails):
        assert state == "FAILED", f"{probe.name}: expected the job to fail, got {state} {message}"
        assert re.search(expect.pattern, message), message
    elif isinstance(expect, Clear):
        assert state in ("refused", "FAILED"), f"{probe.name}: expected a clear error, got {state}"
        assert re.search(expect.pattern, message), message
    else:
        assert state == "SUCCEEDED", f"{probe.name}: expected success, got {state}: {message}"
        expect.check(env, job.result())
    assert SECRET not in message and "Traceback" not in message
    after = snapshot(env.root)
    changed = sorted(u for u, digest in before.items() if after.get(u) != digest)
    assert not changed, f"{probe.name} changed or removed committed objects: {changed}"


REFUSALS = [p for p in PROBES if isinstance(p.expect, Refused)]


@pytest.mark.parametrize("probe", REFUSALS, ids=lambda p: p.name)
def test_the_bucket_trigger_refuses_what_submit_refuses(env: Env, probe: Probe):
    """The same spec dropped into the bucket (``shardfold watch`` locally): refused, the field named in the
    error report beside it, nothing started, nothing committed changed."""
    spec = probe.spec(env)
    body = json.dumps(spec).encode()
    spec_uri = env.put(f"jobs/probe-{hashlib.sha256(body).hexdigest()[:12]}.json", body)
    before = snapshot(env.root)
    started: list[tuple[str, ...]] = []
    report = dispatch(spec_uri, lambda *job: started.append(job), root=env.root, deployed=env.client.deployed)
    assert not started and "error" in report, report
    expect = probe.as_text or probe.expect
    fields = [e.get("field") for e in report.get("errors", [])] or [report["error"]]
    assert any(expect.field == f or expect.field in (f or "") for f in fields), report
    assert re.search(expect.pattern, report["error"]), report["error"]
    after = snapshot(env.root)
    assert not [u for u, digest in before.items() if after.get(u) != digest]
