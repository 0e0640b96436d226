"""The inference job's CPU-side core (no torch): plan, preprocess, reconcile, commit and lineage."""

import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardfold.functions import store
from shardfold.functions.errors import BadInputError, SpecError
from shardfold.functions.inference import pipeline
from shardfold.functions.inference import shards as layout
from shardfold.functions.inference.preprocess import decode_shard, load_tokenizer
from shardfold.functions.inference.spec import InferenceSpec
from shardfold.functions.specs import parse_spec

JOB = "inference-20260101T000000-abcdef"
DIM = 4


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "home"))
    return store.uri.store_root()


def texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "naïve", "café"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(1, 40))) for _ in range(n)]


def put_jsonl(root: str, key: str, docs: list, raw_lines: dict[int, bytes] | None = None) -> str:
    lines = [json.dumps(d).encode() for d in docs]
    for i, b in (raw_lines or {}).items():
        lines.insert(i, b)
    store.put(store.uri.join(root, key), b"\n".join(lines) + b"\n")
    return key


def put_parquet(root: str, key: str, table: pa.Table, row_group_size: int) -> str:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, row_group_size=row_group_size)
    store.put(store.uri.join(root, key), sink.getvalue().to_pybytes())
    return key


def spec_of(**kw) -> InferenceSpec:
    return parse_spec({"kind": "inference", "field": "text", **kw})


def run_cpu(spec: InferenceSpec, root: str) -> dict:
    planned = pipeline.prepare(spec, JOB, root)
    for item in store.get_json(planned["worklist"]["uri"]):
        pipeline.preprocess(spec, JOB, root, item["shard"])
    pipeline.cpu_done(spec, JOB, root)
    return planned


def fake_worker(root: str, shards: list[int] | None = None, order_seed: int = 0) -> list[int]:
    """Stand-in for the GPU worker: embedding of a row = [row_index, len, first id, last id], written for
    the given shards (default: all lacking a marker) in a shuffled order, .npz then .done marker."""
    p = layout.load_plan(root, JOB)
    h = p["config_hash"]
    todo = shards if shards is not None else pipeline.missing_shards(root, JOB, p)
    todo = list(todo)
    random.Random(order_seed).shuffle(todo)
    for k in todo:
        sh = decode_shard(store.get(layout.pre_uri(root, JOB, h, k)))
        off = sh["offsets"]
        emb = np.zeros((len(sh["row_index"]), DIM), dtype=np.float32)
        for r in range(len(emb)):
            ids = sh["input_ids"][off[r] : off[r + 1]]
            emb[r] = [sh["row_index"][r], len(ids), ids[0], ids[-1]]
        import io

        buf = io.BytesIO()
        np.savez(buf, embedding=emb)
        store.put(layout.out_uri(root, JOB, h, k), buf.getvalue())
        store.put_if_absent(layout.done_uri(root, JOB, h, k), b"")
    return todo


def read_output(result: dict) -> pa.Table:
    import io

    return pq.read_table(io.BytesIO(store.get(result["output"])))


# ---------------------------------------------------------------------------------------------- spec


def test_spec_defaults_and_errors():
    s = spec_of(inputs=["a.jsonl", "s3://b/c.parquet"])
    assert (s.model, s.max_input_tokens, s.batch_tokens, s.shard_rows, s.on_bad_row) == (
        "minilm",
        256,
        16384,
        2000,
        "fail",
    )
    assert parse_spec(s.model_dump_json()) == s
    with pytest.raises(SpecError, match="cannot infer the format"):
        spec_of(inputs=["a.csv"])
    with pytest.raises(SpecError, match="repeats"):
        spec_of(inputs=["a.jsonl", "a.jsonl"])
    # the same object spelled differently is the same input
    with pytest.raises(SpecError, match=r"inputs\.2 repeats inputs\.0 \(d/a\.jsonl\).*inputs\.3 repeats inp"):
        spec_of(inputs=["d/a.jsonl", "b.jsonl", "./d//a.jsonl", "x/../d/./a.jsonl"])
    assert spec_of(inputs=["./d//a.jsonl", "x/../b.jsonl"]).inputs == ["d/a.jsonl", "b.jsonl"]
    with pytest.raises(SpecError, match="batch_tokens"):
        spec_of(inputs=["a.jsonl"], max_tokens=512, batch_tokens=100)
    t = spec_of(inputs=["a.jsonl"], model={"torchscript": "m.pt"})
    assert t.model.torchscript == "m.pt" and t.model.input == "token_ids"


