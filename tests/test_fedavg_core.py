"""The fedavg job's pure core on the local store: plan → aggregate (per shard) → commit.

Every result is compared bit for bit with a plain in-memory reference that applies the same formula in the
same client order (see functions.fedavg.kernels), over shard counts from 1 to many, with shard and chunk
boundaries inside tensors, mixed dtypes and clients whose files are laid out differently.
"""

from __future__ import annotations

import json
import math
import struct

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from shardfold.functions import store
from shardfold.functions.errors import (
    AggregationOverflow,
    InvalidModelFile,
    NonFiniteAggregate,
    NonFiniteUpdate,
    ObjectNotFound,
    PlanError,
    SpecError,
)
from shardfold.functions.fedavg import core, handlers, kernels
from shardfold.functions.fedavg.layout import DTYPES, Tensor
from shardfold.functions.fedavg.shardplan import Budget, Geometry, MiB, Segment, choose_shards, task_loads
from shardfold.functions.fedavg.spec import FedAvgSpec
from shardfold.functions.specs import parse_spec

JOB = "fedavg-20260101T000000-abcdef"
TINY = Budget(min_shard_bytes=1, chunk_bytes=56, robust_bytes=4096, min_robust_chunk=8)
NP_NAME = {np.dtype(v.np).str: k for k, v in DTYPES.items() if k != "BOOL"}
BF16 = np.dtype(ml_dtypes.bfloat16)


# --- writing and reading files ----------------------------------------------------------------------------


def st_name(a: np.ndarray) -> str:
    if a.dtype == np.bool_:
        return "BOOL"
    if a.dtype == BF16:
        return "BF16"
    return NP_NAME[a.dtype.str]


def encode(
    tensors: dict[str, np.ndarray], metadata: dict | None = None, order: list[str] | None = None
) -> bytes:
    """A safetensors file with the data laid out in ``order`` (default: sorted names)."""
    header: dict = {"__metadata__": metadata} if metadata is not None else {}
    data = b""
    for name in order or sorted(tensors):
        a = np.asarray(tensors[name])
        raw = a.tobytes(order="C")
        header[name] = {
            "dtype": st_name(a),
            "shape": list(a.shape),
            "data_offsets": [len(data), len(data) + len(raw)],
        }
        data += raw
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def model(rng: np.random.Generator, integer_valued: bool = False) -> dict[str, np.ndarray]:
    """Mixed dtypes and shapes, including a 0-rank and an empty tensor."""

    def f(shape, dtype, scale=4.0):
        x = rng.standard_normal(shape) * scale
        if integer_valued:
            x = np.round(x)
        return np.asarray(x).astype(dtype)

    return {
        "conv.weight": f((5, 3, 3, 3), np.float32),
        "conv.bias": f((5,), np.float32),
        "emb": f((7, 6), BF16),
        "head.w": f((4, 9), np.float16),
        "scale": f((), np.float64),
        "bn.running_mean": f((13,), np.float64),
        "bn.num_batches_tracked": np.array(rng.integers(0, 1000), np.int64),
        "counts": rng.integers(-50, 50, size=(11,)).astype(np.int64),
        "empty": np.zeros((0, 4), np.float32),
        "f8": f((6,), ml_dtypes.float8_e4m3fn, scale=1.0),
        "mask": rng.integers(0, 2, size=(3, 3)).astype(bool),
        "ids": rng.integers(0, 255, size=(5,)).astype(np.uint8),
        "pos": rng.integers(-(2**20), 2**20, size=(2, 2)).astype(np.int32),
    }


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "home"))
    return store.uri.store_root()


def put_clients(root: str, updates: list[dict[str, np.ndarray]], num_examples=None, orders=None) -> list[str]:
    uris = []
    for i, u in enumerate(updates):
        meta = (
            None
            if num_examples is None or num_examples[i] is None
            else {"num_examples": str(num_examples[i])}
        )
        uri = store.uri.join(root, "round", f"client-{i:03d}.safetensors")
        store.put(uri, encode(u, meta, orders[i] if orders else None))
        uris.append(uri)
    return uris


def run_job(spec: FedAvgSpec, root: str, budget: Budget = TINY, job_id: str = JOB) -> dict:
    planned = core.prepare(spec, job_id, root, budget=budget)
    for item in store.get_json(planned["worklist"]["uri"]):
        core.aggregate(spec, job_id, root, item["shard"])
    return core.commit(spec, job_id, root, planned["shards"])


READ_AS = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": BF16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "I64": np.int64, "I32": np.int32, "U8": np.uint8, "BOOL": np.bool_,
}  # fmt: skip


def load(uri: str) -> dict[str, np.ndarray]:
    """The tensors of a safetensors object, read by offsets (safetensors' numpy loader has no F8 types;
    :func:`test_output_is_a_valid_safetensors_file` checks the library reads our files)."""
    raw = store.get(uri)
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    data = raw[8 + n :]
    return {
        k: np.frombuffer(data[v["data_offsets"][0] : v["data_offsets"][1]], READ_AS[v["dtype"]]).reshape(
            v["shape"]
        )
        for k, v in header.items()
    }


def data_buffer(uri: str) -> bytes:
    raw = store.get(uri)
    (n,) = struct.unpack("<Q", raw[:8])
    return raw[8 + n :]


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# --- the reference -----------------------------------------------------------------------------------------


