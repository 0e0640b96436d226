"""What a job may read and write: checked at submit and again by every task that resolves a URI.

A spec comes from anyone who may write to the bucket, so every URI in it goes through :func:`input_uri` or
:func:`output_uri` before anything is read or written (the tasks call them too: a spec or a manifest written
behind submit's back is held to the same rules).

* **Local files on the S3 store** are refused, inputs and outputs alike: a function would read its own
  filesystem (``/proc/self/environ`` holds its role's credentials), not the submitter's. On the local store
  ``file://`` is the user's own machine and stays allowed, but for a spec dropped into a watched folder
  (``local_files`` false, which dispatch sets): whoever may write the folder may not make the job read or
  write this machine's files outside the store. Submit and every task check under the spec's own limits
  (:func:`policy`).
* **System prefixes** of the store are never outputs: ``ledger/`` (the dpquery budget ledgers),
  ``jobs/`` (submitted specs, every job's spec, status, journal and scratch) and ``claims/`` (which job
  owns which output: :mod:`functions.claims`). The one exception is the job's
  own ``jobs/<id>/output/`` folder, where the defaults point.
* **A deployment's grants** (:class:`Grants`): on AWS the workers' roles may write outputs only under the
  stack's ``outputPrefixes`` (``results/`` by default), read other buckets only where ``readBuckets`` or
  ``writeBuckets`` names them and write other buckets only where ``writeBuckets`` does. The functions get
  the grants in their environment, the SDK from the stack outputs; a URI outside them is refused naming the
  config key, before a task could fail on an AccessDenied.
* **An output is never one of the job's own inputs** (nor, for an output prefix, above one of them): a
  job must not destroy what it reads.
* Keys never hold ``..`` segments or NUL characters (:mod:`functions.store.uri`), and on the local store a
  key never leads out of the store root through a symbolic link (data elsewhere is named by its own
  ``file://`` URI). Two URIs that reach the same file through links are one object.
"""

from __future__ import annotations

import contextvars
import enum
import functools
import os
import posixpath
import stat
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from shardfold.functions import claims
from shardfold.functions.errors import AccessDenied, UnsafeKey
from shardfold.functions.store.uri import FILE, S3, is_file, is_s3, join, resolve, split_s3

LEDGER_PREFIX = "ledger/"
JOBS_PREFIX = "jobs/"
SYSTEM_PREFIXES = (LEDGER_PREFIX, JOBS_PREFIX, claims.CLAIMS_PREFIX)
OUTPUT_PREFIXES_ENV = "SHARDFOLD_OUTPUT_PREFIXES"
READ_BUCKETS_ENV = "SHARDFOLD_READ_BUCKETS"
WRITE_BUCKETS_ENV = "SHARDFOLD_WRITE_BUCKETS"


def parse_bucket_ref(ref: str) -> tuple[str, str]:
    """``"bucket"``, ``"bucket/prefix"`` or ``"s3://bucket/prefix"`` -> ``(bucket, prefix)``."""
    ref = ref.removeprefix("s3://").strip("/")
    bucket, _, prefix = ref.partition("/")
    if not bucket or "*" in bucket:
        raise UnsafeKey(f"bucket reference {ref!r} must name a bucket (optionally bucket/prefix)")
    return bucket, prefix.strip("/")


def _in_ref(bucket: str, key: str, ref: str) -> bool:
    b, prefix = parse_bucket_ref(ref)
    return b == bucket and (not prefix or key == prefix or key.startswith(prefix + "/"))


def _split_list(raw: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in raw.split(",") if p.strip())