# ---------------------------------------------------------------------------------------------- plan


def test_plan_is_deterministic_and_hash_tracks_config(root):
    put_jsonl(root, "in/a.jsonl", [{"text": t} for t in texts(25)])
    put_parquet(root, "in/b.parquet", pa.table({"text": texts(17, 1)}), row_group_size=5)
    spec = spec_of(inputs=["in/a.jsonl", "in/b.parquet"], shard_rows=10)
    first = pipeline.prepare(spec, JOB, root)
    plan1 = store.get(layout.plan_uri(root, JOB))
    man1 = store.get(layout.worklist_uri(root, JOB))
    second = pipeline.prepare(spec, JOB, root)
    assert first == second
    assert (
        store.get(layout.plan_uri(root, JOB)) == plan1 and store.get(layout.worklist_uri(root, JOB)) == man1
    )
    p = json.loads(plan1)
    assert [(s["input"], s["start_row"], s["rows"], s["row_offset"]) for s in p["shards"]] == [
        ("in/a.jsonl", 0, 10, 0),
        ("in/a.jsonl", 10, 10, 10),
        ("in/a.jsonl", 20, 5, 20),
        ("in/b.parquet", 0, 10, 25),
        ("in/b.parquet", 10, 7, 35),
    ]
    assert first["rows"] == 42 and json.loads(man1) == [{"shard": k} for k in range(5)]
    h = first["config_hash"]
    assert len(h) == 16
    assert (
        layout.config_hash(spec_of(inputs=["in/a.jsonl"], shard_rows=3), root)[0] == h
    )  # sharding is not config
    assert layout.config_hash(spec_of(inputs=["in/a.jsonl"], max_tokens=128), root)[0] != h
    assert layout.config_hash(parse_spec({**spec.model_dump(), "field": "body"}), root)[0] != h


def test_jsonl_shards_skip_blank_lines_and_keep_line_numbers(root):
    body = b'{"text": "a"}\n\n  \n{"text": "b"}\r\n{"text": "c"}'  # no final newline
    store.put(store.uri.join(root, "x.jsonl"), body)
    rows = list(layout.jsonl_lines(store.uri.join(root, "x.jsonl")))
    assert [(body[s:e].strip(), n) for s, e, n in rows] == [
        (b'{"text": "a"}', 1),
        (b'{"text": "b"}', 4),
        (b'{"text": "c"}', 5),
    ]


def test_jsonl_lines_across_read_chunks(root, monkeypatch):
    monkeypatch.setattr(layout, "READ_CHUNK", 7)
    docs = [{"text": t} for t in texts(30, 3)]
    put_jsonl(root, "y.jsonl", docs, raw_lines={5: b"   ", 9: b""})
    rows = list(layout.jsonl_lines(store.uri.join(root, "y.jsonl")))
    data = store.get(store.uri.join(root, "y.jsonl"))
    assert [json.loads(data[s:e]) for s, e, _ in rows] == docs
    assert [n for *_, n in rows][4:7] == [5, 7, 8]


# ---------------------------------------------------------------------------------------------- preprocess


