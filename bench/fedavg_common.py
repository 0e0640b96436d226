"""Shared pieces of the FedAvg benchmarks (``fedavg_throughput.py``, ``fedavg_memory.py``,
``fedavg_cost.py`` and ``fedavg.py``, which runs all three on one set of updates).

Contract:

* Generated updates: float32 safetensors files (deterministic values, ``num_examples`` metadata) in a temp
  ``SHARDFOLD_HOME``. Client counts above ``--distinct`` are hard links to the first ``--distinct`` files
  (distinct names and weights): memory and time do not depend on the values, and every file is read from
  the page cache either way. ``reference_samples`` gives the exact weighted mean (float64) at sampled
  positions, so every output is checked.
* Every memory figure and every single-task timing comes from a fresh interpreter: this file is also the
  children's entry point (``python bench/fedavg_common.py --child REQ.json``, via ``benchutil.Children``),
  and peaks are ``benchutil.PeakRSS`` read inside the child after its imports.
* ``session()`` is one benchmark run: workspace, watchdog (``--max-total-s``), the run's load window
  (``benchutil.LoadWatch``), and the JSON written at the end whatever happened.
* Nothing asserts on time: targets are PASS/FAIL lines (``print_targets``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import numpy as np  # noqa: E402
from benchutil import (  # noqa: E402
    Children,
    LoadWatch,
    PeakRSS,
    child_main,
    load_end_line,
    load_start_line,
    quiet_logs,
)

MiB = 1024 * 1024
GiB = 1024 * MiB
MB = 1_000_000
SAMPLES_PER_TENSOR = 64  # positions compared between our output, Flower's and a float64 reference
RESULTS = HERE / "results"


def fmt_mb(n: float | None) -> str:
    return "-" if n is None else f"{n / MiB:,.0f}"


def fmt_gb(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def mbps(bps: float | None) -> str:
    return "-" if bps is None else f"{bps / MB:,.0f}"


# --------------------------------------------------------------------------------------------------------
# generated updates


def model_layout(model_bytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """Tensor names and shapes (float32) of a synthetic model of about ``model_bytes``.

    An embedding, eight blocks of weight + bias, a head whose odd size puts later boundaries off any
    power-of-two alignment, and a 0-d scalar: shard ranges cross tensor boundaries as they do on a real
    model.
    """
    elems = max(model_bytes // 4, 64 * 1024)
    cols = 1024
    blocks = 8
    small = blocks * cols + 1000 + 1
    rows_total = max((elems - small) // cols, blocks + 2)
    embed_rows = rows_total - blocks * (rows_total // (blocks + 2))
    block_rows = rows_total // (blocks + 2)
    layout: list[tuple[str, tuple[int, ...]]] = [("embed.weight", (embed_rows, cols))]
    for b in range(blocks):
        layout.append((f"blocks.{b}.weight", (block_rows, cols)))
        layout.append((f"blocks.{b}.bias", (cols,)))
    layout.append(("head.bias", (1000,)))
    layout.append(("scale", ()))
    return layout


def layout_bytes(layout: list[tuple[str, tuple[int, ...]]]) -> int:
    return sum(4 * math.prod(s) for _, s in layout)


def client_weight(c: int) -> int:
    """num_examples of client ``c``: deterministic, uneven."""
    return 100 + (c * 37) % 500


def client_coeffs(c: int) -> tuple[np.float32, np.float32]:
    """Client ``c``'s update is ``base * a_c + b_c``: distinct, deterministic, one pass to make."""
    return np.float32(1.0 + 0.013 * (c % 97)), np.float32(0.001 * ((c * 7) % 31) - 0.015)


def write_updates(
    directory: Path, layout: list[tuple[str, tuple[int, ...]]], distinct: int, seed: int
) -> tuple[list[Path], float]:
    """Write ``distinct`` client updates (safetensors, ``num_examples`` metadata); returns paths, seconds."""
    import safetensors.numpy

    directory.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    elems = sum(math.prod(s) for _, s in layout)
    base = np.random.default_rng(seed).standard_normal(elems, dtype=np.float32)
    buf = np.empty_like(base)
    paths = []
    for c in range(distinct):
        a, b = client_coeffs(c)
        np.multiply(base, a, out=buf)
        buf += b
        tensors: dict[str, np.ndarray] = {}
        off = 0
        for name, shape in layout:
            n = math.prod(shape)
            tensors[name] = buf[off : off + n].reshape(shape)
            off += n
        path = directory / f"client-{c:04d}.safetensors"
        safetensors.numpy.save_file(tensors, str(path), metadata={"num_examples": str(client_weight(c))})
        paths.append(path)
    del base, buf
    # Flush the updates to disk now: otherwise the job's own writes (its parts, the output) are throttled
    # while the kernel writes back gigabytes of set-up data, and the job is charged for the disk.
    os.sync()
    return paths, time.perf_counter() - t0


