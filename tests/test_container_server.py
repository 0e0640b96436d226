"""The container server: local Batch containers forked from one process that imported their code once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from shardfold.orchestrator import container_server
from shardfold.orchestrator.local_batch import _environment, run_container

pytestmark = [
    pytest.mark.slow,  # child processes
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the container server is Linux-only"),
]
WAIT_S = 30


@pytest.fixture(autouse=True)
def server_on(monkeypatch):
    monkeypatch.setenv(container_server.ENABLE_ENV, "1")


def _module(tmp_path: Path, monkeypatch, name: str, body: str) -> str:
    """Write a handler module where this process and its containers import it; return its name."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(name, None)
    return name


def _start(module: str, fn: str, tmp_path: Path, preload=False, **event) -> container_server.Container:
    env = _environment(f"{module}:{fn}", f"test.{fn}", event, str(tmp_path / "status.json"), fn)
    return container_server.start(f"{module}:{fn}", env, preload=preload)


def _until(check, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


HANDLERS = """
    import json, os, time
    from shardfold.functions.store.retry import TransientError

    def report(event, context):
        with open(event["out"], "w") as fh:
            comm = open("/proc/self/comm").read().strip()
            json.dump({"pid": os.getpid(), "ppid": os.getppid(), "comm": comm, "cwd": os.getcwd(),
                       "env": os.environ.get("MARK")}, fh)

    def fails(event, context):
        raise ValueError("no")

    def transient(event, context):
        raise TransientError("throttled")

    def sleepy(event, context):
        open(event["out"], "w").write(str(os.getpid()))
        time.sleep(60)
"""


def test_a_container_is_its_own_process_with_the_request_s_environment_and_exit_code(tmp_path, monkeypatch):
    mod = _module(tmp_path, monkeypatch, "sf_cs_handlers", HANDLERS)
    monkeypatch.setenv("MARK", "from the executor")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out.json"
    container = _start(mod, "report", tmp_path, out=str(out))
    assert container.wait(WAIT_S) == 0 and container.poll() == 0
    seen = json.loads(out.read_text())
    server = container_server._server
    assert server is not None
    assert seen["pid"] == container.pid != os.getpid() and seen["ppid"] == server.proc.pid
    assert seen["comm"] == container_server.NAME  # how ps and the tests tell a container from the server
    assert seen["cwd"] == str(tmp_path) and seen["env"] == "from the executor"
    assert _start(mod, "fails", tmp_path).wait(WAIT_S) == 1
    assert _start(mod, "transient", tmp_path).wait(WAIT_S) == 75  # EX_TEMPFAIL, as Batch's retry table reads
    assert container_server._server is server  # one server for every container of this process


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_signal_reaches_the_container_and_its_death_reads_as_minus_the_signal(tmp_path, monkeypatch, sig):
    mod = _module(tmp_path, monkeypatch, "sf_cs_handlers", HANDLERS)
    out = tmp_path / "pid"
    container = _start(mod, "sleepy", tmp_path, out=str(out))
    _until(out.exists, "the container to start")
    with pytest.raises(subprocess.TimeoutExpired):
        container.wait(0.05)
    container.send_signal(sig)
    assert container.wait(WAIT_S) == -sig  # as subprocess.Popen reports it
    assert not psutil.pid_exists(container.pid) or psutil.Process(container.pid).status() == "zombie"


def test_preload_runs_in_the_server_and_its_imports_are_inherited(tmp_path, monkeypatch):
    mod = _module(
        tmp_path,
        monkeypatch,
        "sf_cs_preloaded",
        """
        import json, os
        import numpy as np

        PRELOADED_IN = None

        def preload():
            global PRELOADED_IN
            if PRELOADED_IN is None:  # once: the server's generator is seeded now, and a fork copies it
                np.random.random()
            PRELOADED_IN = os.getpid()
            with open(os.environ["CALLS"], "a") as fh:  # the request's environment
                fh.write(f"{os.getpid()}\\n")

        def handler(event, context):
            seen = {"pid": os.getpid(), "ppid": os.getppid(), "preloaded_in": PRELOADED_IN}
            with open(event["out"], "w") as fh:
                json.dump({**seen, "draw": float(np.random.random())}, fh)
        """,
    )
    calls, seen = tmp_path / "calls", []
    monkeypatch.setenv("CALLS", str(calls))
    for k in range(2):
        out = tmp_path / f"out{k}.json"
        container = _start(mod, "handler", tmp_path, preload=True, out=str(out))
        assert container.wait(WAIT_S) == 0
        seen.append(json.loads(out.read_text()))
    server = container_server._server.proc.pid
    assert [int(pid) for pid in calls.read_text().split()] == [server, server]  # preload ran in the server
    assert all(s["preloaded_in"] == s["ppid"] == server != s["pid"] for s in seen)  # and the child has it
    assert seen[0]["draw"] != seen[1]["draw"]  # reseeded, as in a fresh interpreter


def test_sys_exit_and_a_failed_start_behave_as_a_fresh_container(tmp_path, monkeypatch):
    mod = _module(
        tmp_path,
        monkeypatch,
        "sf_cs_exits",
        """
        import os, sys

        def exits(event, context):
            sys.exit(event["code"])

        def where(event, context):
            open(event["out"], "w").write(str(os.getppid()))
        """,
    )
    assert _start(mod, "exits", tmp_path, code=75).wait(WAIT_S) == 75  # retried by Batch's table, as fresh
    assert _start(mod, "exits", tmp_path, code=None).wait(WAIT_S) == 0

    def broken(*args, **kwargs):
        raise OSError("the container server has ended")

    monkeypatch.setattr(container_server, "start", broken)  # the executor starts the container afresh
    out = tmp_path / "ppid"
    run_container(f"{mod}:where", "test.where", {"out": str(out)}, timeout_s=WAIT_S, cancel=threading.Event())
    assert int(out.read_text()) == os.getpid()  # a child of this process, not of a server


def test_a_handler_without_preload_is_imported_by_the_container_as_it_is_on_disk(tmp_path, monkeypatch):
    body = """
        def handler(event, context):
            open(event["out"], "w").write("{}")
        """
    out = tmp_path / "out"
    # versions of different lengths: Python's bytecode cache (when it is written) validates by mtime
    # in whole seconds and size, so an edit within the second of the same size would read as unchanged
    for version in ("1", "two"):
        mod = _module(tmp_path, monkeypatch, "sf_cs_edited", body.format(version))
        assert _start(mod, "handler", tmp_path, out=str(out)).wait(WAIT_S) == 0
        assert out.read_text() == version


def test_a_server_that_dies_fails_its_containers_and_the_next_start_gets_a_new_one(tmp_path, monkeypatch):
    mod = _module(tmp_path, monkeypatch, "sf_cs_handlers", HANDLERS)
    out = tmp_path / "pid"
    container = _start(mod, "sleepy", tmp_path, out=str(out))
    _until(out.exists, "the container to start")
    first = container_server._server
    first.proc.kill()
    assert container.wait(WAIT_S) == -signal.SIGKILL
    psutil.wait_procs([psutil.Process(container.pid)], timeout=WAIT_S)  # it died with its server
    assert not psutil.pid_exists(container.pid)
    report = tmp_path / "out.json"
    assert _start(mod, "report", tmp_path, out=str(report)).wait(WAIT_S) == 0
    assert container_server._server is not first and json.loads(report.read_text())["ppid"] != first.proc.pid


def test_the_server_and_its_containers_end_with_the_process_that_owns_them(tmp_path, monkeypatch):
    """``kill -9`` of the executor's process: nothing runs in it, so the server notices by itself."""
    _module(tmp_path, monkeypatch, "sf_cs_handlers", HANDLERS)
    pids = tmp_path / "pids.json"
    owner = textwrap.dedent(
        f"""
        import json, os, sys, time
        sys.path.insert(0, {str(tmp_path)!r})
        from shardfold.orchestrator import container_server
        from shardfold.orchestrator.local_batch import _environment, run_container
        out = {str(tmp_path / "pid")!r}
        env = _environment("sf_cs_handlers:sleepy", "t", {{"out": out}}, {str(tmp_path / "s.json")!r}, "t")
        c = container_server.start("sf_cs_handlers:sleepy", env, preload=False)
        while not os.path.exists(out):
            time.sleep(0.02)
        # written whole, then renamed: the test reads it as soon as the name exists
        open({str(pids)!r} + ".tmp", "w").write(json.dumps([container_server._server.proc.pid, c.pid]))
        os.replace({str(pids)!r} + ".tmp", {str(pids)!r})
        time.sleep(60)
        """
    )
    root = str(Path(container_server.__file__).resolve().parent.parent)
    proc = subprocess.Popen([sys.executable, "-c", owner], env={**os.environ, "PYTHONPATH": root})
    try:
        _until(pids.exists, "the owner to start a container")
        server, container = (psutil.Process(pid) for pid in json.loads(pids.read_text()))
        proc.kill()
        proc.wait(WAIT_S)
        _, alive = psutil.wait_procs([server, container], timeout=WAIT_S)
        assert not alive, alive
    finally:
        proc.kill()


def test_the_server_ends_with_its_owner_even_in_the_middle_of_a_preload(tmp_path, monkeypatch):
    """A preload (torch and the model, for an inference container) holds the server's loop for as long as it
    imports: the owner's death ends the server there and then, before the import would have finished."""
    slow = tmp_path / "sf_cs_slow.py"
    done = tmp_path / "import-finished"
    started = tmp_path / "import-started"
    slow.write_text(
        "import pathlib, time\n"
        f"pathlib.Path({str(started)!r}).touch()\n"
        "time.sleep(30)  # an import that takes long\n"
        f"pathlib.Path({str(done)!r}).touch()\n"
        "def handler(event, context):\n    return None\n"
    )
    pids = tmp_path / "pids.json"
    owner = textwrap.dedent(
        f"""
        import json, os, sys, threading, time
        sys.path.insert(0, {str(tmp_path)!r})
        from shardfold.orchestrator import container_server
        from shardfold.orchestrator.local_batch import _environment
        env = _environment("sf_cs_slow:handler", "t", {{}}, {str(tmp_path / "s.json")!r}, "t")
        threading.Thread(
            target=container_server.start, args=("sf_cs_slow:handler", env), kwargs={{"preload": True}},
            daemon=True,
        ).start()
        while container_server._server is None:
            time.sleep(0.02)
        open({str(pids)!r} + ".tmp", "w").write(json.dumps(container_server._server.proc.pid))
        os.replace({str(pids)!r} + ".tmp", {str(pids)!r})
        time.sleep(60)
        """
    )
    root = str(Path(container_server.__file__).resolve().parent.parent)
    proc = subprocess.Popen([sys.executable, "-c", owner], env={**os.environ, "PYTHONPATH": root})
    try:
        _until(lambda: pids.exists() and started.exists(), "the server to start the slow preload")
        server = psutil.Process(json.loads(pids.read_text()))
        proc.kill()
        proc.wait(WAIT_S)
        _, alive = psutil.wait_procs([server], timeout=WAIT_S)
        assert not alive and not done.exists()  # gone while the import was still sleeping
    finally:
        proc.kill()