def reference(
    updates: list[dict[str, np.ndarray]],
    weights: list[float],
    *,
    aggregator: str = "mean",
    uniform: bool = False,
    accumulate: str = "float32",
    integer_policy: str = "mean",
    trim_fraction: float = 0.1,
) -> dict[str, np.ndarray]:
    """Plain in-memory aggregation with the documented formulas, tensor by tensor."""
    n = len(updates)
    out = {}
    for name, a0 in updates[0].items():
        xs = [u[name] for u in updates]
        is_float = a0.dtype.kind == "f" or a0.dtype == BF16 or a0.dtype.kind == "V"
        is_float = is_float or a0.dtype in (
            np.dtype(ml_dtypes.float8_e4m3fn),
            np.dtype(ml_dtypes.float8_e5m2),
        )
        if not is_float and integer_policy == "first":
            out[name] = xs[0].copy()
            continue
        if not is_float and integer_policy == "max":
            r = xs[0]
            for x in xs[1:]:
                r = np.maximum(r, x)
            out[name] = r
            continue
        if is_float:
            acc = np.float64 if (accumulate == "float64" or a0.dtype == np.float64) else np.float32
        else:
            acc = np.float64
        vals = [x.astype(acc) for x in xs]
        if aggregator == "mean":
            w = [acc(1.0)] * n if uniform else [acc(x) for x in weights]
            total = acc(n) if uniform else acc(math.fsum(weights))
            s = vals[0] * w[0]
            for v, wi in zip(vals[1:], w[1:], strict=True):
                s = s + v * wi
            r = s / total
        else:
            srt = np.sort(np.stack(vals), axis=0)
            if aggregator == "median":
                m = n // 2
                r = srt[m] if n % 2 else (srt[m - 1] + srt[m]) / acc(2)
            else:
                k = math.floor(trim_fraction * n + 1e-9)
                s = srt[k]
                for j in range(k + 1, n - k):
                    s = s + srt[j]
                r = s / acc(n - 2 * k)
        r = np.asarray(r, dtype=acc)
        if not is_float:
            r = np.rint(r)
        out[name] = r.astype(a0.dtype)
    return out


# --- bitwise equality --------------------------------------------------------------------------------------

N_CLIENTS = 7


@pytest.fixture
def clients7(root):
    rng = np.random.default_rng(7)
    updates = [model(rng) for _ in range(N_CLIENTS)]
    weights = [float(w) for w in rng.integers(1, 500, N_CLIENTS)]
    names = sorted(updates[0])
    # Different layouts: reversed order for client 2, a rotation for client 5; the rest sorted.
    orders = [names] * N_CLIENTS
    orders[2] = names[::-1]
    orders[5] = names[3:] + names[:3]
    # Client 1's weight comes from the spec, the others' from __metadata__.num_examples.
    meta = [int(w) for w in weights]
    meta[1] = None
    uris = put_clients(root, updates, meta, orders)
    return updates, weights, uris


def client_specs(uris, weights, spec_weight_for=(1,)):
    return [
        {"uri": u, "weight": weights[i]} if i in spec_weight_for else {"uri": u} for i, u in enumerate(uris)
    ]


@pytest.mark.parametrize("shards", [1, 2, 3, 5, 8, 13, 40, 200])
def test_mean_is_bitwise_equal_to_the_reference_at_any_shard_count(root, clients7, shards):
    updates, weights, uris = clients7
    spec = FedAvgSpec(clients=client_specs(uris, weights), shards=shards)
    result = run_job(spec, root)
    got = load(result["output"])
    want = reference(updates, weights)
    assert set(got) == set(want)
    for name in want:
        assert same_bits(got[name], want[name]), name
    assert result["shards"] == min(shards, result["shards"]) and result["clients"] == N_CLIENTS
    assert result["total_weight"] == math.fsum(weights)
    assert result["dtypes"] == {
        "BF16": 1,
        "BOOL": 1,
        "F16": 1,
        "F32": 3,
        "F64": 2,
        "F8_E4M3": 1,
        "I32": 1,
        "I64": 2,
        "U8": 1,
    }
    assert not store.list_uris(core.job_uri(root, JOB, "fedavg"))  # temporaries removed


def test_data_is_identical_across_shard_and_chunk_sizes(root, clients7, tmp_path):
    updates, weights, uris = clients7
    buffers = set()
    for shards, chunk in [(1, 4 * MiB), (4, 56), (17, 8), (1, 1)]:
        spec = FedAvgSpec(clients=client_specs(uris, weights), shards=shards)
        budget = Budget(min_shard_bytes=1, chunk_bytes=chunk)
        result = run_job(spec, root, budget, job_id=f"fedavg-20260101T000000-{shards:03d}{chunk % 1000:03d}")
        buffers.add(data_buffer(result["output"]))
    assert len(buffers) == 1


@pytest.mark.parametrize(
    "options",
    [
        {"uniform": True},
        {"accumulate": "float64"},
        {"uniform": True, "accumulate": "float64"},
        {"integer_policy": "first"},
        {"integer_policy": "max"},
    ],
)
def test_mean_options_match_the_reference(root, clients7, options):
    updates, weights, uris = clients7
    spec = FedAvgSpec(clients=client_specs(uris, weights), shards=6, **options)
    got = load(run_job(spec, root)["output"])
    want = reference(updates, weights, **options)
    for name in want:
        assert same_bits(got[name], want[name]), name


def test_integer_valued_updates_give_sharded_equal_tree_equal_flat(root):
    """With integer data the float32 sums are exact, so any grouping gives the same bits (λ-FL's tree)."""
    rng = np.random.default_rng(3)
    n = 20
    updates = [{"w": np.round(rng.standard_normal((31, 17)) * 100).astype(np.float32)} for _ in range(n)]
    weights = [float(w) for w in rng.integers(1, 64, n)]
    uris = put_clients(root, updates, [int(w) for w in weights])
    spec = FedAvgSpec(clients=[{"uri": u} for u in uris], shards=9)
    sharded = load(run_job(spec, root)["output"])["w"]

    xs = [u["w"] for u in updates]
    w32 = [np.float32(w) for w in weights]
    total = np.float32(sum(weights))
    flat = sum((x * w for x, w in zip(xs, w32, strict=True)), np.zeros_like(xs[0])) / total
    group = math.ceil(math.sqrt(n))  # λ-FL: ~sqrt(N) clients per leaf, leaves' partial sums added at the root
    partials = [
        sum((x * w for x, w in zip(xs[g : g + group], w32[g : g + group], strict=True)), np.zeros_like(xs[0]))
        for g in range(0, n, group)
    ]
    tree = sum(partials[::-1], np.zeros_like(xs[0])) / total
    assert same_bits(sharded, flat) and same_bits(sharded, tree)


