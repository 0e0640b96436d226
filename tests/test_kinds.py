"""Job kinds: a new kind is new files only, and the descriptors are the one table of kinds.

The fixture writes a minimal kind, ``tally``, as a package in a temporary folder — its descriptor, spec,
workflow, handlers and sizing — names it in ``SHARDFOLD_KIND_PACKAGES``, and runs it through the one submit
path on the local executor (one step in worker processes) and on moto's Step Functions interpreter, and
compiles its ASL. No file of the project is touched.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from shardfold.client import Client
from shardfold.client.backends import compile_asl
from shardfold.functions import kinds
from shardfold.functions.errors import PlanError, SpecError
from shardfold.functions.specs import parse_spec, uri_fields

TALLY = {
    "__init__.py": '"""A test kind: the total length of some words."""\n',
    "kind.py": """
        from typing import Literal

        from shardfold.functions.kinds import JobKind
        from shardfold.functions.specs import OutputUri, StrictModel
        from shardfold.functions.workflow import Map, Task, Workflow

        class TallyJob(StrictModel):
            kind: Literal["tally"] = "tally"
            words: list[str]
            output: OutputUri | None = None

        SPLIT = Task("split", "tally.split", memory_mb=256)
        COUNT_WORD = Task("count_word", "tally.count", mode="process", memory_mb=256)
        COUNT = Map("count", items="$.split.worklist", body=(COUNT_WORD,))
        TOTAL = Task("total", "tally.total", memory_mb=256)
        WORKFLOW = Workflow(kind="tally", steps=(SPLIT, COUNT, TOTAL))

        KIND = JobKind(
            name="tally",
            package=__package__,
            spec=TallyJob,
            workflow=WORKFLOW,
            sizing="tally.sizing",
            rights=frozenset(),  # its tasks touch their job's folder only
        )
    """,
    "handlers.py": """
        from shardfold.functions import store
        from shardfold.functions.worklist import write_worklist
        from shardfold.functions.specs import parse_spec
        from shardfold.functions.store.uri import join

        def _uri(event, *parts):
            return join(event["store_root"], "jobs", event["job_id"], "tally", *parts)

        def split(event, context):
            spec = parse_spec(store.get(event["spec_uri"]))
            items = [{"i": i, "word": w} for i, w in enumerate(spec.words)]
            return {"worklist": write_worklist(_uri(event, "worklist.json"), items), "n": len(items)}

        def count(event, context):
            item = event["item"]
            store.put_json(_uri(event, "counts", f"{item['i']:05d}.json"), len(item["word"]))
            return {}

        def total(event, context):
            n = event["split"]["n"]
            total = sum(store.get_json(_uri(event, "counts", f"{i:05d}.json")) for i in range(n))
            result = {"job_id": event["job_id"], "kind": "tally", "total": total}
            store.put_json(join(event["store_root"], "jobs", event["job_id"], "result.json"), result)
            return {"total": total}
    """,
    "sizing.py": """
        from shardfold.functions.estimate import MiB, Loads, Probe, TaskLoad
        from tally.kind import COUNT, COUNT_WORD, SPLIT, TOTAL

        def probe(spec, store_root, budget):
            return Probe(facts={"words": len(spec.words), "longest": max(map(len, spec.words))})

        def loads(spec, probed):
            n = probed.facts["words"]
            word = TaskLoad(100 * MiB, {"the longest word": probed.facts["longest"] * MiB}, gets=1, puts=1)
            return Loads(
                items=n,
                tasks={SPLIT: TaskLoad(100 * MiB), COUNT_WORD: word, TOTAL: TaskLoad(100 * MiB)},
                map_items={COUNT: n},
            )
    """,
}


@pytest.fixture
def tally(tmp_path, monkeypatch):
    package = tmp_path / "plugins" / "tally"
    package.mkdir(parents=True)
    for name, text in TALLY.items():
        (package / name).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path / "plugins"))
    monkeypatch.setenv(kinds.EXTRA_PACKAGES_ENV, "tally")
    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "store"))
    yield {"kind": "tally", "words": ["a", "bb", "ccc", "dddd"]}
    for name in [m for m in sys.modules if m == "tally" or m.startswith("tally.")]:
        del sys.modules[name]


@pytest.mark.slow
def test_a_kind_in_its_own_package_runs_everywhere(tally):
    assert (
        "tally" in kinds.names() and kinds.find("tally").handler_path("tally.count") == "tally.handlers:count"
    )
    with Client() as local:
        job = local.submit(tally)
        assert job.wait(progress=False).state == "SUCCEEDED"
        assert job.result()["total"] == 10
        plan = local.plan(tally)
        assert [(s.name, s.tasks) for s in plan.steps] == [("split", 1), ("count_word", 4), ("total", 1)]
    with Client(backend="moto") as moto:
        job = moto.submit(tally)
        assert job.wait(progress=False).state == "SUCCEEDED"
        assert job.result()["total"] == 10
    asl = compile_asl("tally", region="us-east-1", account="123456789012", stage="dev")
    assert {"split", "count", "total"} <= set(asl["States"])
    # the one table of kinds: the spec union knows it too
    assert "tally" in kinds.spec_union().json_schema()["discriminator"]["mapping"]


def test_the_new_kind_is_refused_like_any_other(tally):
    with Client() as local:
        with pytest.raises(PlanError, match=r"count_word.*memory_mb of step 'count_word'"):
            local.plan({**tally, "words": ["x" * 500]})  # 600 MiB projected, 256 MiB configured
        with pytest.raises(SpecError, match="words"):
            local.submit({"kind": "tally"})


def test_unknown_kinds_and_broken_descriptors_are_errors(tmp_path, monkeypatch):
    with pytest.raises(SpecError, match="unknown job kind 'nope'") as info:
        parse_spec({"kind": "nope"})
    assert info.value.errors[0]["field"] == "kind"
    package = tmp_path / "broken"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "kind.py").write_text("KIND = 'not a descriptor'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(kinds.EXTRA_PACKAGES_ENV, "broken")
    with pytest.raises(PlanError, match="must be the JobKind"):
        kinds.find("broken")


def test_builtin_kinds_are_discovered_without_importing_them():
    before = set(sys.modules)
    here = Path(kinds.__file__).parent  # every folder of functions/ with a kind.py is a kind
    assert kinds.names() == sorted(p.parent.name for p in here.glob("*/kind.py"))
    assert len(kinds.names()) >= 4
    assert not {m for m in set(sys.modules) - before if m.startswith("functions.")}


def test_uri_fields_come_from_the_declared_types():
    spec = parse_spec(
        {
            "kind": "fedavg",
            "clients": [{"uri": "./a.safetensors"}, {"uri": "b.safetensors", "weight": 2}],
            "output": "../out.safetensors",
        },
        base_uri="s3://bucket/jobs/round.json",
    )
    found = [(f.field, f.uri, f.role) for f in uri_fields(spec)]
    assert found == [
        ("clients.0.uri", "s3://bucket/jobs/a.safetensors", "input"),
        ("clients.1.uri", "b.safetensors", "input"),
        ("output", "s3://bucket/out.safetensors", "output"),
    ]
    events = Path(__file__).resolve().parent.parent / "events"
    dp = parse_spec(json.loads((events / "dpquery.json").read_text()))
    assert [f.field for f in uri_fields(dp)] == ["dataset"]


def test_the_uri_walk_passes_by_only_fields_that_can_hold_no_uri():
    from typing import Any, Literal

    from pydantic import BaseModel

    from shardfold.functions.specs import BatchItem, InputUri, OutputUri, _fields

    class Inner(BaseModel):
        path: InputUri
        note: str = ""

    class Outer(BaseModel):
        count: int = 0
        label: Literal["a", "b"] = "a"
        items: list[BatchItem] | None = None
        inner: Inner | None = None
        anything: Any = None  # the walk cannot see into it, so it is walked
        out: OutputUri

    assert [name for name, *_ in _fields(Outer)] == ["items", "inner", "anything", "out"]
    spec = Outer(
        items=[BatchItem(uri="file:///d/x"), BatchItem(uri="k", start=3)],
        inner=Inner(path="file:///d/y"),
        anything=Inner(path="file:///d/z"),
        out="file:///d/out",
    )
    found = [(f.field, f.uri) for f in uri_fields(spec)]
    assert found == [
        ("items.0.uri", "file:///d/x"),
        ("items.1.uri", "k"),
        ("inner.path", "file:///d/y"),
        ("anything.path", "file:///d/z"),
        ("out", "file:///d/out"),
    ]