def client_paths(directory: Path, distinct_paths: list[Path], n: int) -> list[Path]:
    """``n`` update paths: the distinct files, then hard links to them (distinct names)."""
    out = []
    for c in range(n):
        if c < len(distinct_paths):
            out.append(distinct_paths[c])
            continue
        link = directory / f"client-{c:04d}.safetensors"
        if not link.exists():
            os.link(distinct_paths[c % len(distinct_paths)], link)
        out.append(link)
    return out


def data_start(path: Path) -> int:
    """Where a safetensors file's data buffer begins: 8 + its header's length."""
    with open(path, "rb") as fh:
        return 8 + int.from_bytes(fh.read(8), "little")


def tensor_views(path: Path) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """name -> (safetensors dtype, shape, absolute byte offset of the data) from a file's header."""
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    out = {}
    for name, v in header.items():
        if name == "__metadata__":
            continue
        out[name] = (v["dtype"], tuple(v["shape"]), 8 + n + v["data_offsets"][0])
    return out


def sample_positions(layout: list[tuple[str, tuple[int, ...]]], seed: int) -> dict[str, list[int]]:
    rng = np.random.default_rng(seed + 99)
    out = {}
    for name, shape in layout:
        size = math.prod(shape)
        k = min(SAMPLES_PER_TENSOR, size)
        pos = sorted({0, size - 1, *rng.integers(0, size, k).tolist()})
        out[name] = [int(p) for p in pos]
    return out


def read_samples(path: Path, positions: dict[str, list[int]]) -> dict[str, list[float]]:
    """Values at ``positions`` of each float32 tensor of a safetensors file, via a memory map."""
    views = tensor_views(path)
    out = {}
    for name, pos in positions.items():
        dtype, shape, offset = views[name]
        if dtype != "F32":
            raise ValueError(f"{path}: tensor {name} is {dtype}, expected F32")
        arr = np.memmap(path, dtype=np.float32, mode="r", offset=offset, shape=(max(math.prod(shape), 1),))
        out[name] = [float(x) for x in arr[np.asarray(pos)]]
        del arr
    return out


def reference_samples(
    layout: list[tuple[str, tuple[int, ...]]],
    positions: dict[str, list[int]],
    n: int,
    distinct: int,
    seed: int,
) -> dict[str, list[float]]:
    """The weighted mean at the sample positions, in float64, from the generator's formula."""
    elems = sum(math.prod(s) for _, s in layout)
    base = np.random.default_rng(seed).standard_normal(elems, dtype=np.float32)
    w = np.array([client_weight(c) for c in range(n)], dtype=np.float64)
    coeffs = [client_coeffs(c % distinct) for c in range(n)]
    out = {}
    off = 0
    for name, shape in layout:
        idx = np.asarray(positions[name]) + off
        vals = base[idx]
        acc = np.zeros(len(idx), dtype=np.float64)
        for (a, b), wc in zip(coeffs, w, strict=True):
            acc += wc * (vals * a + b).astype(np.float64)  # the client's float32 value, then float64
        out[name] = (acc / w.sum()).tolist()
        off += math.prod(shape)
    del base
    return out


def max_rel_err(got: dict[str, list[float]], want: dict[str, list[float]]) -> float:
    worst = 0.0
    for name, w in want.items():
        g = np.asarray(got[name], dtype=np.float64)
        wv = np.asarray(w, dtype=np.float64)
        scale = np.maximum(np.abs(wv), 1e-3)
        worst = max(worst, float(np.max(np.abs(g - wv) / scale)))
    return worst


# --------------------------------------------------------------------------------------------------------
# child processes: run as ``python bench/fedavg_common.py --child REQ.json``


