"""Secure aggregation (``"secure": true`` and ``client.fedavg.mask_update``): the masks cancel exactly in the
sum, one masked update is uniform mod 2³², the job's mean equals the dequantised plain sum bit for bit on both
executors, a missing client fails the round, and bad input is refused naming what is wrong."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from shardfold.client import Client
from shardfold.client import secagg as masks
from shardfold.client.fedavg import UpdateError
from shardfold.functions import store
from shardfold.functions.errors import InvalidModelFile, ObjectNotFound, SpecError
from shardfold.functions.fedavg import core, secagg
from shardfold.functions.fedavg.spec import FedAvgSpec
from shardfold.functions.specs import parse_spec

JOB = "fedavg-20260101T000000-5ec5ec"
CLIP = 4.0


@pytest.fixture
def client(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "home"))
    with Client() as c:
        yield c


def updates(n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {
            "w": rng.standard_normal((64, 48)).astype(np.float32),
            "b": rng.standard_normal(48).astype(np.float32),
            "e": rng.standard_normal(32).astype(ml_dtypes.bfloat16),
        }
        for _ in range(n)
    ]


def secure_round(client: Client, ups: list, prefix: str = "rounds/s") -> list[str]:
    """Every client publishes its key, then masks and uploads its update (seeded rounding)."""
    ids = [f"c{i}" for i in range(len(ups))]
    keys = {cid: client.fedavg.secure_keys(prefix, cid) for cid in ids}
    return [
        client.fedavg.mask_update(
            u, f"{prefix}/{cid}.safetensors", round_prefix=prefix, client_id=cid,
            private_key=keys[cid], roster=ids, clip_range=CLIP, seed=i,
        )
        for i, (cid, u) in enumerate(zip(ids, ups, strict=True))
    ]  # fmt: skip


def quantised(ups: list, n: int) -> list[np.ndarray]:
    """Each update's quantised values, flat in tensor-name order, with the seeds secure_round used."""
    t = secagg.scale(n)
    out = []
    for i, u in enumerate(ups):
        rng = np.random.default_rng(i)
        out.append(
            np.concatenate(
                [secagg.quantise(u[k].astype(np.float64).ravel(), CLIP, t, rng) for k in sorted(u)]
            )
        )
    return out


def run(spec: FedAvgSpec, root: str, job_id: str = JOB) -> dict:
    planned = core.prepare(spec, job_id, root)
    for item in store.get_json(planned["worklist"]["uri"]):
        core.aggregate(spec, job_id, root, item["shard"])
    return core.commit(spec, job_id, root, planned["shards"])


def test_the_masks_cancel_and_the_job_returns_the_dequantised_plain_sum(client):
    ups = updates(4)
    uris = secure_round(client, ups)
    masked = [np.concatenate([client.fedavg.load(u)[k].ravel() for k in sorted(ups[0])]) for u in uris]
    plain = quantised(ups, 4)
    total = np.zeros_like(plain[0])
    for m in masked:
        np.add(total, m, out=total)
    want_total = np.zeros_like(plain[0])
    for q in plain:
        np.add(want_total, q, out=want_total)
    assert total.dtype == np.uint32 and np.array_equal(total, want_total)  # the masks cancel exactly
    assert not any(np.array_equal(m, q) for m, q in zip(masked, plain, strict=True))  # and each one masks

    result = run(FedAvgSpec(clients=[{"uri": u} for u in uris], secure=True), client.store_root)
    out = client.fedavg.load(result["output"])
    params = secagg.RoundParams.from_json(client.fedavg.metadata(uris[0])[secagg.METADATA_KEY])
    mean = secagg.dequantise(want_total, params, 4).astype(np.float32)
    at = 0
    for k in sorted(ups[0]):
        size = ups[0][k].size
        assert out[k].dtype == np.float32 and out[k].shape == ups[0][k].shape
        assert out[k].ravel().tobytes() == mean[at : at + size].tobytes(), k
        at += size
        # and close to the plain float mean: within one quantisation step (rounding is unbiased)
        exact = np.mean([u[k].astype(np.float64) for u in ups], axis=0)
        assert np.abs(out[k] - exact).max() <= CLIP / params.scale * 1.01 + 1e-6
    assert result["dtypes"] == {"F32": 3} and result["clients"] == 4


def test_one_masked_update_is_uniform_mod_2_32(client):
    """Its 8 top bits and 8 low bits are uniform over 256 values (chi-square, 255 degrees of freedom);
    the quantised update alone is far from it."""
    ups = [{"w": np.full(200_000, 0.25, np.float32)} for _ in range(3)]
    uris = secure_round(client, ups)
    masked = client.fedavg.load(uris[1])["w"]
    plain = quantised(ups, 3)[1]

    def chi2(bins: np.ndarray) -> float:
        counts = np.bincount(bins, minlength=256)
        expected = bins.size / 256
        return float(((counts - expected) ** 2 / expected).sum())

    limit = 255 + 6 * math.sqrt(2 * 255)  # mean + 6 standard deviations
    assert chi2((masked >> 24).astype(np.int64)) < limit and chi2((masked & 0xFF).astype(np.int64)) < limit
    assert chi2((plain >> 24).astype(np.int64)) > 100 * limit


