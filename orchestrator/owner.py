"""Job ownership on the local backend: which process runs a job, and whether it still does.

A local job is run by one process, its **owner**, recorded in ``jobs/<id>/owner.json``::

    {"token": "...", "host": "...", "boot_id": "...", "pid": 123, "pid_start": 456789,
     "claimed_at": "...", "lease_until": 1760000000.0, "released": false}

``pid_start`` is the process's start time (``/proc/<pid>/stat`` field 22, clock ticks since boot), so a
reused pid is not mistaken for the owner; ``boot_id`` tells a reboot apart. The owner renews
``lease_until`` while it runs (:class:`Lease`) and marks the record ``released`` when the job ends.

**Is the owner alive?** On the owner's own host (same host name and boot id) the process table decides:
alive while a process with that pid and start time exists, however old its lease. From another host (a
store shared over the network) only the lease can tell: alive until ``lease_until``.

**Claiming** (:func:`claim`, at start and resume) is atomic through the store's put-if-absent: the first
owner is written put-if-absent; a released or dead owner is succeeded by writing
``jobs/<id>/owner/<old token>.next`` put-if-absent (one claimant wins, the others are refused naming the
winner), then ``owner.json``. A live owner is never replaced: :class:`JobOwned` names its host and pid.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from shardfold.functions import store
from shardfold.functions.errors import ObjectNotFound, ShardfoldError
from shardfold.functions.jobs import job_key
from shardfold.functions.log import logger
from shardfold.functions.store.uri import join
from shardfold.orchestrator.status import now

LEASE_S = 60.0  # how long a renewed lease lasts; renewed every LEASE_S / 4
_CHAIN_LIMIT = 10_000  # successor markers followed at most (one per resume)


class JobOwned(ShardfoldError):
    """The job is running in another live process (or being taken over by one)."""

    def __init__(self, job_id: str, owner: Owner, taking_over: bool = False):
        self.owner = owner
        doing = "is being resumed by" if taking_over else "is still running in"
        super().__init__(
            f"job {job_id} {doing} {owner.describe()}; wait for it (`shardfold status {job_id}`) "
            f"or cancel it (`shardfold cancel {job_id}`) — it was not resumed twice"
        )


@dataclass
class Owner:
    token: str
    host: str
    pid: int
    pid_start: int | None = None
    boot_id: str | None = None
    claimed_at: str | None = None
    lease_until: float = 0.0
    released: bool = False

    def describe(self) -> str:
        return f"process {self.pid} on host {self.host}" + (
            f" (since {self.claimed_at})" if self.claimed_at else ""
        )

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Owner:
        return cls(**{k: record[k] for k in cls.__dataclass_fields__ if k in record})

    def same_machine(self) -> bool:
        return self.host == _HOST and (self.boot_id is None or _BOOT_ID is None or self.boot_id == _BOOT_ID)

    def gone(self, at: float | None = None) -> str | None:
        """Why this owner no longer runs the job, or None while it may still run it."""
        if self.released:
            return f"{self.describe()} let it go"
        if self.host == _HOST and self.boot_id and _BOOT_ID and self.boot_id != _BOOT_ID:
            return f"{self.describe()} is gone (the machine restarted)"
        if self.same_machine():
            if not process_alive(self.pid, self.pid_start):
                return f"{self.describe()} is gone"
            return None
        if (time.time() if at is None else at) > self.lease_until:
            return f"{self.describe()} stopped renewing its lease (until {_iso(self.lease_until)})"
        return None


def _iso(t: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(t, dt.UTC).isoformat(timespec="seconds")


def _read_boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux ``/proc``), or None where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may hold spaces or ')': split after the last ')'
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])  # field 22, counted from field 3 (the state) at index 0
    except (IndexError, ValueError):
        return None


def process_alive(pid: int, start: int | None = None) -> bool:
    """Whether process ``pid`` exists (and, when ``start`` is known, is the one that started then)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    if start is None:
        return True
    # a start time was recorded, so this system has /proc; an unreadable stat means it just exited
    return process_start(pid) == start


_HOST = socket.gethostname()
_BOOT_ID = _read_boot_id()


def this_process(lease_s: float = LEASE_S) -> Owner:
    pid = os.getpid()
    return Owner(
        token=uuid.uuid4().hex,
        host=_HOST,
        pid=pid,
        pid_start=process_start(pid),
        boot_id=_BOOT_ID,
        claimed_at=now(),
        lease_until=time.time() + lease_s,
    )


def owner_uri(store_root: str, job_id: str) -> str:
    return join(store_root, job_key(job_id, "owner.json"))


