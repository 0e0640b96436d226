"""The inference GPU worker: ``python -m functions.inference.worker`` (AWS Batch container, or locally).

The workflow's BatchJob steps call :func:`handler` (registered as ``inference.worker``) with the state as
event; the CLI takes the same event from ``--event`` JSON, ``$SHARDFOLD_EVENT`` or flags. Both run
:func:`run_worker`:

1. Poll the listing of ``pre/<H>/`` (and ``out/<H>/`` for commit markers): 50 ms after progress, backing
   off to ``$SHARDFOLD_INFERENCE_POLL_S`` (1 s) while idle. Every preprocessed shard that is a target of
   this attempt and has no ``.done`` marker is claimed with ``put_if_absent`` on ``claims/<attempt>/<k:05d>``:
   a claim another live worker holds is left to it. At most ``prefetch`` claimed shards are read ahead by
   a small thread pool, so a worker never hoards shards others could take.
2. Each shard's rows are computed by the job's task (:mod:`compute`): embed and classify batch them by
   token budget after sorting by length (:mod:`batcher`) under ``torch.inference_mode()`` on CUDA if
   present, else CPU (out of GPU memory halves the budget and re-splits the failed batch; the budget
   grows back after calm batches: :func:`compute.embed_rows`); generate decodes them with continuous
   batching (:mod:`generation`).
3. ``out/<H>/<k>.npz`` (the task's arrays in the shard's row order, :mod:`compute`) is written, then the
   commit marker ``out/<H>/<k>.done`` with ``put_if_absent``, on a thread of its own while the next shard
   computes: a shard is committed iff its marker exists.
4. The worker exits once ``cpu_done.json`` exists (checked *before* the listing, so the listing is
   complete) and nothing is left to claim.

Attempt 0 (the ``infer`` step) targets every planned shard; a repair attempt (``attempt >= 1``: the
event's ``attempt``, or that of its Map item: the ``repair_infer`` step's one worker is
``{"attempt": 1}``)
targets only the shards in ``missing.json`` and claims under ``claims/<attempt>/``, so claims left by a
killed attempt-0 worker do not block the repair. A claim whose holder is known to be dead is taken over
(see :func:`_claim`): one held by an earlier attempt of the same Batch job (same ``AWS_BATCH_JOB_ID``,
higher ``AWS_BATCH_JOB_ATTEMPT``), by another Batch job that ``DescribeJobs`` reports SUCCEEDED or FAILED
(a peer worker that died, or the job of the run before a redrive), or, outside Batch, by a process of this
host that no longer runs (a local worker killed, then the job resumed). A claim of a live worker, or one
whose holder's fate is unknown, is never taken.

Each worker writes its summary to ``workers/<attempt>/<host>-<pid>-<run>.json`` when it finishes (rows,
batches, padding fraction, seconds per shard); ``commit`` gathers them into the output's manifest.

Exit codes: 0; 75 for a transient fault (the job definition retries it); 1 otherwise.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import io
import json
import os
import socket
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from shardfold.functions import credentials, store, telemetry
from shardfold.functions.errors import ShardfoldError
from shardfold.functions.inference import compute
from shardfold.functions.inference import shards as layout
from shardfold.functions.inference.compute import WorkerStats
from shardfold.functions.inference.spec import InferenceSpec
from shardfold.functions.log import logger
from shardfold.functions.runtime import JobEvent, task

POLL_ENV, POLL_S = "SHARDFOLD_INFERENCE_POLL_S", 1.0  # the longest wait between listings
FIRST_POLL_S = 0.05  # the first wait after progress; doubled while idle, up to POLL_S
PREFETCH = 2  # claimed shards read ahead of the one being computed
# Give up (an error: the job fails) when, before cpu_done.json, no new preprocessed shard appeared for this
# long: the CPU stage has died. On AWS a failed CPU branch stops the Batch job anyway (Parallel); locally
# this bounds the wait. A CPU task is bounded by the Lambda timeout (900 s) times its retries.
CPU_BATCH_TOKENS = 2048  # token budget cap when no GPU is present (see run_worker)
IDLE_ENV, IDLE_S = "SHARDFOLD_INFERENCE_IDLE_S", 3600.0


CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "<quota> <period>" in microseconds, or "max"


def cpu_threads(workers: int = 1) -> int:
    """Threads for a CPU worker's model: the cores this process may run on (its CPU affinity, and a
    cgroup's CPU quota, a container's limit that torch's default of every core of the host ignores),
    shared among the job's ``workers`` running side by side on this host."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = CGROUP_CPU_MAX.read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores // max(1, workers))


