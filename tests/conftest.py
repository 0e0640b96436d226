"""Fixtures shared across the suite, and the test processes' environment.

``OMP_NUM_THREADS=1`` unless already set, here, before any test module imports torch or numpy, so every
process the tests start inherits it (the local executor's spawned workers, the local Batch containers).
The suite runs jobs whose worker processes (inference containers, process-pool tasks) run side by side
with each other and with the test process; with OpenMP's default of one thread per core they oversubscribe
the cores and spin-wait for each other. On a loaded 2-core machine it halved the whole suite's wall time
(10:38 to 5:21, load average about 4.5) and cut the inference containers' CPU from 194 s to 87 s. No test
depends on the thread count: embeddings are compared with tolerances, between runs in the same environment.

``OMP_WAIT_POLICY=PASSIVE`` too, unless already set: a thread that waits at an OpenMP barrier sleeps rather
than spins. The inference worker sets torch's threads itself, to the cores it may use (two here, whatever
``OMP_NUM_THREADS`` says), and with three test processes on two cores one of its two threads is often
descheduled: the other spun at every barrier, holding a core the late thread needed. On a 2-core machine,
``-n 3``: tests/test_inference_llm.py and tests/test_inference_job.py took 122 s of CPU and 62 s, now 69 s
and 36 s (three such processes with two torch threads each: 10 to 18 s, now 1.2 to 1.9 s; one thread each,
0.9 to 1.7 s). Where a thread waits is the only change: no result depends on it.

Under pytest-xdist, no inherited ``COLUMNS``/``LINES``: the readline that pytest imports exports
``COLUMNS=80`` and ``LINES=24`` into the C environment, xdist's workers start with them, and rich fixes a
console's width from ``COLUMNS`` when the console is made (``client/cli.py`` makes its consoles at import),
so the tests that set ``COLUMNS`` for wide tables would get 80 columns.
"""

import gc
import os
import re

import pytest
from hypothesis import settings
from tiers import FAST, FAST_EXAMPLES

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.pop("COLUMNS", None)
    os.environ.pop("LINES", None)


@pytest.fixture(autouse=True)
def _own_stacks(tmp_path, monkeypatch):
    """No test reads or writes the user's saved stack outputs (``~/.config/shardfold/stacks``)."""
    monkeypatch.setenv("SHARDFOLD_STACKS_DIR", str(tmp_path / "stacks"))
    for var in ("SHARDFOLD_STACK", "SHARDFOLD_PULUMI_STACK"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def aws_env(monkeypatch):
    """Dummy credentials and no endpoint override, so boto3 talks to moto (never to a real account)."""
    for var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    # in-process moto answers botocore only: the CRT client (GetBatch's default, submit's size probe) talks
    # HTTP, so it needs a moto server (tests/test_get_batch.py's crt_bucket); here reads go through boto3
    monkeypatch.setenv("SHARDFOLD_S3_TRANSPORT", "boto3")


@pytest.fixture
def local_client(tmp_path, monkeypatch):
    """A client of a fresh local store, its inference workers polling every 50 ms."""
    from shardfold.client import Client

    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SHARDFOLD_INFERENCE_POLL_S", "0.05")
    with Client() as c:
        yield c


@pytest.fixture
def local_root(tmp_path, monkeypatch):
    """A fresh local store root (``SHARDFOLD_HOME`` under the test's tmp dir)."""
    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "home"))
    from shardfold.functions import store

    return store.store_root()


@pytest.fixture
def s3_root(aws_env):
    """An S3 store root in in-process moto: the bucket ``sf-test``."""
    import boto3
    from moto import mock_aws

    with mock_aws():
        boto3.client("s3").create_bucket(Bucket="sf-test")
        yield "s3://sf-test"


@pytest.fixture(scope="module")
def moto_server():
    """A moto server on loopback (for the CRT client, which speaks HTTP); its endpoint URL."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


def pytest_ignore_collect(collection_path, config):
    """``make test-fast`` (``-m "not slow"``) does not even import a module that is slow as a whole
    (``pytestmark = pytest.mark.slow`` at its top level): every one of its tests would be deselected, and
    importing them (moto, pulumi, the job harnesses) was a large share of the fast tier's time."""
    if collection_path.suffix != ".py" or (config.option.markexpr or "").strip() != "not slow":
        return None
    try:
        text = collection_path.read_text(encoding="utf-8")
    except OSError:
        return None
    return True if re.search(r"^pytestmark = .*\bpytest\.mark\.slow\b", text, re.MULTILINE) else None


def pytest_collection_modifyitems(config, items):
    """The tests marked ``early`` run before all others, in collection order otherwise. Under ``-n 3 --dist
    worksteal`` each process starts on a third of the tests in order, and one that is idle takes half of
    what another has left; a test of tens of seconds that started late was the run's tail, the other
    processes idle meanwhile (the million-row memory test, 38 s, started at 205 s and ended the suite at
    244 s, the others done at 208 s and 219 s)."""
    items.sort(key=lambda item: item.get_closest_marker("early") is None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """After each test (its fixtures torn down), collect its cyclic garbage and freeze what survives.

    A test process holds millions of long-lived objects (torch, transformers, moto, pulumi), imported as
    tests need them. CPython's full collection scans them all each time the heap grows by a quarter, so
    without this a fifth of the test processes' CPU went to the cycle collector, rescanning objects that
    live as long as the process. Frozen objects are still freed by reference counting; only a cycle among
    them outlives its last reference, which a test process can afford."""
    yield
    gc.collect()
    gc.freeze()


# Property tests that name no example count get Hypothesis's default (100), or few in the fast tier.
settings.register_profile("fast", max_examples=FAST_EXAMPLES)
if FAST:
    settings.load_profile("fast")
