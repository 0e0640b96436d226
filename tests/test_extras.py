"""Optional dependencies (functions.extras): what each kind and feature needs beyond the base install, and
the one-line refusal, at submit, when this machine runs the tasks and lacks it. tests/test_wheel.py checks
the same against a real base install."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from shardfold.client.sdk import load_spec_document
from shardfold.functions import extras, kinds
from shardfold.functions.extras import MissingExtra
from shardfold.functions.specs import parse_spec
from shardfold.functions.submit import check, submit

REPO = Path(__file__).resolve().parent.parent
EVENTS = REPO / "events"


@pytest.fixture
def hidden(monkeypatch):
    """Modules made to look uninstalled: ``hidden.add("opendp")``."""
    gone: set[str] = set()
    real = extras.find_spec
    monkeypatch.setattr(extras, "find_spec", lambda name: None if name in gone else real(name))
    return gone


def test_every_extra_named_in_the_code_is_one_of_pyprojects():
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(extras.EXTRAS) <= set(declared)
    all_extras = declared["all"][0]
    assert all(name in all_extras for name in extras.EXTRAS), all_extras  # shardfold[all] has each


def test_the_refusal_names_the_extra_and_what_is_missing(hidden):
    extras.require("dp", "this dpquery job")  # installed here: nothing happens
    hidden.update({"opendp", "cvxpy"})
    assert extras.missing("dp") == ["opendp", "cvxpy"]
    with pytest.raises(MissingExtra) as err:
        extras.require("dp", "this dpquery job")
    assert str(err.value) == (
        "this dpquery job needs the 'dp' extra (opendp, cvxpy not installed): pip install 'shardfold[dp]'"
    )
    extras.require("pandas", "job.telemetry()", modules=("pyarrow",))  # only the modules asked for


def _doc(name: str) -> tuple[dict, str]:
    raw, base = load_spec_document(EVENTS / f"{name}.json")
    return json.loads(raw), base


def _spec(name: str):
    doc, base = _doc(name)
    return parse_spec(doc, base_uri=base)


def test_each_kind_declares_the_extras_its_tasks_import():
    assert kinds.find("getbatch").extras(_spec("getbatch")) == ()
    assert kinds.find("fedavg").extras(_spec("fedavg")) == ()
    assert kinds.find("dpquery").extras(_spec("dpquery")) == ("dp",)
    assert kinds.find("inference").extras(_spec("inference")) == ("inference",)


def test_dp_fedavg_needs_the_dp_extra_and_plain_fedavg_does_not(hidden, local_root):
    doc, base = _doc("fedavg")
    hidden.add("opendp")
    check(doc, store_root=local_root, base_uri=base, runs_here=True)  # plain fedavg: the base install runs it
    structure = doc["clients"][0]["uri"]
    doc["dp"] = {"noise_multiplier": 1.0, "clip_norm": 1.0, "dataset_id": "fed-demo", "structure": structure}
    doc["clients"] = [{k: v for k, v in c.items() if k != "weight"} for c in doc["clients"]]  # DP: uniform
    with pytest.raises(MissingExtra, match=r"this fedavg job needs the 'dp' extra \(opendp not installed\)"):
        check(doc, store_root=local_root, base_uri=base, runs_here=True)


def test_submit_refuses_before_writing_anything_where_the_tasks_run_here_only(hidden, local_root):
    hidden.add("pyarrow")
    started = []
    doc, base = _doc("dpquery")
    with pytest.raises(MissingExtra, match=r"pip install 'shardfold\[dp\]'"):
        submit(doc, store_root=local_root, base_uri=base, start=lambda *a: started.append(a), runs_here=True)
    assert started == [] and not (Path(local_root.removeprefix("file://")) / "jobs").exists()
    # on AWS the deployed images have every extra: the submitting machine needs none
    spec, _ = check(doc, store_root=local_root, base_uri=base, runs_here=False)
    assert spec.kind == "dpquery"
