"""A tiny test-only job kind, ``toy``, that exercises every executor feature without the real kinds.

Spec (a JSON object at ``spec_uri``)::

    {"kind": "toy", "n": 10,            # items 0..n-1; the result is the sum of their squares
     "fail": [3],                       # items that raise ValueError while jobs/<id>/toy/fail-switch exists
     "transient": {"2": 2},             # item -> how many times it raises ConnectionError before succeeding
     "gate": false,                     # items wait for GATE (a threading.Event; thread mode only)
     "parts": 0,                        # >0: plan groups items into parts of this size (map over parts)
     "looks": 3}                        # toy.look (a polling Task) is ready at its third call

Every call of ``square`` leaves a marker under ``jobs/<id>/toy/calls/`` so tests count invocations through
the store (they work across processes); outputs are written put-if-absent, so a re-run does no new work.
"""

from __future__ import annotations

import json
import threading
import uuid
from typing import Any

from shardfold.functions import store
from shardfold.functions.store.uri import join
from shardfold.functions.workflow import BatchJob, Map, Parallel, Retry, Task, Workflow
from shardfold.functions.worklist import write_worklist
from shardfold.orchestrator.registry import register

GATE = threading.Event()  # tests release blocked items with GATE.set()
STARTED = threading.Event()  # set when the first gated item has started

TOY_RETRY = (Retry(errors=("ConnectionError",), interval_s=1, max_attempts=3, backoff=1.0),)


def _uri(event: dict[str, Any], *parts: str) -> str:
    return join(event["store_root"], "jobs", event["job_id"], "toy", *parts)


def _spec(event: dict[str, Any]) -> dict[str, Any]:
    return store.get_json(event["spec_uri"])


def plan(event: dict[str, Any], context: Any) -> dict[str, Any]:
    spec = _spec(event)
    n = int(spec["n"])
    size = int(spec.get("parts") or 0)
    if size:
        store.put_json(_uri(event, "items.json"), list(range(n)))
        items: list[Any] = [{"first": p, "count": min(size, n - p)} for p in range(0, n, size)]
    else:
        items = [{"i": i} for i in range(n)]
    return {"worklist": write_worklist(_uri(event, "worklist.json"), items), "n": n}


def square(event: dict[str, Any], context: Any) -> dict[str, Any]:
    i = int(event["item"]["i"])
    spec = _spec(event)
    out = _uri(event, "out", f"{i:06d}.json")
    calls = store.list_uris(_uri(event, "calls", f"{i:06d}") + "-")
    store.put(_uri(event, "calls", f"{i:06d}-{uuid.uuid4().hex}"), b"")
    if spec.get("gate"):
        STARTED.set()
        if not GATE.wait(timeout=30):
            raise TimeoutError("the test never opened the gate")
    if len(calls) < int(spec.get("transient", {}).get(str(i), 0)):
        raise ConnectionError(f"item {i}: transient failure {len(calls) + 1}")
    if i in spec.get("fail", []) and store.exists(_uri(event, "fail-switch")):
        raise ValueError(f"item {i} is bad")
    store.put_if_absent(out, json.dumps({"i": i, "square": i * i}).encode())
    return {"i": i}


def square_part(event: dict[str, Any], context: Any) -> dict[str, Any]:
    part = event["item"]
    items = store.get_json(_uri(event, "items.json"))[part["first"] : part["first"] + part["count"]]
    store.put_if_absent(
        _uri(event, "out", f"{part['first']:06d}.json"),
        json.dumps({"i": part["first"], "square": sum(i * i for i in items)}).encode(),
    )
    return {"part": part["first"]}


def total(event: dict[str, Any], context: Any) -> dict[str, Any]:
    outs = store.list_uris(_uri(event, "out") + "/")
    result = {
        "sum": sum(store.get_json(u)["square"] for u in outs),
        "outputs": len(outs),
        "n": event["plan"]["n"],
    }
    store.put_json(join(event["store_root"], "jobs", event["job_id"], "result.json"), result)
    return result


