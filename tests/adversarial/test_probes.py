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
import tarfile
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from probekit import Clear, Env, Probe, Refused, Safe, classify, snapshot

from shardfold.client.fedavg import decode_update
from shardfold.functions.errors import ShardfoldError, SpecError
from shardfold.functions.trigger import dispatch

pytestmark = pytest.mark.slow

WAIT_S = 300  # a deadline, not a timing assumption
SECRET = "4111-1111-1111-1111"  # a value in a private dataset's bad row: no error may quote it


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
    # refused at submit where it is a local file; on S3 the job fails naming it
    Probe("a missing object", gb(HELLO, {"uri": "data/missing.bin"}), Clear("missing.bin")),
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


# -------------------------------------------------------------------------------- round 2 (issue 33)
# Hostile and careless inputs the first round did not have, across the kinds; each also runs through the
# bucket trigger (local and moto) when it is a refusal, and through the CLI and `watch` (test_entry_paths).

DEEP = "[" * 100_000 + "]" * 100_000


def gb_deep_manifest(env: Env) -> dict[str, Any]:
    return gb_manifest(('{"uri": ' + DEEP + "}\n").encode())(env)


def fa_dp(**dp_fields: Any) -> Callable[[Env], dict[str, Any]]:
    fields = {"clip_norm": 1.0, "noise_multiplier": 1.0, "dataset_id": "fed-probe", "dataset_budget_rho": 5.0}
    return lambda env: {"kind": "fedavg", "clients": CLIENTS, "dp": {**fields, **dp_fields}}


def fa_dp_base_is_output(env: Env) -> dict[str, Any]:
    from shardfold.functions import store

    env.put("results/probe-base.safetensors", store.get(env.uri(CLIENTS[0]["uri"])))
    base = "results/probe-base.safetensors"
    return {**fa_dp(base=base)(env), "clients": CLIENTS[1:], "output": base}