@dataclass(frozen=True)
class Grants:
    """What a deployment lets its jobs touch besides their own folders: ``output_prefixes`` of the job
    bucket, other buckets (``bucket`` or ``bucket/prefix``) to read and to write. Mirrors the stack config
    (``outputPrefixes``, ``readBuckets``, ``writeBuckets``) and the workers' IAM policy built from it."""

    output_prefixes: tuple[str, ...] = ("results/",)
    read_buckets: tuple[str, ...] = ()
    write_buckets: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        folders = tuple(p.strip().strip("/") + "/" for p in self.output_prefixes if p.strip().strip("/"))
        object.__setattr__(self, "output_prefixes", folders)
        for ref in (*self.read_buckets, *self.write_buckets):
            parse_bucket_ref(ref)

    @classmethod
    def from_env(cls) -> Grants | None:
        """The deployed functions' grants (``SHARDFOLD_OUTPUT_PREFIXES`` etc.), or None when not deployed."""
        raw = os.environ.get(OUTPUT_PREFIXES_ENV)
        if raw is None:
            return None
        return cls(
            _split_list(raw),
            _split_list(os.environ.get(READ_BUCKETS_ENV, "")),
            _split_list(os.environ.get(WRITE_BUCKETS_ENV, "")),
        )

    @classmethod
    def from_outputs(cls, outputs: Mapping[str, Any]) -> Grants | None:
        """The grants in a stack's outputs, or None for a stack that exports none."""
        if outputs.get("output_prefixes") is None:
            return None
        return cls(
            tuple(outputs["output_prefixes"]),
            tuple(outputs.get("read_buckets") or ()),
            tuple(outputs.get("write_buckets") or ()),
        )

    def env(self) -> dict[str, str]:
        """The environment that carries these grants to the functions (:meth:`from_env` reads it back)."""
        return {
            OUTPUT_PREFIXES_ENV: ",".join(self.output_prefixes),
            READ_BUCKETS_ENV: ",".join(self.read_buckets),
            WRITE_BUCKETS_ENV: ",".join(self.write_buckets),
        }

    def may_read(self, bucket: str, key: str) -> bool:
        """Whether a job may read ``bucket/key`` of a bucket other than the job bucket."""
        return any(_in_ref(bucket, key, r) for r in (*self.read_buckets, *self.write_buckets))

    def may_write(self, bucket: str, key: str) -> bool:
        """Whether a job may write ``bucket/key`` of a bucket other than the job bucket."""
        return any(_in_ref(bucket, key, r) for r in self.write_buckets)


class Right(enum.StrEnum):
    """What a kind's functions may touch beyond their own job's folder (``jobs/<id>/``, which every task
    reads and writes). A kind declares its rights (``JobKind.rights``); the workers' IAM policies
    (:func:`reach`: infra, the moto harness, the emulator tier) and every task's own check
    (:class:`TaskScope`) derive from the declaration. Starting Batch jobs is no right: it follows from the
    workflow's ``BatchJob`` steps (the state machine's role)."""

    INPUTS = "inputs"  # read what a job may name as input: the job bucket, readBuckets and writeBuckets
    OUTPUTS = "outputs"  # write the job's outputs (outputPrefixes, writeBuckets); read claims/ to check them
    LEDGER = "ledger"  # read and append to the privacy-budget ledgers (ledger/)


Ref = tuple[str, str]  # (bucket, prefix without slashes; "" for the whole bucket)


def reach(rights: Iterable[Right], grants: Grants, bucket: str) -> tuple[list[Ref], list[Ref]]:
    """``(read, write)``: the ``(bucket, prefix)`` places a worker holding ``rights`` may read, and those it
    may write (and read), under a deployment's ``grants`` with job bucket ``bucket``. ``jobs/`` is written
    by every worker: a role serves every job, so which job's folder a task writes is checked by the task
    (:class:`TaskScope`), not by IAM."""
    rights = set(rights)
    read: list[Ref] = []
    write: list[Ref] = [(bucket, JOBS_PREFIX.rstrip("/"))]
    if Right.INPUTS in rights:
        read += [(bucket, ""), *(parse_bucket_ref(r) for r in (*grants.read_buckets, *grants.write_buckets))]
    if Right.OUTPUTS in rights:
        write += [(bucket, p.rstrip("/")) for p in grants.output_prefixes]
        write += [parse_bucket_ref(r) for r in grants.write_buckets]
        read.append((bucket, claims.CLAIMS_PREFIX.rstrip("/")))
    if Right.LEDGER in rights:
        write.append((bucket, LEDGER_PREFIX.rstrip("/")))
    write = _uncovered(write, [])
    return _uncovered(read, write), write


def _uncovered(refs: list[Ref], also: list[Ref]) -> list[Ref]:
    """``refs`` in order without repeats and without those that another of them, or of ``also``, holds."""

    def holds(a: Ref, b: Ref) -> bool:
        return a[0] == b[0] and (not a[1] or b[1] == a[1] or b[1].startswith(a[1] + "/"))

    out: list[Ref] = []
    for i, ref in enumerate(refs):
        others = [r for j, r in enumerate(refs) if j != i and r != ref] + also
        if ref not in out and not any(holds(o, ref) for o in others):
            out.append(ref)
    return out


