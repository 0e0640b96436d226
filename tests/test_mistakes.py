"""Common mistakes of a new user, as a table: each one submitted as a user would (a spec file beside its
data, a dict from Python, the CLI), and what it must give: a clear error at submit that names the field
and the fix, or, where the spelling is right, a job that runs. Nothing here waits minutes to fail in a
task: every refusal happens before a job is recorded."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

from shardfold.client import Client
from shardfold.client.cli import cli
from shardfold.functions.errors import ShardfoldError

EVENTS = Path(__file__).resolve().parent.parent / "events"


@dataclass(frozen=True)
class Mistake:
    name: str
    # (the folder the spec file and its data sit in) -> a spec (a dict, or a Path of a spec file)
    spec: Callable[[Path], dict | Path]
    refused: str | None  # a pattern the error at submit must hold (the field, the fix); None: it runs
    field: str | None = None  # the field the error names


def _event(name: str, **over) -> Callable[[Path], dict]:
    def make(folder: Path) -> dict:
        doc = json.loads((EVENTS / f"{name}.json").read_text())
        doc.update(over)
        return doc

    return make


def _file(make: Callable[[Path], dict]) -> Callable[[Path], Path]:
    """The spec written as a file in the folder, beside its data."""

    def write(folder: Path) -> Path:
        path = folder / "spec.json"
        path.write_text(json.dumps(make(folder)))
        return path

    return write


def _getbatch(*uris: str, **over) -> Callable[[Path], dict]:
    return lambda folder: {
        "kind": "getbatch",
        "items": [{"uri": u(folder) if callable(u) else u} for u in uris],
        **over,
    }


def _many_parts(folder: Path) -> dict:
    """60,000 items, one per part: a Map of 60,000 children."""
    (folder / "items.jsonl").write_text('{"uri": "./data/hello.txt"}\n' * 60_000)
    return {"kind": "getbatch", "manifest": "./items.jsonl", "items_per_part": 1}


MISTAKES = [
    # paths: what a spelling means
    Mistake(
        "a bare relative path beside the spec file",
        _file(_getbatch("data/hello.txt")),
        r"'\./data/hello\.txt'",
        "items.0.uri",
    ),
    Mistake("./ beside the spec file", _file(_getbatch("./data/hello.txt")), None),
    Mistake("an absolute path", _getbatch(lambda f: str(f / "data" / "hello.txt")), None),
    Mistake(
        "an absolute path to nothing",
        _getbatch(lambda f: str(f / "data" / "nope.txt")),
        r"no file at",
        "items.0.uri",
    ),
    Mistake("a dict's ./ is the working directory", _getbatch("./data/hello.txt"), None),
    Mistake("a dict's ./ to nothing", _getbatch("./data/nope.txt"), r"no file at .*nope\.txt", "items.0.uri"),
    Mistake(
        "a missing file in a spec file",
        _file(_getbatch("./data/hello.txt", "./data/gone.txt")),
        r"items\.1\.uri",
        "items.1.uri",
    ),
    Mistake(
        "a missing file, continue_on_error", _file(_getbatch("./data/gone.txt", continue_on_error=True)), None
    ),
    # errors found at submit, not in a task minutes later
    Mistake(
        "a missing fedavg client",
        _file(
            _event(
                "fedavg",
                clients=[
                    {"uri": "./data/fedavg/client-0.safetensors"},
                    {"uri": "./data/fedavg/client-9.safetensors"},
                ],
            )
        ),
        r"client-9",
        "clients",
    ),
    Mistake(
        "a dpquery column the dataset lacks",
        _file(
            _event(
                "dpquery",
                schema=[{"name": "agee", "range": [18, 89], "bin_width": 10}],
                workload=[{"attributes": ["agee"]}],
            )
        ),
        r"no column 'agee'; its \d+ column\(s\): 'age'",
        None,
    ),
    Mistake(
        "a dpquery dataset that is not there",
        _file(_event("dpquery", dataset="./data/dpquery/nobody.csv")),
        r"no object at .*nobody\.csv",
        "dataset",
    ),
    Mistake(
        "an inference field no row has", _file(_event("inference", field="txt")), r"no 'txt'.*'text'", "field"
    ),
    Mistake(
        "an inference id_field no row has",
        _file(_event("inference", id_field="key")),
        r"no 'key'",
        "id_field",
    ),
    Mistake(
        "an inference input that is not there",
        _file(_event("inference", inputs=["./data/inference/nothing.jsonl"])),
        r"nothing\.jsonl",
        "inputs.0",
    ),
    Mistake(
        "more parts than a Map may have",
        _file(_many_parts),
        r"'gather_part' would run 60,000 tasks.*items_per_part",
        None,
    ),
    # the spec itself
    Mistake(
        "no kind", lambda f: {"items": [{"uri": "./data/hello.txt"}]}, r"has no 'kind'.*getbatch", "kind"
    ),
    Mistake(
        "a misspelt kind", lambda f: {"kind": "getbach", "items": []}, r"unknown job kind 'getbach'", "kind"
    ),
    Mistake(
        "a misspelt field",
        lambda f: {"kind": "getbatch", "itmes": [{"uri": "./data/hello.txt"}]},
        r"itmes",
        None,
    ),
    Mistake(
        "items and a manifest",
        lambda f: {"kind": "getbatch", "items": [{"uri": "./data/hello.txt"}], "manifest": "m.jsonl"},
        r"exactly one of 'items'",
        None,
    ),
    Mistake(
        "a negative start",
        lambda f: {"kind": "getbatch", "items": [{"uri": "./data/hello.txt", "start": -1}]},
        r"items\.0\.start",
        None,
    ),
    Mistake("a dpquery budget without rho or epsilon", _file(_event("dpquery", budget={})), r"budget", None),
]


@pytest.fixture
def folder(tmp_path, monkeypatch) -> Path:
    """A user's folder: the shipped events' data in ``data/``, the working directory, its own store."""
    shutil.copytree(EVENTS / "data", tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "store"))
    monkeypatch.delenv("SHARDFOLD_BACKEND", raising=False)
    return tmp_path


@pytest.mark.parametrize("mistake", MISTAKES, ids=[m.name for m in MISTAKES])
def test_each_mistake_is_refused_at_submit_naming_the_fix_or_runs(mistake, folder):
    spec = mistake.spec(folder)
    with Client() as client:
        if mistake.refused is None:
            job = client.submit(spec)
            assert job.wait(progress=False, timeout_s=120).state == "SUCCEEDED", job.status().error
            return
        with pytest.raises(ShardfoldError) as caught:
            client.submit(spec)
        assert client.jobs() == [], "a refused spec records no job"
    message = str(caught.value)
    assert re.search(mistake.refused, message), message
    if mistake.field is not None:
        fields = [e.get("field") for e in getattr(caught.value, "errors", None) or []]
        assert mistake.field in fields or message.startswith(mistake.field), (fields, message)


def test_the_cli_reads_a_spec_from_stdin_its_paths_from_the_working_directory(folder):
    spec = json.dumps({"kind": "getbatch", "items": [{"uri": "./data/hello.txt"}]})
    res = CliRunner().invoke(cli, ["run", "-", "--json"], input=spec, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["items"] == 1
    gone = CliRunner().invoke(cli, ["run", "-"], input=spec.replace("hello", "nope"))
    assert gone.exit_code != 0 and "no file at" in gone.output and "nope.txt" in gone.output
