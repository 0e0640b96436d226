"""Job identity and the per-job store layout, shared by the SDK, the bucket trigger and the executors.

A job id is ``<kind>-<YYYYMMDDTHHMMSS>-<6 hex>``: sortable by submission time, unique enough for one user,
and a valid Step Functions execution name (the AWS executor uses it as one).
"""

from __future__ import annotations

import datetime as _dt
import re
import secrets
from typing import Any

JOB_ID_RE = re.compile(r"^(?P<kind>[a-z][a-z0-9]*)-(?P<ts>\d{8}T\d{6})-(?P<rand>[0-9a-f]{6})$")

# Spec fields that hold URIs. A value starting with "./" or "../" in a spec *file* is relative to the file's
# own location, so a spec and its data can travel together (events/getbatch.json + events/data/).
URI_FIELDS = frozenset({"uri", "manifest", "output", "dataset", "inputs"})


def new_job_id(kind: str, now: _dt.datetime | None = None) -> str:
    """A fresh job id for ``kind`` (UTC timestamp plus 24 random bits)."""
    now = now or _dt.datetime.now(_dt.UTC)
    return f"{kind}-{now.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(3)}"


def kind_of(job_id: str) -> str | None:
    """The kind encoded in a job id, or None if the id is not one of ours."""
    m = JOB_ID_RE.match(job_id)
    return m.group("kind") if m else None


def job_key(job_id: str, *parts: str) -> str:
    """Key of a job's object relative to the store root: ``jobs/<id>/<parts...>``."""
    return "/".join(["jobs", job_id, *parts])


def spec_key(job_id: str) -> str:
    return job_key(job_id, "spec.json")


def status_key(job_id: str) -> str:
    return job_key(job_id, "status.json")


def result_key(job_id: str) -> str:
    return job_key(job_id, "result.json")


def _parent(uri: str) -> str:
    return uri.rsplit("/", 1)[0] if "/" in uri else ""


def resolve_relative_uris(doc: Any, base_uri: str) -> Any:
    """Rewrite ``./x`` and ``../x`` URI fields of a spec document against ``base_uri`` (the spec's URI).

    Only fields named in :data:`URI_FIELDS` are touched; everything else is returned unchanged.
    """
    base_dir = _parent(base_uri)

    def rel(value: str) -> str:
        scheme, sep, path = base_dir.partition("://")
        parts = path.split("/") if sep else base_dir.split("/")
        for seg in value.split("/"):
            if seg in ("", "."):
                continue
            if seg == "..":
                # never climb above the bucket (s3) or the filesystem root (file)
                if len(parts) > (1 if sep else 0):
                    parts.pop()
                continue
            parts.append(seg)
        joined = "/".join(parts)
        return f"{scheme}://{joined}" if sep else joined

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            out = {}
            for k, v in node.items():
                if k in URI_FIELDS and isinstance(v, str) and (v.startswith("./") or v.startswith("../")):
                    out[k] = rel(v)
                elif k in URI_FIELDS and isinstance(v, list) and all(isinstance(x, str) for x in v):
                    # a list of URIs, e.g. an inference job's inputs
                    out[k] = [rel(x) if x.startswith(("./", "../")) else x for x in v]
                else:
                    out[k] = walk(v)
            return out
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(doc)
