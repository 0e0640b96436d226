"""A spec's local input files, copied into the store it is submitted to (``Client.submit(..., upload=True)``,
``shardfold run --upload``).

A job on S3 reads only ``s3://`` objects (``functions.access``: a function would read its own filesystem,
not the submitter's). To run a spec that names files of this machine on the cloud path (AWS, or the moto
dry run of it), each input file is put under ``uploads/<sha256 prefix>/<file name>`` in the store and the
spec names that key instead. The key is the content's: the same file uploaded twice is one object, a
changed file a new one, and an upload never replaces an object another job may be reading; an object
already at the key is used only if its bytes hash to it. Only files are uploaded (on S3 of at most 512 MiB
each: one conditional PUT); a folder (a prefix input) is refused naming its field. The rewritten spec
then goes through the one submit path, checked as any other.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from shardfold.functions import store
from shardfold.functions.errors import SpecError
from shardfold.functions.specs import dump_spec, parse_spec, uri_fields
from shardfold.functions.store.s3 import MAX_SINGLE_PUT
from shardfold.functions.store.uri import is_file, is_s3, join, local_path

UPLOADS_PREFIX = "uploads"
_CHUNK = 1 << 20
_READ = 8 << 20  # ranged reads of an object already there, to hash it


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _holds(uri: str, size: int, digest: str) -> bool:
    """Whether the object at ``uri`` is ``size`` bytes whose sha256 starts with ``digest`` (anyone who may
    write the bucket could have put other bytes at a key they can predict)."""
    if store.size(uri) != size:
        return False
    h = hashlib.sha256()
    for start in range(0, size, _READ):
        h.update(store.get(uri, start, min(_READ, size - start)))
    return h.hexdigest().startswith(digest)


def _set(doc: Any, loc: tuple[str | int, ...], value: str) -> None:
    for step in loc[:-1]:
        doc = doc[step]
    doc[loc[-1]] = value


def upload_inputs(doc: Any, base_uri: str | None, store_root: str) -> dict[str, Any]:
    """The spec ``doc`` (relative URIs resolved against ``base_uri``) with every local input file copied
    into ``store_root`` and named there by its key; :class:`SpecError` naming the field of a folder or a
    missing file."""
    spec = parse_spec(doc, base_uri=base_uri)
    out = dump_spec(spec)
    uploaded: dict[str, str] = {}  # a file named by several fields is uploaded once
    for field in uri_fields(spec):
        if field.role != "input" or not is_file(field.uri):
            continue
        where = ".".join(map(str, field.loc))
        path = local_path(field.uri)
        if field.prefix or path.is_dir():
            raise SpecError(
                f"{where}: {field.uri} is a folder; upload copies files only (put the folder's files in the "
                "store and name its prefix)",
                [{"field": where, "error": "a folder cannot be uploaded"}],
            )
        if not path.is_file():
            raise SpecError(
                f"{where}: no file at {path} to upload", [{"field": where, "error": "no such file"}]
            )
        key = uploaded.get(str(path))
        if key is None:
            key = f"{UPLOADS_PREFIX}/{_digest(path)[:32]}/{path.name}"
            uri, size = join(store_root, key), path.stat().st_size
            if is_s3(uri) and size > MAX_SINGLE_PUT:
                raise SpecError(
                    f"{where}: {path} is {size:,} bytes; upload copies files of at most {MAX_SINGLE_PUT:,} "
                    "bytes (one conditional PUT): put it in the bucket yourself and name its key",
                    [{"field": where, "error": "too large to upload"}],
                )
            digest = key.split("/")[1]
            with path.open("rb") as f:
                written = store.put_file_if_absent(uri, f)
            if not written and not _holds(uri, size, digest):  # the key names these bytes, none other
                raise SpecError(f"{where}: {uri} holds other bytes than {path}; remove it and upload again")
            uploaded[str(path)] = key
        _set(out, field.loc, key)
    return out