@dataclass(frozen=True)
class TaskScope:
    """What one task may touch: its own job's folder, and what its kind's ``rights`` add, within the
    deployment's ``grants`` (None: no deployment, as on the local store). Every store call the task makes is
    checked (:func:`functions.store.scoped`), on every backend; on AWS the function's role refuses the same
    places (:func:`reach`), except other jobs' folders, which a role that serves every job cannot tell from
    the task's own.

    A listing or a prefix delete (``prefix``) reaches every key that starts with its string, as S3 matches
    it: ``l`` reaches ``ledger/``, the root reaches everything, ``jobs/j`` every job whose id starts so."""

    store_root: str
    job_id: str
    kind: str
    rights: frozenset[Right]
    grants: Grants | None = None

    def __post_init__(self) -> None:  # one spelling of the root, for the fast key below
        root = self.store_root
        if root.startswith(FILE):
            root = FILE + posixpath.normpath(root[len(FILE) :])
        object.__setattr__(self, "store_root", root.rstrip("/"))

    def _key(self, uri: str) -> str | None:
        """:func:`store_key`, without its path normalisation for a plain file URI under a local root
        (GetBatch checks every item: a thousand a part)."""
        root, path = self.store_root, uri[len(FILE) :]
        if uri.startswith(FILE) and root.startswith(FILE) and "/." not in path and "//" not in path:
            folder = root[len(FILE) :] + "/"
            if not path.startswith(folder):
                return None
            return path[len(folder) :].rstrip("/") or None  # the root itself is no key, as store_key says
        return store_key(uri, root)

    def _raw(self, uri: str) -> str | None:
        """A prefix's string below the root, as the store matches it (not normalised; ``""`` for the root
        itself), or None outside the store."""
        if uri == self.store_root:
            return ""
        folder = self.store_root + "/"
        return uri[len(folder) :] if uri.startswith(folder) else None

    def check(self, uri: str, write: bool, prefix: bool = False) -> None:
        """Raise :class:`AccessDenied` naming what is missing when the task may not read (or ``write``)
        ``uri`` (a full URI; with ``prefix``, every key that starts with it)."""
        own = f"{JOBS_PREFIX}{self.job_id}/"
        if prefix:
            raw = self._raw(uri)
            if raw is None:
                areas: list[str | None] = [None]
            elif raw.startswith(own):
                return
            else:  # every system folder the prefix reaches into or covers, and the rest of the store
                areas = [f for f in SYSTEM_PREFIXES if f.startswith(raw) or raw.startswith(f)]
                if not any(raw.startswith(f) for f in SYSTEM_PREFIXES):
                    areas.append("")
            key = raw
        else:
            key = self._key(uri)
            if key is not None and _under(key, own):
                return
            if key is None and not write and self.grants is None and Right.INPUTS in self.rights:
                return  # a read outside the store, where no deployment limits what the inputs right reads
            areas = [None if key is None else next((f for f in SYSTEM_PREFIXES if _under(key, f)), "")]
        for area in areas:
            self._allow(area, key, uri, write)

    def _allow(self, area: str | None, key: str | None, uri: str, write: bool) -> None:
        """``area``: None outside the store, ``""`` the store outside its system folders, else that folder."""
        if area == LEDGER_PREFIX:
            need = Right.LEDGER
        elif area and write:
            what = "another job's folder" if area == JOBS_PREFIX else "the output claims"
            raise AccessDenied(f"{uri}: a {self.kind} task of job {self.job_id} may not write {what}")
        elif area == claims.CLAIMS_PREFIX:
            need = Right.OUTPUTS if Right.OUTPUTS in self.rights else Right.INPUTS
        else:  # other jobs' folders too: an input may be another job's output
            need = Right.OUTPUTS if write else Right.INPUTS
        if need not in self.rights:
            verb = "write" if write else "read"
            raise AccessDenied(
                f"{uri}: a {self.kind} task may not {verb} it; the {self.kind} kind does not declare the "
                f"{need.value!r} right (JobKind.rights)"
            )
        if self.grants is not None and area in ("", None):
            self._granted(key if area == "" else None, uri, write)

    def _granted(self, key: str | None, uri: str, write: bool) -> None:
        """Within the deployment's grants, as the function's role is: outputs under ``outputPrefixes`` or in
        ``writeBuckets``, other buckets only where listed."""
        assert self.grants is not None
        if key is not None:  # the job bucket: reads anywhere, writes under the output prefixes
            if not write or any(key.startswith(p) for p in self.grants.output_prefixes):
                return
            raise AccessDenied(
                f"{uri}: outside the folders this deployment lets jobs write "
                f"({', '.join(self.grants.output_prefixes) or 'none'}; shardfold:outputPrefixes)"
            )
        other = _other_bucket(uri, self.store_root)
        if other is None:
            return  # a file of this machine: the spec's own limits decide (input_uri, output_uri)
        allowed = self.grants.may_write(*other) if write else self.grants.may_read(*other)
        if not allowed:
            key_name = "writeBuckets" if write else "readBuckets"
            raise AccessDenied(f"{uri}: bucket {other[0]} is not in this deployment's shardfold:{key_name}")