ROUND2 = [
    # getbatch: names, outputs, manifests, options
    Probe("a backslash name", gb({**HELLO, "name": "..\\..\\evil.sh"}), Refused("items.0.name", "U\\+005C")),
    Probe("the name '.'", gb({**HELLO, "name": "."}), Refused("items.0.name", "folder")),
    Probe(
        "a newline in a name", gb({**HELLO, "name": "a\nforged line"}), Refused("items.0.name", "U\\+000A")
    ),
    Probe(
        "a bidi override in a name",
        gb({**HELLO, "name": "\u202etxt.exe"}),
        Refused("items.0.name", "U\\+202E"),
    ),
    Probe("a drive letter in a name", gb({**HELLO, "name": "C:evil"}), Refused("items.0.name", "absolute")),
    Probe("an output naming a folder", gb(HELLO, output="results/"), Refused("output", "names a folder")),
    Probe("an output ending in /.", gb(HELLO, output="results/."), Refused("output", "names a folder")),
    Probe(
        "an output over an object no job wrote",
        gb(HELLO, output="results/kept.bin"),
        Refused("output", "overwrite"),
    ),
    Probe("an output under claims/", gb(HELLO, output="claims/x.tar"), Refused("output", "system prefix")),
    Probe("a manifest nested 100,000 deep", gb_deep_manifest, Clear("nests deeper")),
    Probe(
        "a manifest line with a key twice",
        gb_manifest(b'{"uri": "data/hello.txt", "uri": "data/about.txt"}\n'),
        Clear("duplicate key"),
    ),
    Probe("items_per_part 0", gb(HELLO, items_per_part=0), Refused("items_per_part", "greater than")),
    Probe("a negative start", gb({**HELLO, "start": -1}), Refused("items.0.start", "greater than")),
    Probe("a negative length", gb({**HELLO, "length": -5}), Refused("items.0.length", "greater than")),
    Probe(
        "a NaN deadline",
        gb(HELLO, deadline_s=float("nan")),
        Refused("deadline_s", "finite"),
        as_text=Refused("<spec>", "NaN is not a JSON value"),
    ),
    Probe("a negative deadline", gb(HELLO, deadline_s=-1), Refused("deadline_s", "greater than")),
    Probe("overwrite as a string", gb(HELLO, overwrite="yes"), Refused("overwrite", "boolean")),
    Probe("local_files as a string", gb(HELLO, local_files="false"), Refused("local_files", "boolean")),
    Probe("an unknown kind", lambda env: {"kind": "getbatchx", "items": [HELLO]}, Refused("kind", "unknown")),
    Probe("no kind", lambda env: {"items": [HELLO]}, Refused("kind", "has no 'kind'")),
    Probe("no items", gb(), Refused("<spec>", "items|manifest")),
    Probe("an empty URI", gb({"uri": ""}), Refused("items.0.uri", "at least 1")),
    Probe(
        "an absolute archpath",
        gb({"uri": "data/shard-000.tar", "archpath": "/etc/passwd"}),
        Refused("items.0.archpath", "leaves the archive"),
    ),
    Probe("a spec that is a list", lambda env: [HELLO], Refused("<spec>", "object")),
    # fedavg: DP and secure rounds, options
    Probe("a DP round without a public model", fa_dp(), Refused("dp.structure", "public model")),
    Probe(
        "a DP structure that is a local file",
        fa_dp(structure="file:///etc/passwd"),
        Refused("dp.structure", "local file"),
        ("moto",),
    ),
    Probe(
        "a DP base that is the output",
        fa_dp_base_is_output,
        Refused("output", "may not overwrite"),
    ),
    Probe(
        "expected_clients of 10^400",
        fa_dp(structure=CLIENTS[0]["uri"], expected_clients=10**400),
        Refused("dp.expected_clients", "less than"),
    ),
    Probe("min_clients above the clients listed", fa(*CLIENTS, min_clients=9), Refused("min_clients", "")),
    Probe(
        "an infinite wait",
        fa(*CLIENTS, wait_s=float("inf")),
        Refused("wait_s", "finite"),
        as_text=Refused("<spec>", "Infinity is not a JSON value"),
    ),
    Probe("an aggregator that is no aggregator", fa(*CLIENTS, aggregator="sum"), Refused("aggregator", "")),
    Probe(
        "a trim fraction of 0.6",
        fa(*CLIENTS, aggregator="trimmed_mean", trim_fraction=0.6),
        Refused("trim_fraction", ""),
    ),
    Probe("zero shards", fa(*CLIENTS, shards=0), Refused("shards", "greater than")),
    Probe("a negative weight", fa({**CLIENTS[0], "weight": -1}), Refused("clients.0.weight", "")),
    Probe("a secure round of one client", fa(CLIENTS[0], secure=True), Refused("clients", "")),
    Probe(
        "a fedavg output over an object no job wrote",
        fa(*CLIENTS, output="results/kept.bin"),
        Refused("output", "overwrite"),
    ),
    # dpquery: what failed after the budget was reserved, and the row-count bisection
    Probe(
        "a range beyond 2^53",
        dp(schema=[{"name": "age", "range": [-(2**63), 2**63], "bin_width": 2**62}]),
        Refused("schema.0", "2\\^53"),
    ),
    Probe("a budget of 5e-324", dp(budget={"rho": 5e-324}), Refused("budget.rho", "greater than")),
    Probe(
        "a row bound placed to bisect the count",
        dp(max_rows_total=1999),
        Refused("max_rows_total", "greater"),
    ),
    Probe("a dataset id climbing out", dp(dataset_id="../ledger"), Refused("dataset_id", "pattern")),
    Probe(
        "a workload naming no attribute", dp(workload=[{"attributes": ["nosuch"]}]), Refused("workload", "")
    ),
    Probe("epsilon without delta", dp(budget={"epsilon": 1.0}), Refused("budget", "delta")),
    Probe("an output prefix under claims/", dp(output="claims/x/"), Refused("output", "system prefix")),
    # inference
    Probe("an empty field", inf(field=""), Refused("field", "at least 1")),
    Probe("zero rows a shard", inf(shard_rows=0), Refused("shard_rows", "greater than")),
    Probe("an inference output naming a folder", inf(output="results/"), Refused("output", "names a folder")),
    Probe("no inputs", inf(inputs=[]), Refused("inputs", "")),
    Probe("max_tokens 1", inf(max_tokens=1), Refused("max_tokens", "greater than")),
]

PROBES = GETBATCH + FEDAVG + DPQUERY + INFERENCE + ROUND2

