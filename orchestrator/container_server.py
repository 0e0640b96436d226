"""Local Batch containers forked from a server that imported their heavy modules once (Linux).

On AWS each Batch job runs in a fresh container. Locally each runs in a fresh process too, with its own pid,
exit code and signals (:mod:`orchestrator.local_batch`), but a new ``python -m functions.container`` paid
torch's and transformers' imports, about 5 s of CPU, on every start: twice that for a job of two GPU
workers, again for its repair worker and for the next job. Instead, the first container of a process starts
one server process, and every container after it is forked from that server:

1. The executor sends a request (an id, the container's environment, working directory and
   ``module:function``, and its own stdout and stderr as file descriptors) over a Unix socket pair.
2. When the handler's module defines ``preload()``, the server takes the request's environment and
   ``sys.path``, imports that module and calls it, so that the server itself imports what the container
   will (the inference worker: torch and transformers' BERT code; no weights, no spec, no I/O). A module
   without it is not imported in the server, so such a container imports its handler as it is on disk.
   Modules the server imported stay as they were imported, for the life of the server.
3. The server forks. The child takes the request's stdout, stderr, working directory, environment and
   ``sys.path`` (as a fresh interpreter started there would have it), reseeds numpy's global generator,
   then runs :func:`functions.container.main` and exits with its code, as the container would
   (``sys.exit(n)`` exits ``n``; Ctrl-C dies of SIGINT). The server answers with the child's pid, and
   later with its exit code (a death by signal ``N`` is ``-N``, as :class:`subprocess.Popen` reports it).
4. The executor signals a container through the server, by the request's id: the server signals only a
   child it has not reaped yet, so a pid it reaped, which may already belong to another process, is never
   signalled.

A child dies with the server (``PR_SET_PDEATHSIG``, and :func:`orchestrator.lifeline.watch_parent`). The
server ends when the process that owns it ends (a pidfd in its select loop), killing its children first, or
when that process closes the socket. It forks from its main thread; the libraries it imported may have
started threads of their own (OpenBLAS), which a forked child does not have, so ``preload`` must only
import: a torch op or a GPU initialised before a fork breaks every child.

Elsewhere than Linux, where ``SHARDFOLD_CONTAINER_SERVER=0``, or when the server cannot start a container,
each container is a fresh ``python -m functions.container`` (:func:`orchestrator.local_batch.run_container`).

Why not multiprocessing's forkserver (the process pools', :func:`orchestrator.local._fork_server`): there is
one per process, its preload a fixed list read when it starts, so every pool worker would import torch, never
under a request's environment nor for a handler registered later; and its children write to its stdout, not
the executor's current one, exit 1 on Ctrl-C rather than die of SIGINT, outlive it, and are signalled by a pid
it may have reaped: this module's code again, around it.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import traceback
import warnings
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from shardfold.orchestrator.lifeline import PARENT_ENV, kill_with_parent, watch_parent, watch_process

ENABLE_ENV = "SHARDFOLD_CONTAINER_SERVER"
NAME = "shardfold-batch"  # a forked container's process name (ps, top): its command line is the server's
START_TIMEOUT_S = 300.0  # the first start imports torch in the server: seconds, minutes on a loaded machine
_HEAD = struct.Struct("!I")
_PR_SET_NAME = 15
_SERVER_GONE = -signal.SIGKILL  # the exit code of a container whose server ended under it


def enabled() -> bool:
    """Whether local Batch containers are forked from a server: on Linux, unless
    ``SHARDFOLD_CONTAINER_SERVER=0``."""
    return sys.platform.startswith("linux") and os.environ.get(ENABLE_ENV, "1") != "0"


# --- framing: a 4-byte length, then JSON; file descriptors ride with the length --------------------------


def _send(sock: socket.socket, message: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
    data = json.dumps(message).encode()
    head = _HEAD.pack(len(data))
    if fds:
        socket.send_fds(sock, [head], list(fds))
    else:
        sock.sendall(head)
    sock.sendall(data)


def _exactly(sock: socket.socket, n: int, got: bytes = b"") -> bytes:
    while len(got) < n:
        chunk = sock.recv(n - len(got))
        if not chunk:
            raise EOFError
        got += chunk
    return got


def _receive(sock: socket.socket, max_fds: int = 0) -> tuple[dict[str, Any], list[int]]:
    """The next message and the descriptors sent with it; EOFError once the peer has closed its end."""
    if max_fds:
        head, fds, _, _ = socket.recv_fds(sock, _HEAD.size, max_fds)
    else:
        head, fds = sock.recv(_HEAD.size), []
    if not head:
        raise EOFError
    (size,) = _HEAD.unpack(_exactly(sock, _HEAD.size, head))
    return json.loads(_exactly(sock, size)), fds


# --- the executor's side ----------------------------------------------------------------------------------


class Container:
    """A container forked by the server, with the part of :class:`subprocess.Popen` the executor uses."""

    def __init__(self, server: _Server, request_id: int, pid: int):
        self._server = server
        self._id = request_id
        self.pid = pid
        self.returncode: int | None = None
        self._ended = threading.Event()

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"container {self.pid}", timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            self._server.signal(self._id, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Server:
    """The executor's handle on one server process: requests go out under a lock; one reader thread
    matches the answers to requests by id."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = {**os.environ, PARENT_ENV: str(os.getpid())}
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shardfold.orchestrator.container_server", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            env=env,
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.owner = os.getpid()
        self._sock = ours
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._starting: dict[int, Future[Container]] = {}
        self._running: dict[int, Container] = {}
        self.alive = True
        threading.Thread(target=self._read, name="shardfold-container-server", daemon=True).start()

    def start(self, handler_path: str, env: dict[str, str], preload: bool) -> Container:
        started: Future[Container] = Future()
        with self._lock:
            if not self.alive:
                raise OSError("the container server has ended")
            request_id = next(self._ids)
            request = {"id": request_id, "handler": handler_path, "env": env, "cwd": os.getcwd()}
            self._starting[request_id] = started
            try:
                _send(self._sock, {"start": {**request, "preload": preload}}, fds=(1, 2))  # as Popen's
            except OSError:
                self._starting.pop(request_id, None)
                raise
        try:
            return started.result(timeout=START_TIMEOUT_S)
        except FutureTimeout:  # a server stuck in an import: end it, and its containers with it
            self.proc.kill()
            raise OSError(f"the container server started no container in {START_TIMEOUT_S:.0f} s") from None

    def signal(self, request_id: int, sig: int) -> None:
        with self._lock, contextlib.suppress(OSError):
            if self.alive:
                _send(self._sock, {"signal": [request_id, int(sig)]})

    def _read(self) -> None:
        try:
            while True:
                message, _ = _receive(self._sock)
                if "started" in message:
                    request_id, pid = message["started"]
                    container = Container(self, request_id, pid)
                    with self._lock:
                        self._running[request_id] = container
                        started = self._starting.pop(request_id)
                    started.set_result(container)
                elif "failed" in message:
                    request_id, why = message["failed"]
                    with self._lock:
                        started = self._starting.pop(request_id)
                    started.set_exception(OSError(why))
                elif "exited" in message:
                    request_id, code = message["exited"]
                    with self._lock:
                        container = self._running.pop(request_id, None)
                    if container is not None:
                        container._exited(code)
        except Exception:  # EOF, a broken socket, or a message it cannot read: the server is done for
            pass
        with self._lock:  # the server is gone, and its children with it (they die with their parent)
            self.alive = False
            starting, self._starting = list(self._starting.values()), {}
            running, self._running = list(self._running.values()), {}
        for started in starting:
            started.set_exception(OSError("the container server ended"))
        for container in running:
            container._exited(_SERVER_GONE)
        self.proc.kill()
        self.proc.wait()


