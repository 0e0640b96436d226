"""fedtree's tasks: group the clients, sum each group whole (a leaf), sum the leaves (the root). Each is a
:func:`functions.runtime.task`, so its telemetry record holds its peak memory, as the sharded job's do."""

from __future__ import annotations

import math

import numpy as np

from functions import store
from functions.fedavg.layout import (
    PREFIX_BYTES,
    encode_header,
    output_tensors,
    parse_header,
    parse_length_prefix,
)
from functions.manifest import write_manifest
from functions.runtime import JobEvent, task
from functions.store.uri import join


class LeafEvent(JobEvent):
    item: dict


class RootEvent(JobEvent):
    group: dict


def _uri(e: JobEvent, *parts: str) -> str:
    return join(e.store_root, "jobs", e.job_id, "fedtree", *parts)


def _model(data: bytes, i: int, uri: str) -> tuple[np.ndarray, object]:
    """The update's data buffer as float32 (one view: every tensor is F32) and its header."""
    header = parse_header(data[PREFIX_BYTES : header_end(data, i, uri)], i, uri)
    if any(t.dtype != "F32" for t in header.tensors.values()):
        raise ValueError(f"{uri}: fedtree takes float32 models only")
    return np.frombuffer(data, np.float32, offset=header.data_start), header


def header_end(data: bytes, i: int, uri: str) -> int:
    return PREFIX_BYTES + parse_length_prefix(data[:PREFIX_BYTES], i, uri)


@task(JobEvent, kind="fedtree")
def group(e: JobEvent, spec) -> dict:
    n = len(spec.clients)
    size = math.ceil(math.sqrt(n))
    groups = [
        {"leaf": k, "clients": list(range(s, min(s + size, n)))} for k, s in enumerate(range(0, n, size))
    ]
    return {"manifest": write_manifest(_uri(e, "groups.json"), groups), "leaves": len(groups)}


@task(LeafEvent, kind="fedtree")
def leaf(e: LeafEvent, spec) -> dict:
    """GET each client's update whole, one after another, and fold it in: acc += w * x."""
    acc = None
    total = 0.0
    for i in e.item["clients"]:
        c = spec.clients[i]
        x, _ = _model(store.get(c.uri), i, c.uri)
        if acc is None:
            acc = x * np.float32(c.weight)
        else:
            acc += x * np.float32(c.weight)
        total += c.weight
        del x
    store.put(_uri(e, "partials", f"{e.index:05d}.f32"), acc.tobytes())
    store.put_json(_uri(e, "partials", f"{e.index:05d}.json"), {"weight": total})
    return {}


@task(RootEvent, kind="fedtree")
def root(e: RootEvent, spec) -> dict:
    first = store.get(spec.clients[0].uri)
    _, header = _model(first, 0, spec.clients[0].uri)
    del first
    acc = None
    total = 0.0
    for k in range(e.group["leaves"]):
        part = np.frombuffer(store.get(_uri(e, "partials", f"{k:05d}.f32")), np.float32)
        acc = part.copy() if acc is None else acc + part
        total += store.get_json(_uri(e, "partials", f"{k:05d}.json"))["weight"]
        del part
    acc /= np.float32(total)

    out = join(e.store_root, "jobs", e.job_id, "output", "model.safetensors")
    store.put(out, encode_header(output_tensors(header), {"format": "pt"}) + acc.tobytes())
    result = {"job_id": e.job_id, "kind": "fedtree", "output": out, "clients": len(spec.clients)}
    store.put_json(join(e.store_root, "jobs", e.job_id, "result.json"), result)
    store.delete_prefix(_uri(e))
    return {"output": out, "weight": total}
