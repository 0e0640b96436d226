"""What a job may read and write: checked at submit and again by every task that resolves a URI.

A spec comes from anyone who may write to the bucket, so every URI in it goes through :func:`input_uri` or
:func:`output_uri` before anything is read or written (the tasks call them too: a spec or a manifest written
behind submit's back is held to the same rules).

* **Local files on the S3 store** are refused, inputs and outputs alike: a function would read its own
  filesystem (``/proc/self/environ`` holds its role's credentials), not the submitter's. On the local store
  ``file://`` is the user's own machine and stays allowed.
* **System prefixes** of the store are never outputs: ``ledger/`` (the dpquery budget ledgers) and
  ``jobs/`` (submitted specs, every job's spec, status, journal and scratch). The one exception is the job's
  own ``jobs/<id>/output/`` folder, where the defaults point.
* **A deployment's output prefixes**: on AWS the workers' roles may write outputs only under the stack's
  ``outputPrefixes`` (``results/`` by default; the functions get them in ``SHARDFOLD_OUTPUT_PREFIXES``, the
  SDK from the stack outputs), so an output elsewhere in the bucket is refused before it could fail.
* **An output is never one of the job's own inputs** (nor, for an output prefix, above one of them): a
  job must not destroy what it reads.
* Keys never hold ``..`` segments or NUL characters (:mod:`functions.store.uri`).
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Iterable

from functions.errors import UnsafeKey
from functions.store.uri import FILE, S3, is_file, is_s3, join, resolve, split_s3

SYSTEM_PREFIXES = ("ledger/", "jobs/")
OUTPUT_PREFIXES_ENV = "SHARDFOLD_OUTPUT_PREFIXES"


def deployed_output_prefixes() -> tuple[str, ...] | None:
    """The deployment's output prefixes (``SHARDFOLD_OUTPUT_PREFIXES``, comma-separated), or None when
    not deployed (anywhere outside the system prefixes)."""
    raw = os.environ.get(OUTPUT_PREFIXES_ENV)
    if raw is None:
        return None
    return tuple(p.strip().strip("/") + "/" for p in raw.split(",") if p.strip().strip("/"))


def _full(uri: str, store_root: str) -> str:
    """A URI as given, or a relative key under ``store_root`` (the bucket on AWS, ``.shardfold/`` locally)."""
    return resolve(uri) if "://" in uri else join(store_root, uri)


def _where(field: str) -> str:
    return f"{field}: " if field else ""


def input_uri(uri: str, store_root: str, field: str = "") -> str:
    """The full URI of something a job reads; :class:`UnsafeKey` naming ``field`` when it may not."""
    full = _full(uri, store_root)
    if is_s3(store_root) and is_file(full):
        raise UnsafeKey(f"{_where(field)}{uri} is a local file; the S3 store reads only s3:// objects")
    return full


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
    writable: tuple[str, ...] | None = None,
) -> str:
    """The full URI of something a job writes; :class:`UnsafeKey` naming ``field`` when it may not.

    ``job_id`` is the job's own id (a task knows it; submit does not yet): its ``jobs/<id>/output/``
    folder is then allowed. ``writable``: the deployment's output prefixes on the S3 store (default: from
    the environment, as the deployed functions have them)."""
    full = _full(uri, store_root)
    if is_s3(store_root) and is_file(full):
        raise UnsafeKey(f"{_where(field)}{uri} is a local file; the S3 store writes only s3:// objects")
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
    if writable is None and is_s3(store_root):
        writable = deployed_output_prefixes()
    if writable is not None and not any(key.startswith(p) for p in writable):
        raise UnsafeKey(
            f"{_where(field)}{uri} is outside the folders this deployment lets jobs write "
            f"({', '.join(writable) or 'none'}); write under one of them, or add the folder to the stack's "
            "shardfold:outputPrefixes"
        )
    return full


def _same_object(a: str, b: str) -> bool:
    if is_file(a) and is_file(b):
        return posixpath.normpath(a[len(FILE) :]) == posixpath.normpath(b[len(FILE) :])
    return a == b


def _under(prefix: str, uri: str) -> bool:
    if is_file(prefix) and is_file(uri):
        p, u = posixpath.normpath(prefix[len(FILE) :]), posixpath.normpath(uri[len(FILE) :])
    elif prefix.startswith(S3) and uri.startswith(S3):
        p, u = prefix.rstrip("/"), uri
    else:
        return False
    return u == p or u.startswith(p + "/")


def not_an_input(
    output: str, inputs: Iterable[tuple[str, str]], field: str = "", prefix: bool = False
) -> None:
    """Refuse an ``output`` (full URI) that is one of the job's ``inputs`` (``(field, full uri)`` pairs),
    or, when it is a ``prefix`` the job writes under, that holds one of them."""
    for where, uri in inputs:
        if _same_object(output, uri) or (prefix and _under(output, uri)):
            what = "holds" if prefix and not _same_object(output, uri) else "is"
            raise UnsafeKey(
                f"{_where(field)}{output} {what} the job's input {where or uri}; a job may not overwrite "
                "what it reads: choose another output"
            )