def _setting(env: str, default: float) -> float:
    """Read when a worker starts, not at import: a container forked from the local container server
    imported this module under an earlier environment."""
    return float(os.environ.get(env) or default)


class WorkerEvent(JobEvent):
    attempt: int | None = None


def load_shard(uri: str) -> dict[str, np.ndarray]:
    """A preprocessed shard's arrays (``input_ids`` flat int32, ``offsets`` int64 rows+1, …)."""
    from shardfold.functions.inference.preprocess import decode_shard

    shard = decode_shard(store.get(uri))
    if shard["offsets"].ndim != 1 or len(shard["offsets"]) < 1:
        raise ShardfoldError(f"{uri}: offsets must be a 1-D array of rows+1 entries")
    return shard


def _targets(store_root: str, job_id: str, attempt: int, plan: dict[str, Any]) -> set[int]:
    planned = {int(s["shard"]) for s in plan["shards"]}
    if attempt == 0:
        return planned
    uri = layout.missing_uri(store_root, job_id)
    if not store.exists(uri):
        return set()
    missing = store.get_json(uri)
    if isinstance(missing, dict):
        missing = missing.get("missing", missing.get("shards", []))
    shards = {int(m["shard"]) if isinstance(m, dict) else int(m) for m in missing}
    return shards & planned


def _listed(prefix: str, suffix: str, after: str | None = None) -> set[int]:
    """Shards with a ``<k>.<suffix>`` object under the prefix, listing only keys after ``after``."""
    found = set()
    for uri in store.list_uris(prefix + "/", after and f"{prefix}/{after}"):
        if uri.endswith(suffix):
            try:
                found.add(layout.shard_of(uri))
            except ValueError:
                continue
    return found


def run_worker(
    spec: InferenceSpec,
    job_id: str,
    store_root: str,
    attempt: int = 0,
    *,
    model: Any = None,
    device: Any = None,
    poll_s: float | None = None,
    idle_s: float | None = None,
    prefetch: int = PREFETCH,
    stop: threading.Event | None = None,
) -> dict[str, Any]:
    """Claim, embed and commit shards until the CPU stage is done and nothing is left; return a summary."""
    started = time.monotonic()
    poll_s = _setting(POLL_ENV, POLL_S) if poll_s is None else poll_s
    idle_s = _setting(IDLE_ENV, IDLE_S) if idle_s is None else idle_s
    stop = stop or threading.Event()
    plan = layout.load_plan(store_root, job_id)
    targets = _targets(store_root, job_id, attempt, plan)
    stats = WorkerStats(attempt=attempt, budget=spec.batch_tokens)
    worker_id = _worker_identity()
    logger.info(
        "inference worker start", extra={"job_id": job_id, "attempt": attempt, "targets": len(targets)}
    )
    if not targets:
        stats.wall_s = time.monotonic() - started
        return stats.summary()
    if model is None:
        model = compute.load_runner(spec, store_root, plan, device)
    _tune_for_device(spec, plan, model, stats)
    run_shard = functools.partial(compute.compute, spec, plan, model)
    h = plan["config_hash"]
    with (
        ThreadPoolExecutor(max_workers=max(1, prefetch), thread_name_prefix="prefetch") as pool,
        _Writes() as writes,
    ):
        queue = _Queue(store_root, job_id, attempt, h, targets, worker_id, pool, prefetch, poll_s)
        while True:
            writes.check()
            finished = queue.refill()
            queue.claim()
            if queue.inflight:
                k, fut = queue.inflight.popleft()
                _process(run_shard, store_root, job_id, h, k, fut.result(), stats, worker_id, started, writes)
                continue
            if not queue.remaining:
                break
            if finished and not queue.backlog:  # the CPU stage is done, and listed shards are all claimed
                logger.warning(
                    "CPU stage done but shards have no preprocessed input; leaving them to reconcile",
                    extra={"job_id": job_id, "shards": sorted(queue.remaining)[:20]},
                )
                break
            queue.check_cpu_stage(idle_s)
            if stop.wait(queue.wait_s):
                break
            # idle: back off to poll_s; reset when a shard arrives
            queue.wait_s = min(poll_s, queue.wait_s * 2)
    return _report(store_root, job_id, worker_id, stats, started)


