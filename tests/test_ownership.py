"""Job ownership on the local backend: one process runs a job, a dead one shows as INTERRUPTED, the run
never hangs on a status it cannot write, and ending ``shardfold run`` ends its worker processes.

The end-to-end tests run ``shardfold run`` in a subprocess on a test kind, ``hold``, written to a temporary
package: its one step is a Parallel of a process-pool task and a Batch container step, both of which wait
for a gate object in the store, so the test can kill the CLI while both kinds of worker process run.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import toyflow
from toyflow import fail_switch, toy_workflow, write_spec

from shardfold.functions import store
from shardfold.functions.jobs import new_job_id
from shardfold.functions.store.uri import join
from shardfold.orchestrator import owner as ownership
from shardfold.orchestrator.local import LocalExecutor
from shardfold.orchestrator.owner import JobOwned, Owner
from shardfold.orchestrator.status import JobStatus, read_status, write_status

WAIT_S = 120  # a deadline for a job or a process, never a timing assumption
HOST = socket.gethostname()


@pytest.fixture
def root(tmp_path) -> str:
    return f"file://{tmp_path}/store"


@pytest.fixture(autouse=True)
def _gate():
    toyflow.GATE.clear()
    toyflow.STARTED.clear()
    yield
    toyflow.GATE.set()


def make(root: str, **kw) -> LocalExecutor:
    wf = toy_workflow()
    return LocalExecutor(store_root=root, workflows={wf.kind: wf}, retry_delay_scale=0.0, **kw)


def gone_pid() -> int:
    """The pid of a process that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def put_owner(root: str, job_id: str, **fields) -> Owner:
    me = ownership.this_process()
    for k, v in fields.items():
        setattr(me, k, v)
    store.put(ownership.owner_uri(root, job_id), me.to_bytes())
    return me


def running_record(root: str, job_id: str) -> None:
    spec_uri = write_spec(root, job_id, n=3)
    write_status(root, JobStatus(job_id=job_id, kind="toy", state="RUNNING", spec_uri=spec_uri))


# --- the owner record -------------------------------------------------------------------------------------


def test_a_live_owner_is_never_replaced_and_is_named(root):
    me = ownership.claim(root, "j")
    assert (me.host, me.pid) == (HOST, os.getpid()) and me.pid_start == ownership.process_start(os.getpid())
    with pytest.raises(JobOwned, match=rf"is still running in process {os.getpid()} on host {HOST}"):
        ownership.claim(root, "j")
    assert ownership.interrupted(root, "j") is None
    ownership.release(root, "j", me)
    assert "let it go" in ownership.interrupted(root, "j")
    ownership.claim(root, "j")  # a released job is claimed at once


@pytest.mark.parametrize(
    "fields, why",
    [
        ({"pid": "gone"}, "is gone"),
        ({"pid_start": "other"}, "is gone"),  # the pid now belongs to another process
        ({"boot_id": "another-boot"}, "the machine restarted"),
        ({"host": "elsewhere", "lease_until": 1.0}, "stopped renewing its lease"),
    ],
)
def test_a_dead_owner_is_taken_over(root, fields, why):
    fields = dict(fields)
    if fields.get("pid") == "gone":
        fields["pid"] = gone_pid()
    if fields.get("pid_start") == "other":
        fields["pid_start"] = (ownership.process_start(os.getpid()) or 0) + 1
    if "boot_id" in fields and ownership._BOOT_ID is None:
        pytest.skip("no boot id on this system")
    put_owner(root, "j", **fields)
    assert why in ownership.interrupted(root, "j")
    me = ownership.claim(root, "j")
    assert ownership.current(root, "j").token == me.token


def test_an_owner_on_another_host_lives_while_its_lease_does(root):
    put_owner(root, "j", host="elsewhere", pid=1, lease_until=4e9)
    with pytest.raises(JobOwned, match="process 1 on host elsewhere"):
        ownership.claim(root, "j")


def test_of_many_claims_on_a_dead_owner_exactly_one_wins(root):
    put_owner(root, "j", pid=gone_pid())
    barrier = threading.Barrier(8)
    won, refused = [], []

    def claim() -> None:
        barrier.wait()
        try:
            won.append(ownership.claim(root, "j"))
        except JobOwned as exc:
            refused.append(exc)

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(refused) == 7
    assert all(exc.owner.token == won[0].token for exc in refused)  # each names the winner
    assert ownership.current(root, "j").token == won[0].token