_server: _Server | None = None
_server_lock = threading.Lock()


def start(handler_path: str, env: dict[str, str], preload: bool) -> Container:
    """Fork a container that runs ``handler_path`` with ``env`` from this process's server (started on
    first use, and again if it ended). ``preload``: the handler's module defines ``preload()``. OSError
    when the server cannot start it."""
    global _server
    with _server_lock:
        if _server is None or not _server.alive or _server.owner != os.getpid():
            _server = _Server()
        server = _server
    return server.start(handler_path, env, preload)


# --- the server's side ------------------------------------------------------------------------------------

_BASE_PATH: list[str] = []  # the server's sys.path less its working directory and PYTHONPATH


def _become(request: dict[str, Any]) -> None:
    """Take the request's environment and ``sys.path``: its working directory, its ``PYTHONPATH``, then
    the interpreter's own entries, as a fresh ``python -m`` started there would have them."""
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    os.environ.pop(PARENT_ENV, None)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = list(dict.fromkeys([request["cwd"], *paths, *_BASE_PATH]))
    importlib.invalidate_caches()  # modules written since the server started are found


def _preload(request: dict[str, Any]) -> None:
    """Import the handler's module under the request's environment, and call its ``preload()``."""
    try:
        _become(request)
        importlib.import_module(request["handler"].partition(":")[0]).preload()
    except Exception:  # the container imports what it needs itself, and reports what fails
        traceback.print_exc()