def test_float32_mean_is_bitwise_flowers_aggregate(root):
    aggregate = pytest.importorskip("flwr.server.strategy.aggregate").aggregate
    rng = np.random.default_rng(11)
    updates = [
        {"a": rng.standard_normal((40, 3)).astype(np.float32), "b": rng.standard_normal(7).astype(np.float32)}
        for _ in range(6)
    ]
    n_examples = [int(x) for x in rng.integers(1, 1000, 6)]
    uris = put_clients(root, updates, n_examples)
    got = load(run_job(FedAvgSpec(clients=[{"uri": u} for u in uris], shards=3), root)["output"])
    flower = aggregate([([u["a"], u["b"]], n) for u, n in zip(updates, n_examples, strict=True)])
    assert same_bits(got["a"], flower[0]) and same_bits(got["b"], flower[1])


def test_output_is_a_valid_safetensors_file(root, clients7):
    updates, weights, uris = clients7
    result = run_job(FedAvgSpec(clients=client_specs(uris, weights), shards=4), root)
    raw = store.get(result["output"])
    (n,) = struct.unpack("<Q", raw[:8])
    assert (8 + n) % 8 == 0 and raw[8 : 8 + n].rstrip(b" ").endswith(b"}")
    assert len(raw) == result["bytes"] == 8 + n + result["data_bytes"]
    path = result["output"].removeprefix("file://")
    ours = load(result["output"])
    with safe_open(path, framework="np") as f:
        meta = f.metadata()
        assert set(f.keys()) == set(updates[0])
        assert f.get_slice("emb").get_dtype() == "BF16" and f.get_slice("f8").get_dtype() == "F8_E4M3"
        for k in f.keys():
            if k != "f8":  # safetensors' numpy loader has no float8 types
                assert same_bits(f.get_tensor(k), ours[k]), k
        assert f.get_tensor("empty").shape == (0, 4) and f.get_tensor("scale").shape == ()
    assert "shardfold_job" not in meta and meta["format"] == "pt"  # same inputs, same bytes, any job
    assert meta["num_examples"] == str(int(math.fsum(weights)))
    torch_st = pytest.importorskip("safetensors.torch")
    tensors = torch_st.load_file(path)
    assert tensors["f8"].view(torch_st.torch.uint8).numpy().tobytes() == ours["f8"].tobytes()


def test_files_written_by_safetensors_itself_are_read_by_their_offsets(root, tmp_path):
    """safetensors.numpy sorts tensors by dtype then name: the header's key order is not the data order."""
    rng = np.random.default_rng(5)
    updates = [
        {
            "z": rng.standard_normal(9).astype(np.float16),
            "a": rng.standard_normal((3, 5)).astype(np.float32),
            "m": rng.standard_normal(4),
        }
        for _ in range(3)
    ]
    uris = []
    for i, u in enumerate(updates):
        path = tmp_path / f"st-{i}.safetensors"
        save_file(u, str(path), metadata={"num_examples": str(i + 1), "format": "np"})
        uris.append(f"file://{path}")
    result = run_job(FedAvgSpec(clients=[{"uri": u} for u in uris], shards=3), root)
    got = load(result["output"])
    want = reference(updates, [1.0, 2.0, 3.0])
    for name in want:
        assert same_bits(got[name], want[name]), name
    assert safe_open(result["output"].removeprefix("file://"), framework="np").metadata()["format"] == "np"


# --- robust aggregators ------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [5, 8])
@pytest.mark.parametrize(
    "options",
    [
        {"aggregator": "median"},
        {"aggregator": "trimmed_mean", "trim_fraction": 0.25},
        {"aggregator": "trimmed_mean", "trim_fraction": 0.0},
        {"aggregator": "median", "accumulate": "float64"},
    ],
)
def test_robust_aggregators_match_numpy_sort_references(root, n, options):
    rng = np.random.default_rng(n)
    updates = [model(rng) for _ in range(n)]
    uris = put_clients(root, updates)  # no num_examples at all: robust aggregators need no weights
    spec = FedAvgSpec(clients=[{"uri": u} for u in uris], shards=5, **options)
    result = run_job(spec, root)
    got = load(result["output"])
    want = reference(updates, [1.0] * n, **options)
    for name in want:
        assert same_bits(got[name], want[name]), name
    assert result["total_weight"] is None


def test_median_and_trimmed_mean_agree_with_numpy_statistics(root):
    rng = np.random.default_rng(1)
    n = 9
    updates = [{"x": rng.standard_normal((6, 5))} for _ in range(n)]  # F64
    uris = put_clients(root, updates)
    stack = np.stack([u["x"] for u in updates])
    med = load(
        run_job(FedAvgSpec(clients=[{"uri": u} for u in uris], aggregator="median", shards=2), root)["output"]
    )
    np.testing.assert_array_equal(med["x"], np.median(stack, axis=0))
    spec = FedAvgSpec(
        clients=[{"uri": u} for u in uris], aggregator="trimmed_mean", trim_fraction=0.2, shards=2
    )
    trimmed = load(run_job(spec, root, job_id="fedavg-20260101T000000-000002")["output"])
    k = 1  # floor(0.2 * 9)
    np.testing.assert_allclose(trimmed["x"], np.sort(stack, axis=0)[k : n - k].mean(axis=0), rtol=1e-15)


def test_robust_chunk_shrinks_as_n_grows_so_the_matrix_stays_bounded(root):
    rng = np.random.default_rng(2)
    budget = Budget(min_shard_bytes=1, chunk_bytes=4096, robust_bytes=8192, min_robust_chunk=8)
    sizes = {}
    for n in (2, 16):
        updates = [{"x": rng.standard_normal(3000).astype(np.float32)} for _ in range(n)]
        uris = put_clients(root, updates)
        spec = FedAvgSpec(clients=[{"uri": u} for u in uris[:n]], aggregator="median")
        plan = core.inspect(spec, JOB, root, budget=budget)
        sizes[n] = plan.chunk_bytes
        matrix = n * plan.chunk_bytes * 2  # float32 acc for F32 inputs; chunk sized for the worst ratio (8/4)
        assert matrix <= budget.robust_bytes
    assert sizes[16] < sizes[2]


# --- integer and bool policies -----------------------------------------------------------------------------