def test_an_owner_whose_lease_lapsed_learns_it_was_taken_over(root):
    old = put_owner(root, "j", host="elsewhere", lease_until=1.0)
    new = ownership.claim(root, "j")
    other = ownership.renew(root, "j", old)
    assert other is not None and other.token == new.token
    ownership.release(root, "j", old)  # not its to release any more
    assert ownership.current(root, "j").token == new.token and not ownership.current(root, "j").released


def test_the_lease_is_renewed_until_stopped_and_never_after_a_release(root):
    me = ownership.claim(root, "j", lease_s=0.04)
    first = me.lease_until
    lease = ownership.Lease(root, "j", me, lease_s=0.04).start()
    deadline = time.monotonic() + WAIT_S
    while ownership.current(root, "j").lease_until == first:
        assert time.monotonic() < deadline, "the lease was never renewed"
        time.sleep(0.01)
    lease.stop()
    ownership.release(root, "j", me)
    time.sleep(0.2)  # several renewal periods: none may undo the release
    assert ownership.current(root, "j").released


# --- the executor -----------------------------------------------------------------------------------------


def test_a_running_job_is_not_resumed_again_from_any_executor(root):
    with make(root) as first, make(root) as second:
        job_id = new_job_id("toy")
        first.start(job_id, "toy", write_spec(root, job_id, n=3, gate=True))
        assert toyflow.STARTED.wait(WAIT_S)
        for ex in (first, second):
            with pytest.raises(JobOwned, match=rf"process {os.getpid()} on host {HOST}"):
                ex.resume(job_id)
        assert second.status(job_id).state == "RUNNING"
        toyflow.GATE.set()
        assert first.wait(job_id, timeout_s=WAIT_S).state == "SUCCEEDED"
        assert ownership.current(root, job_id).released


