"""Compare S3 GET clients on many small objects: boto3 (thread pool), awscrt S3Client, aiobotocore.

Runs a minimal in-memory S3 stand-in (asyncio, its own process, auth ignored) so the client, not the
server, is what gets measured, then reports objects/s and client CPU ms per object for each client, plus
the GetBatch engine on its default (awscrt) and boto3 transports. Prints a table and writes
bench/results/transports.json. Never asserts on time. The load averages before and after and the CPU other
processes used during each client's run (``benchutil.LoadWatch``, NOISY above half a core) are printed and
recorded.

    .venv/bin/python bench/transports.py --objects 2000 --size 10240 --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchutil import LoadWatch, load_end_line, load_start_line, mark  # noqa: E402

BUCKET = "bench"


# --- the server -----------------------------------------------------------------------------------------


class _Handler(asyncio.Protocol):
    """HTTP/1.1 keep-alive GET server for path-style /bucket/key requests, with single byte ranges."""

    def __init__(self, blob: bytes):
        self.blob = blob
        self.buf = b""

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while b"\r\n\r\n" in self.buf:
            head, self.buf = self.buf.split(b"\r\n\r\n", 1)
            self._answer(head.decode("latin-1"))

    def _answer(self, head: str) -> None:
        lines = head.split("\r\n")
        rng = None
        for line in lines[1:]:
            k, _, v = line.partition(":")
            if k.strip().lower() == "range":
                rng = v.strip()
        total = len(self.blob)
        status, body, extra = "200 OK", self.blob, ""
        if rng:
            a, _, b = rng.removeprefix("bytes=").partition("-")
            start, end = int(a), min(int(b) if b else total - 1, total - 1)
            status, body = "206 Partial Content", self.blob[start : end + 1]
            extra = f"Content-Range: bytes {start}-{end}/{total}\r\n"
        self.transport.write(
            (
                f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n{extra}"
                'ETag: "bench"\r\nContent-Type: application/octet-stream\r\n\r\n'
            ).encode()
            + body
        )


def _serve(sock: socket.socket, size: int) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _Handler(b"x" * size), sock=sock)
        await server.serve_forever()

    asyncio.run(main())


def start_server(size: int) -> tuple[mp.Process, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    proc = mp.get_context("fork").Process(target=_serve, args=(sock, size), daemon=True)
    proc.start()
    return proc, sock.getsockname()[1]


# --- the clients ----------------------------------------------------------------------------------------


def run_boto3(endpoint: str, keys: list[str], conc: int) -> None:
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        config=Config(max_pool_connections=conc, retries={"mode": "standard"}, tcp_keepalive=True),
    )

    def get(key: str) -> int:
        return len(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())

    with ThreadPoolExecutor(conc) as pool:
        assert all(n > 0 for n in pool.map(get, keys))


def run_crt(endpoint: str, keys: list[str], conc: int) -> None:
    from awscrt.auth import AwsCredentialsProvider
    from awscrt.http import HttpHeaders, HttpRequest
    from awscrt.io import ClientBootstrap, DefaultHostResolver, EventLoopGroup
    from awscrt.s3 import S3Client, S3RequestTlsMode, S3RequestType

    elg = EventLoopGroup(2)
    bootstrap = ClientBootstrap(elg, DefaultHostResolver(elg))
    creds = AwsCredentialsProvider.new_static("bench", "bench")
    client = S3Client(
        bootstrap=bootstrap, region="us-east-1", credential_provider=creds, tls_mode=S3RequestTlsMode.DISABLED
    )
    host = endpoint.removeprefix("http://")
    sem = threading.Semaphore(conc)
    done = threading.Event()
    left = [len(keys)]
    lock = threading.Lock()

    def issue(key: str) -> None:
        chunks: list[bytes] = []

        def on_done(error=None, **kw) -> None:
            assert error is None, error
            sem.release()
            with lock:
                left[0] -= 1
                if not left[0]:
                    done.set()

        client.make_request(
            type=S3RequestType.GET_OBJECT,
            request=HttpRequest("GET", f"/{BUCKET}/{key}", HttpHeaders([("Host", host)])),
            on_body=lambda chunk, offset, **kw: chunks.append(bytes(chunk)),
            on_done=on_done,
        )

    for key in keys:
        sem.acquire()
        issue(key)
    done.wait()


def run_aiobotocore(endpoint: str, keys: list[str], conc: int) -> None:
    from aiobotocore.config import AioConfig
    from aiobotocore.session import get_session

    async def main() -> None:
        session = get_session()
        cfg = AioConfig(max_pool_connections=conc, retries={"mode": "standard"})
        async with session.create_client("s3", endpoint_url=endpoint, config=cfg) as client:
            sem = asyncio.Semaphore(conc)

            async def get(key: str) -> int:
                async with sem:
                    resp = await client.get_object(Bucket=BUCKET, Key=key)
                    async with resp["Body"] as body:
                        return len(await body.read())

            sizes = await asyncio.gather(*(get(k) for k in keys))
            assert all(n > 0 for n in sizes)

    asyncio.run(main())


def run_get_batch(endpoint: str, keys: list[str], conc: int, transport: object = None) -> None:
    from shardfold.functions.store import get_batch

    uris = [f"s3://{BUCKET}/{k}" for k in keys]
    sizes = [len(e.data) for e in get_batch(uris, concurrency=conc, transport=transport)]
    assert len(sizes) == len(keys) and min(sizes) > 0


def run_get_batch_boto3(endpoint: str, keys: list[str], conc: int) -> None:
    from shardfold.functions.store.transport import Boto3Transport, RoutingTransport

    run_get_batch(endpoint, keys, conc, RoutingTransport(Boto3Transport()))


CLIENTS = {
    "boto3-threads": run_boto3,
    "awscrt": run_crt,
    "aiobotocore": run_aiobotocore,
    "get_batch": run_get_batch,
    "get_batch[boto3]": run_get_batch_boto3,
}


def measure(name: str, endpoint: str, keys: list[str], conc: int, server: psutil.Process) -> dict:
    # Warm up (imports, connection pools) on a slice, then time the whole list.
    CLIENTS[name](endpoint, keys[: min(len(keys), 64)], conc)
    srv0 = server.cpu_times()
    watch = LoadWatch(name)
    cpu0, t0 = time.process_time(), time.perf_counter()
    CLIENTS[name](endpoint, keys, conc)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    load = watch.stop()
    srv1 = server.cpu_times()
    srv_cpu = (srv1.user + srv1.system) - (srv0.user + srv0.system)
    return {
        "client": name,
        "objects": len(keys),
        "objects_per_s": len(keys) / wall,
        "cpu_ms_per_object": 1000 * cpu / len(keys),
        "server_cpu_ms_per_object": 1000 * srv_cpu / len(keys),
        "load": load,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objects", type=int, default=2000)
    ap.add_argument("--size", type=int, default=10240)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--clients", default=",".join(CLIENTS))
    args = ap.parse_args(argv)
    watch = LoadWatch("run")
    print(load_start_line(watch))

    proc, port = start_server(args.size)
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL_S3=endpoint,
    )
    keys = [f"obj/{i:06d}" for i in range(args.objects)]
    server = psutil.Process(proc.pid)
    rows = [measure(name, endpoint, keys, args.concurrency, server) for name in args.clients.split(",")]
    proc.terminate()

    base = next((r for r in rows if r["client"] == "boto3-threads"), None)
    print(f"{args.objects} GETs of {args.size} B, concurrency {args.concurrency}, {os.cpu_count()} CPUs")
    print(f"{'client':<18}{'obj/s':>10}{'CPU ms/obj':>12}{'vs boto3':>10}{'server ms/obj':>15}  load")
    for r in rows:
        rel = f"{r['cpu_ms_per_object'] / base['cpu_ms_per_object']:.2f}x" if base else "-"
        print(
            f"{r['client']:<18}{r['objects_per_s']:>10.0f}{r['cpu_ms_per_object']:>12.3f}{rel:>10}"
            f"{r['server_cpu_ms_per_object']:>15.3f}  {mark(r['load'])}"
        )
    load = watch.stop()
    print(load_end_line(watch))
    out = Path(__file__).parent / "results" / "transports.json"
    out.parent.mkdir(exist_ok=True)
    doc = {"args": vars(args), "python": sys.version, "rows": rows, "load": load}
    out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