def test_integer_mean_rounds_half_to_even_and_bool_is_a_weighted_majority(root):
    ups = [
        {"i": np.array([1, 2, -1, 7], np.int64), "b": np.array([True, True, False, True])},
        {"i": np.array([2, 3, -2, 7], np.int64), "b": np.array([False, True, False, False])},
    ]
    uris = put_clients(root, ups, [1, 1])
    got = load(run_job(FedAvgSpec(clients=[{"uri": u} for u in uris]), root)["output"])
    assert got["i"].tolist() == [2, 2, -2, 7]  # 1.5 -> 2, 2.5 -> 2, -1.5 -> -2
    assert got["b"].dtype == np.bool_ and got["b"].tolist() == [False, True, False, False]  # ties -> False
    spec = FedAvgSpec(clients=[{"uri": uris[0], "weight": 3.0}, {"uri": uris[1], "weight": 1.0}])
    got = load(run_job(spec, root, job_id="fedavg-20260101T000000-000003")["output"])
    assert got["b"].tolist() == [True, True, False, True]  # client 0 outweighs client 1
    spec = FedAvgSpec(clients=[{"uri": u} for u in uris], integer_policy="max")
    got = load(run_job(spec, root, job_id="fedavg-20260101T000000-000004")["output"])
    assert got["i"].tolist() == [2, 3, -1, 7] and got["b"].tolist() == [True, True, False, True]


# --- bad input ---------------------------------------------------------------------------------------------


def good(rng=None) -> dict[str, np.ndarray]:
    rng = rng or np.random.default_rng(0)
    return {"a": rng.standard_normal((4, 4)).astype(np.float32), "b": np.arange(3, dtype=np.int64)}


def raw_header(doc: dict, data: bytes, pad: bool = True) -> bytes:
    text = json.dumps(doc).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


A_OK = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
DUPLICATE = b'{"a": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}, "a": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}}'  # noqa: E501