def test_two_resumes_at_once_one_runs_the_other_is_refused_naming_it(root):
    with make(root) as a, make(root) as b:
        job_id = new_job_id("toy")
        fail_switch(root, job_id, True)
        toyflow.GATE.set()
        a.start(job_id, "toy", write_spec(root, job_id, n=4, gate=True, fail=[1]))
        assert a.wait(job_id, timeout_s=WAIT_S).state == "FAILED"
        fail_switch(root, job_id, False)
        toyflow.GATE.clear()
        barrier = threading.Barrier(2)
        results: dict[str, BaseException | None] = {}

        def resume(name: str, ex: LocalExecutor) -> None:
            barrier.wait()
            try:
                ex.resume(job_id)
                results[name] = None
            except JobOwned as exc:
                results[name] = exc

        threads = [threading.Thread(target=resume, args=(n, ex)) for n, ex in (("a", a), ("b", b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [n for n, r in results.items() if r is None]
        assert len(winners) == 1, results
        refused = next(r for r in results.values() if r is not None)
        assert f"process {os.getpid()} on host {HOST}" in str(refused)
        toyflow.GATE.set()
        winner = a if winners == ["a"] else b
        assert winner.wait(job_id, timeout_s=WAIT_S).state == "SUCCEEDED"


def test_a_running_record_whose_owner_died_reads_interrupted_and_resumes(root):
    job_id = new_job_id("toy")
    running_record(root, job_id)
    put_owner(root, job_id, pid=gone_pid())
    with make(root) as ex:
        st = ex.status(job_id)
        assert st.state == "INTERRUPTED" and st.finished
        assert "is gone" in st.error and f"resume with: shardfold resume {job_id}" in st.error
        assert [s.state for s in ex.jobs()] == ["INTERRUPTED"]
        assert ex.wait(job_id, timeout_s=WAIT_S).state == "INTERRUPTED"  # returns: nothing runs it
        ex.resume(job_id)
        assert ex.wait(job_id, timeout_s=WAIT_S).state == "SUCCEEDED"
    assert read_status(root, job_id)["state"] == "SUCCEEDED"


def test_a_record_without_an_owner_reads_interrupted(root):
    job_id = new_job_id("toy")
    running_record(root, job_id)  # as a process from before ownership left it
    with make(root) as ex:
        assert ex.status(job_id).state == "INTERRUPTED"
        ex.cancel(job_id)
        assert ex.status(job_id).state == "CANCELLED" and read_status(root, job_id)["state"] == "CANCELLED"


def test_a_final_status_that_cannot_be_written_fails_the_run_and_wakes_the_waiter(root, monkeypatch):
    import shardfold.orchestrator.local as local

    def full_disk(store_root: str, status: JobStatus) -> None:
        if status.finished:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write_status(store_root, status)

    monkeypatch.setattr(local, "write_status", full_disk)
    with make(root) as ex:
        job_id = new_job_id("toy")
        ex.start(job_id, "toy", write_spec(root, job_id, n=3))
        st = ex.wait(job_id, timeout_s=WAIT_S)
        assert st.state == "FAILED", st
        assert "ended SUCCEEDED but its status could not be recorded" in st.error
        assert os.strerror(errno.ENOSPC) in st.error and f"shardfold resume {job_id}" in st.error
    monkeypatch.undo()
    # on record it is still RUNNING, and (the run let it go) reads INTERRUPTED; a resume records the end
    assert read_status(root, job_id)["state"] == "RUNNING"
    with make(root) as other:
        assert other.status(job_id).state == "INTERRUPTED"
        other.resume(job_id)
        assert other.wait(job_id, timeout_s=WAIT_S).state == "SUCCEEDED"


def test_interrupt_records_interrupted_and_lets_the_job_go(root):
    with make(root) as ex:
        job_id = new_job_id("toy")
        ex.start(job_id, "toy", write_spec(root, job_id, n=3, gate=True))
        assert toyflow.STARTED.wait(WAIT_S)
        assert ex.interrupt("SIGTERM") == [job_id]
        st = ex.wait(job_id, timeout_s=WAIT_S)
        assert st.state == "INTERRUPTED" and "interrupted (SIGTERM)" in st.error
        record = read_status(root, job_id)
        assert record["state"] == "INTERRUPTED" and f"shardfold resume {job_id}" in record["error"]
        assert ownership.current(root, job_id).released
        toyflow.GATE.set()
    with make(root) as again:
        again.resume(job_id)
        assert again.wait(job_id, timeout_s=WAIT_S).state == "SUCCEEDED"


# --- `shardfold run` in a subprocess, killed ----------------------------------------------------------------

HOLD = {
    "__init__.py": '"""A test kind: a pool task and a Batch container that wait for a gate."""\n',
    "kind.py": """
        from typing import Literal

        from shardfold.functions.kinds import JobKind
        from shardfold.functions.specs import StrictModel
        from shardfold.functions.workflow import BatchJob, Parallel, Task, Workflow

        class HoldJob(StrictModel):
            kind: Literal["hold"] = "hold"

        CRUNCH = Task("crunch", "hold.crunch", mode="process", memory_mb=256)
        CONTAIN = BatchJob("contain", "hold.contain", vcpus=1, memory_mb=512, timeout_s=600)
        BOTH = Parallel("both", branches=((CRUNCH,), (CONTAIN,)))
        WORKFLOW = Workflow(kind="hold", steps=(BOTH,))

        KIND = JobKind(
            name="hold",
            package=__package__,
            spec=HoldJob,
            workflow=WORKFLOW,
            sizing="hold.sizing",
            rights=frozenset(),
        )
    """,
    "handlers.py": """
        import os
        import time

        from shardfold.functions import store
        from shardfold.functions.store.uri import join

        def _hold(event, name):
            base = join(event["store_root"], "jobs", event["job_id"], "hold")
            store.put(join(base, "started", name), str(os.getpid()).encode())
            while not store.exists(join(base, "gate")):
                time.sleep(0.05)
            result = join(event["store_root"], "jobs", event["job_id"], "result.json")
            store.put_json(result, {"kind": "hold"})
            return {}

        def crunch(event, context):
            return _hold(event, "crunch")

        def contain(event, context):
            return _hold(event, "contain")
    """,
    "sizing.py": """
        from shardfold.functions.estimate import MiB, Loads, Probe, TaskLoad
        from hold.kind import CONTAIN, CRUNCH

        def probe(spec, store_root, budget):
            return Probe(facts={})

        def loads(spec, probed):
            return Loads(items=1, tasks={CRUNCH: TaskLoad(100 * MiB), CONTAIN: TaskLoad(100 * MiB)})
    """,
}


@pytest.fixture
def hold(tmp_path, monkeypatch):
    package = tmp_path / "plugins" / "hold"
    package.mkdir(parents=True)
    for name, text in HOLD.items():
        (package / name).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path / "plugins"))
    monkeypatch.setenv("SHARDFOLD_KIND_PACKAGES", "hold")
    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "store"))
    spec = tmp_path / "hold.json"
    spec.write_text(json.dumps({"kind": "hold"}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    yield {"spec": spec, "root": f"file://{tmp_path}/store", "env": env, "store": tmp_path / "store"}
    for name in [m for m in sys.modules if m == "hold" or m.startswith("hold.")]:
        del sys.modules[name]


def shardfold(hold, *args: str, session: bool = False) -> subprocess.Popen:
    """``shardfold ARGS`` in a subprocess; its output goes to files (a worker left alive would hold a pipe
    open), read with :func:`output`. ``session``: in a session of its own, as a terminal runs a command, so
    that a signal to its process group reaches it and everything it started, as Ctrl-C does."""
    n = len(list(hold["store"].parent.glob("cli-*.out")))
    outs = [open(hold["store"].parent / f"cli-{n}.{name}", "w") for name in ("out", "err")]  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardfold.client.cli", *args],
        env=hold["env"],
        stdout=outs[0],
        stderr=outs[1],
        start_new_session=session,
    )
    for f in outs:
        f.close()
    proc.outputs = [Path(f.name) for f in outs]  # type: ignore[attr-defined]
    return proc


def output(proc: subprocess.Popen) -> tuple[str, str]:
    """Wait for ``proc`` to end; its stdout and stderr."""
    proc.wait(timeout=WAIT_S)
    return tuple(p.read_text() for p in proc.outputs)  # type: ignore[attr-defined,return-value]


def until(predicate, what: str, proc: subprocess.Popen) -> None:
    """Poll ``predicate`` until it holds; fail if ``proc`` ends first or the deadline passes."""
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"shardfold ended before {what}: {output(proc)}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {WAIT_S} s")
        time.sleep(0.1)


