"""fedtree's tasks: group the clients, sum each group whole (a leaf), sum the leaves (the root). Each is a
:func:`functions.runtime.task`, so its telemetry record holds its peak memory, as the sharded job's do."""

from __future__ import annotations

import math

import numpy as np

from shardfold.functions import store
from shardfold.functions.fedavg.layout import (
    PREFIX_BYTES,
    encode_header,
    output_tensors,
    parse_header,
    parse_length_prefix,
)
from shardfold.functions.manifest import write_manifest
from shardfold.functions.runtime import JobEvent, task
from shardfold.functions.store.uri import join


class LeafEvent(JobEvent):
    item: dict


class RootEvent(JobEvent):
    group: dict


def _uri(e: JobEvent, *parts: str) -> str:
    return join(e.store_root, "jobs", e.job_id, "fedtree", *parts)


def _model(data: bytes | np.ndarray, i: int, uri: str) -> tuple[np.ndarray, object]:
    """The update's data buffer as float32 (one view: every tensor is F32) and its header."""
    header = parse_header(bytes(data[PREFIX_BYTES : header_end(data, i, uri)]), i, uri)
    if any(t.dtype != "F32" for t in header.tensors.values()):
        raise ValueError(f"{uri}: fedtree takes float32 models only")
    return np.frombuffer(data, np.float32, offset=header.data_start), header


def header_end(data: bytes | np.ndarray, i: int, uri: str) -> int:
    return PREFIX_BYTES + parse_length_prefix(bytes(data[:PREFIX_BYTES]), i, uri)


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
    """GET the group's updates whole and fold each in, ``acc += w * x``. A careful aggregator, given the
    sharded job's read path: the next update is read while this one is summed (GetBatch, two in flight,
    into reused aligned buffers), and ``w * x`` goes into one scratch model allocated once (the same float32
    roundings as ``acc += x * w``)."""
    clients = [spec.clients[i] for i in e.item["clients"]]
    sizes = store.sizes([c.uri for c in clients])
    items = [{"uri": c.uri, "start": 0, "length": sizes[c.uri]} for c in clients]
    big = max(sizes.values())
    acc = tmp = None
    total = 0.0
    stream = store.get_batch(items, window=2, concurrency=2, max_bytes=2 * big + (1 << 20), buffer_bytes=big)
    with stream:
        for i, c, entry in zip(e.item["clients"], clients, stream, strict=True):
            x, _ = _model(entry.data, i, c.uri)
            del entry
            w = np.float32(c.weight)
            if acc is None:
                acc, tmp = x * w, np.empty_like(x)
            else:
                np.multiply(x, w, out=tmp)
                acc += tmp
            total += c.weight
            del x
    with store.writer(_uri(e, "partials", f"{e.index:05d}.f32")) as f:
        f.write(acc.data)  # the array's own buffer: no copy
    store.put_json(_uri(e, "partials", f"{e.index:05d}.json"), {"weight": total})
    return {}


@task(RootEvent, kind="fedtree")
def root(e: RootEvent, spec) -> dict:
    uri0 = spec.clients[0].uri  # the output's header is client 0's tensors: read its header only
    end = header_end(store.get(uri0, 0, PREFIX_BYTES), 0, uri0)
    header = parse_header(store.get(uri0, PREFIX_BYTES, end - PREFIX_BYTES), 0, uri0)
    acc = None
    total = 0.0
    for k in range(e.group["leaves"]):
        part = np.frombuffer(store.get(_uri(e, "partials", f"{k:05d}.f32")), np.float32)
        if acc is None:
            acc = part.copy()
        else:
            acc += part
        total += store.get_json(_uri(e, "partials", f"{k:05d}.json"))["weight"]
        del part
    acc /= np.float32(total)

    out = join(e.store_root, "jobs", e.job_id, "output", "model.safetensors")
    with store.writer(out) as f:
        f.write(encode_header(output_tensors(header), {"format": "pt"}))
        f.write(acc.data)
    result = {"job_id": e.job_id, "kind": "fedtree", "output": out, "clients": len(spec.clients)}
    store.put_json(join(e.store_root, "jobs", e.job_id, "result.json"), result)
    store.delete_prefix(_uri(e))
    return {"output": out, "weight": total}