def _rchar() -> int:
    try:
        with open("/proc/self/io") as fh:
            for line in fh:
                if line.startswith("rchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def child_stream(req: dict) -> dict:
    """Memory-bound kernels on in-memory float32 arrays; rates are input (``b``) bytes per second.

    One thread: the issue's ``a += w*b`` and friends. Threaded: the fastest memory-bound kernels
    (``np.add``, ``np.copyto``) over the same bytes cut into one contiguous slice per thread, all threads
    at once (numpy releases the GIL in these loops): what the machine's memory system can stream."""
    elems = int(req["elems"])
    repeats = int(req["repeats"])
    threads = max(1, int(req.get("threads") or 1))
    a = np.zeros(elems, dtype=np.float32)
    b = np.random.default_rng(1).standard_normal(elems, dtype=np.float32)
    w = np.float32(0.37)
    tmp = np.empty(MiB // 4, dtype=np.float32)
    step = tmp.size

    def axpy() -> None:
        a.__iadd__(w * b)  # the kernel, as written: a temporary w*b, then a += it

    def add_out() -> None:
        np.add(a, b, out=a)

    def copy() -> None:
        np.copyto(a, b)

    def chunked() -> None:  # what a careful accumulate does: w*b into a cache-sized buffer, then add
        for i in range(0, elems, step):
            j = min(i + step, elems)
            t = tmp[: j - i]
            np.multiply(b[i:j], w, out=t)
            np.add(a[i:j], t, out=a[i:j])

    def best_median(fn: Any) -> dict:
        fn()  # warm (page faults of the temporaries, thread start)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return {"best_Bps": b.nbytes / min(times), "median_Bps": b.nbytes / float(np.median(times))}

    one = {
        "a += w*b": axpy,
        "np.add(a, b, out=a)": add_out,
        "np.copyto(a, b)": copy,
        "chunked w*b, +=": chunked,
    }
    out: dict[str, Any] = {"bytes": int(b.nbytes), "threads": threads}
    out["one_thread"] = {name: best_median(fn) for name, fn in one.items()}
    bounds = np.linspace(0, elems, threads + 1).astype(np.int64)
    slices = [slice(int(bounds[i]), int(bounds[i + 1])) for i in range(threads)]
    with ThreadPoolExecutor(threads) as pool:

        def spread(kernel: Any) -> Any:
            def run() -> None:
                list(pool.map(kernel, slices))

            return run

        def add_slice(s: slice) -> None:
            np.add(a[s], b[s], out=a[s])

        def copy_slice(s: slice) -> None:
            np.copyto(a[s], b[s])

        out["threaded"] = {
            "np.add(a, b, out=a)": best_median(spread(add_slice)),
            "np.copyto(a, b)": best_median(spread(copy_slice)),
        }
    return out


FILESUM_KERNELS = ("mmap + np.add", "mmap + weighted fold", "pread + weighted fold")


def child_filesum(req: dict) -> dict:
    """The all-core limit on the job's own files: every core reads a contiguous slice of the model's data
    from all N client files and sums it, chunk by chunk (``chunk_bytes``), as a fedavg shard does, with
    nothing else (no plan, no store, no part, no process start). Rates are input bytes (N x the model) per
    second of wall time, best of ``repeats``; the files are served from the page cache.

    Kernels (``FILESUM_KERNELS``): each file mapped (``mmap``, mapped anew per repeat, so its pages fault in
    as a reader's would) and summed with ``np.add`` (the cheapest sum: the ceiling) or with the job's own
    weighted fold (``kernels.axpy``: the same arithmetic as the job); or read like ``cat`` (``os.preadv``
    into one reused page-aligned buffer per thread) and folded. One thread per core (numpy and ``preadv``
    release the GIL)."""
    import mmap

    from shardfold.functions.fedavg import kernels

    paths = [Path(p) for p in req["paths"]]
    weights = [np.float32(w) for w in req["weights"]]
    starts = [int(x) for x in req["data_starts"]]  # each file's data buffer (8 + its header's length)
    nbytes = int(req["data_bytes"])
    threads = max(1, int(req["threads"]))
    chunk = max(4, int(req["chunk_bytes"]) // 4 * 4)
    repeats = max(1, int(req["repeats"]))
    elems = nbytes // 4
    cuts = np.linspace(0, elems, threads + 1).astype(np.int64)
    ranges = [(int(cuts[k]), int(cuts[k + 1])) for k in range(threads)]
    step = chunk // 4
    accs = [np.empty(step, np.float32) for _ in range(threads)]
    scratches = [np.empty(kernels.BLOCK, np.float32) for _ in range(threads)]
    raws = [np.empty(chunk + 4096, np.uint8) for _ in range(threads)]
    bufs = [r[-r.ctypes.data % 4096 :][:chunk] for r in raws]  # page-aligned, as the store's are

    def mapped(kernel: str) -> None:
        fds = [os.open(p, os.O_RDONLY) for p in paths]
        maps = [mmap.mmap(fd, 0, prot=mmap.PROT_READ) for fd in fds]
        try:

            def work(k: int) -> None:
                lo_all, hi_all = ranges[k]
                acc, scratch = accs[k], scratches[k]
                for lo in range(lo_all, hi_all, step):
                    count = min(step, hi_all - lo)
                    a = acc[:count]
                    for i, mm in enumerate(maps):
                        x = np.frombuffer(mm, np.float32, count, starts[i] + 4 * lo)
                        if kernel == "mmap + np.add" and i == 0:
                            np.copyto(a, x)
                        elif kernel == "mmap + np.add":
                            np.add(a, x, out=a)
                        elif i == 0:
                            np.multiply(x, weights[0], out=a)
                        else:
                            kernels.axpy(a, x, weights[i], scratch)
                        del x

            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(work, range(threads)))
        finally:
            for mm in maps:
                mm.close()
            for fd in fds:
                os.close(fd)

    def read() -> None:
        fds = [os.open(p, os.O_RDONLY) for p in paths]
        try:

            def work(k: int) -> None:
                lo_all, hi_all = ranges[k]
                acc, scratch, buf = accs[k], scratches[k], bufs[k]
                for lo in range(lo_all, hi_all, step):
                    count = min(step, hi_all - lo)
                    a, view = acc[:count], buf[: 4 * count]
                    x = view.view(np.float32)
                    for i, fd in enumerate(fds):
                        got = os.preadv(fd, [view], starts[i] + 4 * lo)
                        if got != view.nbytes:
                            raise OSError(f"{paths[i]}: short read ({got} of {view.nbytes} bytes)")
                        if i == 0:
                            np.multiply(x, weights[0], out=a)
                        else:
                            kernels.axpy(a, x, weights[i], scratch)

            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(work, range(threads)))
        finally:
            for fd in fds:
                os.close(fd)

    runs = {
        "mmap + np.add": lambda: mapped("mmap + np.add"),
        "mmap + weighted fold": lambda: mapped("mmap + weighted fold"),
        "pread + weighted fold": read,
    }
    total = len(paths) * elems * 4
    out: dict[str, Any] = {"threads": threads, "input_bytes": total, "chunk_bytes": chunk, "kernels": {}}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for fn in runs.values():
        fn()  # warm: the page cache, the threads, the buffers' pages
    for _ in range(repeats):  # interleaved, so a burst of other load falls on every kernel alike
        for name, fn in runs.items():
            c0 = time.process_time()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
            times.setdefault(name + " cpu", []).append(time.process_time() - c0)
    for name in runs:
        ts = times[name]
        best = int(np.argmin(ts))
        out["kernels"][name] = {
            "best_Bps": total / ts[best],
            "median_Bps": total / float(np.median(ts)),
            "seconds": ts,
            "cpu_s_per_GB": times[name + " cpu"][best] / (total / 1e9),
        }
    return out


def child_flower(req: dict) -> dict:
    """Flower's aggregation on updates read from disk, as a Flower server holds them: the FitRes list
    (``aggregate_inplace``, the FedAvg strategy's default) or the NDArrays list (``aggregate``)."""
    import safetensors.numpy
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
    from flwr.server.strategy.aggregate import aggregate, aggregate_inplace

    names: list[str] = req["names"]
    mem = PeakRSS()
    t0 = time.perf_counter()
    mode = req["mode"]
    results: list[Any] = []
    for path, n in zip(req["paths"], req["weights"], strict=True):
        tensors = safetensors.numpy.load_file(path)
        arrays = [tensors[k] for k in names]
        del tensors
        if mode == "inplace":
            fit = FitRes(
                status=Status(code=Code.OK, message="ok"),
                parameters=ndarrays_to_parameters(arrays),
                num_examples=int(n),
                metrics={},
            )
            results.append((None, fit))  # the ClientProxy is not used by aggregate_inplace
            del arrays
        else:
            results.append((arrays, int(n)))
    t1 = time.perf_counter()
    params = aggregate_inplace(results) if mode == "inplace" else aggregate(results)
    t2 = time.perf_counter()
    peak = mem.report()
    samples = {}
    for name, arr in zip(names, params, strict=True):
        flat = np.asarray(arr).reshape(-1)
        samples[name] = [float(x) for x in flat[np.asarray(req["positions"][name])]]
    return {
        **peak,
        "load_s": t1 - t0,
        "aggregate_s": t2 - t1,
        "samples": samples,
        "result_dtype": str(np.asarray(params[0]).dtype),
    }


def child_shard(req: dict) -> dict:
    """One Map child of the fedavg workflow (its body's tasks, in order), exactly as the local executor's
    process pool runs it: ``orchestrator.invoke.call`` on the Map item's event."""
    quiet_logs(False)
    from shardfold.orchestrator.invoke import HandlerFailed, call
    from shardfold.orchestrator.registry import import_handler

    for step in req["steps"]:
        import_handler(step["path"])  # imports outside the measurement, as on a warm Lambda
    state = dict(req["event"])
    mem = PeakRSS()
    r0 = _rchar()
    c0 = time.process_time()
    t0 = time.perf_counter()
    results = {}
    for step in req["steps"]:
        try:
            res = call(
                step["path"],
                state,
                function_name=step["function"],
                memory_mb=step["memory_mb"],
                timeout_s=step["timeout_s"],
            )
        except HandlerFailed as exc:
            return {"error": f"{step['function']}: {exc.error}: {exc.message}"}
        state = {**state, step["name"]: res}
        results[step["name"]] = res
    t1 = time.perf_counter()
    return {
        **mem.report(),
        "seconds": t1 - t0,
        "cpu_s": time.process_time() - c0,
        "bytes_read": _rchar() - r0,
        "results": results,
    }


def child_core_split(req: dict) -> dict:
    """``functions.fedavg.core.aggregate`` taken apart to time its two phases: ``aggregate_into`` (ranged
    reads + the weighted sum, written as the task writes its part: in place locally, spooled on S3) and
    the part's upload (locally the rename into place, on S3 the PUT)."""
    quiet_logs(False)
    from shardfold.functions import store
    from shardfold.functions.fedavg import core
    from shardfold.functions.fedavg.shardplan import SPOOL_BYTES

    event = req["event"]
    store_root, job_id, shard = event["store_root"], event["job_id"], int(event["item"]["shard"])
    t0 = time.perf_counter()
    c0 = time.process_time()
    plan = core.load_plan(store_root, job_id)
    t1 = time.perf_counter()
    with store.spooled_writer(core.part_uri(store_root, job_id, shard), SPOOL_BYTES) as out:
        stats = core.aggregate_into(plan, shard, out)
        t2 = time.perf_counter()
        c2 = time.process_time()
    t3 = time.perf_counter()
    return {
        "load_plan_s": t1 - t0,
        "aggregate_into_s": t2 - t1,
        "aggregate_into_cpu_s": c2 - c0,
        "upload_s": t3 - t2,
        "stats": stats,
    }


CHILD_OPS = {
    "stream": child_stream,
    "filesum": child_filesum,
    "flower": child_flower,
    "shard": child_shard,
    "core_split": child_core_split,
}


# --------------------------------------------------------------------------------------------------------
# the fedavg workflow, driven step by step for single-task measurements


class FedAvgUnavailable(Exception):
    pass


def fedavg_workflow() -> Any:
    try:
        from shardfold.functions.kinds import WORKFLOWS
    except Exception as exc:  # pragma: no cover - a broken checkout
        raise FedAvgUnavailable(f"shardfold.functions.kinds does not import: {exc}") from exc
    wf = WORKFLOWS.get("fedavg")
    if wf is None:
        raise FedAvgUnavailable("no 'fedavg' workflow is registered (functions/fedavg/workflow.py)")
    return wf


def split_workflow(wf: Any) -> tuple[list[Any], Any, list[Any]]:
    """(steps before the aggregate Map, the aggregate Map, steps after it). The steps before it may hold
    DP-FedAvg's norms Map, which a round without ``dp`` runs empty."""
    from shardfold.functions.fedavg.workflow import AGGREGATE
    from shardfold.functions.workflow import Map, Task

    pre: list[Any] = []
    for i, step in enumerate(wf.steps):
        if step is AGGREGATE:
            return pre, step, list(wf.steps[i + 1 :])
        if not isinstance(step, Task | Map):
            raise FedAvgUnavailable(f"fedavg workflow step {step.name!r} is a {type(step).__name__}")
        pre.append(step)
    raise FedAvgUnavailable("the fedavg workflow has no aggregate Map to measure")


def spec_doc(uris: list[str], weights: list[int], options: dict) -> dict:
    return {
        "kind": "fedavg",
        "clients": [{"uri": u, "weight": float(w)} for u, w in zip(uris, weights, strict=True)],
        **options,
    }


def prepare_shard_tasks(store_root: str, doc: dict) -> tuple[list[dict], list[dict], dict]:
    """Record a fedavg job's spec, run the steps before its Map here, and return
    (the Map's items as child events, the Map body's steps, the pre-Map results)."""
    from shardfold.functions import store
    from shardfold.functions.jobs import new_job_id, spec_key
    from shardfold.functions.specs import parse_spec
    from shardfold.functions.store.uri import join
    from shardfold.functions.workflow import Map
    from shardfold.functions.worklist import read_worklist
    from shardfold.orchestrator.invoke import HandlerFailed, call
    from shardfold.orchestrator.registry import handler_path

    wf = fedavg_workflow()
    pre, map_step, _post = split_workflow(wf)
    spec = parse_spec(doc)
    job_id = new_job_id("fedavg")
    spec_uri = join(store_root, spec_key(job_id))
    store.put_json(spec_uri, spec.model_dump(mode="json", exclude_none=True))
    state: dict[str, Any] = {"job_id": job_id, "spec_uri": spec_uri, "store_root": store_root}
    pre_results = {}

    def run(task: Any, event: dict) -> Any:
        try:
            return call(
                handler_path(task.function),
                event,
                function_name=task.function,
                memory_mb=task.memory_mb,
                timeout_s=task.timeout_s,
            )
        except HandlerFailed as exc:
            raise FedAvgUnavailable(f"{task.function} failed: {exc.error}: {exc.message}") from None

    for step in pre:
        if isinstance(step, Map):  # DP-FedAvg's norms: its children, one after another (none without dp)
            ref = state[step.items.removeprefix("$.").split(".")[0]]["norms"]
            base = {k: state[k] for k in ("job_id", "spec_uri", "store_root")}
            for i, item in enumerate(read_worklist(ref)):
                for task in step.body:
                    run(task, {**base, "item": item, "index": i})
            continue
        res = run(step, state)
        state = {**state, step.name: res}
        pre_results[step.name] = res
    ref: Any = state
    for part in map_step.items.removeprefix("$.").split("."):
        ref = ref[part]
    items = read_worklist(ref)
    base = {k: state[k] for k in ("job_id", "spec_uri", "store_root")}
    events = [{**base, "item": item, "index": i} for i, item in enumerate(items)]
    steps = [
        {
            "name": t.name,
            "function": t.function,
            "path": handler_path(t.function),
            "memory_mb": t.memory_mb,
            "timeout_s": t.timeout_s,
        }
        for t in map_step.body
    ]
    return events, steps, pre_results


def job_breakdown(store_root: str, doc: dict) -> dict:
    """The job's steps run one after another in this process (no pool, no overlap), each timed: where a
    job's time goes. Same handlers and events as the executor's."""
    from shardfold.orchestrator.invoke import call
    from shardfold.orchestrator.registry import handler_path

    t0 = time.perf_counter()
    events, steps, pre = prepare_shard_tasks(store_root, doc)
    t1 = time.perf_counter()
    shard_s = []
    for ev in events:
        state = dict(ev)
        ts = time.perf_counter()
        for st in steps:
            res = call(
                st["path"], state, function_name=st["function"], memory_mb=st["memory_mb"], timeout_s=900
            )
            state = {**state, st["name"]: res}
        shard_s.append(time.perf_counter() - ts)
    _pre, _map, post = split_workflow(fedavg_workflow())
    state = {**{k: events[0][k] for k in ("job_id", "spec_uri", "store_root")}, **pre}
    tc = time.perf_counter()
    for task in post:
        res = call(
            handler_path(task.function),
            state,
            function_name=task.function,
            memory_mb=task.memory_mb,
            timeout_s=task.timeout_s,
        )
        state = {**state, task.name: res}
    t3 = time.perf_counter()
    return {"plan_s": t1 - t0, "shards_s": shard_s, "after_map_s": t3 - tc, "total_s": t3 - t0}


def run_job(store_root: str, doc: dict, repeats: int, timeout_s: float) -> dict:
    """The whole fedavg job on the local executor: ``Client().submit(spec)``, ``wait``; best of repeats.

    One client (one process pool) serves every repeat, so the first run pays the pool's start."""
    from shardfold.client import Client
    from shardfold.functions import store
    from shardfold.functions.store.uri import local_path

    runs = []
    result: dict = {}
    with Client() as cl:
        for _ in range(repeats):
            t0 = time.perf_counter()
            job = cl.submit(doc)
            job.wait(progress=False, timeout_s=timeout_s)
            t1 = time.perf_counter()
            result = job.result()
            runs.append(t1 - t0)
            out_uri = result.get("output") if isinstance(result, dict) else None
            if len(runs) < repeats and out_uri:
                with contextlib.suppress(Exception):
                    store.delete(out_uri)
    out_uri = result.get("output") if isinstance(result, dict) else None
    path = str(local_path(out_uri)) if out_uri and out_uri.startswith("file://") else None
    return {"seconds": runs, "result": result, "output_path": path}


# --------------------------------------------------------------------------------------------------------
# one benchmark run: arguments, workspace, updates, the shard task measured in a child


def versions() -> dict:
    out = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "mem_total": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
    }
    for mod in ("numpy", "safetensors", "flwr", "ml_dtypes"):
        try:
            out[mod] = importlib.import_module(mod).__version__
        except Exception:
            out[mod] = None
    return out