@pytest.mark.parametrize("max_tokens", [8, 256])
def test_preprocess_token_ids_equal_tokenizers_encode(root, max_tokens):
    from tokenizers import Tokenizer

    corpus = texts(23, 5) + ["", "A much longer sentence " * 100]
    put_jsonl(root, "in/a.jsonl", [{"text": t, "key": f"k{i}"} for i, t in enumerate(corpus)])
    spec = spec_of(inputs=["in/a.jsonl"], shard_rows=6, max_tokens=max_tokens, id_field="key")
    planned = run_cpu(spec, root)
    ref = Tokenizer.from_file(str(layout.tokenizer_path()))
    ref.no_padding()
    ref.enable_truncation(max_length=max_tokens)
    cls_id, sep_id = ref.token_to_id("[CLS]"), ref.token_to_id("[SEP]")
    got_ids, got_rows, got_keys = [], [], []
    for k in range(planned["shards"]):
        sh = decode_shard(store.get(layout.pre_uri(root, JOB, planned["config_hash"], k)))
        assert sh["input_ids"].dtype == np.int32 and sh["offsets"].dtype == np.int64
        off = sh["offsets"]
        got_ids += [sh["input_ids"][off[r] : off[r + 1]].tolist() for r in range(len(off) - 1)]
        got_rows += sh["row_index"].tolist()
        got_keys += sh["ids"].tolist()
    assert got_rows == list(range(len(corpus))) and got_keys == [f"k{i}" for i in range(len(corpus))]
    for text, ids in zip(corpus, got_ids, strict=True):
        assert ids == ref.encode(text).ids
        assert ids[0] == cls_id and ids[-1] == sep_id and len(ids) <= max_tokens
    assert len(got_ids[-1]) == max_tokens  # the long row was truncated
    assert load_tokenizer(max_tokens).encode("héllo").ids == ref.encode("héllo").ids


def test_preprocess_parquet_row_groups_and_default_ids(root):
    corpus = texts(30, 7)
    put_parquet(root, "p.parquet", pa.table({"text": corpus, "n": list(range(30))}), row_group_size=4)
    spec = spec_of(inputs=["p.parquet"], shard_rows=7)
    planned = run_cpu(spec, root)
    ref = load_tokenizer(256)
    flat = []
    for k in range(planned["shards"]):
        sh = decode_shard(store.get(layout.pre_uri(root, JOB, planned["config_hash"], k)))
        assert sh["ids"].tolist() == sh["row_index"].tolist()  # default id: the row number
        off = sh["offsets"]
        flat += [sh["input_ids"][off[r] : off[r + 1]].tolist() for r in range(len(off) - 1)]
    assert flat == [e.ids for e in ref.encode_batch(corpus)]


def test_preprocess_keeps_an_existing_shard(root):
    put_jsonl(root, "a.jsonl", [{"text": t} for t in texts(5)])
    spec = spec_of(inputs=["a.jsonl"])
    run_cpu(spec, root)
    assert pipeline.preprocess(spec, JOB, root, 0) == {"shard": 0, "cached": True}


# ---------------------------------------------------------------------------------------------- bad input


def test_empty_file_fails_naming_it(root):
    put_jsonl(root, "good.jsonl", [{"text": "x"}])
    store.put(store.uri.join(root, "empty.jsonl"), b"\n \n")
    with pytest.raises(BadInputError, match=r"inputs\.1 empty\.jsonl: the file is empty"):
        pipeline.prepare(spec_of(inputs=["good.jsonl", "empty.jsonl"]), JOB, root)
    put_parquet(root, "empty.parquet", pa.table({"text": pa.array([], pa.string())}), 10)
    with pytest.raises(BadInputError, match="empty.parquet: the file is empty"):
        pipeline.prepare(spec_of(inputs=["empty.parquet"], on_bad_row="skip"), JOB, root)
    with pytest.raises(BadInputError, match="missing.jsonl: cannot read it"):
        pipeline.prepare(spec_of(inputs=["missing.jsonl"]), JOB, root)


def test_a_corrupt_parquet_file_fails_naming_it_without_arrow_internals(root):
    store.put(store.uri.join(root, "junk.parquet"), b"PAR1 this is not parquet at all" * 10)
    with pytest.raises(
        BadInputError, match=r"inputs\.0 junk\.parquet: not a readable Parquet file \("
    ) as err:
        pipeline.prepare(spec_of(inputs=["junk.parquet"]), JOB, root)
    assert "\n" not in str(err.value) and "Buffer" not in str(err.value)