def both_workers_running(hold, cli: subprocess.Popen) -> tuple[str, list[psutil.Process]]:
    """Wait until the job's pool worker and container both run; returns the job id and the CLI's
    descendant processes."""
    jobs = hold["store"] / "jobs"
    until(lambda: jobs.is_dir() and any(jobs.glob("*/hold/started/contain")), "container", cli)
    job_id = next(jobs.glob("*/hold/started/contain")).parent.parent.parent.name
    started = jobs / job_id / "hold" / "started"
    until(lambda: (started / "crunch").exists(), "pool worker", cli)
    workers = psutil.Process(cli.pid).children(recursive=True)
    pids = {p.pid for p in workers}
    assert {int((started / n).read_text()) for n in ("crunch", "contain")} <= pids
    return job_id, workers


def assert_all_gone(workers: list[psutil.Process]) -> None:
    _, alive = psutil.wait_procs(workers, timeout=WAIT_S)
    assert not alive, [(p.pid, p.cmdline()) for p in alive]


@pytest.mark.slow
def test_kill_9_of_shardfold_run_ends_its_workers_and_the_job_resumes(hold):
    from shardfold.client import Client

    cli = shardfold(hold, "run", str(hold["spec"]))
    job_id, workers = both_workers_running(hold, cli)
    with Client() as client:  # a second resume while it runs: refused, naming the owner
        with pytest.raises(JobOwned, match=rf"process {cli.pid} on host {HOST}"):
            client.job(job_id).resume()
    cli.kill()
    cli.wait(timeout=WAIT_S)
    assert_all_gone(workers)
    with Client() as client:
        st = client.job(job_id).status()
    assert st.state == "INTERRUPTED", st
    assert f"process {cli.pid} on host {HOST}" in st.error and f"shardfold resume {job_id}" in st.error
    store.put(join(hold["root"], "jobs", job_id, "hold", "gate"), b"")
    again = shardfold(hold, "resume", job_id)
    out, err = output(again)
    assert again.returncode == 0, (out, err)
    assert "SUCCEEDED" in out and read_status(hold["root"], job_id)["state"] == "SUCCEEDED"


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_shardfold_run_ends_its_workers_and_records_interrupted(hold, sig):
    cli = shardfold(hold, "run", str(hold["spec"]))
    job_id, workers = both_workers_running(hold, cli)
    cli.send_signal(sig)
    out, err = output(cli)
    assert cli.returncode == 128 + sig, (out, err)
    assert f"resume with: shardfold resume {job_id}" in err
    assert_all_gone(workers)
    record = read_status(hold["root"], job_id)
    assert record["state"] == "INTERRUPTED" and signal.Signals(sig).name in record["error"]
    assert ownership.current(hold["root"], job_id).released


