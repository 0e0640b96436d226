"""GetBatch benchmark: many small objects over HTTP from an S3-compatible endpoint on loopback.

Compares, in one run and on the same keys:

  (a)  sequential boto3 GETs (the per-sample loader, the paper's "individual GETs")
  (b)  boto3 + ThreadPoolExecutor(concurrency), max_pool_connections = concurrency
  (c)  s3fs/fsspec ``fs.cat(paths)`` (its batch API; batch_size and pool = concurrency, no HEAD per object)
  (c0) s3fs with its defaults (max_concurrency=10 -> one HEAD per object before the GET), opt-in
  (d)  Shardfold ``functions.store.get_batch(items)`` with the engine's defaults
       (``--d-transports crt,boto3`` adds rows with SHARDFOLD_S3_TRANSPORT forced to each)
  (e)  the serverless ``getbatch`` job on the local executor: submit, wait for the archive to be committed
  (e+r) the same jobs with the archive read back (each member's bytes, as (d) hands them over), derived
       from (e)'s runs: the read is a consumer's work that (d) does not have, so it is shown apart
  (x)  opt-in reference ceiling: awscrt's native S3Client given the whole batch at once (no product code)

The endpoint is ``bench/s3server.py``: SeaweedFS, a real S3 server, in a child process on 127.0.0.1,
behind a loopback proxy that injects a lognormal time-to-first-byte. Before the timed modes SeaweedFS is
measured directly with no injected latency (capacity, server CPU per request); during every mode its CPU
use and the proxy's are reported, so a reader can check neither was the bottleneck. Client CPU is the
benchmark process's CPU time (all its threads, plus any child processes it started, SeaweedFS and the
proxy excluded). Each mode's ``others`` column and the run's closing line come from ``benchutil.LoadWatch``:
the CPU other processes used meanwhile (% of one core), marked NOISY above half a core, with the load
averages before and after; all go to the JSON.

The benchmark prints a table and writes JSON to bench/results/getbatch.json. It never asserts on timing:
the targets are reported as pass/fail lines. Every mode has a time budget, so the run ends by itself.

    .venv/bin/python bench/getbatch.py               # 10 KiB, batch 256, 20 batches, concurrency 128
    .venv/bin/python bench/getbatch.py --quick       # a short smoke run
    .venv/bin/python bench/getbatch.py --sizes 1KiB,16KiB,256KiB,1MiB --batches 8
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib
import inspect
import io
import json
import math
import os
import platform
import random
import re
import shutil
import sys
import tarfile
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from benchutil import LoadWatch, load_end_line, load_start_line  # noqa: E402
from s3server import ServerHandle, synthetic_keys  # noqa: E402

KiB = 1024
MiB = 1024 * 1024
BUCKET = "bench"
ALL_MODES = ["a", "b", "c", "c0", "d", "e", "x"]  # "e+r" is derived from "e"
DEFAULT_MODES = ["a", "b", "c", "d", "e"]
MODE_LABELS = {
    "a": "(a) boto3 sequential",
    "b": "(b) boto3 threads",
    "c": "(c) s3fs cat",
    "c0": "(c0) s3fs cat, defaults",
    "d": "(d) store.get_batch",
    "e": "(e) getbatch job",
    "e+r": "(e) job + read-back",
    "x": "(x) awscrt S3Client ref",
}


class Skip(Exception):
    """A mode cannot run in this checkout (e.g. its module has not landed yet)."""


# --------------------------------------------------------------------------------------------------------
# small helpers


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)(i?[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 1KiB, 10KiB, 1MiB or a byte count")
    mult = {"": 1, "k": KiB, "m": MiB, "g": 1024 * MiB}[m.group(2).lower()]
    return int(float(m.group(1)) * mult)


def fmt_size(n: int) -> str:
    if n >= MiB and n % MiB == 0:
        return f"{n // MiB} MiB"
    if n >= KiB and n % KiB == 0:
        return f"{n // KiB} KiB"
    return f"{n} B"


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100); None for no values."""
    if not values:
        return None
    v = sorted(values)
    if len(v) == 1:
        return v[0]
    pos = (len(v) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


class ClientCPU:
    """CPU seconds of this process (all threads) plus its descendants, the benchmark server excluded."""

    def __init__(self, exclude_pids: set[int]):
        import psutil

        self.proc = psutil.Process()
        self.exclude = exclude_pids

    def __call__(self) -> float:
        import psutil

        t = self.proc.cpu_times()
        total = t.user + t.system + t.children_user + t.children_system
        try:
            kids = self.proc.children(recursive=True)
        except psutil.Error:
            kids = []
        for k in kids:
            if k.pid in self.exclude:
                continue
            try:
                kt = k.cpu_times()
                total += kt.user + kt.system
            except psutil.Error:
                pass
        return total


def expected_head(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


# --------------------------------------------------------------------------------------------------------
# modes: each returns a MODE object with setup() / fetch(keys) -> list[bytes] in key order / close()


@dataclass
class Ctx:
    endpoint: str
    port: int
    bucket: str
    size: int
    concurrency: int
    read_timeout: float
    store_home: str
    d_transport: str | None = None
    d_concurrency: int | None = None
    x_concurrency: int = 128
    server_pid: int = 0


def _boto3_client(ctx: Ctx, pool: int):
    import boto3
    from botocore.config import Config

    cfg = Config(
        s3={"addressing_style": "path"},
        max_pool_connections=pool,
        retries={"mode": "standard", "max_attempts": 3},
        connect_timeout=5,
        read_timeout=ctx.read_timeout,
        tcp_keepalive=True,
    )
    return boto3.session.Session().client(
        "s3",
        endpoint_url=ctx.endpoint,
        region_name="us-east-1",
        aws_access_key_id="bench",
        aws_secret_access_key="bench",
        config=cfg,
    )


class ModeA:
    concurrency_note = "1"

    def __init__(self, ctx: Ctx):
        self.ctx = ctx
        self.s3 = _boto3_client(ctx, 10)

    def fetch(self, keys: list[str]) -> list[bytes]:
        s3, b = self.s3, self.ctx.bucket
        return [s3.get_object(Bucket=b, Key=k)["Body"].read() for k in keys]

    def close(self):
        self.s3.close()


class ModeB:
    def __init__(self, ctx: Ctx):
        self.ctx = ctx
        self.concurrency_note = str(ctx.concurrency)
        self.s3 = _boto3_client(ctx, ctx.concurrency)
        self.pool = ThreadPoolExecutor(ctx.concurrency, thread_name_prefix="bench-b")

    def _get(self, key: str) -> bytes:
        return self.s3.get_object(Bucket=self.ctx.bucket, Key=key)["Body"].read()

    def fetch(self, keys: list[str]) -> list[bytes]:
        return list(self.pool.map(self._get, keys))

    def close(self):
        self.pool.shutdown(wait=True)
        self.s3.close()


class ModeC:
    tuned = True

    def __init__(self, ctx: Ctx):
        try:
            import s3fs
        except ImportError as exc:
            raise Skip(f"s3fs not importable: {exc}") from exc
        self.ctx = ctx
        self.concurrency_note = str(ctx.concurrency)
        kw = {}
        if self.tuned:
            # Without this s3fs HEADs every object (to decide on a concurrent ranged read) before its GET.
            kw["max_concurrency"] = 1
        self.fs = s3fs.S3FileSystem(
            key="bench",
            secret="bench",
            client_kwargs={"endpoint_url": ctx.endpoint, "region_name": "us-east-1"},
            config_kwargs={
                "s3": {"addressing_style": "path"},
                "max_pool_connections": ctx.concurrency,
                "connect_timeout": 5,
                "read_timeout": ctx.read_timeout,
            },
            skip_instance_cache=True,
            use_listings_cache=False,
            **kw,
        )

    def fetch(self, keys: list[str]) -> list[bytes]:
        paths = [f"{self.ctx.bucket}/{k}" for k in keys]
        out = self.fs.cat(paths, batch_size=self.ctx.concurrency)
        return [out[p] for p in paths]

    def close(self):
        # Close its session (128 keep-alive connections on fsspec's IO loop): left open, they keep that loop
        # thread waking in this process while the later modes run.
        fs, self.fs = self.fs, None
        creator = getattr(fs, "_s3creator", None)
        if creator is not None:
            fs.close_session(fs.loop, creator)


class ModeC0(ModeC):
    tuned = False


class ModeD:
    def __init__(self, ctx: Ctx):
        try:
            store = importlib.import_module("shardfold.functions.store")
            get_batch = store.get_batch
        except Exception as exc:
            raise Skip(
                f"shardfold.functions.store.get_batch not importable: {type(exc).__name__}: {exc}"
            ) from exc
        self.ctx = ctx
        self.get_batch = get_batch
        self.kw = {}
        # A forced transport goes through the engine's documented switch, read per get_batch() call.
        self._saved_env = os.environ.get("SHARDFOLD_S3_TRANSPORT")
        if ctx.d_transport:
            os.environ["SHARDFOLD_S3_TRANSPORT"] = ctx.d_transport
        if ctx.d_concurrency:
            self.kw["concurrency"] = ctx.d_concurrency
        try:
            default = importlib.import_module("shardfold.functions.store.batch").DEFAULT_CONCURRENCY
        except Exception:
            default = "?"
        self.concurrency_note = str(ctx.d_concurrency) if ctx.d_concurrency else f"eng {default}"
        self.uri_prefix = f"s3://{ctx.bucket}/"

    def fetch(self, keys: list[str]) -> list[bytes]:
        items = [self.uri_prefix + k for k in keys]
        out = []
        for e in self.get_batch(items, **self.kw):
            if e.error:
                raise RuntimeError(f"get_batch entry {e.index} ({e.name}) failed: {e.error}")
            out.append(e.data)
        return out

    def close(self):
        if self.ctx.d_transport:
            if self._saved_env is None:
                os.environ.pop("SHARDFOLD_S3_TRANSPORT", None)
            else:
                os.environ["SHARDFOLD_S3_TRANSPORT"] = self._saved_env


class ModeE:
    def __init__(self, ctx: Ctx):
        try:
            client_mod = importlib.import_module("client")
            self.store = importlib.import_module("shardfold.functions.store")
            client_cls = client_mod.Client
        except Exception as exc:
            raise Skip(
                f"client.Client / shardfold.functions.store not importable: {type(exc).__name__}: {exc}"
            ) from exc
        self.ctx = ctx
        try:
            self.concurrency_note = (
                f"eng {importlib.import_module('shardfold.functions.store.batch').DEFAULT_CONCURRENCY}"
            )
        except Exception:
            self.concurrency_note = "engine"
        try:
            self.client = client_cls()
        except Exception as exc:
            raise Skip(f"Client() failed: {type(exc).__name__}: {exc}") from exc
        wait = getattr(client_mod, "Job", None)
        self.wait_kw = {}
        if wait is not None and hasattr(wait, "wait"):
            params = inspect.signature(wait.wait).parameters
            if "progress" in params:
                self.wait_kw["progress"] = False
            for name in ("timeout_s", "timeout"):
                if name in params:
                    self.wait_kw[name] = 300
                    break
        self.jobs: list[str] = []
        # Per batch: wall and client CPU seconds of submit (incl. its plan check), wait, result + read.
        self.phases: dict[str, list[tuple[float, float]]] = {}
        # The last fetch's read-back (wall, CPU): run_mode leaves it out of (e) and reports it as (e+r).
        self.untimed: tuple[float, float] = (0.0, 0.0)

    def _archive_uri(self, result) -> str:
        if isinstance(result, str):
            return result
        if isinstance(result, dict):
            for k in ("archive", "output", "uri", "archive_uri", "output_uri", "tar"):
                v = result.get(k)
                if isinstance(v, str):
                    return v
        raise RuntimeError(f"cannot find the archive URI in job.result() = {result!r:.300}")

    def fetch(self, keys: list[str]) -> list[bytes]:
        # The phases' CPU is this process's (the job's tasks run on its threads), read with a clock that costs
        # a microsecond: ClientCPU's walk of /proc inside the timed window would slow (e) alone
        cpu = time.process_time
        t0, c0 = time.perf_counter(), cpu()
        spec = {"kind": "getbatch", "items": [{"uri": f"s3://{self.ctx.bucket}/{k}"} for k in keys]}
        job = self.client.submit(spec)
        t1, c1 = time.perf_counter(), cpu()
        self.jobs.append(getattr(job, "job_id", getattr(job, "id", "?")))
        st = job.wait(**self.wait_kw)
        state = getattr(st, "state", None)
        if state is not None and str(state) not in ("SUCCEEDED", "JobState.SUCCEEDED"):
            raise RuntimeError(f"job {self.jobs[-1]} ended {state}: {getattr(st, 'error', None)}")
        uri = self._archive_uri(job.result())
        t2, c2 = time.perf_counter(), cpu()
        out = read_archive(uri, self.store)
        t3, c3 = time.perf_counter(), cpu()
        for name, wall, used in (
            ("submit", t1 - t0, c1 - c0),
            ("wait", t2 - t1, c2 - c1),
            ("read", t3 - t2, c3 - c2),
        ):
            self.phases.setdefault(name, []).append((wall, used))
        self.untimed = (t3 - t2, c3 - c2)
        return out

    def after_batch(self) -> None:
        """Drop finished jobs' files (archives of 1 MiB objects would otherwise fill the disk)."""
        for job_id in self.jobs:
            shutil.rmtree(os.path.join(self.ctx.store_home, "jobs", job_id), ignore_errors=True)

    def close(self):
        self.after_batch()
        close = getattr(self.client, "close", None)
        if close is not None:
            close()


def read_archive(uri: str, store) -> list[bytes]:
    """Each regular member's bytes, in order, as a user reads the archive: a local file through ``tarfile``
    (one copy per member out of the page cache), an S3 object with one GET."""
    if uri.startswith("file://"):
        tf = tarfile.open(uri[len("file://") :], mode="r:")
    else:
        tf = tarfile.open(fileobj=io.BytesIO(store.get(uri)), mode="r:")
    with tf:
        return [tf.extractfile(m).read() for m in tf if m.isfile()]


class ModeX:
    """Reference ceiling: awscrt's native S3Client issuing the whole batch at once (not a product path)."""

    def __init__(self, ctx: Ctx):
        try:
            from awscrt import auth, http, s3
            from awscrt import io as crt_io
        except ImportError as exc:
            raise Skip(f"awscrt not importable: {exc}") from exc
        self.ctx = ctx
        self._http = http
        self._s3 = s3
        conns = ctx.x_concurrency
        self.concurrency_note = str(conns)
        elg = crt_io.EventLoopGroup(1)
        bootstrap = crt_io.ClientBootstrap(elg, crt_io.DefaultHostResolver(elg))
        self.client = s3.S3Client(
            bootstrap=bootstrap,
            region="us-east-1",
            tls_mode=s3.S3RequestTlsMode.DISABLED,
            credential_provider=auth.AwsCredentialsProvider.new_static("bench", "bench"),
            max_active_connections_override=conns,
            throughput_target_gbps=100,
        )
        self.host = f"127.0.0.1:{ctx.port}"

    def fetch(self, keys: list[str]) -> list[bytes]:
        import threading

        http, s3 = self._http, self._s3
        bufs: list[list[bytes]] = [[] for _ in keys]
        errors: list[str] = []
        left = [len(keys)]
        lock = threading.Lock()
        done = threading.Event()
        reqs = []
        for i, k in enumerate(keys):

            def on_body(chunk, offset, _b=bufs[i], **_kw):
                _b.append(chunk)

            def on_done(error=None, status_code=None, _k=k, **_kw):
                if error is not None:
                    errors.append(f"{_k}: {error} (HTTP {status_code})")
                with lock:
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()

            req = http.HttpRequest("GET", f"/{self.ctx.bucket}/{k}", http.HttpHeaders([("Host", self.host)]))
            reqs.append(
                self.client.make_request(
                    type=s3.S3RequestType.GET_OBJECT, request=req, on_body=on_body, on_done=on_done
                )
            )
        if not done.wait(self.ctx.read_timeout * 2):
            raise RuntimeError("awscrt batch timed out")
        if errors:
            raise RuntimeError(f"{len(errors)} GETs failed, first: {errors[0]}")
        return [b"".join(b) for b in bufs]

    def close(self):
        self.client = None


MODE_CLASSES = {"a": ModeA, "b": ModeB, "c": ModeC, "c0": ModeC0, "d": ModeD, "e": ModeE, "x": ModeX}


# --------------------------------------------------------------------------------------------------------
# measurement


@dataclass
class Row:
    size: int
    mode: str
    label: str
    concurrency: str = ""
    status: str = "ok"
    note: str = ""
    batches: int = 0
    batch_size: int = 0
    objects: int = 0
    bytes: int = 0
    wall_s: float = 0.0
    obj_per_s: float | None = None
    mib_per_s: float | None = None
    client_cpu_s: float | None = None
    cpu_s_per_1k: float | None = None
    lat_p50_ms: float | None = None
    lat_p95_ms: float | None = None
    lat_p99_ms: float | None = None
    lat_max_ms: float | None = None
    batch_latencies_ms: list[float] = field(default_factory=list)
    server_cpu_s: float | None = None
    server_busy_pct: float | None = None  # SeaweedFS
    proxy_busy_pct: float | None = None  # the latency proxy in front of it
    other_busy_pct: float | None = None  # CPU used by other processes on the machine, % of one core
    load: dict = field(default_factory=dict)  # benchutil.LoadWatch report over the timed batches
    server_requests: dict = field(default_factory=dict)
    requests_per_obj: float | None = None
    phases: dict = field(default_factory=dict)
    untimed: list = field(default_factory=list)  # per batch [wall s, CPU s] left out of the timing


def with_read_back(row: Row) -> Row | None:
    """(e+r): the (e) row with each job's read-back of its archive added back in."""
    if row.status != "ok" or not row.untimed:
        return None
    out = Row(**{**asdict(row), "mode": "e+r", "label": MODE_LABELS["e+r"], "phases": {}, "note": ""})
    out.batch_latencies_ms = [
        ms + 1000 * w for ms, (w, _) in zip(row.batch_latencies_ms, row.untimed, strict=True)
    ]
    out.wall_s = row.wall_s + sum(w for w, _ in row.untimed)
    out.client_cpu_s = row.client_cpu_s + sum(c for _, c in row.untimed)
    out.obj_per_s = out.objects / out.wall_s
    out.mib_per_s = out.bytes / MiB / out.wall_s
    out.cpu_s_per_1k = out.client_cpu_s / out.objects * 1000
    out.lat_p50_ms = percentile(out.batch_latencies_ms, 50)
    out.lat_p95_ms = percentile(out.batch_latencies_ms, 95)
    out.lat_p99_ms = percentile(out.batch_latencies_ms, 99)
    out.lat_max_ms = max(out.batch_latencies_ms)
    return out


def verify(keys: list[str], got: list[bytes], size: int) -> str | None:
    if len(got) != len(keys):
        return f"expected {len(keys)} objects, got {len(got)}"
    for i, (k, data) in enumerate(zip(keys, got, strict=True)):
        if len(data) != size:
            return f"object {i} ({k}): {len(data)} bytes, expected {size}"
        if data[:32] != expected_head(k)[: min(32, size)]:
            return f"object {i} ({k}): wrong content (out of order or another object)"
    return None


def run_mode(
    mode: str,
    ctx: Ctx,
    batches: list[list[str]],
    budget_s: float,
    server: ServerHandle,
    cpu: ClientCPU,
    label: str | None = None,
) -> Row:
    row = Row(size=ctx.size, mode=mode, label=label or MODE_LABELS[mode], batch_size=len(batches[0]))
    # What earlier modes left alive (their clients, pools, caches) is moved out of the garbage collector's
    # sight, so a mode that allocates much (the job) does not pay for scanning its predecessors' objects.
    gc.collect()
    gc.freeze()
    try:
        impl = MODE_CLASSES[mode](ctx)
    except Skip as exc:
        row.status, row.note = "skipped", str(exc)
        print(f"  {row.label} skipped: {exc}", flush=True)
        return row
    except Exception as exc:
        row.status, row.note = "error", f"setup: {type(exc).__name__}: {exc}"
        print(f"  {row.label} failed to set up: {exc}", flush=True)
        traceback.print_exc()
        return row
    row.concurrency = impl.concurrency_note
    try:
        # Warm-up (untimed): imports, connection pools, thread pools, first-call caches.
        warm = batches[0][: min(len(batches[0]), max(4, ctx.concurrency))]
        problem = verify(warm, impl.fetch(warm), ctx.size)
        if problem:
            raise RuntimeError(f"warm-up: {problem}")
        phases = getattr(impl, "phases", None)
        if phases is not None:
            phases.clear()
        gc.collect()
        server.call("reset_stats")
        watch = LoadWatch(row.label)
        s0, t0 = server.cpu_seconds(), time.perf_counter()
        lat, used, untimed = [], [], []
        for keys in batches:
            # Only the fetch is timed (not the check of its result or the clean-up after it), less what the
            # mode reports as the consumer's work ((e)'s read-back)
            # cpu() walks /proc for child processes (~1-3 ms): it is read outside the timed window
            cb = cpu()
            tb = time.perf_counter()
            got = impl.fetch(keys)
            wall_b = time.perf_counter() - tb
            cpu_b = cpu() - cb
            skip = getattr(impl, "untimed", (0.0, 0.0))
            untimed.append(skip)
            lat.append(wall_b - skip[0])
            used.append(cpu_b - skip[1])
            if hasattr(impl, "after_batch"):
                impl.after_batch()
            problem = verify(keys, got, ctx.size)
            del got
            if problem:
                raise RuntimeError(problem)
            row.batches += 1
            row.objects += len(keys)
            if time.perf_counter() - t0 > budget_s:
                row.note = f"time budget {budget_s:g}s reached after {row.batches} of {len(batches)} batches"
                break
        wall, elapsed = sum(lat), time.perf_counter() - t0
        s1 = server.cpu_seconds()  # (SeaweedFS, proxy)
        row.load = watch.stop()
        stats = server.call("stats")
    except Exception as exc:
        row.status = "error"
        row.note = f"{type(exc).__name__}: {exc}"[:500]
        print(f"  {row.label} failed: {row.note}", flush=True)
        traceback.print_exc()
        return row
    finally:
        try:
            impl.close()
        except Exception:
            pass
    row.bytes = row.objects * ctx.size
    row.wall_s = wall
    row.obj_per_s = row.objects / wall
    row.mib_per_s = row.bytes / MiB / wall
    row.client_cpu_s = sum(used)
    row.cpu_s_per_1k = row.client_cpu_s / row.objects * 1000
    row.batch_latencies_ms = [x * 1000 for x in lat]
    row.lat_p50_ms = percentile(row.batch_latencies_ms, 50)
    row.lat_p95_ms = percentile(row.batch_latencies_ms, 95)
    row.lat_p99_ms = percentile(row.batch_latencies_ms, 99)
    row.lat_max_ms = max(row.batch_latencies_ms)
    row.server_cpu_s = s1[0] - s0[0]
    row.server_busy_pct = 100 * row.server_cpu_s / elapsed
    row.proxy_busy_pct = 100 * (s1[1] - s0[1]) / elapsed
    row.untimed = [list(u) for u in untimed] if any(w for w, _ in untimed) else []
    row.other_busy_pct = 100 * row.load["others_cores"]  # the servers are our children: not counted here
    row.server_requests = stats["counts"]
    row.requests_per_obj = sum(stats["counts"].values()) / row.objects
    if phases:
        row.phases = {
            name: {
                "wall_ms_mean": 1000 * sum(w for w, _ in v) / len(v),
                "client_cpu_ms_mean": 1000 * sum(c for _, c in v) / len(v),
            }
            for name, v in phases.items()
        }
        desc = ", ".join(
            f"{n} {p['wall_ms_mean']:.0f} ms wall / {p['client_cpu_ms_mean']:.0f} ms CPU"
            for n, p in row.phases.items()
        )
        row.note = (row.note + "; " if row.note else "") + "per job: " + desc
        print(f"    {desc}", flush=True)
    print(
        f"  {row.label:<26} {row.obj_per_s:9.1f} obj/s  {row.cpu_s_per_1k:7.3f} CPU-s/1k  "
        f"p50 {row.lat_p50_ms:8.1f} ms  server {row.server_busy_pct:5.1f}% busy "
        f"(+ proxy {row.proxy_busy_pct:4.1f}%)",
        flush=True,
    )
    return row


async def _load(port: int, bucket: str, keys: list[str], conns: int, seconds: float) -> tuple[int, float]:
    import asyncio

    done = 0
    deadline = time.perf_counter() + seconds

    async def worker(w: int) -> None:
        nonlocal done
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        i = w
        try:
            while time.perf_counter() < deadline:
                key = keys[i % len(keys)]
                i += conns
                writer.write(f"GET /{bucket}/{key} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
                head = await reader.readuntil(b"\r\n\r\n")
                m = re.search(rb"(?i)content-length:\s*(\d+)", head)
                await reader.readexactly(int(m.group(1)))
                done += 1
        finally:
            writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(conns)))
    return done, time.perf_counter() - t0


def measure_capacity(server: ServerHandle, keys: list[str], size: int, seconds: float, conns: int) -> dict:
    """GET rate and SeaweedFS's CPU per GET, asked directly (no proxy, no injected latency) by a raw asyncio
    HTTP client."""
    import asyncio

    s0 = server.cpu_seconds()[0]
    n, wall = asyncio.run(_load(server.s3_port, BUCKET, keys, conns, seconds))
    srv_cpu = server.cpu_seconds()[0] - s0
    per_req_us = srv_cpu / n * 1e6 if n else None
    return {
        "size": size,
        "connections": conns,
        "seconds": wall,
        "requests": n,
        "achieved_get_per_s": n / wall if wall else None,
        "server_cpu_s": srv_cpu,
        "server_busy_pct": 100 * srv_cpu / wall if wall else None,
        "server_cpu_us_per_get": per_req_us,
        "capacity_get_per_s_one_core": 1e6 / per_req_us if per_req_us else None,
    }


# --------------------------------------------------------------------------------------------------------
# report


def _f(v, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def print_table(rows: list[Row]) -> str:
    cols = [
        ("size", "<", lambda r: fmt_size(r.size)),
        ("mode", "<", lambda r: r.label),
        ("conc", ">", lambda r: r.concurrency),
        ("batches", ">", lambda r: str(r.batches) if r.status == "ok" else ""),
        ("objects", ">", lambda r: str(r.objects) if r.status == "ok" else ""),
        ("obj/s", ">", lambda r: _f(r.obj_per_s, ".1f")),
        ("MiB/s", ">", lambda r: _f(r.mib_per_s, ".2f")),
        ("CPU-s/1k", ">", lambda r: _f(r.cpu_s_per_1k, ".3f")),
        ("p50 ms", ">", lambda r: _f(r.lat_p50_ms, ".1f")),
        ("p95 ms", ">", lambda r: _f(r.lat_p95_ms, ".1f")),
        ("p99 ms", ">", lambda r: _f(r.lat_p99_ms, ".1f")),
        ("req/obj", ">", lambda r: _f(r.requests_per_obj, ".2f")),
        (
            "srv busy",
            ">",
            lambda r: _f(r.server_busy_pct, ".0f") + ("%" if r.server_busy_pct is not None else ""),
        ),
        (
            "others",
            ">",
            lambda r: (
                _f(r.other_busy_pct, ".0f")
                + ("%" if r.other_busy_pct is not None else "")
                + (" NOISY" if r.load.get("noisy") else "")
            ),
        ),
        ("vs (a)", ">", lambda r: r._vs_a if hasattr(r, "_vs_a") else ""),
        ("note", "<", lambda r: (r.note[:70] + "...") if len(r.note) > 73 else r.note),
    ]
    a_rate = {r.size: r.obj_per_s for r in rows if r.mode == "a" and r.status == "ok"}
    for r in rows:
        base = a_rate.get(r.size)
        r._vs_a = f"{r.obj_per_s / base:.1f}x" if base and r.obj_per_s else ""
    cells = [[fn(r) for _, _, fn in cols] for r in rows]
    widths = [
        max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, (h, _, _) in enumerate(cols)
    ]
    widths[-1] = 0  # the note column is not padded
    lines = []

    def fmt(vals):
        out = []
        for (_h, align, _), w, v in zip(cols, widths, vals, strict=True):
            out.append(f"{v:{align}{w}}" if w else v)
        return "  ".join(out).rstrip()

    lines.append(fmt([h for h, _, _ in cols]))
    lines.append(fmt(["-" * w if w else "----" for w in widths]))
    for c in cells:
        lines.append(fmt(c))
    text = "\n".join(lines)
    print(text)
    for r in rows:
        del r._vs_a
    return text


def evaluate_targets(rows: list[Row]) -> list[dict]:
    """The issue's targets, at 10 KiB and batch 256 (elsewhere the same ratios are informative)."""
    out = []
    for size in sorted({r.size for r in rows}):
        by = {
            r.mode: r for r in rows if r.size == size and r.status == "ok" and r.label == MODE_LABELS[r.mode]
        }
        bs = next((r.batch_size for r in rows if r.size == size and r.batch_size), 0)
        official = size == 10 * KiB and bs == 256
        d, a, b, c = by.get("d"), by.get("a"), by.get("b"), by.get("c")

        def add(name, goal, value, ok, detail, size=size, bs=bs, official=official):
            out.append(
                {
                    "size": size,
                    "batch": bs,
                    "target": name,
                    "goal": goal,
                    "value": value,
                    "pass": ok,
                    "official": official,
                    "detail": detail,
                }
            )

        if not any(r.size == size and r.mode == "d" for r in rows):
            continue  # (d) was not asked for
        if d is None:
            why = next((r.note for r in rows if r.size == size and r.mode == "d"), "not run")
            for name, goal in (
                ("(d) vs (a) throughput", ">= 10x"),
                ("(d) vs best of (b),(c)", ">= 1.5x"),
                ("(d) CPU/obj vs (b)", "<= 0.5x"),
            ):
                add(name, goal, None, None, f"(d) unavailable: {why}")
            continue
        if a:
            x = d.obj_per_s / a.obj_per_s
            add(
                "(d) vs (a) throughput",
                ">= 10x",
                x,
                x >= 10,
                f"(d) {d.obj_per_s:.0f} obj/s vs (a) {a.obj_per_s:.0f} obj/s",
            )
        peers = [p for p in (b, c) if p]
        if peers:
            best = max(peers, key=lambda p: p.obj_per_s)
            x = d.obj_per_s / best.obj_per_s
            add(
                "(d) vs best of (b),(c)",
                ">= 1.5x",
                x,
                x >= 1.5,
                f"(d) {d.obj_per_s:.0f} obj/s vs {best.label} {best.obj_per_s:.0f} obj/s",
            )
        if b:
            x = d.cpu_s_per_1k / b.cpu_s_per_1k
            add(
                "(d) CPU/obj vs (b)",
                "<= 0.5x",
                x,
                x <= 0.5,
                f"(d) {d.cpu_s_per_1k:.3f} vs (b) {b.cpu_s_per_1k:.3f} CPU-s per 1k objects",
            )
        e = by.get("e")
        if e:
            # the job (submit until its archive is committed) against the engine alone, which is the
            # platform's overhead: issue 10 asks >= 0.8x at 10 KiB and >= 0.7x at 1 MiB (batch 256); other
            # sizes are reported against 0.7x. With the read-back added, the same goal is informative: (d)
            # hands over bytes in memory, the job an archive in the store that the consumer reads after it.
            goal = 0.8 if size <= 10 * KiB else 0.7
            for r in (e, by.get("e+r")):
                if r is None:
                    continue
                x = r.obj_per_s / d.obj_per_s
                add(
                    f"({r.mode}) vs (d) throughput",
                    f">= {goal}x",
                    x,
                    x >= goal,
                    f"({r.mode}) {r.obj_per_s:.0f} obj/s vs (d) {d.obj_per_s:.0f} obj/s",
                    official=r.mode == "e" and bs == 256 and size in (10 * KiB, MiB),
                )
    return out


def print_targets(targets: list[dict]) -> None:
    if not targets:
        return
    print()
    print("Targets (a report, not an assertion; official at 10 KiB, and the job's also at 1 MiB, batch 256):")
    said_na: set[int] = set()
    for t in targets:
        if t["pass"] is None:
            if t["size"] not in said_na:
                said_na.add(t["size"])
                print(f"  {fmt_size(t['size']):>7}  n/a  {t['detail']}")
            continue
        verdict = "PASS" if t["pass"] else "FAIL"
        tag = "" if t["official"] else "  [informative]"
        val = f"{t['value']:6.2f}x"
        print(
            f"  {fmt_size(t['size']):>7}  {t['target']:<24} goal {t['goal']:<7} got {val}  {verdict}  "
            f"{t['detail']}{tag}"
        )


# --------------------------------------------------------------------------------------------------------


def set_client_env(endpoint: str, store_home: str) -> None:
    """Point every S3 client at the benchmark server with dummy credentials; no user config is read."""
    for k in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
        os.environ.pop(k, None)
    os.environ.update(
        {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ENDPOINT_URL_S3": endpoint,
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_REGION": "us-east-1",
            "AWS_CONFIG_FILE": os.path.join(store_home, "no-aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": os.path.join(store_home, "no-aws-credentials"),
            "AWS_EC2_METADATA_DISABLED": "true",
            "SHARDFOLD_HOME": store_home,
        }
    )


def versions() -> dict:
    out = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "SHARDFOLD_S3_TRANSPORT": os.environ.get("SHARDFOLD_S3_TRANSPORT"),
    }
    for mod in ("boto3", "botocore", "awscrt", "s3fs", "aiobotocore", "aiohttp"):
        try:
            out[mod] = importlib.import_module(mod).__version__
        except Exception:
            out[mod] = None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    ap.add_argument("--sizes", default="10KiB", help="comma-separated object sizes (default 10KiB)")
    ap.add_argument("--batch", type=int, default=256, help="objects per batch (default 256)")
    ap.add_argument("--batches", type=int, default=20, help="timed batches per mode (default 20)")
    ap.add_argument("--seq-batches", type=int, default=3, help="timed batches for sequential (a) (default 3)")
    ap.add_argument(
        "--e-batches", type=int, default=None, help="timed batches (jobs) for (e) (default: as --batches)"
    )
    ap.add_argument(
        "--concurrency",
        type=int,
        default=128,
        help="threads/connections for (b),(c) (default 128, the engine default)",
    )
    ap.add_argument("--d-concurrency", type=int, default=None, help="force get_batch(concurrency=...)")
    ap.add_argument("--x-concurrency", type=int, default=128, help="connections for reference mode (x)")
    ap.add_argument(
        "--d-transports",
        default="",
        help="extra (d) rows with SHARDFOLD_S3_TRANSPORT forced, e.g. 'crt,boto3'",
    )
    ap.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        help=f"comma-separated subset of {','.join(ALL_MODES)} (default {','.join(DEFAULT_MODES)})",
    )
    ap.add_argument("--ttfb-ms", type=float, default=16.0, help="median injected time to first byte (16)")
    ap.add_argument(
        "--ttfb-sigma",
        type=float,
        default=0.6,
        help="lognormal sigma of the injected TTFB (0.6: p99 ~ 4x median); 0 = fixed",
    )
    ap.add_argument("--ttfb-cap-ms", type=float, default=2000.0, help="cap on one injected delay (2000)")
    ap.add_argument("--budget-s", type=float, default=60.0, help="time budget per mode and size (60)")
    ap.add_argument("--capacity-s", type=float, default=2.0, help="seconds of the no-latency capacity run")
    ap.add_argument("--pool-mib", type=int, default=512, help="cap on distinct object bytes per size (512)")
    ap.add_argument("--seed", type=int, default=1, help="seed for keys, batches and injected latency")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="short run: 4 batches, 1 sequential batch, 3 jobs, 20 s budgets, 0.5 s capacity run",
    )
    ap.add_argument(
        "--max-total-s",
        type=float,
        default=None,
        help="hard stop for the whole run (default 1200 s per size; 240 s per size with --quick)",
    )
    ap.add_argument("--verbose", action="store_true", help="keep the library's INFO logs")
    ap.add_argument("--out", default=str(HERE / "results" / "getbatch.json"), help="JSON output path")
    args = ap.parse_args(argv)

    if args.e_batches is None:
        args.e_batches = args.batches
    if args.quick:
        args.batches = min(args.batches, 4)
        args.seq_batches = 1
        args.e_batches = min(args.e_batches, 3)
        args.budget_s = min(args.budget_s, 20.0)
        args.capacity_s = min(args.capacity_s, 0.5)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ALL_MODES]
    if bad:
        ap.error(f"unknown modes {bad}; choose from {ALL_MODES}")
    if any(s < 32 for s in sizes):
        ap.error("object sizes must be at least 32 bytes (objects carry a 32-byte key digest)")
    d_transports = [t.strip() for t in args.d_transports.split(",") if t.strip()]

    max_total = args.max_total_s or (240.0 if args.quick else 1200.0) * len(sizes)
    watchdog = threading.Timer(max_total, _give_up, args=(max_total,))
    watchdog.daemon = True
    watchdog.start()

    rng = random.Random(args.seed)
    store_home = tempfile.mkdtemp(prefix="shardfold-bench-")
    server = ServerHandle(args.ttfb_ms / 1000, args.ttfb_sigma, args.seed, args.ttfb_cap_ms / 1000)
    set_client_env(server.endpoint, store_home)
    if not args.verbose and not (os.environ.get("POWERTOOLS_LOG_LEVEL") or os.environ.get("LOG_LEVEL")):
        os.environ["POWERTOOLS_LOG_LEVEL"] = "WARNING"  # library INFO lines would bury the table
    cpu = ClientCPU(server.pids)
    print(
        f"S3 endpoint {server.endpoint}: SeaweedFS {server.s3_endpoint} (pid {server.pid}) behind the "
        f"latency proxy (pid {server.proxy.pid}); client pid {os.getpid()}; {os.cpu_count()} CPUs"
    )
    print(
        f"injected TTFB: lognormal median {args.ttfb_ms:g} ms, sigma {args.ttfb_sigma:g} "
        f"(p99 ~ {args.ttfb_ms * math.exp(2.326 * args.ttfb_sigma):.0f} ms), cap {args.ttfb_cap_ms:g} ms"
    )

    rows: list[Row] = []
    capacity: list[dict] = []
    watch = LoadWatch("run")
    print(
        load_start_line(watch) + " (the 'others' column is CPU other processes used during each mode, % of "
        "one core; NOISY above 50%)"
    )
    t_start = time.perf_counter()
    try:
        for size in sizes:
            pool_n = max(args.batch, min(args.batch * args.batches, args.pool_mib * MiB // size))
            prefix = f"obj{size}/"
            keys = synthetic_keys(prefix, pool_n)
            t_pop = time.perf_counter()
            server.populate(BUCKET, prefix, pool_n, size, seed=args.seed)
            t_pop = time.perf_counter() - t_pop
            batches = [rng.sample(keys, args.batch) for _ in range(args.batches)]
            print(
                f"\n== {fmt_size(size)} objects: {pool_n} distinct keys, batch {args.batch}, "
                f"{args.batches} batches, concurrency {args.concurrency} (written in {t_pop:.1f} s)"
            )

            cap = measure_capacity(server, keys, size, args.capacity_s, conns=max(8, args.concurrency))
            capacity.append(cap)
            print(
                f"  SeaweedFS capacity (asked directly, no injected latency, {cap['connections']} conns): "
                f"{cap['achieved_get_per_s']:.0f} GET/s achieved at "
                f"{cap['server_busy_pct']:.0f}% server CPU; "
                f"{cap['server_cpu_us_per_get']:.0f} us server CPU per GET -> "
                f"~{cap['capacity_get_per_s_one_core']:.0f} GET/s per server core"
            )

            ctx = Ctx(
                endpoint=server.endpoint,
                port=server.port,
                bucket=BUCKET,
                size=size,
                concurrency=args.concurrency,
                read_timeout=60,
                store_home=store_home,
                d_concurrency=args.d_concurrency,
                x_concurrency=args.x_concurrency,
                server_pid=server.pid,
            )
            for mode in modes:
                nb = {"a": args.seq_batches, "e": args.e_batches}.get(mode, args.batches)
                rows.append(run_mode(mode, ctx, batches[: max(1, nb)], args.budget_s, server, cpu))
                if (derived := with_read_back(rows[-1])) is not None:
                    rows.append(derived)
                gc.collect()
                if mode == "d":
                    for tr in d_transports:
                        tctx = Ctx(**{**asdict(ctx), "d_transport": tr})
                        rows.append(
                            run_mode(
                                "d", tctx, batches, args.budget_s, server, cpu, label=f"(d) get_batch[{tr}]"
                            )
                        )
                        gc.collect()
            server.clear(BUCKET, prefix)
    finally:
        server.stop()
        shutil.rmtree(store_home, ignore_errors=True)

    print()
    table = print_table(rows)
    targets = evaluate_targets(rows)
    print_targets(targets)
    noted = [r for r in rows if r.note]
    if noted:
        print()
    for r in noted:
        state = "" if r.status == "ok" else f" {r.status}"
        print(f"{fmt_size(r.size)} {r.label}{state}: {r.note}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "benchmark": "getbatch",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "elapsed_s": time.perf_counter() - t_start,
        "config": {
            "sizes": sizes,
            "batch": args.batch,
            "batches": args.batches,
            "seq_batches": args.seq_batches,
            "e_batches": args.e_batches,
            "concurrency": args.concurrency,
            "d_concurrency": args.d_concurrency,
            "d_transports": d_transports,
            "modes": modes,
            "ttfb_median_ms": args.ttfb_ms,
            "ttfb_sigma": args.ttfb_sigma,
            "ttfb_cap_ms": args.ttfb_cap_ms,
            "budget_s": args.budget_s,
            "seed": args.seed,
            "quick": args.quick,
        },
        "environment": versions(),
        "load": watch.stop(),
        "load_average_start": list(watch.load_before),
        "load_average_end": watch.stop()["load_average_after"],
        "server_capacity": capacity,
        "results": [asdict(r) for r in rows],
        "targets": targets,
        "table": table,
    }
    out.write_text(json.dumps(doc, indent=2))
    print(f"\n{load_end_line(watch)}")
    print(f"wrote {out}")
    watchdog.cancel()
    return 0


def _give_up(limit: float) -> None:
    """Watchdog: a stuck client must not keep the benchmark running forever."""
    print(f"\ngetbatch benchmark: still running after {limit:.0f} s (--max-total-s); giving up", flush=True)
    os._exit(3)  # the proxy stops on its closed pipe, SeaweedFS on its parent-death signal


if __name__ == "__main__":
    raise SystemExit(main())