BAD_LINES = {
    2: (b'{"text": "ok", ', "line 3: not JSON"),
    4: (b'{"text": "caf\xe9"}', "line 5: not UTF-8"),
    6: (b'{"other": "no text"}', "line 7: missing field 'text'"),
    8: (b'["text"]', "line 9: a JSON list, not an object"),
    10: (b'{"text": 42}', "line 11: field 'text' is a int, not a string"),
}


@pytest.mark.parametrize("at", sorted(BAD_LINES))
def test_bad_line_fails_with_file_and_line(root, at):
    line, message = BAD_LINES[at]
    put_jsonl(root, "in/bad.jsonl", [{"text": t} for t in texts(12)], raw_lines={at: line})
    spec = spec_of(inputs=["in/bad.jsonl"], shard_rows=5)
    planned = pipeline.prepare(spec, JOB, root)
    with pytest.raises(BadInputError, match="in/bad.jsonl " + message):
        for k in range(planned["shards"]):
            pipeline.preprocess(spec, JOB, root, k)


def test_skip_policy_drops_and_reports_bad_rows(root):
    good = texts(12, 9)
    raw = {at: line for at, (line, _) in BAD_LINES.items()}
    put_jsonl(root, "in/bad.jsonl", [{"text": t} for t in good], raw_lines=raw)
    put_parquet(root, "in/p.parquet", pa.table({"text": ["p0", None, "p2"]}), row_group_size=2)
    spec = spec_of(inputs=["in/bad.jsonl", "in/p.parquet"], shard_rows=4, on_bad_row="skip")
    run_cpu(spec, root)
    fake_worker(root)
    pipeline.reconcile(spec, JOB, root)
    result = pipeline.commit(spec, JOB, root)
    assert result["rows"] == 14 and result["skipped"] == 6
    manifest = json.loads(store.get(result["manifest"]))
    assert [(s["input"], s.get("line", s.get("row")), s["row_index"]) for s in manifest["skipped"]] == [
        ("in/bad.jsonl", 3, 2),
        ("in/bad.jsonl", 5, 4),
        ("in/bad.jsonl", 7, 6),
        ("in/bad.jsonl", 9, 8),
        ("in/bad.jsonl", 11, 10),
        ("in/p.parquet", 1, 18),
    ]
    table = read_output(result)
    kept = [r for r in range(20) if r not in {2, 4, 6, 8, 10, 18}]
    assert table.column("id").to_pylist() == kept
    assert [int(e[0]) for e in table.column("embedding").to_pylist()] == kept


def test_missing_parquet_column_and_missing_id(root):
    put_parquet(root, "p.parquet", pa.table({"body": ["a", "b"]}), 2)
    spec = spec_of(inputs=["p.parquet"])
    pipeline.prepare(spec, JOB, root)
    with pytest.raises(BadInputError, match=r"p.parquet: no column 'text'"):
        pipeline.preprocess(spec, JOB, root, 0)
    put_jsonl(root, "a.jsonl", [{"text": "a", "id": 1}, {"text": "b"}])
    spec = spec_of(inputs=["a.jsonl"], id_field="id")
    pipeline.prepare(spec, JOB, root)
    with pytest.raises(BadInputError, match=r"a.jsonl line 2: missing id field 'id'"):
        pipeline.preprocess(spec, JOB, root, 0)


# ---------------------------------------------------------------------------------- reconcile, commit