def _tune_for_device(spec: InferenceSpec, plan: dict[str, Any], model: Any, stats: WorkerStats) -> None:
    """Note the model's device in ``stats``; on a CPU, cap the token budget and set the model's threads."""
    stats.device = str(getattr(model, "device", "cpu"))
    if stats.device.startswith("cpu"):
        # On a CPU, batches past ~2k tokens run slower per token (activations and attention scores fall out
        # of cache; measured with MiniLM), and a GPU-sized budget would make few, heavily padded batches.
        stats.budget = min(stats.budget, CPU_BATCH_TOKENS)
        import torch

        # the model's intra-op threads, chosen: the cores this worker may use, shared with the job's other
        # workers on this host (several workers are data-parallel CPU workers, each on its share)
        stats.threads = cpu_threads(min(spec.gpu_workers, len(plan["shards"])))  # as many as prepare starts
        torch.set_num_threads(stats.threads)
    stats.budget_cap = stats.budget


class _Queue:
    """The attempt's target shards as this worker knows them: those left (neither committed, nor claimed by
    it or another worker), those listed as ready and not yet claimed, and the claimed ones being read ahead
    (at most ``prefetch`` besides the one computing).

    Listings start at the first remaining shard's key and happen only when no listed shard is left to
    claim, so a job of N shards lists O(N) keys in all when shards arrive roughly in order, not O(N^2)."""

    def __init__(self, store_root, job_id, attempt, h, targets, worker_id, pool, prefetch, poll_s) -> None:
        self.job_id, self.worker_id, self.pool = job_id, worker_id, pool
        self.prefetch, self.poll_s = prefetch, poll_s
        self.pre = layout.pre_prefix(store_root, job_id, h)
        self.out = layout.out_prefix(store_root, job_id, h)
        self.pre_uri = functools.partial(layout.pre_uri, store_root, job_id, h)
        self.claim_uri = functools.partial(layout.claim_uri, store_root, job_id, attempt)
        self.cpu_done = layout.cpu_done_uri(store_root, job_id)
        self.cpu_failed = layout.cpu_failed_uri(store_root, job_id)
        self.remaining = set(targets)
        self.keys = sorted(targets, key=layout.shard_name)  # the order S3 lists them in
        self.first = 0  # keys before it are no longer remaining
        self.backlog: deque[int] = deque()  # listed as ready, not yet claimed
        self.inflight: deque[tuple[int, Future]] = deque()  # claimed, being read
        self.seen_ready: set[int] = set()
        self.last_progress = time.monotonic()  # when a preprocessed shard last appeared
        self.wait_s = min(poll_s, FIRST_POLL_S)

    def refill(self) -> bool:
        """List the ready shards when none listed is left to claim and there is room to read one ahead;
        whether the CPU stage was done before this listing (so the listing is complete)."""
        if not self.remaining or self.backlog or len(self.inflight) > self.prefetch:
            return False
        finished = store.exists(self.cpu_done)
        while self.keys[self.first] not in self.remaining:
            self.first += 1
        after = layout.shard_name(self.keys[self.first])
        ready = _listed(self.pre, ".npz", after) & self.remaining
        if ready - self.seen_ready:
            self.seen_ready |= ready
            self.last_progress = time.monotonic()
            self.wait_s = min(self.poll_s, FIRST_POLL_S)
        if ready:
            self.remaining -= _listed(self.out, ".done", after)
            self.backlog.extend(sorted(ready & self.remaining))
        return finished

    def claim(self) -> None:
        """Claim listed shards and start reading the ones won, while there is room to read ahead."""
        while self.backlog and len(self.inflight) <= self.prefetch:
            k = self.backlog.popleft()
            self.remaining.discard(k)
            if _claim(self.claim_uri(k), self.worker_id):
                # carried: the read counts for this task, under its reach and credentials
                self.inflight.append((k, self.pool.submit(telemetry.carried(load_shard), self.pre_uri(k))))

    def check_cpu_stage(self, idle_s: float) -> None:
        """Raise when the CPU stage failed, or has shown no new shard for ``idle_s`` without finishing."""
        if store.exists(self.cpu_failed):
            error = store.get_json(self.cpu_failed)["error"]
            raise ShardfoldError(f"job {self.job_id}: the CPU stage failed: {error}")
        if time.monotonic() - self.last_progress > idle_s:
            raise ShardfoldError(
                f"job {self.job_id}: no preprocessed shard appeared for {idle_s:.0f} s and the CPU stage has "
                f"not finished ({self.cpu_done} is absent); "
                f"{len(self.remaining)} shard(s) left, e.g. {sorted(self.remaining)[:10]}"
            )