def _next_uri(store_root: str, job_id: str, token: str) -> str:
    return join(store_root, job_key(job_id, "owner", f"{token}.next"))


def _get(uri: str) -> Owner | None:
    try:
        return Owner.from_record(store.get_json(uri))
    except ObjectNotFound:
        return None


def current(store_root: str, job_id: str) -> Owner | None:
    """The job's owner now (following a takeover that has not rewritten ``owner.json`` yet), or None."""
    owner = _get(owner_uri(store_root, job_id))
    for _ in range(_CHAIN_LIMIT):
        if owner is None:
            return None
        successor = _get(_next_uri(store_root, job_id, owner.token))
        if successor is None:
            return owner
        owner = successor
    return owner


def interrupted(store_root: str, job_id: str) -> str | None:
    """Why a job whose record says RUNNING is not running any more, or None while its owner lives.

    A record with no owner at all was written by a process that predates ownership (or by hand)."""
    owner = current(store_root, job_id)
    if owner is None:
        return "no process owns it"
    return owner.gone()


def claim(store_root: str, job_id: str, lease_s: float = LEASE_S) -> Owner:
    """Make this process the job's owner; :class:`JobOwned` if a live process owns it."""
    me = this_process(lease_s)
    uri = owner_uri(store_root, job_id)
    if store.put_if_absent(uri, me.to_bytes()):
        return me
    old = current(store_root, job_id)
    if old is None:  # owner.json vanished (deleted by hand); take it as the first owner would
        if store.put_if_absent(uri, me.to_bytes()):
            return me
        old = current(store_root, job_id)
        if old is None:
            raise ShardfoldError(f"job {job_id}: its owner record {uri} cannot be read back")
    if old.gone() is None:
        raise JobOwned(job_id, old)
    if not store.put_if_absent(_next_uri(store_root, job_id, old.token), me.to_bytes()):
        winner = current(store_root, job_id) or old
        raise JobOwned(job_id, winner, taking_over=winner.token != old.token)
    store.put(uri, me.to_bytes())
    logger.info("job taken over", extra={"job_id": job_id, "previous_owner": old.describe()})
    return me


def _still_mine(store_root: str, job_id: str, me: Owner) -> Owner | None:
    """None while ``me`` owns the job, else the process that does now."""
    owner = current(store_root, job_id)
    if owner is None or owner.token == me.token:  # (a record removed by hand is written again)
        return None
    return owner


def renew(store_root: str, job_id: str, me: Owner, lease_s: float = LEASE_S) -> Owner | None:
    """Extend this owner's lease; returns the process that took the job over instead, if any."""
    other = _still_mine(store_root, job_id, me)
    if other is not None:
        return other
    me.lease_until = time.time() + lease_s
    store.put(owner_uri(store_root, job_id), me.to_bytes())
    return None


def release(store_root: str, job_id: str, me: Owner) -> None:
    """Let the job go (it ended, or this process is leaving it): a later resume claims it at once."""
    if _still_mine(store_root, job_id, me) is not None:
        return
    me.released = True
    store.put(owner_uri(store_root, job_id), me.to_bytes())


class Lease:
    """Renews an owner's lease on a daemon thread until :meth:`stop`; ``on_lost`` is called (once) with the
    process that took the job over, should that ever happen (this one's lease lapsed, seen from another
    host). A renewal the store refuses is logged and tried again at the next tick."""

    def __init__(
        self,
        store_root: str,
        job_id: str,
        me: Owner,
        lease_s: float = LEASE_S,
        on_lost: Callable[[Owner], None] | None = None,
    ):
        self.store_root, self.job_id, self.me, self.lease_s = store_root, job_id, me, lease_s
        self.on_lost = on_lost
        self._stop = threading.Event()
        self._renewing = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=f"shardfold-lease-{job_id}", daemon=True)

    def start(self) -> Lease:
        self._thread.start()
        return self

    def stop(self) -> None:
        """No renewal after this returns (one in flight is waited for, so it cannot undo a release)."""
        self._stop.set()
        with self._renewing:
            pass

    def _loop(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            with self._renewing:
                if self._stop.is_set():
                    return
                try:
                    other = renew(self.store_root, self.job_id, self.me, self.lease_s)
                except Exception as exc:  # the store is full or unreachable: try again next tick
                    logger.warning("lease renewal failed", extra={"job_id": self.job_id, "error": repr(exc)})
                    continue
            if other is not None and not self._stop.is_set():
                logger.error("job taken over", extra={"job_id": self.job_id, "owner": other.describe()})
                if self.on_lost is not None:
                    self.on_lost(other)
                return
