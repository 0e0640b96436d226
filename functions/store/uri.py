"""Object URIs: ``s3://bucket/key``, ``file:///abs/path``, or a key relative to the store root.

URIs are kept as plain strings (no percent-encoding): ``file://`` plus an absolute path, so a path with
spaces or ``%`` means what it says. A key with a ``..`` segment is refused on every scheme, and a relative
key may not start with ``/``: both would let a job read or write outside the place it was given.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from shardfold.functions.errors import StoreError, UnsafeKey

S3 = "s3://"
FILE = "file://"


def store_root() -> str:
    """The store root as an absolute ``file://`` URI: ``$SHARDFOLD_HOME``, else ``./.shardfold``.

    ``SHARDFOLD_HOME`` may also be an ``s3://bucket[/prefix]`` URI (the AWS backend's root).
    """
    home = os.environ.get("SHARDFOLD_HOME") or ".shardfold"
    if home.startswith(S3):
        return home.rstrip("/")
    if home.startswith(FILE):
        home = home[len(FILE) :]
    return FILE + os.path.abspath(home)


def is_s3(uri: str) -> bool:
    return uri.startswith(S3)


def is_file(uri: str) -> bool:
    return uri.startswith(FILE)


def check_key(key: str, what: str = "key") -> None:
    """Refuse a ``..`` segment anywhere (it would escape the directory or prefix the caller meant) and a NUL
    (a filesystem or an archive would cut the name there)."""
    if ".." in key.split("/"):
        raise UnsafeKey(f"{what} {key!r} contains a '..' segment; give a path without '..'")
    if "\x00" in key:
        raise UnsafeKey(f"{what} {key!r} contains a NUL character")


def resolve(uri_or_key: str, root: str | None = None) -> str:
    """Turn a URI or a store-relative key into a full URI.

    ``s3://`` and ``file://`` URIs are kept (they name the user's own objects); a relative key is joined
    under ``root`` (default :func:`store_root`). Absolute paths without a scheme and ``..`` segments raise
    :class:`UnsafeKey`.
    """
    if uri_or_key.startswith(S3):
        split_s3(uri_or_key)  # validates bucket and key
        return uri_or_key
    if uri_or_key.startswith(FILE):
        path = uri_or_key[len(FILE) :]
        if not path.startswith("/"):
            raise UnsafeKey(f"{uri_or_key!r} is not an absolute file URI; write file:///abs/path")
        check_key(path, "path")
        return uri_or_key
    if "://" in uri_or_key:
        scheme = uri_or_key.split("://", 1)[0]
        raise StoreError(f"unsupported URI scheme {scheme!r} in {uri_or_key!r}; use s3://, file:// or a key")
    if uri_or_key.startswith("/") or not uri_or_key:
        raise UnsafeKey(
            f"key {uri_or_key!r} is absolute or empty; give a key relative to the store root "
            "or an explicit file:///abs/path URI"
        )
    check_key(uri_or_key)
    return join(root or store_root(), uri_or_key)


def normalise(uri_or_key: str) -> str:
    """The one spelling of a URI or store key that a spec keeps, so that one object has one name:

    * a key relative to the store root: empty and ``.`` segments dropped and ``x/..`` pairs cancelled, so
      ``./c``, ``.//c`` and ``a/../c`` are all ``c``; a key whose ``..`` would climb above the root (or an
      absolute or empty one) is left as given, for :func:`resolve` to refuse;
    * a ``file://`` path: empty and ``.`` segments dropped; a ``..`` stays (through a symbolic link
      ``a/../c`` need not be ``c``), and :func:`resolve` refuses it;
    * ``s3://`` URIs and anything else: unchanged (S3 keys are literal: ``a//c`` and ``a/c`` are two objects).

    A trailing ``/`` (a prefix) is kept. Idempotent.
    """
    if uri_or_key.startswith(FILE):
        path = uri_or_key[len(FILE) :]
        if not path.startswith("/") or ("//" not in path and "/./" not in path and not path.endswith("/.")):
            return uri_or_key  # not absolute, or already normal (the common case: checked without a split)
        kept = [seg for seg in path.split("/") if seg not in ("", ".")]
        tail = "/" if path.endswith("/") and kept else ""
        return FILE + "/" + "/".join(kept) + tail
    if "://" in uri_or_key or uri_or_key.startswith("/") or not uri_or_key:
        return uri_or_key
    kept = []
    for seg in uri_or_key.split("/"):
        if seg in ("", "."):
            continue
        if seg == "..":
            if not kept:
                return uri_or_key  # above the root: resolve() refuses it as given
            kept.pop()
            continue
        kept.append(seg)
    if not kept:
        return uri_or_key
    return "/".join(kept) + ("/" if uri_or_key.endswith("/") else "")


def join(base_uri: str, *parts: str) -> str:
    """Join key parts onto a URI with single slashes; parts may not contain ``..`` segments."""
    out = base_uri.rstrip("/")
    for part in parts:
        part = part.strip("/")
        if part:
            check_key(part)
            out += "/" + part
    return out


def split_s3(uri: str) -> tuple[str, str]:
    """``s3://bucket/key`` -> ``(bucket, key)``; the key may be empty (a bucket-wide prefix)."""
    if not uri.startswith(S3):
        raise StoreError(f"{uri!r} is not an s3:// URI")
    bucket, _, key = uri[len(S3) :].partition("/")
    if len(bucket) < 3:
        raise StoreError(f"{uri!r} has no valid bucket name; write s3://bucket/key")
    check_key(key)
    return bucket, key


def local_path(uri: str) -> Path:
    """The filesystem path of a ``file://`` URI."""
    if not uri.startswith(FILE):
        raise StoreError(f"{uri!r} is not a file:// URI")
    return Path(uri[len(FILE) :])


def default_name(uri: str, root: str | None = None) -> str:
    """An entry's default archive name: the key within its bucket for S3, the key under the store root for
    local files, else the absolute path without its leading slash."""
    if uri.startswith(S3):
        return uri[len(S3) :].partition("/")[2].lstrip("/")
    path = uri[len(FILE) :] if uri.startswith(FILE) else uri
    base = (root or store_root()).removeprefix(FILE).rstrip("/") + "/"
    if path.startswith(base):
        return path[len(base) :]
    return path.lstrip("/")


# What the task in hand may touch (functions.access.TaskScope.check): called with every full URI a store call
# reads or writes, before the request is made.
_scope: contextvars.ContextVar[Callable[[str, bool, bool], None] | None] = contextvars.ContextVar(
    "shardfold_store_scope", default=None
)


@contextmanager
def scoped(check: Callable[[str, bool, bool], None]) -> Iterator[None]:
    """Check every URI the block reads or writes first: ``check(uri, write, prefix)``, ``prefix`` for a
    listing or a prefix delete (every key that starts with ``uri``)."""
    token = _scope.set(check)
    try:
        yield
    finally:
        _scope.reset(token)


def reach(uri: str, write: bool = False, root: str | None = None, prefix: bool = False) -> str:
    """``uri`` resolved (a key: under ``root``, default the store root), after the scope's check
    (:func:`scoped`)."""
    uri = resolve(uri, root)
    check = _scope.get()
    if check is not None:
        check(uri, write, prefix)
    return uri
