"""Specs are strict: a value of the wrong JSON type is refused naming its field, never coerced; every sample
spec still parses and round-trips through JSON."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from shardfold.functions import kinds
from shardfold.functions.errors import SpecError
from shardfold.functions.specs import dump_spec, parse_spec

EVENTS = Path(__file__).resolve().parent.parent / "events"
SAMPLES = sorted(p for p in EVENTS.glob("*.json") if "kind" in json.loads(p.read_text()))


def sample(kind: str) -> dict:
    return json.loads((EVENTS / f"{kind}.json").read_text())


def test_every_kind_has_a_sample_spec():
    assert {json.loads(p.read_text())["kind"] for p in SAMPLES} == set(kinds.names())


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_sample_specs_parse_and_round_trip(path):
    spec = parse_spec(path.read_text(), base_uri=path.resolve().as_uri())
    assert parse_spec(json.dumps(dump_spec(spec))) == spec


def _set(doc: dict, loc: tuple, value) -> dict:
    doc = copy.deepcopy(doc)
    target = doc
    for key in loc[:-1]:
        target = target[key]
    target[loc[-1]] = value
    return doc


# (kind, where in the sample, a value of the wrong JSON type, the field the error names)
BAD = [
    ("getbatch", ("items", 0, "start"), "2", "items.0.start"),
    ("getbatch", ("items", 0, "length"), "16", "items.0.length"),
    ("getbatch", ("items", 0, "length"), 16.0, "items.0.length"),
    ("getbatch", ("items_per_part",), "2", "items_per_part"),
    ("getbatch", ("continue_on_error",), "true", "continue_on_error"),
    ("getbatch", ("continue_on_error",), 1, "continue_on_error"),
    ("getbatch", ("items", 0, "uri"), 7, "items.0.uri"),
    ("fedavg", ("clients", 0, "weight"), "5", "clients.0.weight"),
    ("fedavg", ("trim_fraction",), "0.1", "trim_fraction"),
    ("fedavg", ("shards",), "2", "shards"),
    ("fedavg", ("uniform",), "false", "uniform"),
    ("dpquery", ("budget",), {"rho": "0.1"}, "budget.rho"),
    ("dpquery", ("budget", "epsilon"), "1.0", "budget.epsilon"),
    ("dpquery", ("dataset_budget_rho",), "1", "dataset_budget_rho"),
    ("dpquery", ("schema", 0, "range"), ["18", 89], "schema.0.range.0"),
    ("dpquery", ("schema", 0, "bin_width"), "10", "schema.0.bin_width"),
    ("dpquery", ("workload", 3, "weight"), "2", "workload.3.weight"),
    ("dpquery", ("noise_samples_per_task",), "4", "noise_samples_per_task"),
    ("inference", ("max_tokens",), "128", "max_tokens"),
    ("inference", ("shard_rows",), 10.0, "shard_rows"),
    ("inference", ("gpu_workers",), "1", "gpu_workers"),
    ("inference", ("inputs", 0), 3, "inputs.0"),
]


@pytest.mark.parametrize("kind, loc, value, field", BAD, ids=lambda x: str(x) if isinstance(x, str) else None)
def test_a_value_of_the_wrong_type_is_refused_naming_its_field(kind, loc, value, field):
    doc = _set(sample(kind), loc, value)
    with pytest.raises(SpecError) as info:
        parse_spec(doc)
    assert field in {e["field"] for e in info.value.errors}, info.value.errors
    assert field in str(info.value) and "errors.pydantic.dev" not in str(info.value)
    (err,) = [e for e in info.value.errors if e["field"] == field]
    assert "got " in err["error"]  # says what was given


def test_an_integer_is_still_a_number():
    # JSON has one number type: 5 is a valid weight, 1 a valid rho
    doc = _set(sample("fedavg"), ("clients", 0, "weight"), 5)
    assert parse_spec(doc).clients[0].weight == 5.0
    doc = sample("dpquery")
    doc["budget"] = {"rho": 1}
    assert parse_spec(doc).budget.rho == 1.0


def test_a_range_is_a_json_list_of_two_integers():
    attr = lambda r: parse_spec(_set(sample("dpquery"), ("schema", 0, "range"), r))  # noqa: E731
    assert attr([18, 89]).schema_[0].range == (18, 89)
    for bad in ([18], [18, 50, 89], [18.5, 89], "18-89"):
        with pytest.raises(SpecError, match=r"schema\.0\.range"):
            attr(bad)


@pytest.mark.parametrize(
    "start, length, refused", [(5, 0, True), (0, 0, False), (5, 1, False), (5, None, False)]
)
def test_a_zero_length_range_after_the_start_is_refused_naming_its_length(start, length, refused):
    item = {"uri": "data/x", "start": start} | ({} if length is None else {"length": length})
    doc = {"kind": "getbatch", "items": [{"uri": "data/y"}, item]}
    if not refused:
        assert parse_spec(doc).items[1].length == length
        return
    with pytest.raises(SpecError, match="selects nothing") as info:
        parse_spec(doc)
    assert [e["field"] for e in info.value.errors] == ["items.1.length"]