def _under(key: str, folder: str) -> bool:
    """Whether ``key`` is ``folder`` (``a/b/``) itself or lies below it."""
    return key == folder.rstrip("/") or key.startswith(folder)


# Whether the job in hand may name files of this machine outside the store: its spec's ``local_files``
# (False for a spec dropped into the bucket or a watched folder), set by submit and by every task.
_LOCAL_FILES: contextvars.ContextVar[bool] = contextvars.ContextVar("shardfold_local_files", default=True)


@contextmanager
def policy(spec: Any) -> Iterator[None]:
    """Check URIs, inside the block, under ``spec``'s own limits (``local_files``)."""
    token = _LOCAL_FILES.set(bool(getattr(spec, "local_files", True)))
    try:
        yield
    finally:
        _LOCAL_FILES.reset(token)


def _local_file(full: str, store_root: str, uri: str, field: str, verb: str) -> None:
    """Refuse a ``file://`` path where the job may not name one: any on the S3 store, and one outside the
    store root for a spec without ``local_files`` (a dropped spec: anyone who may write the drop made it)."""
    if not is_file(full):
        return
    if is_s3(store_root):
        raise UnsafeKey(
            f"{_where(field)}{uri} is a local file; the S3 store {verb} only s3:// objects (put it in the "
            "bucket and name its key: `shardfold run --upload` copies a spec's local inputs)"
        )
    if not _LOCAL_FILES.get() and store_key(full, store_root) is None:
        raise UnsafeKey(
            f"{_where(field)}{uri} is a file outside the store; a spec dropped into a watched folder (or the "
            "bucket) names only the store's own objects: put the file in the store and name its key"
        )


def _grants(grants: Grants | None, store_root: str) -> Grants | None:
    """The grants that hold for ``store_root``: the given ones, else the deployment's (on an S3 store)."""
    if grants is None and is_s3(store_root):
        return Grants.from_env()
    return grants


def _full(uri: str, store_root: str) -> str:
    """A URI as given, or a relative key under ``store_root`` (the bucket on AWS, ``.shardfold/`` locally)."""
    return resolve(uri) if "://" in uri else join(store_root, uri)


def _where(field: str) -> str:
    return f"{field}: " if field else ""


def _stays_inside(full: str, store_root: str, uri: str, field: str, checked: set[str] | None = None) -> None:
    """On the local store, refuse a path under the root that a symbolic link takes outside it.

    ``checked``: folders already found not to be links in this pass; a caller checking many paths (a request
    names thousands, mostly in a few folders) passes one set, so each folder costs one ``lstat``."""
    if not (is_file(full) and is_file(store_root)):
        return
    path, root = _normal_path(full[len(FILE) :]), _normal_path(store_root[len(FILE) :])
    if not path.startswith(root + "/"):
        return  # a file:// path elsewhere: the user's own machine
    # one lstat per component below the root, not a realpath: only a link needs resolving
    parts = path[len(root) + 1 :].split("/")
    at = root
    for depth, part in enumerate(parts, 1):
        at += "/" + part
        folder = depth < len(parts)
        if folder and checked is not None and at in checked:
            continue
        try:
            if not stat.S_ISLNK(os.lstat(at).st_mode):
                if folder and checked is not None:
                    checked.add(at)
                continue
        except OSError:
            return  # not there (yet): nothing below it can be a link
        real, real_root = os.path.realpath(path), os.path.realpath(root)
        if real != real_root and not real.startswith(real_root + "/"):
            raise UnsafeKey(
                f"{_where(field)}{uri} leads out of the store root through a symbolic link (to {real}); "
                "name data outside the store by its own file:// URI"
            )
        return


def _normal_path(path: str) -> str:
    """``posixpath.normpath``, skipped for a path with nothing to normalise (a request checks thousands)."""
    if "/." in path or "//" in path or path.endswith("/") or not path.startswith("/"):
        return posixpath.normpath(path)
    return path