def test_commit_restores_input_order_from_out_of_order_outputs(root):
    corpus = texts(53, 11)
    put_jsonl(root, "a.jsonl", [{"text": t, "id": 1000 + i} for i, t in enumerate(corpus[:30])])
    put_parquet(root, "b.parquet", pa.table({"text": corpus[30:], "id": list(range(1030, 1053))}), 5)
    spec = spec_of(inputs=["a.jsonl", "b.parquet"], shard_rows=4, id_field="id")
    planned = run_cpu(spec, root)
    assert pipeline.reconcile(spec, JOB, root)["count"] == planned["shards"]
    fake_worker(root, order_seed=42)
    rec = pipeline.reconcile(spec, JOB, root)
    assert rec["count"] == 0 and store.get_json(rec["missing"]["uri"]) == []
    result = pipeline.commit(spec, JOB, root)
    assert (result["rows"], result["dim"], result["skipped"]) == (53, DIM, 0)
    table = read_output(result)
    assert table.schema.field("id").type == pa.int64()
    # one fixed-size vector per row (FLOAT[dim] in DuckDB), the model and width in the file's metadata
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), DIM)
    meta = {k.decode(): v.decode() for k, v in table.schema.metadata.items()}
    assert meta["shardfold.dim"] == str(DIM) and meta["shardfold.config_hash"] == result["config_hash"]
    assert meta["shardfold.model"] == json.loads(meta["shardfold.config"])["model"]
    assert table.column("id").to_pylist() == list(range(1000, 1053))
    emb = table.column("embedding").to_pylist()
    assert [int(e[0]) for e in emb] == list(range(53))
    ref = load_tokenizer(256).encode_batch(corpus)
    assert [int(e[1]) for e in emb] == [len(r.ids) for r in ref]
    assert pipeline.commit(spec, JOB, root) == result  # a retried commit returns the committed result
    assert store.get_json(store.uri.join(root, "jobs", JOB, "result.json")) == result


def test_reconcile_lists_exactly_the_shards_without_markers(root):
    put_jsonl(root, "a.jsonl", [{"text": t} for t in texts(40)])
    spec = spec_of(inputs=["a.jsonl"], shard_rows=4)
    run_cpu(spec, root)
    fake_worker(root, shards=[0, 2, 3, 5, 9])
    rec = pipeline.reconcile(spec, JOB, root)
    assert rec["count"] == 5 and rec["first"] == [1, 4, 6, 7, 8]
    assert store.get_json(rec["missing"]["uri"]) == [{"shard": k} for k in (1, 4, 6, 7, 8)]
    # an output without its marker is not committed
    h = layout.load_plan(root, JOB)["config_hash"]
    store.put(layout.out_uri(root, JOB, h, 1), b"partial")
    assert pipeline.reconcile(spec, JOB, root)["first"] == [1, 4, 6, 7, 8]
    with pytest.raises(
        pipeline.MissingShards, match=r"5 shard\(s\) still lack a commit marker .*: 1, 4, 6, 7, 8"
    ):
        pipeline.commit(spec, JOB, root)


def test_lineage_recomputes_only_the_lost_shard(root, tmp_path, monkeypatch):
    put_jsonl(root, "a.jsonl", [{"text": t} for t in texts(30)])
    spec = spec_of(inputs=["a.jsonl"], shard_rows=5)
    # the output of a clean run, in a store of its own (commit removes the job's scratch)
    clean = store.uri.join(f"file://{tmp_path}", "clean")
    store.put(store.uri.join(clean, "a.jsonl"), store.get(store.uri.join(root, "a.jsonl")))
    run_cpu(spec, clean)
    fake_worker(clean)
    first = read_output(pipeline.commit(spec, JOB, clean))
    run_cpu(spec, root)
    fake_worker(root)
    h = layout.load_plan(root, JOB)["config_hash"]

    # one output marker lost: only that shard is listed, and its CPU task is a no-op
    store.delete(layout.done_uri(root, JOB, h, 3))
    rec = pipeline.reconcile(spec, JOB, root)
    assert store.get_json(rec["missing"]["uri"]) == [{"shard": 3}]
    tokenized = []
    real = pipeline.encode_shard
    monkeypatch.setattr(
        pipeline, "encode_shard", lambda rows, *a: tokenized.append(rows.row_index[0]) or real(rows, *a)
    )
    for item in store.get_json(rec["missing"]["uri"]):
        assert pipeline.preprocess(spec, JOB, root, item["shard"])["cached"] is True
    assert tokenized == [] and fake_worker(root) == [3]

    # its preprocessed shard lost too: only that shard's CPU task (and GPU task) run again
    store.delete(layout.done_uri(root, JOB, h, 3))
    store.delete(layout.pre_uri(root, JOB, h, 3))
    rec = pipeline.reconcile(spec, JOB, root)
    assert store.get_json(rec["missing"]["uri"]) == [{"shard": 3}]
    before = {k: store.get(layout.pre_uri(root, JOB, h, k)) for k in (0, 1, 2, 4, 5)}
    for item in store.get_json(rec["missing"]["uri"]):
        assert pipeline.preprocess(spec, JOB, root, item["shard"])["cached"] is False
    assert tokenized == [15]  # shard 3 starts at row 15
    assert {k: store.get(layout.pre_uri(root, JOB, h, k)) for k in (0, 1, 2, 4, 5)} == before
    assert fake_worker(root) == [3]
    assert read_output(pipeline.commit(spec, JOB, root)).equals(first)