def add_common_args(ap: argparse.ArgumentParser, out_name: str) -> None:
    """Flags every fedavg script takes (the model, the updates, the run's limits and output)."""
    ap.add_argument("--model-mib", type=float, default=256.0, help="model (update) size in MiB (256)")
    ap.add_argument(
        "--distinct", type=int, default=32, help="distinct update files; more N are hard links (32)"
    )
    ap.add_argument("--job-n", type=int, default=32, help="clients in the throughput job and shard task (32)")
    ap.add_argument(
        "--core-repeats",
        type=int,
        default=3,
        help="shard-task runs per N; the fastest counts, the peak is the max (3)",
    )
    ap.add_argument("--workdir", default=None, help="where updates are written (default: a new temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the generated updates")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--quick", action="store_true", help="64 MiB model, 8-client job, 2 repeats of each timing"
    )
    ap.add_argument("--max-total-s", type=float, default=None, help="hard stop (900 s; 300 s with --quick)")
    ap.add_argument("--verbose", action="store_true", help="keep the library's INFO logs")
    ap.add_argument("--out", default=str(RESULTS / out_name), help="JSON output path")


def apply_common_quick(args: argparse.Namespace) -> None:
    if args.quick:
        args.model_mib = min(args.model_mib, 64.0)
        args.job_n = min(args.job_n, 8)
        args.core_repeats = min(args.core_repeats, 2)
    if args.distinct < 1 or args.job_n < 1:
        raise SystemExit("client counts must be >= 1")