@pytest.mark.slow
def test_ctrl_c_at_the_terminal_stops_everything_without_a_traceback(hold):
    """Ctrl-C signals the terminal's whole process group: the CLI, its pool workers, its container server
    and the containers. Only the CLI acts on it (the workers ignore it, the containers have a group of their
    own): no KeyboardInterrupt traceback from a worker, no task failed of it, no semaphore leaked, nothing
    left running, the job INTERRUPTED and resumable."""
    cli = shardfold(hold, "run", str(hold["spec"]), session=True)
    job_id, workers = both_workers_running(hold, cli)
    started = hold["store"] / "jobs" / job_id / "hold" / "started"
    crunch, contain = (int((started / n).read_text()) for n in ("crunch", "contain"))
    ignored = int(Path(f"/proc/{crunch}/status").read_text().split("SigIgn:")[1].split()[0], 16)
    assert ignored >> (signal.SIGINT - 1) & 1, "a pool worker ignores SIGINT"
    assert os.getpgid(contain) != os.getpgid(cli.pid), "a container has a process group of its own"
    os.killpg(os.getpgid(cli.pid), signal.SIGINT)
    out, err = output(cli)
    assert cli.returncode == 128 + signal.SIGINT, (out, err)
    assert f"resume with: shardfold resume {job_id}" in err
    for noise in ("Traceback", "KeyboardInterrupt", "leaked semaphore", "task failed"):
        assert noise not in err, err
    assert_all_gone(workers)
    assert read_status(hold["root"], job_id)["state"] == "INTERRUPTED"


@pytest.mark.slow  # end to end: a job, a model or child processes
def test_the_lifeline_runs_a_module_as_main_and_ends_it_with_its_parent(tmp_path):
    """How a Batch container starts (``python -m orchestrator.lifeline functions.container``): the module
    runs as ``__main__``, and ends once the process that started it is gone (here it exits at once)."""
    gate, ran, pid = tmp_path / "gate", tmp_path / "ran", tmp_path / "child.pid"
    (tmp_path / "waiter.py").write_text(
        f"import os, time\nopen({str(ran)!r}, 'w').write(__name__)\n"
        f"while not os.path.exists({str(gate)!r}):\n    time.sleep(0.05)\n"
    )
    parent = textwrap.dedent(
        f"""
        import os, subprocess, time
        from shardfold.orchestrator.lifeline import PARENT_ENV, child_command
        child = subprocess.Popen(child_command("waiter"), env={{**os.environ, PARENT_ENV: str(os.getpid())}})
        open({str(pid)!r}, "w").write(str(child.pid))
        while not os.path.exists({str(ran)!r}):
            time.sleep(0.05)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *(p for p in sys.path if p)])}
    subprocess.run([sys.executable, "-c", parent], env=env, check=True, timeout=WAIT_S)
    assert ran.read_text() == "__main__"
    try:
        child = psutil.Process(int(pid.read_text()))
    except psutil.NoSuchProcess:
        return  # already gone
    assert_all_gone([child])


# --- the AWS backend: the execution is the owner --------------------------------------------------------

SM_ARN = "arn:aws:states:us-east-1:123456789012:stateMachine:shardfold-toy"
EXEC_ARN = "arn:aws:states:us-east-1:123456789012:execution:shardfold-toy:toy-20261205T000000-abc123"


class FakeSfn:
    """What resume asks Step Functions: DescribeExecution answers ``statuses`` in turn; StartExecution of the
    restart finds another client's execution of that name. Resume never redrives."""

    def __init__(self, *statuses: str):
        self.statuses = list(statuses)

    def describe_execution(self, executionArn: str) -> dict:
        status = self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]
        return {"status": status, "input": "{}"}

    def redrive_execution(self, executionArn: str) -> None:
        raise AssertionError("resume must not redrive: it would re-run the Fail state")

    def start_execution(self, **kwargs) -> dict:
        from botocore.exceptions import ClientError

        raise ClientError({"Error": {"Code": "ExecutionAlreadyExists", "Message": "no"}}, "StartExecution")


@pytest.mark.parametrize(
    "statuses, running_in",
    [
        (("RUNNING",), EXEC_ARN),  # still running
        (("FAILED",), EXEC_ARN + "-r1"),  # another client restarted it as toy-...-r1 just now
    ],
)
def test_aws_resume_is_refused_while_an_execution_runs_the_job(root, statuses, running_in):
    from shardfold.functions.errors import ShardfoldError
    from shardfold.orchestrator.aws import AwsExecutor

    ex = AwsExecutor.__new__(AwsExecutor)  # no AWS: only what resume touches
    ex.store_root, ex.state_machine_arns, ex._sfn = root, {"toy": SM_ARN}, FakeSfn(*statuses)
    write_status(
        root,
        JobStatus(job_id="toy-20261205T000000-abc123", kind="toy", state="FAILED", execution_arn=EXEC_ARN),
    )
    with pytest.raises(
        ShardfoldError, match=rf"toy-20261205T000000-abc123 is still running in execution {running_in};"
    ):
        ex.resume("toy-20261205T000000-abc123")
    assert read_status(root, "toy-20261205T000000-abc123")["state"] == "FAILED"