def test_string_ids_and_custom_output(root):
    put_jsonl(root, "a.jsonl", [{"text": "x", "id": "doc-1"}, {"text": "y", "id": "doc-2"}])
    spec = spec_of(inputs=["a.jsonl"], id_field="id", output="results/emb.parquet")
    run_cpu(spec, root)
    fake_worker(root)
    result = pipeline.commit(spec, JOB, root)
    assert result["output"] == store.uri.join(root, "results/emb.parquet")
    assert result["manifest"] == store.uri.join(root, "results/emb.manifest.json")
    assert read_output(result).column("id").to_pylist() == ["doc-1", "doc-2"]


def test_string_ids_after_integer_ones_make_every_id_a_string(root):
    """The merge streams row groups as it goes: a later shard's string ids restart it once, all strings."""
    rows = [{"text": "x", "id": 1}, {"text": "y", "id": 2}, {"text": "z", "id": "doc-3"}]
    put_jsonl(root, "a.jsonl", rows)
    spec = spec_of(inputs=["a.jsonl"], id_field="id", shard_rows=2)
    run_cpu(spec, root)
    fake_worker(root)
    result = pipeline.commit(spec, JOB, root)
    assert read_output(result).column("id").to_pylist() == ["1", "2", "doc-3"]


# --------------------------------------------------------------------------------- handlers, workflow


def test_handlers_and_workflow(root):
    from shardfold.functions.inference import handlers
    from shardfold.functions.kinds import WORKFLOWS
    from shardfold.functions.workflow import BatchJob, Parallel

    put_jsonl(root, "a.jsonl", [{"text": t} for t in texts(9)])
    spec = spec_of(inputs=["a.jsonl"], shard_rows=4)
    spec_uri = store.uri.join(root, "jobs", JOB, "spec.json")
    store.put(spec_uri, spec.model_dump_json().encode())
    state = {"job_id": JOB, "spec_uri": spec_uri, "store_root": root}
    planned = handlers.prepare(state)
    assert planned["shards"] == 3
    for i, item in enumerate(store.get_json(planned["worklist"]["uri"])):
        handlers.preprocess({**state, "item": item, "index": i})
    handlers.cpu_done(state)
    assert store.exists(layout.cpu_done_uri(root, JOB))
    fake_worker(root)
    clean = handlers.reconcile({**state, "prepare": planned})
    assert clean["count"] == 0 and clean["repair_workers"]["count"] == 0  # a clean run: no repair job
    assert handlers.commit(state)["rows"] == 9

    wf = WORKFLOWS["inference"]
    assert wf.lambda_package == "image"
    assert isinstance(wf.steps[1], Parallel) and [s.name for s in wf.steps] == [
        "prepare",
        "stages",
        "reconcile",
        "repair_preprocess",
        "repair_workers",
        "commit",
    ]
    assert {s.entry_point for s in wf.walk() if isinstance(s, BatchJob)} == {"inference.worker"}


def test_cpu_modules_import_no_torch():
    import ast
    from pathlib import Path

    pkg = Path(pipeline.__file__).parent
    for name in (
        "shards.py",
        "preprocess.py",
        "pipeline.py",
        "handlers.py",
        "sizing.py",
        "kind.py",
        "spec.py",
    ):
        tree = ast.parse((pkg / name).read_text())
        mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        mods |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not {m.split(".")[0] for m in mods} & {"torch", "transformers", "sentence_transformers"}, name