@dataclass
class Workspace:
    """The run's files and what was measured so far (shared by the parts of ``fedavg.py``)."""

    args: argparse.Namespace
    doc: dict
    workdir: Path
    home: Path
    children: Children
    layout: list[tuple[str, tuple[int, ...]]]
    model_bytes: int
    notes: list[str] = field(default_factory=list)
    distinct: int = 0
    distinct_paths: list[Path] = field(default_factory=list)
    shard_rows: dict[int, dict] = field(default_factory=dict)  # N -> the shard task measured at N
    max_n: int = 0  # the most clients any part of this run will ask for: updates are written once
    _tasks: dict[int, tuple[dict, list[dict]]] = field(default_factory=dict)
    _fedavg: tuple[bool, str] | None = None

    @property
    def store_root(self) -> str:
        return self.home.resolve().as_uri()

    @property
    def upd_dir(self) -> Path:
        return self.home / "updates"

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.layout]

    @property
    def positions(self) -> dict[str, list[int]]:
        return sample_positions(self.layout, self.args.seed)

    def fedavg_available(self) -> tuple[bool, str]:
        if self._fedavg is None:
            try:
                fedavg_workflow()
                self._fedavg = (True, "")
            except FedAvgUnavailable as exc:
                self._fedavg = (False, str(exc))
                print(f"\n!! fedavg is not available: {exc}; the parts that run it are skipped")
                self.notes.append(f"fedavg unavailable: {exc}")
        return self._fedavg

    def need_updates(self, max_n: int) -> bool:
        """Write enough distinct updates for ``max_n`` clients (once); False, printed, if disk is short."""
        distinct = min(self.args.distinct, max(max_n, self.max_n))
        if distinct <= self.distinct:
            return True
        need = distinct * self.model_bytes * 1.05 + 3 * self.model_bytes
        free = shutil.disk_usage(self.workdir).free
        if free < need:
            print(
                f"not enough disk in {self.workdir}: need ~{fmt_gb(need)}, {fmt_gb(free)} free; "
                "use --workdir, --distinct or --model-mib"
            )
            return False
        print(f"\n== writing {distinct} updates of {self.model_bytes / MiB:,.1f} MiB to {self.upd_dir}")
        self.distinct_paths, gen_s = write_updates(self.upd_dir, self.layout, distinct, self.args.seed)
        self.distinct = distinct
        print(
            f"  {distinct * self.model_bytes / GiB:.1f} GiB in {gen_s:.1f} s "
            f"({distinct * self.model_bytes / gen_s / MB:,.0f} MB/s)"
        )
        self.doc["generate"] = {"seconds": gen_s, "bytes": distinct * self.model_bytes, "distinct": distinct}
        return True

    def paths(self, n: int) -> list[Path]:
        return client_paths(self.upd_dir, self.distinct_paths, n)

    def uris_weights(self, n: int) -> tuple[list[str], list[int]]:
        return [p.resolve().as_uri() for p in self.paths(n)], [client_weight(c) for c in range(n)]

    def reference(self, n: int) -> dict[str, list[float]]:
        return reference_samples(self.layout, self.positions, n, self.distinct, self.args.seed)