def _report(
    store_root: str, job_id: str, worker_id: dict[str, Any], stats: WorkerStats, started: float
) -> dict[str, Any]:
    """Write the worker's summary to ``workers/<attempt>/<host>-<pid>-<run>.json``, log it, return it."""
    stats.wall_s = time.monotonic() - started
    summary = stats.summary()
    name = f"{worker_id['host']}-{worker_id['pid']}-{worker_id['run']}"
    store.put_json(
        layout.worker_report_uri(store_root, job_id, stats.attempt, name), {**summary, "worker": worker_id}
    )
    logger.info(
        "inference worker done",
        extra={"job_id": job_id, **{k: v for k, v in summary.items() if k not in ("shard_s", "computed")}},
    )
    return summary


def _worker_identity() -> dict[str, Any]:
    """Who holds a claim: host and pid, plus the AWS Batch job (``AWS_BATCH_JOB_ID``, ``parent:index`` for
    an array child) and its attempt (``AWS_BATCH_JOB_ATTEMPT``, from 1) when run by Batch."""
    # "run" tells apart workers sharing a process (the moto harness runs Batch jobs on threads)
    ident: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid(), "run": uuid.uuid4().hex[:8]}
    started = _process_start(os.getpid())
    if started is not None:
        ident["pid_start"] = started
    if os.environ.get("AWS_BATCH_JOB_ID"):
        ident["batch_job"] = os.environ["AWS_BATCH_JOB_ID"]
        ident["batch_attempt"] = int(os.environ.get("AWS_BATCH_JOB_ATTEMPT") or 1)
    return ident


def _process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22), which tells a
    reused pid from the original; None where /proc is not there, or the process is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else int(fields[19])


