"""dpquery's data path and measurement math, without a workflow: reading CSV/Parquet and mapping domains
(errors name the column and the count, never a value), one-pass marginals, the orthonormal residual
transform, OpenDP's privacy map, exact reconstruction with the noise seam, Monte Carlo unbiasedness and
variance on the reference case, the ledger (also under racing threads), and the no-numpy-random lint."""

from __future__ import annotations

import ast
import io
import math
import threading
from fractions import Fraction
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import examples

from shardfold.functions import ledger
from shardfold.functions.dpquery import data, planner
from shardfold.functions.dpquery import measure as mz
from shardfold.functions.dpquery import reconstruct as rc
from shardfold.functions.dpquery.spec import DPAttribute
from shardfold.functions.errors import BudgetExceeded, DatasetError, PlanError, SpecError

SECRET = "SSN-123-45-6789"  # planted in bad rows: no error message may ever contain it


def attrs_abc() -> list[DPAttribute]:
    return [
        DPAttribute(name="a", categories=["x", "y"]),
        DPAttribute(name="b", categories=[0, 1, 2]),
        DPAttribute(name="c", range=(18, 60), bin_width=10),
    ]


def table_abc(n: int, seed: int = 0) -> tuple[pa.Table, np.ndarray]:
    rng = np.random.default_rng(seed)
    a, b, c = rng.integers(0, 2, n), rng.integers(0, 3, n), rng.integers(18, 61, n)
    t = pa.table({"a": np.array(["x", "y"])[a], "b": b, "c": c, "extra": np.zeros(n)})
    idx = np.stack([a, b, (c - 18) // 10])
    return t, idx


def write(tmp_path: Path, t: pa.Table, fmt: str) -> str:
    path = tmp_path / f"d.{fmt}"
    if fmt == "parquet":
        pq.write_table(t, path, row_group_size=700)
    else:
        pcsv.write_csv(t, path)
    return f"file://{path}"


def true_marginal(idx: np.ndarray, sizes: list[int], attrs: tuple[int, ...]) -> np.ndarray:
    full = np.zeros(sizes, dtype=np.int64)
    np.add.at(full, tuple(idx), 1)
    drop = tuple(i for i in range(len(sizes)) if i not in attrs)
    return full.sum(axis=drop) if drop else full


# --- reading and domains ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_marginals_match_numpy_in_small_batches(tmp_path, fmt, monkeypatch):
    monkeypatch.setattr(data, "BATCH_ROWS", 256)  # many record batches
    monkeypatch.setattr(data, "CSV_BLOCK_BYTES", 4096)
    t, idx = table_abc(3000)
    uri = write(tmp_path, t, fmt)
    attrs = attrs_abc()
    assert data.scan(uri, fmt, attrs) is None  # it returns nothing about the rows
    wanted = [(), (0,), (2,), (0, 1), (1, 2), (0, 1, 2)]
    got = data.marginals(uri, fmt, attrs, wanted)
    sizes = [2, 3, 5]
    for tpl in wanted:
        assert np.array_equal(got[tpl], true_marginal(idx, sizes, tpl)), tpl
    assert got[()].shape == () and int(got[()]) == 3000


def test_maximal_covers():
    assert data.maximal([(0,), (0, 1), (1,), (2,), (), (1, 2), (0, 1)]) == [(0, 1), (1, 2)]


def test_category_text_matching_and_range_parsing(tmp_path):
    t = pa.table(
        {
            "flag": pa.array([True, False, True]),
            "code": pa.array([7, 7, 12]),  # integers matched to string/int categories by their text
            "level": pa.array(["low", "high", "low"]).dictionary_encode(),
            "age": pa.array([" 19", "+20", "21"]),  # integer text, with sign and spaces
            "score": pa.array([1.0, 2.0, 3.0]),  # integral floats in a range
        }
    )
    uri = write(tmp_path, t, "parquet")
    attrs = [
        DPAttribute(name="flag", categories=[False, True]),
        DPAttribute(name="code", categories=["7", 12]),
        DPAttribute(name="level", categories=["high", "low"]),
        DPAttribute(name="age", range=(19, 22)),
        DPAttribute(name="score", range=(0, 3), bin_width=2),
    ]
    got = data.marginals(uri, "parquet", attrs, [(0,), (1,), (2,), (3,), (4,)])
    assert got[(0,)].tolist() == [1, 2]
    assert got[(1,)].tolist() == [2, 1]
    assert got[(2,)].tolist() == [1, 2]
    assert got[(3,)].tolist() == [1, 1, 1, 0]
    assert got[(4,)].tolist() == [1, 2]
    # the same through CSV, where every column is read as text
    uri_csv = write(tmp_path, t.set_column(2, "level", pa.array(["low", "high", "low"])), "csv")
    got_csv = data.marginals(uri_csv, "csv", attrs, [(0,), (1,), (2,), (3,), (4,)])
    for k in got:
        assert np.array_equal(got[k], got_csv[k]), k


def with_bad_values(n: int = 500) -> tuple[pa.Table, np.ndarray]:
    """table_abc(n) with 10 rows of 'a' holding a secret category and 5 rows of 'c' out of range (99 and
    -5) or missing; the domain indices of the untouched values (−1 where a value is bad)."""
    t, idx = table_abc(n)
    idx = idx.copy()
    a = t.column("a").to_pylist()
    c = t.column("c").to_pylist()
    for i in range(0, n, 50):
        a[i] = SECRET
        idx[0, i] = -1
    for i in range(3, n, 100):
        c[i] = 99 if i < 200 else (-5 if i < 300 else None)
        idx[2, i] = -1
    t = t.set_column(0, "a", pa.array(a)).set_column(2, "c", pa.array(c, pa.int64()))
    return t, idx


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_drop_leaves_the_record_out_of_every_marginal_and_never_fails(tmp_path, fmt):
    t, idx = with_bad_values()
    uri = write(tmp_path, t, fmt)
    assert data.scan(uri, fmt, attrs_abc()) is None  # no error, no count
    keep = (idx >= 0).all(axis=0)
    wanted = [(), (0,), (1,), (2,), (0, 2)]
    got = data.marginals(uri, fmt, attrs_abc(), wanted)
    for tpl in wanted:  # every marginal counts the same records: those in the domain on every attribute
        assert np.array_equal(got[tpl], true_marginal(idx[:, keep], [2, 3, 5], tpl)), tpl
    # the total alone (no column used) still reads the dropping columns
    assert int(data.marginals(uri, fmt, attrs_abc(), [()])[()]) == int(keep.sum())


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_clip_moves_out_of_range_integers_to_the_end_bins(tmp_path, fmt):
    t, idx = with_bad_values()
    c = t.column("c").to_pylist()
    uri = write(tmp_path, t, fmt)
    attrs = attrs_abc()
    attrs[2] = DPAttribute(name="c", range=(18, 60), bin_width=10, out_of_domain="clip")
    attrs[0] = DPAttribute(name="a", categories=["x", "y"], out_of_domain="other")
    got = data.marginals(uri, fmt, attrs, [(2,), (0, 2)])
    want_c = np.zeros(5, dtype=np.int64)
    for v in c:
        if v is not None:  # a missing value cannot be clipped: its record is dropped
            want_c[(min(max(v, 18), 60) - 18) // 10] += 1
    assert got[(2,)].tolist() == want_c.tolist()
    assert got[(0, 2)].shape == (3, 5) and got[(0, 2)][2].sum() == 10  # the secret category is "other"
    with pytest.raises(Exception, match="'clip' applies to a 'range'"):
        DPAttribute(name="a", categories=["x", "y"], out_of_domain="clip")


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_other_counts_bad_values_in_an_extra_category(tmp_path, fmt):
    t, idx = with_bad_values()
    uri = write(tmp_path, t, fmt)
    attrs = [DPAttribute(**a.model_dump(exclude_none=True), out_of_domain="other") for a in attrs_abc()]
    assert [a.size for a in attrs] == [3, 4, 6]
    assert attrs[0].labels() == ["x", "y", "(other)"] and attrs[2].labels()[-1] == "(other)"
    got = data.marginals(uri, fmt, attrs, [(), (0,), (2,)])
    assert int(got[()]) == 500  # nothing dropped
    assert got[(0,)][2] == 10 and got[(2,)][5] == 5
    assert np.array_equal(got[(0,)][:2], np.bincount(idx[0][idx[0] >= 0], minlength=2))


def test_the_job_default_and_per_attribute_overrides():
    from shardfold.functions.dpquery.spec import DPQuerySpec

    doc = {
        "dataset": "file:///tmp/x.csv",
        "schema": [
            {"name": "a", "categories": ["x", "y"]},
            {"name": "c", "range": [0, 9], "out_of_domain": "drop"},
        ],
        "workload": [{"attributes": ["a", "c"]}],
        "budget": {"rho": 0.1},
        "dataset_id": "d",
        "out_of_domain": "other",
    }
    spec = DPQuerySpec.model_validate(doc)
    assert [a.policy for a in spec.attributes] == ["other", "drop"] and spec.domains() == [3, 10]
    assert "out_of_domain" not in spec.model_dump(exclude_none=True)["schema"][0]  # inherited, not dumped
    assert DPQuerySpec.model_validate({**doc, "out_of_domain": "drop"}).domains() == [2, 10]
    with pytest.raises(ValueError, match="applies only to ranges"):
        DPQuerySpec.model_validate({**doc, "out_of_domain": "clip"})
    other = {**doc, "schema": [{"name": "a", "categories": ["x", "(other)"]}, doc["schema"][1]]}
    with pytest.raises(ValueError, match="label of the out-of-domain category"):
        DPQuerySpec.model_validate(other)


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_missing_column_is_named(tmp_path, fmt):
    t, _ = table_abc(50)
    uri = write(tmp_path, t.drop_columns(["b"]), fmt)
    with pytest.raises(DatasetError, match="no column 'b'") as err:
        data.scan(uri, fmt, attrs_abc())
    assert err.value.missing == ["b"]


def test_malformed_csv_rows_are_skipped_never_fatal(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_bytes(
        b"a,b,c\nx,1,20\n"
        + f"y,2,{SECRET},extra\nx,2\n".encode()  # a field too many, one too few
        + b"y,\xff\xfe,30\n"  # not UTF-8: out of domain, not a failure
        + b"y,\xff,31,\xfe\n"  # malformed AND not UTF-8 (pyarrow's row handler decodes the row)
        + b"NA,0, 45 \n,1,20\ny,1,+19\n"  # "NA" is text, an empty field is missing, spaces and "+" parse
    )
    uri = f"file://{path}"
    assert data.scan(uri, "csv", attrs_abc()) is None
    got = data.marginals(uri, "csv", attrs_abc(), [(), (0, 1, 2)])
    assert int(got[()]) == 2  # x,1,20 and y,1,+19
    other = [DPAttribute(**a.model_dump(exclude_none=True), out_of_domain="other") for a in attrs_abc()]
    got = data.marginals(uri, "csv", other, [(), (0,), (1,), (2,)])
    assert int(got[()]) == 5  # the three malformed lines are skipped under every policy
    assert got[(0,)].tolist() == [1, 2, 2] and got[(1,)].tolist() == [1, 3, 0, 1]
    assert got[(2,)].tolist() == [3, 1, 1, 0, 0, 0]


def test_a_file_that_is_not_parquet_fails_without_quoting_it(tmp_path):
    path = tmp_path / "junk.parquet"
    path.write_bytes(b"PAR1" + SECRET.encode() * 10)
    with pytest.raises(DatasetError, match="details withheld") as err:
        data.scan(f"file://{path}", "parquet", attrs_abc())
    assert SECRET not in str(err.value)


def test_parquet_column_types_are_checked_from_the_schema(tmp_path):
    t = pa.table({"a": pa.array([1.5, 2.5]), "b": pa.array([[1], [2]]), "c": pa.array([None, None])})
    uri = write(tmp_path, t, "parquet")
    with pytest.raises(DatasetError, match="column 'b' has type list"):
        data.scan(uri, "parquet", attrs_abc())
    ok = pa.table({"a": pa.array([None, None], pa.string()), "b": [1, 2], "c": pa.array([None, None])})
    uri = write(tmp_path, ok, "parquet")  # an all-null column is missing values, not an error
    assert data.scan(uri, "parquet", attrs_abc()) is None
    assert int(data.marginals(uri, "parquet", attrs_abc(), [()])[()]) == 0


def test_the_value_by_value_fallback_agrees_with_the_vectorised_mapping():
    texts = ["x", "y", None, "7", " 19", "+20", "-3", "20.5", "1e3", "", "\ufffd", "99999999999999999999"]
    for attr in [
        DPAttribute(name="v", categories=["x", "y", 7]),
        DPAttribute(name="v", range=(18, 30), bin_width=3),
        DPAttribute(name="v", range=(18, 30), out_of_domain="clip"),
        DPAttribute(name="v", range=(-5, 30), out_of_domain="other"),
    ]:
        d = data.Domain(attr)
        for arr in [
            pa.array(texts),
            pa.array([1, 7, None, 25, -(2**63), 2**63 - 1]),
            pa.array([1.0, 19.0, float("nan"), float("inf"), 20.5, None, 1e30]),
            pa.array([2**64 - 1, 3, 19], pa.uint64()),
        ]:
            assert d.indices(arr).tolist() == d._slow(arr).tolist(), (attr, arr)


def test_a_line_longer_than_a_block_is_read_not_called_malformed(tmp_path, monkeypatch):
    # blocks of 1 KiB, growing to 64 KiB: a 20 KB line after 500 rows restarts the read with larger blocks,
    # and the rows already counted are skipped, never counted twice
    monkeypatch.setattr(data, "CSV_BLOCK_BYTES", 1024)
    monkeypatch.setattr(data, "HEADER_BLOCK_BYTES", 64)
    rows = [f"{'xyz'[i % 3]},{i % 4},{i % 30}" for i in range(1000)]
    path = tmp_path / "long.csv"
    path.write_text(
        "a,b,c,note\n" + "\n".join(r + ("," + "n" * 20_000 if i == 500 else ",") for i, r in enumerate(rows))
    )
    got = [b for b in data.record_batches(f"file://{path}", "csv", ["a", "c"])]
    assert sum(b.num_rows for b in got) == 1000
    assert pa.Table.from_batches(got).column("c").to_pylist() == [str(i % 30) for i in range(1000)]
    monkeypatch.setattr(data, "MAX_CSV_BLOCK_BYTES", 4096)  # a line over the cap: a clear error, no row
    with pytest.raises(DatasetError, match="no line over") as err:
        list(data.record_batches(f"file://{path}", "csv", ["a", "c"]))
    assert "nnnn" not in str(err.value)


def test_a_wide_csv_header_is_read_without_inferring_every_column(tmp_path):
    # 10^5 columns (a 600 KB header, longer than the first read): the names come from the csv module
    names = ["a", "b", "c"] + [f"x{i}" for i in range(100_000)]
    path = tmp_path / "wide.csv"
    path.write_text(",".join(names) + "\n" + "x,1,20," + ",".join("0" for _ in range(100_000)) + "\n")
    assert data.column_names(f"file://{path}", "csv") == names
    data.scan(f"file://{path}", "csv", attrs_abc())
    quoted = tmp_path / "quoted.csv"
    quoted.write_text('"a","b ""two""","c\nd"\n1,2,3\n')  # quotes and a newline inside a name
    assert data.column_names(f"file://{quoted}", "csv") == ["a", 'b "two"', "c\nd"]
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(DatasetError, match="empty"):
        data.column_names(f"file://{empty}", "csv")


def test_missing_dataset(tmp_path):
    with pytest.raises(Exception, match="does not exist"):
        data.scan(f"file://{tmp_path}/nope.csv", "csv", attrs_abc())


def test_store_file_reads_parquet_by_ranges(tmp_path):
    t, _ = table_abc(2000)
    uri = write(tmp_path, t, "parquet")
    with io.BufferedReader(data.StoreFile(uri), buffer_size=1024) as f:
        back = pq.ParquetFile(f).read()
    assert back.equals(pq.read_table(uri[len("file://") :]))


def test_ambiguous_categories_are_refused():
    with pytest.raises(DatasetError, match="both match the text '1'"):
        data.Domain(DPAttribute(name="v", categories=["1", 1]))


# --- the residual transform and the sampler --------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 5, 10, 37])
def test_contrasts_are_orthonormal_and_orthogonal_to_ones(n):
    e = mz.contrasts(n)
    assert e.shape == (n - 1, n)
    assert np.allclose(e @ e.T, np.eye(n - 1), atol=1e-14)
    assert np.allclose(e @ np.ones(n), 0, atol=1e-14)
    assert np.allclose(e.T @ e, np.eye(n) - 1.0 / n, atol=1e-14)


def test_mode_wise_transform_equals_the_kronecker_product():
    rng = np.random.default_rng(3)
    x = rng.integers(0, 9, size=(2, 3, 4)).astype(float)
    kron = np.kron(np.kron(mz.contrasts(2), mz.contrasts(3)), mz.contrasts(4))
    assert np.allclose(mz.residual(x), kron @ x.reshape(-1), atol=1e-12)
    assert mz.residual(np.array(17)).tolist() == [17.0]


@pytest.mark.parametrize("sizes", [(), (2,), (3, 3), (2, 3, 4), (10, 10, 10), (7, 2, 9, 5)])
def test_sensitivity_rounds_up_and_is_attained(sizes):
    p = Fraction(1)
    for n in sizes:
        p *= Fraction(n - 1, n)
    d = mz.l2_sensitivity(sizes)
    assert Fraction(d) ** 2 >= p and Fraction(math.nextafter(d, 0)) ** 2 < p
    if sizes:  # a record's column of E_S has squared norm exactly p_S
        col = np.zeros(sizes)
        col[(0,) * len(sizes)] = 1
        assert math.isclose(float(np.sum(mz.residual(col) ** 2)), float(p), rel_tol=1e-12)


def test_opendp_map_is_the_ideal_rho_up_to_rounding():
    for sizes, scale in [((2, 3, 4), 1.3), ((10, 10), 0.07), ((), 25.0)]:
        d_in = mz.l2_sensitivity(sizes)
        ideal = d_in**2 / (2 * scale**2)
        k = math.prod(n - 1 for n in sizes)
        value = mz.privacy_map(k, scale, d_in)
        assert ideal * (1 - 1e-12) <= value <= ideal * (1 + 1e-12)


def test_measure_refuses_before_drawing_when_the_map_exceeds_the_plan(monkeypatch):
    def no_draw(*a, **k):
        raise AssertionError("noise was drawn")

    monkeypatch.setattr(mz, "release", no_draw)
    s = mz.SetSpec(index=3, attrs=(0,), sizes=(3,), scale=1.0, rho_planned=0.3)  # map: (2/3)/2 = 0.333
    with pytest.raises(PlanError, match="residual set 3"):
        mz.measure_sets([s], lambda attrs: np.array([1, 2, 3]))


def test_measure_records_the_sampler_map():
    s = mz.SetSpec(index=0, attrs=(0, 1), sizes=(2, 3), scale=2.0, rho_planned=1 / 3 / 8 * (1 + 1e-12))
    values, records = mz.measure_sets([s], lambda attrs: np.arange(6).reshape(2, 3))
    assert values.shape == (2,) and records[0]["index"] == 0
    assert math.isclose(records[0]["rho"], (1 / 3) / 8, rel_tol=1e-12)
    blob = mz.encode(values, {"sets": [[0, 2.0, records[0]["d_in"], records[0]["rho"]]]})
    assert np.array_equal(mz.decode_values(blob[:16]), values)
    assert mz.decode_trailer(blob[16:])["sets"][0][3] == records[0]["rho"]


# --- reconstruction -------------------------------------------------------------------------------------


def _exact_roundtrip(sizes: list[int], workload: list[tuple[int, ...]], seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 1000, size=sizes)
    pl = planner.plan(domains=sizes, workload=workload, rho=1.0)

    def marg(attrs):
        drop = tuple(i for i in range(len(sizes)) if i not in attrs)
        return x.sum(axis=drop) if drop else x

    sets = [
        mz.SetSpec(k, pl.residual(k), tuple(sizes[a] for a in pl.residual(k)), 1.0, float(pl.rho_s[k]))
        for k in range(pl.num_residuals)
    ]
    values, _ = mz.measure_sets(sets, marg, noise=False)
    off = np.concatenate([[0], np.cumsum(pl.noise_count)])
    for j in range(pl.num_marginals):
        a = pl.marginal(j)
        terms = [(pl.residual(k), values[off[k] : off[k + 1]]) for k in pl.subsets(j)]
        est = rc.reconstruct([sizes[i] for i in a], a, terms)
        truth = marg(a)
        assert np.max(np.abs(est - truth)) <= 1e-9 * max(1.0, float(np.max(truth))), a


def test_exact_without_noise_on_the_reference_case():
    _exact_roundtrip([2, 3, 4], [(0,), (0, 1), (1, 2)], seed=0)
    _exact_roundtrip([5, 2, 3, 2], [(0, 1, 2, 3), (1,), (0, 3)], seed=1)


@settings(max_examples=examples(25), deadline=None)
@given(
    sizes=st.lists(st.integers(2, 5), min_size=1, max_size=4),
    data_=st.data(),
)
def test_exact_without_noise_for_random_workloads(sizes, data_):
    d = len(sizes)
    subsets = st.lists(st.integers(0, d - 1), unique=True, max_size=d).map(lambda v: tuple(sorted(v)))
    workload = data_.draw(st.lists(subsets, min_size=1, max_size=4, unique=True))
    _exact_roundtrip(sizes, workload, seed=d)


@pytest.mark.slow  # end to end: a job, a model or child processes
def test_monte_carlo_unbiased_with_the_predicted_variance():
    """Reference case (dp-query.md §2.6, §7): domains [2,3,4], W = {(0),(0,1),(1,2)}, 2ρ = 1. R runs, each
    with noise from OpenDP's sampler (R draws per residual set in one call); Bonferroni bounds of §7."""
    runs = 4000
    sizes = [2, 3, 4]
    pl = planner.plan(domains=sizes, workload=[(0,), (0, 1), (1, 2)], rho=0.5)
    assert np.allclose(pl.var, [3.6269, 1.9102, 1.5383], atol=1e-4)
    rng = np.random.default_rng(7)
    x = rng.integers(0, 30, size=sizes)

    def marg(attrs):
        drop = tuple(i for i in range(3) if i not in attrs)
        return x.sum(axis=drop) if drop else x

    draws = {}
    for k in range(pl.num_residuals):
        s = pl.residual(k)
        y = mz.residual(marg(s))
        noisy, _ = mz.release(
            np.tile(y, runs), math.sqrt(float(pl.sigma2[k])), mz.l2_sensitivity([sizes[a] for a in s])
        )
        draws[k] = noisy.reshape(runs, y.size)
    for j in range(pl.num_marginals):
        a = pl.marginal(j)
        shape = [sizes[i] for i in a]
        est = np.stack(
            [
                rc.reconstruct(shape, a, [(pl.residual(k), draws[k][r]) for k in pl.subsets(j)])
                for r in range(runs)
            ]
        )
        truth = marg(a)
        v = float(pl.var[j])
        z = np.abs(est.mean(axis=0) - truth) / math.sqrt(v / runs)
        assert z.max() < 5, (a, z.max())
        emp = est.var(axis=0, ddof=1)
        assert np.all(np.abs(emp - v) < 5 * v * math.sqrt(2 / runs)), (a, emp, v)


# --- ledger -------------------------------------------------------------------------------------------------


def test_ledger_opens_reserves_refuses_and_spends(tmp_path):
    root = f"file://{tmp_path}"
    with pytest.raises(SpecError, match="must give 'dataset_budget_rho'"):
        ledger.reserve(root, "census", "job-1", 0.4)
    assert ledger.reserve(root, "census", "job-1", 0.4, total_rho=1.0)["remaining_rho"] == pytest.approx(0.6)
    assert ledger.reserve(root, "census", "job-1", 0.4)["jobs"] == 1  # idempotent: a retried plan
    with pytest.raises(SpecError, match="differs from the total 1.0"):
        ledger.reserve(root, "census", "job-2", 0.1, total_rho=2.0)
    ledger.reserve(root, "census", "job-2", 0.5)
    with pytest.raises(BudgetExceeded, match="exceeds the remaining budget"):
        ledger.reserve(root, "census", "job-3", 0.2)
    ledger.spend(root, "census", "job-1", 0.3999999996)
    ledger.spend(root, "census", "job-1", 0.3999999996)  # idempotent
    state = ledger.read(root, "census")
    assert [e["type"] for e in state.entries] == ["open", "reserve", "reserve", "spend"]
    assert state.committed() == pytest.approx(0.8999999996)
    ledger.reserve(root, "census", "job-3", 0.1)  # fits: the spend released the slack... and 0.1 remained
    with pytest.raises(Exception, match="more than its reservation"):
        ledger.spend(root, "census", "job-2", 0.6)


def test_ledger_under_racing_jobs(tmp_path):
    """24 jobs race to reserve 0.1 each on a total of 1.0 (and race to open the ledger): exactly 10 win,
    every reservation is on the ledger once, and the sum never exceeds the total."""
    root = f"file://{tmp_path}"
    barrier = threading.Barrier(24)
    won, refused, errors = [], [], []

    def job(i: int) -> None:
        barrier.wait()
        try:
            for _ in range(2):  # a retry of the same job must not reserve twice
                ledger.reserve(root, "race", f"job-{i}", 0.1, total_rho=1.0)
            won.append(i)
        except BudgetExceeded:
            refused.append(i)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=job, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    state = ledger.read(root, "race")
    assert len(won) == 10 and len(refused) == 14
    assert sorted(state.reserved) == sorted(f"job-{i}" for i in won)
    assert [e["type"] for e in state.entries].count("open") == 1
    assert len(state.entries) == 11 and state.committed() <= 1.0


# --- safety lint --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("module", ["measure.py", "core.py", "data.py", "reconstruct.py", "smasher.py"])
def test_no_numpy_or_stdlib_random_in_the_measure_path(module):
    path = Path(data.__file__).with_name(module)
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            assert not any(a.name.split(".")[0] in ("random", "secrets") for a in node.names), module
            assert not any(a.name.startswith("numpy.random") for a in node.names), module
        if isinstance(node, ast.ImportFrom):
            assert (node.module or "").split(".")[0] not in ("random", "secrets"), module
            assert not (node.module or "").startswith("numpy.random"), module
            assert not (node.module == "numpy" and any(a.name == "random" for a in node.names)), module
        if isinstance(node, ast.Attribute):
            assert node.attr != "random", f"{module}: .random attribute at line {node.lineno}"