def stamp(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """A second Parallel branch: proves branch results are selected into $.<parallel name>."""
    return {"job": event["job_id"]}


def echo(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """The spec's ``echo`` object, as the step's result (what a later step's ``mode_from`` reads)."""
    return dict(_spec(event).get("echo") or {})


def batch_double(event: dict[str, Any], context: Any) -> None:
    """A BatchJob entry point: reads the total and writes its double (the result is discarded)."""
    store.put_json(_uri(event, "batch.json"), {"double": 2 * event["total"]["sum"]})


def nap(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Sleep ``spec["nap_s"]`` seconds (a task that runs past its timeout), then leave a marker."""
    import time

    time.sleep(float(_spec(event).get("nap_s", 0)))
    store.put(_uri(event, "napped"), b"")
    return {"napped": True}


def whereabouts(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """What the task sees: its pid, ``$TOY_MARK``, and ``VALUE`` of the module ``spec["module"]``."""
    import importlib
    import os

    module = _spec(event).get("module")
    seen = {"pid": os.getpid(), "mark": os.environ.get("TOY_MARK")}
    seen["value"] = importlib.import_module(module).VALUE if module else None
    store.put_json(_uri(event, "whereabouts.json"), seen)
    return {}


def look(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """A polling Task: not ready (wait 1 s) until its ``spec["looks"]``-th call; counts its calls in the
    state it is handed back (``$.look``) and in the store."""
    seen = (event.get("look") or {}).get("seen", 0) + 1
    store.put(_uri(event, "looks", f"{seen:03d}-{uuid.uuid4().hex}"), b"")
    if seen < int(_spec(event).get("looks", 1)):
        return {"ready": False, "wait_s": 1, "seen": seen}
    return {"ready": True, "seen": seen}


def polled(last: bool = False) -> Workflow:
    """A polling Task (``toy.look``) before another step, or ending the workflow (``last``)."""
    steps = (Task("look", "toy.look", poll=True),) + (() if last else (Task("stamp", "toy.stamp"),))
    return Workflow(kind="toypolllast" if last else "toypoll", steps=steps)


def scrub(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """A workflow's on_failure task: records that it ran and the error it was handed (``$.error``)."""
    store.put_json(_uri(event, "scrubbed.json"), {"error": event.get("error")})
    return {}


def toy_scrubbed(mode: str = "thread") -> Workflow:
    """The toy workflow with an on_failure task (``toy.scrub``)."""
    return Workflow(
        kind="toyscrub", steps=toy_workflow(mode=mode).steps, on_failure=Task("scrub", "toy.scrub")
    )


def scrubbed(store_root: str, job_id: str) -> dict[str, Any] | None:
    """What ``toy.scrub`` recorded for the job, or None when it did not run."""
    uri = join(store_root, "jobs", job_id, "toy", "scrubbed.json")
    return store.get_json(uri) if store.exists(uri) else None


for _name, _fn in {
    "toy.scrub": scrub,
    "toy.look": look,
    "toy.whereabouts": whereabouts,
    "toy.nap": nap,
    "toy.plan": plan,
    "toy.square": square,
    "toy.square_part": square_part,
    "toy.total": total,
    "toy.stamp": stamp,
    "toy.echo": echo,
    "toy.batch_double": batch_double,
}.items():
    register(_name, _fn)


def toy_workflow(mode: str = "thread", max_concurrency: int = 4, batch: bool = False) -> Workflow:
    steps: list[Any] = [
        Task("plan", "toy.plan"),
        Map(
            "squares",
            items="$.plan.worklist",
            body=(Task("square", "toy.square", mode=mode, retry=TOY_RETRY),),  # type: ignore[arg-type]
            max_concurrency=max_concurrency,
        ),
        Task("total", "toy.total"),
    ]
    if batch:
        steps.append(BatchJob("double", "toy.batch_double", timeout_s=600))
    return Workflow(kind="toy", steps=tuple(steps))


def parts_workflow() -> Workflow:
    """Map over parts of a big item list (the getbatch shape): the work list of parts stays in the store."""
    return Workflow(
        kind="toyparts",
        steps=(
            Task("plan", "toy.plan"),
            Parallel(
                "fan",
                branches=(
                    (Map("parts", items="$.plan.worklist", body=(Task("part", "toy.square_part"),)),),
                    (Task("stamp", "toy.stamp"),),
                ),
            ),
            Task("total", "toy.total"),
        ),
    )


def write_spec(store_root: str, job_id: str, **spec: Any) -> str:
    uri = join(store_root, "jobs", job_id, "spec.json")
    store.put_json(uri, {"kind": "toy", **spec})
    return uri


def calls(store_root: str, job_id: str) -> dict[int, int]:
    """{item: number of square calls} from the call markers."""
    out: dict[int, int] = {}
    for uri in store.list_uris(join(store_root, "jobs", job_id, "toy", "calls") + "/"):
        i = int(uri.rsplit("/", 1)[-1].split("-", 1)[0])
        out[i] = out.get(i, 0) + 1
    return out


def fail_switch(store_root: str, job_id: str, on: bool) -> None:
    uri = join(store_root, "jobs", job_id, "toy", "fail-switch")
    if on:
        store.put(uri, b"on")
    else:
        store.delete(uri)