def _holder_is_dead(held: dict[str, Any], ident: dict[str, Any]) -> bool:
    """Whether the claim's holder is known to be dead (see the module doc); unknown means alive."""
    if "batch_job" in ident or "batch_job" in held:
        if held.get("batch_job") == ident.get("batch_job"):
            return int(held.get("batch_attempt", 0)) < int(ident.get("batch_attempt", 0))
        # another Batch job's claim (a peer worker, or a job of the run before a redrive)
        return "batch_job" in held and "batch_job" in ident and _batch_job_ended(held["batch_job"])
    if held.get("host") != ident["host"] or not isinstance(held.get("pid"), int):
        return False  # another machine's process: nothing here can tell whether it still runs
    if held["pid"] == ident["pid"]:
        return False
    started = _process_start(held["pid"])
    if started is None:
        try:
            os.kill(held["pid"], 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return Path("/proc").is_dir()  # alive by kill(0), but /proc says gone or zombie
    return "pid_start" in held and started != held["pid_start"]  # the pid now names another process


def _batch_job_ended(job_id: str) -> bool:
    """Whether AWS Batch reports the job SUCCEEDED or FAILED, so no container of it runs any more; False
    when it cannot tell (no access, throttled, a job Batch no longer lists)."""
    try:
        jobs = credentials.session().client("batch").describe_jobs(jobs=[job_id])["jobs"]
    except Exception as exc:  # noqa: BLE001 - not knowing means alive: the shard waits for the repair round
        logger.warning(
            "cannot tell whether a claim's Batch job ended", extra={"job": job_id, "error": str(exc)}
        )
        return False
    return bool(jobs) and jobs[0].get("status") in ("SUCCEEDED", "FAILED")


def _claim(uri: str, ident: dict[str, Any]) -> bool:
    """Claim a shard with ``put_if_absent``, or take over a claim whose holder is dead: an earlier attempt
    of this same Batch job (only one attempt of a Batch job runs at a time, and the job definition retried
    it after exit 75 or a lost host), another Batch job that Batch reports ended, or a process of this
    host that no longer runs. Leaving such shards to the repair round would waste them."""
    body = json.dumps({**ident, "at": time.time()}).encode()
    if store.put_if_absent(uri, body):
        return True
    try:
        held = store.get_json(uri)
    except ShardfoldError:
        return False
    if _holder_is_dead(held, ident):
        store.put(uri, body)
        logger.info("took over the claim of a dead worker", extra={"claim": uri, "holder": held})
        return True
    return False


def _process(
    run_shard: Any,
    store_root: str,
    job_id: str,
    h: str,
    k: int,
    shard: dict[str, np.ndarray],
    stats: WorkerStats,
    worker_id: dict[str, Any],
    started: float,
    writes: _Writes | None = None,
) -> None:
    """Compute shard ``k`` and commit it: its output, then its marker; the commit on ``writes``' thread
    when given (the next shard computes meanwhile), else here."""
    done = layout.done_uri(store_root, job_id, h, k)
    if store.exists(done):  # committed while it was prefetched (another worker, or an earlier attempt)
        stats.skipped.append(k)
        return
    t0 = time.monotonic()
    arrays = run_shard(shard, stats)
    seconds = time.monotonic() - t0
    rows = len(shard["row_index"])

    def write() -> None:
        buf = io.BytesIO()
        np.savez(buf, **arrays)  # a GPU shard's rows come back to the host here
        data = buf.getvalue()
        # on a GPU the compute thread only queued the batches: the shard's time is the device's
        on_gpu = [a.seconds() for a in arrays.values() if isinstance(a, compute.DeviceRows)]
        shard_s = on_gpu[0] if on_gpu and on_gpu[0] is not None else seconds
        store.put(layout.out_uri(store_root, job_id, h, k), data)
        marker = {
            "shard": k,
            "rows": rows,
            "sha256": hashlib.sha256(data).hexdigest(),
            "attempt": stats.attempt,
            **worker_id,
        }
        if store.put_if_absent(done, json.dumps(marker).encode()):
            stats.computed.append(k)
            stats.shard_s[k] = shard_s
            stats.rows += rows
            if stats.first_commit_s is None:
                stats.first_commit_s = round(time.monotonic() - started, 3)
        else:
            stats.skipped.append(k)

    if writes is None:
        write()
    else:
        writes.submit(write)


class _Writes:
    """Shard commits on one thread beside the compute: at most one waits while the next shard computes
    (so one more shard's output in memory), and a failed write is raised at the next submit or drain."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="sf-commit")
        self.pending: Future | None = None

    def submit(self, write: Any) -> None:
        self.drain()
        self.pending = self.pool.submit(telemetry.carried(write))  # under the task's reach and credentials

    def check(self) -> None:
        """Raise a finished write's error now (a worker waiting for shards would otherwise hold it)."""
        if self.pending is not None and self.pending.done():
            self.drain()

    def drain(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def __enter__(self) -> _Writes:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        try:
            if exc_type is None:
                self.drain()  # the last shard's commit, and its error if it failed
        finally:
            self.pool.shutdown(wait=True)


def attempt_of(event: dict[str, Any]) -> int:
    """The event's ``attempt``, or its Map item's (the repair round's worker: ``{"attempt": 1}``); else 0."""
    if event.get("attempt") is not None:
        return int(event["attempt"])
    item = event.get("item")
    if isinstance(item, dict) and item.get("attempt") is not None:
        return int(item["attempt"])
    return 0


@task(WorkerEvent, kind="inference", step="inference.worker")
def handler(e: WorkerEvent, spec: InferenceSpec) -> dict[str, Any]:
    """Entry point ``inference.worker`` (BatchJob steps ``infer`` and ``repair_infer``)."""
    return run_worker(spec, e.job_id, e.store_root, attempt_of(e.model_dump()))


def preload() -> None:
    """Import what a worker imports, loading nothing (:func:`models.preload`): the local executor's
    container server calls this before it forks a worker (:mod:`orchestrator.container_server`)."""
    from shardfold.functions.inference import models

    models.preload()


def main(argv: list[str] | None = None) -> int:
    from shardfold.functions.container import EXIT_TRANSIENT, TRANSIENT

    parser = argparse.ArgumentParser(
        prog="python -m shardfold.functions.inference.worker", description=__doc__
    )
    parser.add_argument("--event", help="the state as JSON (default: $SHARDFOLD_EVENT)")
    parser.add_argument("--job-id")
    parser.add_argument("--spec-uri")
    parser.add_argument("--store-root")
    parser.add_argument("--attempt", type=int)
    args = parser.parse_args(argv)
    event = json.loads(args.event or os.environ.get("SHARDFOLD_EVENT") or "{}")
    for key in ("job_id", "spec_uri", "store_root", "attempt"):
        if getattr(args, key) is not None:
            event[key] = getattr(args, key)
    try:
        handler(event)
    except TRANSIENT:
        logger.exception("inference worker hit a transient fault")
        return EXIT_TRANSIENT
    except Exception:
        logger.exception("inference worker failed")
        return 1
    return 0


if __name__ == "__main__":
    from shardfold.functions.container import exit_now

    exit_now(main())