def _other_bucket(full: str, store_root: str) -> tuple[str, str] | None:
    """``(bucket, key)`` of an s3:// URI in a bucket other than the S3 store's, else None."""
    if not (is_s3(full) and is_s3(store_root)):
        return None
    bucket, key = split_s3(full)
    return (bucket, key) if bucket != split_s3(store_root)[0] else None


def input_uri(
    uri: str,
    store_root: str,
    field: str = "",
    grants: Grants | None = None,
    checked: set[str] | None = None,
) -> str:
    """The full URI of something a job reads; :class:`UnsafeKey` naming ``field`` when it may not.

    ``grants``: the deployment's (default: from the environment, as the deployed functions have them).
    ``checked``: see :func:`_stays_inside` (for a caller checking many URIs)."""
    if _plainly_allowed(uri, store_root):
        return uri
    return _checked_input(uri, store_root, field, grants, checked)


def _checked_input(
    uri: str, store_root: str, field: str, grants: Grants | None, checked: set[str] | None
) -> str:
    """:func:`input_uri`'s every rule, one by one."""
    full = _full(uri, store_root)
    _local_file(full, store_root, uri, field, "reads")
    _stays_inside(full, store_root, uri, field, checked)
    # ledger/ and claims/ hold no job's data (other jobs' folders may: an input may be another job's output);
    # the substring test first, as a request names thousands of inputs
    if "ledger" in full or "claims" in full:
        key = store_key(full, store_root) or ""
        hidden = next((p for p in (LEDGER_PREFIX, claims.CLAIMS_PREFIX) if _under(key, p)), None)
        if hidden:
            raise UnsafeKey(
                f"{_where(field)}{uri} is under the store's system prefix {hidden}, which holds no job's data"
            )
    other = _other_bucket(full, store_root)
    grants = _grants(grants, store_root)
    if other is not None and grants is not None and not grants.may_read(*other):
        raise UnsafeKey(
            f"{_where(field)}{uri} is in bucket {other[0]}, which this deployment does not let jobs read; "
            "add it to the stack's shardfold:readBuckets (bucket or bucket/prefix)"
        )
    return full


def _plainly_allowed(uri: str, store_root: str) -> bool:
    """Whether ``uri`` is a file of this machine that every rule of :func:`input_uri` lets through as it is,
    seen from the string alone: an absolute path in normal form, with no dot-segment, NUL or system prefix
    name, outside a local store root, for a spec that may name local files. A request names thousands of
    these; anything else takes the whole check (a test holds the two to the same answers)."""
    if not (uri.startswith(FILE) and store_root.startswith(FILE) and _LOCAL_FILES.get()):
        return False
    path = uri[len(FILE) :]
    if not path.startswith("/") or "/." in path or "//" in path or "\x00" in path:
        return False
    if "ledger" in path or "claims" in path:
        return False
    root = _root_path(store_root)
    return root != "/" and path != root and not path.startswith(root + "/")


@functools.lru_cache(maxsize=16)
def _root_path(store_root: str) -> str:
    """A local store root's path in normal form."""
    return _normal_path(store_root[len(FILE) :]).rstrip("/") or "/"


def store_key(uri: str, store_root: str) -> str | None:
    """``uri``'s key relative to the store root when it lies inside it (same bucket, or under the local root
    directory, after normalising the path), else None."""
    if is_s3(uri) and is_s3(store_root):
        bucket, key = split_s3(uri)
        root_bucket, prefix = split_s3(store_root)
        if bucket != root_bucket:
            return None
        prefix = prefix.strip("/")
        if not prefix:
            return key
        return key[len(prefix) + 1 :] if key.startswith(prefix + "/") else None
    if is_file(uri) and is_file(store_root):
        path = posixpath.normpath(uri[len(FILE) :])
        root = posixpath.normpath(store_root[len(FILE) :])
        return posixpath.relpath(path, root) if path.startswith(root + "/") else None
    return None