def test_a_missing_masked_update_fails_the_round_naming_it(client):
    """The first step of secure aggregation: every client whose key was published must send its update."""
    uris = secure_round(client, updates(3))
    store.delete(uris[2])
    with pytest.raises(ObjectNotFound, match=r"client 2 \("):
        run(FedAvgSpec(clients=[{"uri": u} for u in uris], secure=True), client.store_root)
    # listing only the two that came is refused too: their masks would not cancel
    with pytest.raises(InvalidModelFile, match="masked for a round of 3 clients"):
        run(FedAvgSpec(clients=[{"uri": u} for u in uris[:2]], secure=True), client.store_root)


def test_updates_of_other_rounds_or_unmasked_ones_are_refused_naming_the_client(client):
    a = secure_round(client, updates(2), "rounds/a")
    b = secure_round(client, updates(2), "rounds/b")
    with pytest.raises(InvalidModelFile, match=r"client 1 \(.*\): masked for another round"):
        run(FedAvgSpec(clients=[{"uri": a[0]}, {"uri": b[1]}], secure=True), client.store_root)
    plain = [client.fedavg.save_update(u, f"plain/{i}.safetensors") for i, u in enumerate(updates(2))]
    with pytest.raises(InvalidModelFile, match="not a masked update's U32"):
        run(FedAvgSpec(clients=[{"uri": u} for u in plain], secure=True), client.store_root)


def test_the_sdk_refuses_what_it_cannot_mask(client):
    key = client.fedavg.secure_keys("rounds/x", "me")
    with pytest.raises(UpdateError, match="already published a key"):
        client.fedavg.secure_keys("rounds/x", "me")
    with pytest.raises(UpdateError, match="client_id"):
        client.fedavg.secure_keys("rounds/x", "../evil")
    client.fedavg.secure_keys("rounds/x", "peer")
    kw = {"round_prefix": "rounds/x", "client_id": "me", "private_key": key, "roster": ["me", "peer"]}
    with pytest.raises(UpdateError, match="masks float tensors only"):
        client.fedavg.mask_update({"steps": np.array(3, np.int64)}, "rounds/x/me.safetensors", **kw)
    with pytest.raises(UpdateError, match="no key published"):
        client.fedavg.mask_update(
            updates(1)[0], "u.safetensors", **{**kw, "private_key": masks.new_private_key()}
        )
    with pytest.raises(UpdateError, match="clip_range"):
        client.fedavg.mask_update(updates(1)[0], "u.safetensors", **kw, clip_range=0)
    with pytest.raises(UpdateError, match="NaN or Inf"):
        client.fedavg.mask_update({"w": np.array([1.0, np.nan], np.float32)}, "u.safetensors", **kw)
    # one masked update per key and round: a second would show the server the difference of the two
    client.fedavg.mask_update(updates(1)[0], "rounds/x/me.safetensors", **kw)
    with pytest.raises(UpdateError, match="already masked an update"):
        client.fedavg.mask_update(updates(1, seed=1)[0], "rounds/x/me-again.safetensors", **kw)


def test_pair_keys_are_symmetric_and_per_round():
    a, b = masks.new_private_key(), masks.new_private_key()
    pa, pb = masks.public_key(a), masks.public_key(b)
    k = masks.pair_key(a, pb, "r1", "alice", "bob")
    assert k == masks.pair_key(b, pa, "r1", "bob", "alice") and len(k) == 32
    assert k != masks.pair_key(a, pb, "r2", "alice", "bob")
    assert np.array_equal(masks.mask_stream(k, 10), masks.mask_stream(k, 20)[:10])


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (
            {
                "dp": {
                    "clip_norm": 1,
                    "noise_multiplier": 1,
                    "dataset_id": "f",
                    "dataset_budget_rho": 1,
                    "base": "a",
                }
            },
            "dp",
        ),
        ({"min_clients": 1}, "min_clients"),
        ({"min_fraction": 0.5}, "min_fraction"),
        ({"aggregator": "median"}, "aggregator"),
        ({"clients": [{"uri": "a", "weight": 3}, {"uri": "b"}]}, "clients.0.weight"),
    ],
)
def test_bad_secure_specs_are_refused_naming_the_field(change, field):
    doc = {"kind": "fedavg", "clients": [{"uri": "a"}, {"uri": "b"}], "secure": True, **change}
    with pytest.raises(SpecError) as exc:
        parse_spec(doc)
    assert field in [e["field"] for e in exc.value.errors], exc.value.errors


@pytest.mark.slow  # end to end: a job on each executor
def test_local_and_moto_executors_give_the_same_secure_mean(tmp_path, monkeypatch):
    outputs = []
    ups = updates(3, seed=5)
    for backend in ("local", "moto"):
        monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / backend))
        with Client(backend=backend) as c:
            uris = secure_round(c, ups)
            result = c.fedavg.run(uris, secure=True)
            assert result["clients"] == 3
            outputs.append(c.fedavg.load(result["output"]))
    assert all(outputs[0][k].tobytes() == outputs[1][k].tobytes() for k in outputs[0])


def test_quantising_never_passes_the_grid_whatever_the_clip_range():
    """clip(x)·T/c can round past T in floating point; T + 1 would wrap to −2³¹ for a round of one client."""
    rng = np.random.default_rng(0)
    for c in rng.uniform(0.1, 1000, 200):
        for n in (1, 2):
            t = secagg.scale(n)
            q = secagg.quantise(np.full(1000, c), float(c), t, rng).view(np.int32)
            assert q.max() <= t and q.min() >= -t