# Accepting one of these would read or write outside what the job may touch: the campaign counts it as an
# escape, not a mere wrong acceptance.
ESCAPES = {
    "local file as an item", "local file inside a manifest", "tar slip ../../x", "tar slip /etc/evil",
    "tar slip a/../../../y", "archpath with ..", "key with ..",
    "key through a symbolic link out of the store",
    "output through a symbolic link out of the store", "local file as a client", "local file as the dataset",
    "local file as an input", "local file as the model", "a backslash name", "a drive letter in a name",
    "an absolute archpath", "a DP structure that is a local file", "output over another job's folder",
    "output over a ledger entry", "output prefix under ledger/", "an output under claims/",
    "an output prefix under claims/", "input in a bucket not granted",
    "output outside the deployment's prefixes",
}  # fmt: skip
for _probe in PROBES:
    _probe.escape = _probe.name in ESCAPES
assert ESCAPES <= {p.name for p in PROBES}, ESCAPES - {p.name for p in PROBES}


def via_sdk(env: Env, probe: Probe) -> tuple[str, str]:
    """The probe submitted through the SDK: its outcome (probekit.OUTCOMES) and what was said."""
    spec = probe.spec(env)  # plants what the probe needs first: those objects are committed too
    before = snapshot(env.root)
    fields: list[str | None] = []
    job = None
    try:
        job = env.client.submit(spec)
        status = job.wait(progress=False, timeout_s=WAIT_S)
        state, message = status.state, status.error or ""
    except SpecError as exc:
        state, message, fields = "refused", str(exc), [e.get("field") for e in exc.errors] or [str(exc)]
    except ShardfoldError as exc:
        state, message, fields = "refused", str(exc), [str(exc)]
    except Exception as exc:  # noqa: BLE001 - a crash is an outcome here
        state, message = "crash", f"{type(exc).__name__}: {exc}"
    after = snapshot(env.root)
    changed = sorted(u for u, digest in before.items() if after.get(u) != digest)
    check = (lambda: probe.expect.check(env, job.result())) if isinstance(probe.expect, Safe) else None
    return classify(probe, probe.expect, state, message, fields, changed, check), message


def via_trigger(env: Env, probe: Probe) -> tuple[str, str]:
    """The same spec dropped into the bucket (``shardfold watch`` locally, through the same dispatch): the
    error report beside it, nothing started."""
    spec = probe.spec(env)
    body = json.dumps(spec).encode()
    spec_uri = env.put(f"jobs/probe-{hashlib.sha256(body).hexdigest()[:12]}.json", body)
    before = snapshot(env.root)
    started: list[tuple[str, ...]] = []
    try:
        report = dispatch(
            spec_uri, lambda *job: started.append(job), root=env.root, deployed=env.client.deployed
        )
    except Exception as exc:  # noqa: BLE001 - a crash is an outcome here
        report = {"crash": f"{type(exc).__name__}: {exc}"}
    after = snapshot(env.root)
    changed = [u for u, digest in before.items() if after.get(u) != digest]
    if "crash" in report:
        state, message, fields = "crash", report["crash"], []
    elif "error" in report and not started:
        state, message = "refused", report["error"]
        fields = [e.get("field") for e in report.get("errors", [])] or [report["error"]]
    else:
        state, message, fields = "SUCCEEDED", json.dumps(report), []  # started: accepted
    return classify(probe, probe.as_text or probe.expect, state, message, fields, changed), message


@pytest.mark.parametrize("probe", PROBES, ids=lambda p: p.name)
def test_probe(env: Env, probe: Probe):
    outcome, message = via_sdk(env, probe)
    assert outcome in ("clear error", "safe result"), f"{probe.name}: {outcome}: {message}"
    assert SECRET not in message


REFUSALS = [p for p in PROBES if isinstance(p.expect, Refused)]


@pytest.mark.parametrize("probe", REFUSALS, ids=lambda p: p.name)
def test_the_bucket_trigger_refuses_what_submit_refuses(env: Env, probe: Probe):
    """Refused, the field named in the error report beside the spec, nothing started, nothing committed
    changed."""
    outcome, message = via_trigger(env, probe)
    assert outcome == "clear error", f"{probe.name}: {outcome}: {message}"