def output_uri(
    uri: str,
    store_root: str,
    field: str = "",
    job_id: str | None = None,
    grants: Grants | None = None,
) -> str:
    """The full URI of something a job writes; :class:`UnsafeKey` naming ``field`` when it may not.

    ``job_id`` is the job's own id (a task knows it; submit does not yet): its ``jobs/<id>/output/``
    folder is then allowed. ``grants``: the deployment's (default: from the environment, as the deployed
    functions have them)."""
    full = _full(uri, store_root)
    _local_file(full, store_root, uri, field, "writes")
    _stays_inside(full, store_root, uri, field)
    grants = _grants(grants, store_root)
    other = _other_bucket(full, store_root)
    if other is not None and grants is not None and not grants.may_write(*other):
        raise UnsafeKey(
            f"{_where(field)}{uri} is in bucket {other[0]}, which this deployment does not let jobs write; "
            "write under the job bucket's outputPrefixes, or add it to the stack's shardfold:writeBuckets"
        )
    key = store_key(full, store_root)
    if key is None:
        return full
    own = f"jobs/{job_id}/output/" if job_id else None
    if own and key.startswith(own):
        return full
    reserved = next((p for p in SYSTEM_PREFIXES if key.startswith(p) or key == p.rstrip("/")), None)
    if reserved:
        raise UnsafeKey(
            f"{_where(field)}{uri} is under the store's system prefix {reserved} (budget ledgers, job "
            "specs, status and scratch); write outputs elsewhere, e.g. results/"
        )
    if grants is not None and not any(key.startswith(p) for p in grants.output_prefixes):
        raise UnsafeKey(
            f"{_where(field)}{uri} is outside the folders this deployment lets jobs write "
            f"({', '.join(grants.output_prefixes) or 'none'}); write under one of them, or add the folder to "
            "the stack's shardfold:outputPrefixes"
        )
    if job_id:  # a task: the output must still be this job's (claimed at submit)
        claims.check_held(store_root, full, job_id, field or "output")
    return full


class _RealPaths:
    """file:// URIs' paths with symbolic links resolved (what the filesystem will open), for many URIs at
    once: each directory is resolved once (a request names thousands of files in a few directories), then
    only the last component is looked at (one ``lstat``; none when ``last_links`` is false: a link as the
    last component then stands for itself)."""

    def __init__(self, last_links: bool = True) -> None:
        self.dirs: dict[str, str] = {}
        self.last_links = last_links

    def __call__(self, uri: str) -> str:
        path = uri[len(FILE) :]
        head, name = posixpath.split(path)
        if not head or name in ("", ".", "..") or (self.last_links and os.path.islink(path)):
            return os.path.realpath(path)
        real_head = self.dirs.get(head)
        if real_head is None:
            real_head = self.dirs[head] = os.path.realpath(head)
        return posixpath.join(real_head, name)


def _identity(uri: str, real: _RealPaths) -> tuple[str, str]:
    """What two URIs share when they name the same object: a file's resolved path (what the filesystem will
    open), else the URI itself."""
    return ("file", real(uri)) if is_file(uri) else ("uri", uri)


def _holds(prefix: tuple[str, str], uri: tuple[str, str]) -> bool:
    """Whether ``uri`` lies under ``prefix`` (both from :func:`_identity`)."""
    if prefix[0] != uri[0] or (prefix[0] == "uri" and not prefix[1].startswith(S3)):
        return False
    p = prefix[1].rstrip("/")
    return uri[1] == p or uri[1].startswith(p + "/")


def not_an_input(
    output: str,
    inputs: Iterable[tuple[str, str]],
    field: str = "",
    prefix: bool = False,
    after_reads: bool = False,
) -> None:
    """Refuse an ``output`` (full URI) that is one of the job's ``inputs`` (``(field, full uri)`` pairs),
    or, when it is a ``prefix`` the job writes under, that holds one of them. Each distinct input is
    resolved once, each folder's links once: a request may name one object, or one folder, thousands of
    times.

    ``after_reads``: the output is one object that a later step writes, once every read of the inputs is
    done (a getbatch request of several parts: assemble writes it). Then, while it does not exist, an input
    file that is a link is not followed (an ``lstat`` per input was most of a 50,000-item plan): a link to
    where the output will be finds nothing when it is read. The inputs' folders are still resolved, so an
    input named through a linked folder is still the output it reaches (and only an input of the output's
    own file name can)."""
    first: dict[str, str] = {}
    for where, uri in inputs:
        first.setdefault(uri, where)
    links = not after_reads or prefix or not is_file(output) or os.path.lexists(output[len(FILE) :])
    real = _RealPaths(last_links=links)
    out = _identity(output, real)
    name = None if links else output.rpartition("/")[2]
    for uri, where in first.items():
        if name is not None and uri.rpartition("/")[2] not in (name, "", ".", "..") and is_file(uri):
            continue  # its file name is its own (no link followed), and not the output's
        it = _identity(uri, real)
        same = it == out
        if same or (prefix and _holds(out, it)):
            raise UnsafeKey(
                f"{_where(field)}{output} {'is' if same else 'holds'} the job's input {where or uri}; a job "
                "may not overwrite what it reads: choose another output"
            )