def test_parquet_over_ranged_reads(root, monkeypatch):
    """Non-local objects are read through RangedReader: same rows, only ranged GETs."""
    corpus = texts(20, 13)
    put_parquet(root, "p.parquet", pa.table({"text": corpus}), row_group_size=3)
    uri = store.uri.join(root, "p.parquet")
    reads = []
    real_get = store.get

    def get(u, start=0, length=None, pin=None):
        reads.append((start, length))
        return real_get(u, start, length, pin)

    monkeypatch.setattr(store, "get", get)
    r = layout.RangedReader(uri)
    assert pq.ParquetFile(r).read().column("text").to_pylist() == corpus
    assert reads and all(length is not None for _, length in reads)
    monkeypatch.setattr(layout, "_parquet_source", layout.RangedReader)
    assert layout.parquet_num_rows(uri) == 20
    spec = spec_of(inputs=["p.parquet"], shard_rows=6)
    planned = run_cpu(spec, root)
    sh = decode_shard(real_get(layout.pre_uri(root, JOB, planned["config_hash"], 2)))
    assert sh["row_index"].tolist() == list(range(12, 18))


def test_a_shard_whose_rows_are_all_skipped(root):
    put_jsonl(root, "a.jsonl", [{"text": "x"}, {"text": "y"}, {"no": 1}, {"no": 2}, {"text": "z"}])
    spec = spec_of(inputs=["a.jsonl"], shard_rows=2, on_bad_row="skip")
    planned = run_cpu(spec, root)
    empty = decode_shard(store.get(layout.pre_uri(root, JOB, planned["config_hash"], 1)))
    assert empty["offsets"].tolist() == [0] and len(empty["input_ids"]) == len(empty["ids"]) == 0
    assert [s["line"] for s in empty["skipped"]] == [3, 4]
    fake_worker(root)
    result = pipeline.commit(spec, JOB, root)
    assert (result["rows"], result["skipped"], result["dim"]) == (3, 2, DIM)
    assert read_output(result).column("id").to_pylist() == [0, 1, 4]


def test_progress_counts_the_input_rows_of_the_shards_embedded(root):
    # the GPU stage in the user's units: rows (skipped ones included, as the plan counts them), beside shards
    put_jsonl(root, "a.jsonl", [{"text": "x"}, {"text": "y"}, {"no": 1}, {"no": 2}, {"text": "z"}])
    spec = spec_of(inputs=["a.jsonl"], shard_rows=2, on_bad_row="skip")
    assert pipeline.progress(root, JOB) == {}
    run_cpu(spec, root)
    fake_worker(root, shards=[2])
    assert pipeline.progress(root, JOB) == {
        "embedded_shards": {"done": 1, "total": 3},
        "embedded_rows": {"done": 1, "total": 5, "unit": "rows"},
    }
    fake_worker(root)
    pipeline.commit(spec, JOB, root)  # the scratch is gone: from the result (3 rows out, 2 skipped)
    assert pipeline.progress(root, JOB) == {
        "embedded_shards": {"done": 3, "total": 3},
        "embedded_rows": {"done": 5, "total": 5, "unit": "rows"},
    }


def test_commit_removes_the_scratch_and_a_retried_commit_too(root):
    put_jsonl(root, "a.jsonl", [{"text": t} for t in texts(12)])
    spec = spec_of(inputs=["a.jsonl"], shard_rows=5)
    run_cpu(spec, root)
    fake_worker(root)
    result = pipeline.commit(spec, JOB, root)
    assert not store.list_uris(layout.job_root(root, JOB) + "/")  # shards, markers, claims, reports
    assert read_output(result).num_rows == 12 and pipeline.progress(root, JOB)["embedded_shards"]["done"] == 3
    # a crash between the result and the cleanup: the retried commit keeps the result and cleans up
    store.put(store.uri.join(layout.job_root(root, JOB), "pre", "x.npz"), b"left over")
    assert pipeline.commit(spec, JOB, root) == result
    assert not store.list_uris(layout.job_root(root, JOB) + "/")
