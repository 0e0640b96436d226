"""dpquery's all-or-nothing rule, fuzzed: nothing a job writes, returns or raises depends on the rows except
the noisy measurements and the tables reconstructed from them.

For random bad-row patterns (values outside the domain, missing values, values that are not integers,
malformed CSV lines, bytes that are not UTF-8) and random ``out_of_domain`` policies, a job runs on a dataset
D and on its neighbours: D plus one bad row, D minus one good row. The job never fails, and every object it
writes (plan document, manifests, per-group table indexes, tables index, result, ledger entries) and every
task result is byte-identical across the neighbours once the measurements and the tables are set aside and
the ledger's timestamps masked. The job id and the dataset's key are the same in each run (separate store
roots), so no other masking is needed, except the dataset fingerprint of plan.json: it identifies the file,
which differs by construction.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardfold.functions import store
from shardfold.functions.dpquery import core
from shardfold.functions.specs import parse_spec
from shardfold.functions.store.uri import join

SECRET = "SSN-987-65-4320"
JOB_ID = "dpquery-20260101-000000-fuzz0000"
HEADER = "sex,region,age,note"


def good_rows(n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [
        f"{'fm'[rng.integers(2)]},{rng.integers(1, 4)},{rng.integers(20, 60)},ok".encode() for _ in range(n)
    ]


# what a bad field may hold: outside the domain, missing, not an integer, not UTF-8, a private value
BAD_SEX = [b"x", SECRET.encode(), b"", b'""', b"F", b" f", b"\xff\xfe", b"NA"]
BAD_REGION = [b"0", b"4", b"", b"1.5", b"one", b"99999999999999999999", b"\xc3"]
BAD_AGE = [b"150", b"-3", b"19", b"60", b"", b"20.5", b"1e3", b" 25 x", b"+", b"\xe9", SECRET.encode()]


@st.composite
def bad_row(draw) -> bytes:
    fields = [
        draw(st.sampled_from(BAD_SEX + [b"f", b"m"])),
        draw(st.sampled_from(BAD_REGION + [b"2"])),
        draw(st.sampled_from(BAD_AGE + [b"33"])),
        b"note",
    ]
    shape = draw(st.sampled_from(["fields", "extra", "short", "empty-note"]))
    if shape == "extra":  # a field too many (malformed)
        fields.append(SECRET.encode())
    elif shape == "short":  # a field too few (malformed)
        fields = fields[:2]
    elif shape == "empty-note":
        fields[3] = b""
    return b",".join(fields)


def spec_doc(dataset: str, policy: str, age_policy: str | None) -> dict:
    age = {"name": "age", "range": [20, 59], "bin_width": 10}
    if age_policy:
        age["out_of_domain"] = age_policy
    return {
        "kind": "dpquery",
        "dataset": dataset,
        "schema": [
            {"name": "sex", "categories": ["f", "m"]},
            {"name": "region", "categories": [1, 2, 3]},
            age,
        ],
        "workload": [{"attributes": []}, {"attributes": ["sex", "region"]}, {"attributes": ["age"]}],
        "budget": {"rho": 0.1},
        "dataset_id": "fuzz",
        "dataset_budget_rho": 1.0,
        "out_of_domain": policy,
        "noise_samples_per_task": 4,
        "cells_per_task": 8,
    }


NOISY = re.compile(r"^jobs/[^/]+/(dpquery/measurements/.*\.bin|output/\d{5}-.*\.(parquet|json))$")
TIME = re.compile(rb'"time": ?"[^"]*"')


def run_job(root: str, doc: dict) -> dict:
    """Every stage of the job through the core (real noise), returning what each stage returned."""
    spec = parse_spec(doc)
    returned = {"prepare": core.prepare(spec, JOB_ID, root)}
    for item in store.get_json(returned["prepare"]["measure"]["uri"]):
        returned[f"measure {item['group']}"] = core.measure(spec, JOB_ID, root, item["group"])
    for item in store.get_json(returned["prepare"]["reconstruct"]["uri"]):
        returned[f"reconstruct {item['group']}"] = core.reconstruct(spec, JOB_ID, root, item["group"])
    returned["finalize"] = core.finalize(spec, JOB_ID, root)
    return returned


CONTENT_HASH = re.compile(rb"sha256:[0-9a-f]{64}")


def written(root: Path, dataset_key: str) -> dict[str, bytes]:
    """Every object the job wrote except the noisy ones, with the store root and timestamps masked."""
    out = {}
    # the dataset fingerprint (plan.json, and the release metadata of the result and tables) identifies the
    # file, as its name does: it differs between any two files, neighbours or not
    plans = list(root.rglob("plan.json"))
    fingerprint = json.loads(plans[0].read_bytes()).get("dataset_fingerprint", "") if plans else ""
    for path in sorted(root.rglob("*")):
        key = path.relative_to(root).as_posix()
        if not path.is_file() or key == dataset_key or NOISY.match(key):
            continue
        if key.startswith("ledger/_by-fingerprint/"):  # the content hash is the ledger's own record
            key = "ledger/_by-fingerprint/F.json"
        body = path.read_bytes().replace(str(root).encode(), b"ROOT")
        body = TIME.sub(b'"time": "T"', body)
        if fingerprint:
            body = body.replace(fingerprint.encode(), b"F")
        body = CONTENT_HASH.sub(b"sha256:H", body)  # the ledger's content fingerprint, likewise
        if key.endswith("dpquery/plan.json"):
            doc = json.loads(body)
            doc["dataset_fingerprint"] = "F"
            body = json.dumps(doc, sort_keys=True).encode()
        out[key] = body
    return out


def observe(tmp: Path, name: str, fmt: str, content: bytes, policy: str, age_policy: str | None):
    root = tmp / name
    root.mkdir()
    key = f"data/people.{fmt}"
    (root / "data").mkdir()
    (root / key).write_bytes(content)
    returned = run_job(f"file://{root}", spec_doc(join(f"file://{root}", key), policy, age_policy))
    masked = json.loads(json.dumps(returned).replace(str(root), "ROOT"))
    return masked, written(root, key)


def assert_same_observations(tmp: Path, fmt: str, datasets: dict[str, bytes], policy, age_policy) -> None:
    seen = {name: observe(tmp, name, fmt, body, policy, age_policy) for name, body in datasets.items()}
    (base_returned, base_written), *_ = seen.values()
    for name, (returned, objects) in seen.items():
        assert returned == base_returned, name
        assert objects.keys() == base_written.keys(), name
        for key in objects:
            assert objects[key] == base_written[key], (name, key)
        assert not any(SECRET.encode() in b for b in objects.values())


def csv_neighbours(rows: list[bytes], bad: bytes, at: int, gone: int) -> dict[str, bytes]:
    def doc(rs: list[bytes]) -> bytes:
        return HEADER.encode() + b"\n" + b"\n".join(rs) + b"\n"

    return {
        "D": doc(rows),
        "D+bad": doc(rows[:at] + [bad] + rows[at:]),
        "D-good": doc(rows[:gone] + rows[gone + 1 :]),
    }


POLICIES = st.tuples(st.sampled_from(["drop", "other"]), st.sampled_from([None, "drop", "clip", "other"]))


def test_neighbouring_csv_datasets_write_the_same_objects(tmp_path):
    """Two fixed patterns (a private value in a malformed row; bytes that are not UTF-8 and an age out of
    range, clipped): the quick version of the fuzz below."""
    rows = good_rows(30, seed=1)
    cases = [
        (f"f,2,33,note,{SECRET}".encode(), "drop", None),
        (b"\xff\xfe,4,150,note", "other", "clip"),
    ]
    for i, (bad, policy, age_policy) in enumerate(cases):
        tmp = tmp_path / str(i)
        tmp.mkdir()
        assert_same_observations(tmp, "csv", csv_neighbours(rows, bad, at=7, gone=11), policy, age_policy)


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bad=bad_row(), at=st.integers(0, 20), gone=st.integers(0, 19), policies=POLICIES, data=st.data())
def test_fuzzed_bad_csv_rows_change_nothing_but_the_noisy_tables(
    tmp_path_factory, bad, at, gone, policies, data
):
    rows = good_rows(20, seed=data.draw(st.integers(0, 3)))
    tmp = tmp_path_factory.mktemp("fuzz-csv")
    assert_same_observations(tmp, "csv", csv_neighbours(rows, bad, at, gone), *policies)


def parquet_bytes(sex: list, region: list, age: list) -> bytes:
    import io

    buf = io.BytesIO()
    t = pa.table({"sex": pa.array(sex, pa.string()), "region": pa.array(region), "age": pa.array(age)})
    pq.write_table(t, buf)
    return buf.getvalue()


@pytest.mark.slow
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sex=st.sampled_from([None, "x", SECRET, "f"]),
    region=st.sampled_from([None, 0, 4, -(2**63), 2]),
    age=st.sampled_from([None, 150.0, 20.5, float("nan"), float("inf"), -3.0, 33.0]),
    at=st.integers(0, 20),
    policies=POLICIES,
)
def test_fuzzed_bad_parquet_rows_change_nothing_but_the_noisy_tables(
    tmp_path_factory, sex, region, age, at, policies
):
    rng = np.random.default_rng(2)
    n = 20
    cols = (
        [str(v) for v in np.array(["f", "m"])[rng.integers(0, 2, n)]],
        [int(v) for v in rng.integers(1, 4, n)],
        [float(v) for v in rng.integers(20, 60, n)],
    )

    def with_row(row):
        return parquet_bytes(*[c[:at] + [v] + c[at:] for c, v in zip(cols, row, strict=True)])

    datasets = {
        "D": parquet_bytes(*cols),
        "D+bad": with_row((sex, region, age)),
        "D-good": parquet_bytes(*[c[:at] + c[at + 1 :] for c in cols]),
    }
    assert_same_observations(tmp_path_factory.mktemp("fuzz-pq"), "parquet", datasets, *policies)