def bad_files() -> dict[str, tuple[bytes | None, type, str]]:
    """name -> (client 1's bytes, or None for a missing object; error type; message fragment)."""
    good_bytes = encode(good())
    return {
        "missing": (None, ObjectNotFound, "no object"),
        "tiny": (b"abc", InvalidModelFile, "8 bytes"),
        "text": (b"hello, this is not a model at all", InvalidModelFile, "100000000-byte limit"),
        "zero_header": (struct.pack("<Q", 0), InvalidModelFile, "0-byte header"),
        "header_past_end": (struct.pack("<Q", 500) + b"{}", InvalidModelFile, "past the end"),
        "not_json": (raw_header({}, b"")[:8] + b"{not json", InvalidModelFile, "not valid JSON"),
        "not_object": (struct.pack("<Q", 6) + b"[1, 2]", InvalidModelFile, "not a JSON object"),
        "duplicate_key": (
            struct.pack("<Q", len(DUPLICATE)) + DUPLICATE + bytes(4),
            InvalidModelFile,
            "duplicate",
        ),
        "bad_dtype": (
            raw_header({"a": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, bytes(8)),
            InvalidModelFile,
            "'C64' is not supported",
        ),
        "bad_shape": (
            raw_header({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, bytes(4)),
            InvalidModelFile,
            "shape",
        ),
        "size_mismatch": (
            raw_header({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8)),
            InvalidModelFile,
            "needs 12",
        ),
        "overlap": (
            raw_header({"a": A_OK, "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12)),
            InvalidModelFile,
            "overlaps",
        ),
        "gap": (
            raw_header({"a": A_OK, "b": {"dtype": "F32", "shape": [1], "data_offsets": [12, 16]}}, bytes(16)),
            InvalidModelFile,
            "gap of 4 bytes",
        ),
        "bad_metadata": (
            raw_header({"__metadata__": {"n": 3}, "a": A_OK}, bytes(8)),
            InvalidModelFile,
            "__metadata__",
        ),
        "truncated": (good_bytes[:-5], InvalidModelFile, "truncated"),
        "trailing": (good_bytes + b"xx", InvalidModelFile, "2 unexpected bytes"),
        "missing_tensor": (encode({"a": good()["a"]}), InvalidModelFile, "has no tensor 'b'"),
        "extra_tensor": (
            encode({**good(), "c": np.zeros(2, np.float32)}),
            InvalidModelFile,
            "tensor 'c' that client 0",
        ),
        "wrong_dtype": (
            encode({**good(), "a": good()["a"].astype(np.float16)}),
            InvalidModelFile,
            "tensor 'a' is F16",
        ),
        "wrong_shape": (
            encode({**good(), "a": good()["a"].reshape(2, 8)}),
            InvalidModelFile,
            "tensor 'a' has shape [2, 8]",
        ),
    }


@pytest.mark.parametrize("case", sorted(bad_files()))
def test_bad_input_is_refused_naming_the_client_and_nothing_is_written(root, case):
    data, error, fragment = bad_files()[case]
    uris = put_clients(root, [good(), good(), good()], [1, 2, 3])
    if data is None:
        store.delete(uris[1])
    else:
        store.put(uris[1], data)
    spec = FedAvgSpec(clients=[{"uri": u} for u in uris])
    with pytest.raises(error) as exc:
        run_job(spec, root)
    assert f"client 1 ({uris[1]})" in str(exc.value) and fragment in str(exc.value)
    if isinstance(exc.value, InvalidModelFile):
        assert exc.value.client == 1 and exc.value.uri == uris[1]
    assert not store.exists(core.output_uri(spec, root, JOB))


@pytest.mark.parametrize(
    ("num_examples", "fragment"),
    [
        (None, "no 'num_examples'"),
        ("many", "'many', not a number"),
        ("0", "must be a finite number > 0"),
        ("-3", "> 0"),
        ("nan", "> 0"),
        ("inf", "> 0"),
    ],
)
def test_a_missing_or_bad_num_examples_names_the_client(root, num_examples, fragment):
    uris = put_clients(root, [good(), good()], [4, num_examples])
    spec = FedAvgSpec(clients=[{"uri": u} for u in uris])
    with pytest.raises(InvalidModelFile, match=fragment) as exc:
        core.prepare(spec, JOB, root, budget=TINY)
    assert f"client 1 ({uris[1]})" in str(exc.value) and "clients.1.weight" in str(exc.value)
    # the weight in the spec, or uniform weights, or a robust aggregator: no num_examples needed
    for kw in (
        {"clients": [{"uri": uris[0]}, {"uri": uris[1], "weight": 2.5}]},
        {"uniform": True},
        {"aggregator": "median"},
    ):
        doc = {"clients": [{"uri": u} for u in uris], **kw}
        assert core.inspect(FedAvgSpec(**doc), JOB, root, budget=TINY).n_clients == 2


def test_spec_weights_must_be_positive():
    with pytest.raises(ValueError, match="finite number > 0"):
        FedAvgSpec(clients=[{"uri": "a", "weight": 0}])


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("aggregator", ["mean", "median"])
def test_nonfinite_updates_are_rejected_naming_client_and_tensor(root, value, aggregator):
    ups = [good(np.random.default_rng(i)) for i in range(4)]
    ups[2]["a"][3, 1] = value
    uris = put_clients(root, ups, [1, 1, 1, 1])
    spec = FedAvgSpec(clients=[{"uri": u} for u in uris], aggregator=aggregator, shards=3)
    with pytest.raises(NonFiniteUpdate) as exc:
        run_job(spec, root, budget=Budget(min_shard_bytes=1, chunk_bytes=12))
    assert f"client 2 ({uris[2]})" in str(exc.value) and "tensor 'a'" in str(exc.value)
    assert "flat element 13" in str(exc.value)
    assert exc.value.client == 2 and exc.value.tensor == "a"
    assert not store.exists(core.output_uri(spec, root, JOB))
    # opted out: aggregated as IEEE arithmetic says
    spec = FedAvgSpec(
        clients=[{"uri": u} for u in uris], aggregator=aggregator, shards=3, allow_nonfinite=True
    )
    got = load(run_job(spec, root, job_id="fedavg-20260101T000000-000005")["output"])
    want = reference(ups, [1.0] * 4, aggregator=aggregator)
    assert same_bits(got["a"], want["a"])
    if aggregator == "mean":
        assert not np.isfinite(got["a"][3, 1]) and np.isfinite(np.delete(got["a"].ravel(), 13)).all()


def test_overflow_of_finite_updates_says_to_accumulate_in_float64(root):
    big = {"a": np.full(4, 3e38, np.float32)}
    uris = put_clients(root, [big, big], [10, 10])
    spec = FedAvgSpec(clients=[{"uri": u} for u in uris])
    with pytest.raises(AggregationOverflow, match="accumulate='float64'"):
        run_job(spec, root)
    got = load(
        run_job(
            FedAvgSpec(clients=[{"uri": u} for u in uris], accumulate="float64"),
            root,
            job_id="fedavg-20260101T000000-000006",
        )["output"]
    )
    assert got["a"].tolist() == [np.float32(3e38)] * 4


# --- weights far from 1, and aggregates that are not finite ------------------------------------------------

WEIGHT_MAGNITUDES = [
    5e-324,
    1e-300,
    1e-200,
    1e-100,
    1e-50,
    1e-40,
    1e-20,
    1.0,
    1e20,
    1e40,
    1e100,
    1e200,
    1e300,
]


def float_updates(n: int, seed: int = 5) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {
            "f32": rng.standard_normal((9, 7)).astype(np.float32),
            "f64": rng.standard_normal(11),
            "f16": rng.standard_normal(6).astype(np.float16),
            "bf16": rng.standard_normal(5).astype(BF16),
        }
        for _ in range(n)
    ]


def assert_float64_mean(got: dict, updates: list, weights: list[float], accumulate: str) -> None:
    """``got`` is the weighted mean computed in float64 (weights relative to the largest), to within the
    output's rounding plus the accumulator's rounding of N terms."""
    w = np.array(weights) / max(weights)
    for name, out in got.items():
        assert np.isfinite(out.astype(np.float64)).all(), name
        xs = [u[name].astype(np.float64) for u in updates]
        want = sum(wi * x for wi, x in zip(w, xs, strict=True)) / w.sum()
        acc = np.float64 if (accumulate == "float64" or out.dtype == np.float64) else np.float32
        atol = 4 * len(xs) * np.finfo(acc).eps * max(float(np.abs(x).max()) for x in xs)
        rtol = float(ml_dtypes.finfo(out.dtype).eps)
        np.testing.assert_allclose(out.astype(np.float64), want, rtol=rtol, atol=atol, err_msg=name)


@pytest.mark.parametrize("accumulate", ["float32", "float64"])
@pytest.mark.parametrize("magnitude", WEIGHT_MAGNITUDES)
def test_weights_from_5e_324_to_1e300_give_the_float64_mean(root, magnitude, accumulate):
    """Weights are scaled in float64 before the cast to the accumulator: 1e-50 in float32 used to be 0, and
    the model all NaN."""
    updates = float_updates(4)
    weights = [magnitude * r for r in (1, 2, 3, 5)]  # exact multiples: even 5e-324 = 2^-1074 keeps the ratios
    uris = put_clients(root, updates)
    spec = FedAvgSpec(clients=client_specs(uris, weights, range(4)), accumulate=accumulate, shards=2)
    result = run_job(spec, root)
    assert result["total_weight"] == math.fsum(weights)
    assert_float64_mean(load(result["output"]), updates, weights, accumulate)


@pytest.mark.parametrize("accumulate", ["float32", "float64"])
def test_weights_of_every_magnitude_in_one_round(root, accumulate):
    updates = float_updates(5, seed=6)
    weights = [5e-324, 1e-300, 1.0, 3e299, 1e300]
    uris = put_clients(root, updates)
    spec = FedAvgSpec(clients=client_specs(uris, weights, range(5)), accumulate=accumulate)
    assert_float64_mean(load(run_job(spec, root)["output"]), updates, weights, accumulate)


@pytest.mark.parametrize("accumulate", ["float32", "float64"])
@pytest.mark.parametrize("k", [-1072, -700, -100, -65, 65, 100, 700, 1000])
def test_weights_scaled_by_a_power_of_two_give_identical_bits(root, k, accumulate):
    """Only the weights' ratios matter, and scaling by 2^k is exact: every dtype (integers, BOOL's majority
    too) comes out bit for bit as with the weights 1..7, which are used as given."""
    rng = np.random.default_rng(8)
    updates = [model(rng) for _ in range(7)]
    plain = [float(w) for w in range(1, 8)]
    uris = put_clients(root, updates)
    spec = FedAvgSpec(clients=client_specs(uris, plain, range(7)), accumulate=accumulate)
    want = load(run_job(spec, root)["output"])
    assert all(same_bits(want[k_], v) for k_, v in reference(updates, plain, accumulate=accumulate).items())
    scaled = [math.ldexp(w, k) for w in plain]
    spec = FedAvgSpec(clients=client_specs(uris, scaled, range(7)), accumulate=accumulate)
    got = load(run_job(spec, root, job_id="fedavg-20260101T000000-000008")["output"])
    assert all(same_bits(got[name], want[name]) for name in want)


def test_kernels_weight_scale_and_total():
    assert kernels.weight_scale([float(w) for w in range(1, 1001)]) == 0  # ordinary weights: as given
    assert kernels.weight_scale([2.0**-64, 1e-30]) == kernels.weight_scale([2.0**64]) == 0
    for weights in ([1e-50, 3e-51], [5e-324], [1e300, 1.0], [1e308, 1e-308], [2.0**65]):
        k = kernels.weight_scale(weights)
        assert k != 0 and 1.0 <= math.ldexp(max(weights), k) < 2.0
    assert kernels.weight_scale([5e-324]) == 1074
    assert kernels.weight_total([1.0, 2.0, 0.1]) == math.fsum([1.0, 2.0, 0.1])
    assert kernels.weight_total([1e308, 5e307]) == 1.5e308  # math.fsum raises OverflowError on its way there
    assert kernels.weight_total([1e308, 1e308]) == math.inf
    assert kernels.weight_total([5e-324] * 3) == 1.5e-323


def test_kernels_first_nonfinite_scans_block_by_block():
    flags = np.empty(4, np.bool_)
    for dtype in (np.float32, np.float64, np.float16, BF16, ml_dtypes.float8_e4m3fn):
        x = np.zeros(11, dtype)
        assert kernels.first_nonfinite(x, flags) is None
        x[9] = np.nan
        assert kernels.first_nonfinite(x, flags) == 9, dtype
    assert kernels.first_nonfinite(np.array([1.0, np.inf, np.nan]), flags) == 1


def test_weights_totalling_beyond_float64_are_a_spec_error_naming_the_field(root):
    updates = float_updates(2)
    uris = put_clients(root, updates)
    spec = FedAvgSpec(clients=client_specs(uris, [1e308, 1e308], range(2)))
    with pytest.raises(SpecError, match=r"clients\.0\.weight = 1e\+308.*only their ratios matter") as exc:
        core.prepare(spec, JOB, root)
    assert exc.value.errors[0]["field"] == "clients.0.weight"
    uris = put_clients(root, updates, ["1e308", "1.5e308"])
    with pytest.raises(SpecError, match=r"client 1 \(.*\) __metadata__\.num_examples = 1\.5e\+308"):
        core.prepare(FedAvgSpec(clients=[{"uri": u} for u in uris]), JOB, root)
    assert not store.exists(core.plan_uri(root, JOB))
    # a total within range works, however large (math.fsum alone overflowed on the way to 1.5e308)
    spec = FedAvgSpec(clients=client_specs(uris, [1e308, 5e307], range(2)))
    result = run_job(spec, root)
    assert result["total_weight"] == 1.5e308
    assert_float64_mean(load(result["output"]), updates, [1e308, 5e307], "float32")


def test_a_nonfinite_aggregate_fails_naming_the_tensor_even_without_the_weight_scale(root, monkeypatch):
    """The output check is the safety net: with the weights cast as given (the old way), 1e-50 in float32 is
    0, the mean 0/0; the task fails instead of writing NaN."""
    monkeypatch.setattr(kernels, "weight_scale", lambda weights: 0)
    uris = put_clients(root, [good(np.random.default_rng(i)) for i in range(3)])
    spec = FedAvgSpec(clients=client_specs(uris, [1e-50, 2e-50, 3e-50], range(3)))
    with pytest.raises(
        NonFiniteAggregate, match=r"tensor 'a': the mean is NaN or Inf at flat element 0"
    ) as exc:
        run_job(spec, root)
    assert exc.value.tensor == "a" and exc.value.element == 0
    assert not store.exists(core.output_uri(spec, root, JOB))


@pytest.mark.parametrize("aggregator", ["median", "trimmed_mean"])
def test_a_robust_aggregate_that_overflows_fails_even_when_nonfinite_is_allowed(root, aggregator):
    """(3e38 + 3e38) / 2 is Inf in float32: it used to be written, and the job succeeded."""
    big = {"a": np.full(4, 3e38, np.float32), "b": np.arange(3, dtype=np.int64)}
    uris = put_clients(root, [big, big], [1, 1])
    extra = {"trim_fraction": 0.0} if aggregator == "trimmed_mean" else {}
    for allow in (False, True):
        spec = FedAvgSpec(
            clients=[{"uri": u} for u in uris], aggregator=aggregator, allow_nonfinite=allow, **extra
        )
        with pytest.raises(NonFiniteAggregate, match="tensor 'a'.*accumulate='float64'") as exc:
            run_job(spec, root)
        assert exc.value.tensor == "a" and not store.exists(core.output_uri(spec, root, JOB))
    spec = FedAvgSpec(
        clients=[{"uri": u} for u in uris], aggregator=aggregator, accumulate="float64", **extra
    )
    assert load(run_job(spec, root)["output"])["a"].tolist() == [np.float32(3e38)] * 4


def test_allow_nonfinite_allows_only_where_an_input_was_not_finite(root):
    """NaN in at element 13 may come out (allowed), but element 0, where every update is finite and the
    weighted sum is Inf + -Inf = NaN, fails the job; without the overflow the same round succeeds."""
    ups = [good(np.random.default_rng(i)) for i in range(3)]
    ups[1]["a"][3, 1] = np.nan
    for u, v in zip(ups, [3e38, 3e38, -3e38], strict=True):
        u["a"][0, 0] = v
    uris = put_clients(root, ups)
    weights = [1.0, 1.0, 2.0]  # -3e38 * 2 is -Inf in float32
    spec = FedAvgSpec(clients=client_specs(uris, weights, range(3)), allow_nonfinite=True, shards=2)
    with pytest.raises(
        NonFiniteAggregate, match="tensor 'a': the mean is NaN or Inf at flat element 0 "
    ) as exc:
        run_job(spec, root, budget=Budget(min_shard_bytes=1, chunk_bytes=12))
    assert not isinstance(exc.value, NonFiniteUpdate) and exc.value.element == 0
    strict = FedAvgSpec(clients=client_specs(uris, weights, range(3)))
    with pytest.raises(NonFiniteUpdate, match="client 1 .*tensor 'a'"):  # the NaN input is named first
        run_job(strict, root)
    for u in ups:
        u["a"][0, 0] = 1.0
    uris = put_clients(root, ups)
    got = load(run_job(spec, root, job_id="fedavg-20260101T000000-000009")["output"])["a"]
    assert np.isnan(got[3, 1]) and np.isfinite(np.delete(got.ravel(), 13)).all()


@pytest.mark.parametrize(
    "first, again",
    [
        ("c.safetensors", "./c.safetensors"),
        ("./c.safetensors", "c.safetensors"),
        ("c.safetensors", "r//../c.safetensors"),
        ("r/c.safetensors", "r//c.safetensors"),
        ("a/../c.safetensors", "./c.safetensors"),
        ("FILE/c.safetensors", "FILE//./c.safetensors"),
    ],
)
def test_one_client_spelled_two_ways_is_refused_naming_both_fields(root, first, again):
    """It used to be planned as two clients (the same update counted twice)."""
    home = root.removeprefix("file://")
    first, again = (u.replace("FILE", f"file://{home}") for u in (first, again))
    other = put_clients(root, [good()], [1])[0]
    doc = {"kind": "fedavg", "clients": [{"uri": first}, {"uri": other}, {"uri": again}]}
    with pytest.raises(
        SpecError, match=r"clients\.2 repeats clients\.0 \(.*c\.safetensors\); each update"
    ) as exc:
        parse_spec(doc)
    assert [e["field"] for e in exc.value.errors] == ["clients.2.uri"]
    with pytest.raises(ValueError, match=r"clients\.2 repeats clients\.0"):
        FedAvgSpec(clients=doc["clients"])


def test_client_uris_are_kept_in_normal_form_and_read_once(root):
    uris = put_clients(root, [good(np.random.default_rng(i)) for i in range(2)], [1, 3])
    keys = [u.removeprefix(root + "/") for u in uris]  # round/client-000.safetensors, ...
    spec = FedAvgSpec(clients=[{"uri": "./" + keys[0]}, {"uri": "x/..//" + keys[1].replace("/", "/./")}])
    assert [c.uri for c in spec.clients] == keys
    assert [c.uri for c in core.inspect(spec, JOB, root, budget=TINY).clients] == uris
    spec = parse_spec(
        {"kind": "fedavg", "clients": [{"uri": "./" + keys[0]}, {"uri": keys[1]}]},
        base_uri=root + "/spec.json",
    )
    assert [c.uri for c in spec.clients] == [uris[0], keys[1]]  # ./ beside the spec file, as before


def test_bad_client_uri_is_a_spec_error(root):
    with pytest.raises(SpecError, match=r"clients\.0\.uri"):
        core.prepare(FedAvgSpec(clients=[{"uri": "../outside"}]), JOB, root)


# --- plan geometry and sizing -------------------------------------------------------------------------------


def test_shard_bounds_fall_on_element_boundaries_and_cross_tensors():
    tensors = [
        Tensor("a", "F64", (3,), 0, 24),
        Tensor("b", "BOOL", (5,), 24, 29),
        Tensor("c", "F32", (10,), 29, 69),
    ]
    geo = Geometry(tensors)
    for shards in range(1, 30):
        bounds = geo.shard_bounds(shards)
        assert bounds[0] == 0 and bounds[-1] == 69 and bounds == sorted(set(bounds))
        for b in bounds:
            t = next((t for t in tensors if t.begin <= b < t.end), None)
            assert t is None or (b - t.begin) % t.dt.itemsize == 0
    chunks = list(geo.chunks(0, 69, 7))
    assert chunks[0][0] == 0 and chunks[-1][1] == 69
    assert all(a < b and b == c for (a, b), (c, _) in zip(chunks, chunks[1:] + [(69, 69)], strict=True))
    assert chunks[:3] == [(0, 8), (8, 16), (16, 24)]  # a 7-byte chunk still holds one F64 element
    assert geo.segments(16, 33) == [Segment(0, 2, 1, 16), Segment(1, 0, 5, 24), Segment(2, 0, 1, 29)]


def test_choose_shards_rule():
    b = Budget()
    assert choose_shards(45 * MiB, 20, 4096, b).shards == 1  # ResNet-18: one 64 MiB target shard
    assert choose_shards(512 * MiB, 20, 4096, b).shards == 8  # VGG-16
    many = choose_shards(512 * MiB, 2000, 4096, b)  # time: each shard reads (N+1) x S within 450 s
    s = 512 * MiB / many.shards
    assert (2000 + 1) * s / b.read_bytes_per_s <= b.time_fraction * b.timeout_s
    assert s >= b.min_shard_bytes
    assert choose_shards(5 * 1024 * MiB, 20, 4096, b).shards == 80
    lowered = choose_shards(12 * MiB, 4, 100, b, requested=16)
    assert lowered.shards == 2 and "lowered" in lowered.notes[0]
    few = choose_shards(5 * 1024 * MiB, 20, 100, b, requested=2)
    assert few.shards == 2 and "timeout" in few.notes[0]
    with pytest.raises(PlanError, match="groups"):
        choose_shards(512 * MiB, 200_000, 4096, b)


def test_real_budget_shards_are_at_least_5_mib_except_the_last(root):
    rng = np.random.default_rng(0)
    up = {
        "a": rng.standard_normal(2 * MiB).astype(np.float32),
        "b": rng.standard_normal(4 * MiB).astype(np.float16),
        "c": np.zeros(1001, np.float64),
    }
    uris = put_clients(root, [up, up], [1, 1])
    plan = core.inspect(FedAvgSpec(clients=[{"uri": u} for u in uris], shards=50), JOB, root)
    sizes = [b - a for a, b in zip(plan.bounds, plan.bounds[1:], strict=False)]
    assert len(sizes) == 3 and plan.notes  # 16 MiB: three shards of >= 5 MiB, the request was lowered
    assert all(s >= 5 * MiB for s in sizes[:-1])
    plan = core.inspect(
        FedAvgSpec(clients=[{"uri": u} for u in uris]), JOB, root, budget=Budget(target_shard_bytes=MiB)
    )
    sizes = [b - a for a, b in zip(plan.bounds, plan.bounds[1:], strict=False)]
    assert len(sizes) == 3 and all(s >= 5 * MiB for s in sizes[:-1])


def test_task_loads_count_the_reads_the_tasks_make_and_memory_is_flat_in_n(root):
    rng = np.random.default_rng(4)
    updates = [model(rng) for _ in range(6)]
    names = sorted(updates[0])
    orders = [names, names[::-1]] * 3  # two layouts: the reversed clients need one read per segment
    uris = put_clients(root, updates, [1] * 6, orders)
    spec = FedAvgSpec(clients=[{"uri": u} for u in uris], shards=4)
    planned = core.prepare(spec, JOB, root, budget=TINY)
    plan = core.load_plan(root, JOB)
    loads = task_loads(plan)
    reads = sum(core.aggregate(spec, JOB, root, k)["reads"] for k in range(planned["shards"]))
    assert loads["aggregate"].gets == reads + 2 * planned["shards"]
    assert loads["aggregate"].tasks == planned["shards"] and loads["prepare"].gets == 1 + 3 * 6
    # memory: the mean's per-task peak does not depend on N; the robust one is bounded by robust_bytes
    small, large = (
        task_loads(core.inspect(FedAvgSpec(clients=[{"uri": u} for u in uris[:k]]), JOB, root))["aggregate"]
        for k in (2, 6)
    )
    # only the plan document (one row per client) grows: a few hundred bytes per client
    plan_doc = "the plan document and read descriptors"
    assert small.runtime_bytes == large.runtime_bytes
    assert {k: v for k, v in small.buffers.items() if k != plan_doc} == {
        k: v for k, v in large.buffers.items() if k != plan_doc
    }
    assert 0 <= large.peak_bytes - small.peak_bytes <= 1024 * (6 - 2) and large.peak_bytes < 512 * MiB
    robust = task_loads(
        core.inspect(FedAvgSpec(clients=[{"uri": u} for u in uris], aggregator="median"), JOB, root)
    )
    assert robust["aggregate"].peak_bytes < 1769 * MiB


# --- handlers, idempotency ---------------------------------------------------------------------------------


def test_handlers_run_the_job_and_retries_are_idempotent(root, clients7):
    updates, weights, uris = clients7
    spec = FedAvgSpec(clients=client_specs(uris, weights), shards=3)
    spec_uri = store.uri.join(root, "jobs", JOB, "spec.json")
    store.put(spec_uri, spec.model_dump_json().encode())
    state = {"job_id": JOB, "spec_uri": spec_uri, "store_root": root}
    planned = handlers.prepare(state)
    assert len(json.dumps(planned)) < 2048
    state["prepare"] = planned
    for i, item in enumerate(store.get_json(planned["worklist"]["uri"])):
        child = {"job_id": JOB, "spec_uri": spec_uri, "store_root": root, "item": item, "index": i}
        first = handlers.aggregate(child)
        part = store.get(core.part_uri(root, JOB, item["shard"]))
        again = handlers.aggregate(child)  # a retried task overwrites its part with identical bytes
        assert again["bytes"] == first["bytes"] == len(part)
        assert store.get(core.part_uri(root, JOB, item["shard"])) == part
    result = handlers.commit(state)
    assert handlers.commit(state) == result  # a retried commit returns the committed result
    want = reference(updates, weights)
    got = load(result["output"])
    assert all(same_bits(got[k], want[k]) for k in want)
    with pytest.raises(SpecError):
        handlers.aggregate({"job_id": JOB, "spec_uri": spec_uri, "store_root": root, "item": {"shard": -1}})


def test_kernels_trim_count_uses_the_written_decimal():
    assert (
        kernels.trim_count(0.29, 100) == 29
        and kernels.trim_count(0.1, 7) == 0
        and kernels.trim_count(0.49, 2) == 0
    )


def test_a_model_without_data_and_a_single_client(root):
    uris = put_clients(
        root, [{"empty": np.zeros((0,), np.float32)}, {"empty": np.zeros((0,), np.float32)}], [1, 1]
    )
    result = run_job(FedAvgSpec(clients=[{"uri": u} for u in uris]), root)
    assert (
        result["data_bytes"] == 0 and result["shards"] == 1 and load(result["output"])["empty"].shape == (0,)
    )
    up = model(np.random.default_rng(9))
    uris = put_clients(root, [up], [5])
    got = load(
        run_job(
            FedAvgSpec(clients=[{"uri": uris[0]}], shards=4), root, job_id="fedavg-20260101T000000-000007"
        )["output"]
    )
    want = reference([up], [5.0])
    assert all(same_bits(got[k], want[k]) for k in want)


def test_a_plan_whose_task_would_not_fit_the_function_memory_is_refused(root):
    uris = put_clients(root, [good(), good()], [1, 1])
    with pytest.raises(PlanError, match="MiB but the function has 128 MiB"):
        core.prepare(FedAvgSpec(clients=[{"uri": u} for u in uris]), JOB, root, budget=Budget(memory_mb=128))
    assert not store.exists(core.plan_uri(root, JOB))