def _give_up(name: str, limit: float, children: Children) -> None:
    print(f"\n{name} benchmark: still running after {limit:.0f} s (--max-total-s); giving up", flush=True)
    children.kill_all()
    os._exit(3)


@contextlib.contextmanager
def session(benchmark: str, args: argparse.Namespace) -> Iterator[Workspace]:
    """A benchmark run: prints the header and the load before, yields the workspace; at the end (also on
    error or a failed part) removes the updates unless ``--keep``, prints the load after and the run's noise
    mark, and writes the JSON document."""
    quiet_logs(args.verbose)
    watch = LoadWatch("run")
    t_start = time.perf_counter()
    max_total = args.max_total_s or (300.0 if args.quick else 900.0)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix=f"shardfold-bench-{benchmark}-"))
    home = workdir / "home"
    home.mkdir(parents=True, exist_ok=True)
    os.environ["SHARDFOLD_HOME"] = str(home)
    children = Children(Path(__file__), workdir, env=dict(os.environ))
    watchdog = threading.Timer(max_total, _give_up, args=(benchmark, max_total, children))
    watchdog.daemon = True
    watchdog.start()
    layout = model_layout(int(args.model_mib * MiB))
    model_bytes = layout_bytes(layout)
    doc: dict[str, Any] = {
        "benchmark": benchmark,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": {**vars(args), "model_bytes": model_bytes},
        "environment": versions(),
        "load_average_start": list(watch.load_before),
    }
    ws = Workspace(args, doc, workdir, home, children, layout, model_bytes)
    print(
        f"{benchmark} benchmark: model {model_bytes / MiB:,.1f} MiB float32 ({len(layout)} tensors); "
        f"{os.cpu_count()} CPUs, {fmt_gb(doc['environment']['mem_total'])} RAM, "
        f"{fmt_gb(shutil.disk_usage(workdir).free)} free in {workdir}"
    )
    print(load_start_line(watch))
    try:
        yield ws
    finally:
        children.kill_all()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        doc["elapsed_s"] = time.perf_counter() - t_start
        doc["load"] = watch.stop()
        doc["load_average_end"] = doc["load"]["load_average_after"]
        doc["notes"] = ws.notes
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=2, default=str))
        print(f"\n{load_end_line(watch)}")
        print(f"wrote {out} ({doc['elapsed_s']:.0f} s)")
        watchdog.cancel()