def _name_process(name: str) -> None:
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def _child(request: dict[str, Any], fds: list[int], server_pid: int) -> int:
    """In the forked child: become the container the request describes and run it; its exit code."""
    kill_with_parent()
    _name_process(NAME)
    watch_parent(server_pid)  # also covers a server that ended before prctl took effect
    # a group of its own, as a container is: Ctrl-C at the owner's terminal is the owner's, which stops its
    # containers itself; a SIGINT sent to the container still ends it as it ends an interpreter
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in fds:
        os.close(fd)
    os.chdir(request["cwd"])
    _become(request)
    if "numpy" in sys.modules:  # a fresh interpreter seeds it from the OS; a fork copies the server's state
        sys.modules["numpy"].random.seed()
    from shardfold.functions.container import main

    try:
        return main()
    except SystemExit as exc:  # as the interpreter exits on sys.exit(code)
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # as an interpreter that Ctrl-C ended: dead of SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        raise


def _fork(request: dict[str, Any], fds: list[int]) -> int:
    """Fork a container; its pid. The child never returns from here."""
    server_pid = os.getpid()  # before the fork: the child's getppid() is the reaper once the server is gone
    sys.stdout.flush()
    sys.stderr.flush()  # what the server printed would otherwise be printed again by every child
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for fd in _SERVER_FDS:
            os.close(fd)
        code = _child(request, fds, server_pid)
    except BaseException:
        traceback.print_exc()
    finally:
        from shardfold.functions.container import exit_now

        exit_now(code)  # never back into the server's loop, whatever happened
    raise AssertionError("unreachable")


_SERVER_FDS: list[int] = []  # the server's own descriptors, closed in every child


def serve(sock: socket.socket, owner: int) -> None:
    """Fork containers on request until ``owner`` ends or closes the socket; then kill them and return."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select through the wakeup fd
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the owner, which stops its containers
    try:
        owner_fd: int | None = os.pidfd_open(owner)
    except (AttributeError, OSError):
        owner_fd = None
    watched = [sock.fileno(), wake_r, *([owner_fd] if owner_fd is not None else [])]
    _SERVER_FDS[:] = [*watched, wake_w]
    children: dict[int, int] = {}  # request id -> pid, until reaped
    try:
        while True:
            ready, _, _ = select.select(watched, [], [], None if owner_fd is not None else 0.5)
            if wake_r in ready:
                os.read(wake_r, 4096)
            _reap(sock, children)
            if owner_fd in ready or os.getppid() != owner:
                return
            if sock.fileno() in ready:
                _answer(sock, children)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass
    finally:
        for pid in children.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _reap(sock: socket.socket, children: dict[int, int]) -> None:
    """Reap every child that ended, and report its exit code by its request's id."""
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        for request_id in [r for r, p in children.items() if p == pid]:
            del children[request_id]
            _send(sock, {"exited": [request_id, os.waitstatus_to_exitcode(status)]})


def _answer(sock: socket.socket, children: dict[int, int]) -> None:
    """Act on the next request: signal a child not reaped yet, or preload and fork a container."""
    message, fds = _receive(sock, max_fds=2)
    if "signal" in message:
        request_id, sig = message["signal"]
        if request_id in children:
            os.kill(children[request_id], sig)
        return
    request = message["start"]
    if request["preload"]:
        _preload(request)
    try:
        pid = _fork(request, fds)
    except OSError as exc:
        _send(sock, {"failed": [request["id"], f"cannot fork a container: {exc}"]})
        return
    finally:
        for fd in fds:
            os.close(fd)
    children[request["id"]] = pid
    _send(sock, {"started": [request["id"], pid]})


def main(argv: list[str]) -> None:
    # Python 3.12+ warns at every fork from a process with threads; this one forks from its only Python
    # thread, and the native threads its imports start (OpenBLAS) are fork-safe (module doc)
    warnings.filterwarnings("ignore", r".*fork\(\) may lead to deadlocks", DeprecationWarning)
    owner = int(os.environ.pop(PARENT_ENV, "0") or 0) or os.getppid()
    own = {p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    _BASE_PATH[:] = [p for p in sys.path[1:] if p not in own]  # sys.path[0]: the directory it started in
    sock = socket.socket(fileno=int(argv[0]))
    # Gone with the owner at once, even while an import holds the loop below (a container's preload of torch
    # and the model took tens of seconds on a loaded machine); its containers die with it (PDEATHSIG).
    watch_process(owner)
    from shardfold.functions.container import main as _  # noqa: F401  (the code every container runs)

    serve(sock, owner)


if __name__ == "__main__":
    main(sys.argv[1:])