def shard_row(ws: Workspace, n: int, *, core_split: bool = False, arena_diag: bool = False) -> dict:
    """Shard 0 of an N-client job run as one task in a fresh process, best of ``--core-repeats`` (time) and
    max (peak RSS); measured once per N per run, extended on request with the ``aggregate_into``/upload
    split and a rerun under ``MALLOC_ARENA_MAX=1``. Errors land in the row (``shard_error``)."""
    row = ws.shard_rows.get(n)
    if row is None:
        row = ws.shard_rows[n] = {"n": n, "input_bytes": n * ws.model_bytes}
        try:
            uris, weights = ws.uris_weights(n)
            events, steps, pre = prepare_shard_tasks(ws.store_root, spec_doc(uris, weights, {}))
        except Exception as exc:
            row["shard_error"] = f"{type(exc).__name__}: {exc}"
            return row
        ws._tasks[n] = (events[0], steps)
        row["shards"] = len(events)
        row["plan"] = pre
        try:  # what the planner's own memory model says for this very plan (local store)
            from shardfold.functions.fedavg import core as fcore
            from shardfold.functions.fedavg import shardplan as fsizing

            loads = fsizing.task_loads(fcore.load_plan(ws.store_root, events[0]["job_id"]), on_s3=False)
            row["planned_peak"] = int(loads["aggregate"].peak_bytes)
            row["planned_runtime"] = int(fsizing.RUNTIME_BYTES)
        except Exception as exc:
            row["planned_error"] = f"{type(exc).__name__}: {exc}"
        req = {"op": "shard", "event": events[0], "steps": steps}
        runs = [ws.children.run(req, timeout_s=600) for _ in range(max(1, ws.args.core_repeats))]
        r = next((x for x in runs if not x.ok), None) or min(runs, key=lambda x: x.result["seconds"])
        if not r.ok:
            row["shard_error"] = r.note
            return row
        res = r.result
        item = events[0]["item"]
        task_res = next(iter(res["results"].values()), {}) if res["results"] else {}
        if isinstance(task_res, dict) and task_res.get("read_bytes"):
            agg_bytes, how = int(task_res["read_bytes"]), "task's read_bytes"
        elif isinstance(item, dict) and "start" in item and "end" in item:
            agg_bytes, how = n * (int(item["end"]) - int(item["start"])), "N x shard range"
        else:
            agg_bytes, how = res["bytes_read"], "read() bytes of the process"
        row["shard"] = {
            "runs_seconds": [x.result["seconds"] for x in runs],
            "runs_peak_rss": [x.result["peak_rss"] for x in runs],
            "peak_rss": max(x.result["peak_rss"] for x in runs),
            "baseline_rss": res["baseline_rss"],
            "wait4_maxrss_incl_parent_at_fork": r.max_rss,
            "seconds": res["seconds"],
            "cpu_s": res.get("cpu_s"),
            "bytes_read": res["bytes_read"],
            "input_bytes": agg_bytes,
            "input_bytes_from": how,
            "Bps": agg_bytes / res["seconds"] if res["seconds"] > 0 else None,
            "item": item,
            "results": res["results"],
        }
    task = ws._tasks.get(n)
    if task is None or not row.get("shard"):
        return row
    event, steps = task
    if core_split and "core_split" not in row:
        splits = [
            ws.children.run({"op": "core_split", "event": event}, timeout_s=600)
            for _ in range(max(1, ws.args.core_repeats))
        ]
        ok = [x for x in splits if x.ok]
        row["core_split"] = (
            min((x.result for x in ok), key=lambda x: x["aggregate_into_s"])
            if ok
            else {"error": splits[0].note}
        )
    if arena_diag and "shard_arena1" not in row:
        # the same task with glibc limited to one malloc arena: separates what the task holds from what
        # the allocator's per-thread arenas retain as the number of reads grows
        r1 = ws.children.run(
            {"op": "shard", "event": event, "steps": steps},
            timeout_s=600,
            env_extra={"MALLOC_ARENA_MAX": "1"},
        )
        row["shard_arena1"] = (
            {"peak_rss": r1.result["peak_rss"], "seconds": r1.result["seconds"]}
            if r1.ok
            else {"error": r1.note}
        )
    return row


def target(
    out: list[dict], name: str, goal: str, value: float | None, ok: bool | None, detail: str, official: bool
) -> None:
    out.append(
        {"target": name, "goal": goal, "value": value, "pass": ok, "detail": detail, "official": official}
    )


def print_targets(targets: list[dict]) -> None:
    print("\nTargets (a report, not an assertion):")
    for t in targets:
        verdict = "n/a " if t["pass"] is None else ("PASS" if t["pass"] else "FAIL")
        tag = "" if t["official"] else "  [informative]"
        print(f"  {t['target']:<48} goal {t['goal']:<11} {verdict}  {t['detail']}{tag}")


def is_default_model(model_bytes: int) -> bool:
    """The targets are official at the default 256 MiB model; elsewhere the same ratios are informative."""
    return abs(model_bytes - 256 * MiB) < 4 * MiB


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--child":
    raise SystemExit(child_main(CHILD_OPS, sys.argv[2]))
