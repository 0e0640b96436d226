"""A fedavg round that survives missing clients (``min_clients``, ``min_fraction``, ``wait_s``).

Every update is needed by default (tests/test_fedavg_core.py: the first bad one fails the round naming it).
With ``min_clients`` or ``min_fraction`` a client whose update is missing, unreadable, not safetensors,
unlike the round's, or without a needed weight is left out, with its reason in the result, and the round
proceeds on the others, re-weighted: the output is bit for bit the round of the remaining clients alone.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from test_fedavg_core import JOB, TINY, bad_files, encode, good, load, put_clients, reference, run_job

from shardfold.functions import store, telemetry
from shardfold.functions.errors import InvalidModelFile, ObjectNotFound, SpecError, TooFewClients
from shardfold.functions.fedavg import core
from shardfold.functions.fedavg.spec import MAX_WAIT_S, FedAvgSpec
from shardfold.functions.specs import parse_spec


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "home"))
    return store.uri.store_root()


def updates(n: int, seed: int = 3) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [good(rng) for _ in range(n)]


def assert_round_of(result: dict, ups: list, weights: list[float], keep: list[int]) -> None:
    """The job's output is bit for bit the reference round of the clients ``keep`` alone."""
    got = load(result["output"])
    want = reference([ups[i] for i in keep], [weights[i] for i in keep])
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].tobytes() == want[name].tobytes(), name


@pytest.mark.parametrize("case", sorted(bad_files()))
def test_a_bad_update_is_left_out_naming_why_and_the_rest_are_averaged(root, case):
    data, error, fragment = bad_files()[case]
    ups, weights = updates(4), [3.0, 5.0, 7.0, 11.0]
    uris = put_clients(root, ups, [int(w) for w in weights])
    if data is None:
        store.delete(uris[1])
    else:
        store.put(uris[1], data)
    spec = FedAvgSpec(clients=[{"uri": u} for u in uris], min_clients=3)
    result = run_job(spec, root)
    assert result["clients"] == 3 and result["clients_listed"] == 4
    ((left,),) = [result["excluded"]]
    assert left["client"] == 1 and left["uri"] == uris[1] and fragment in left["reason"], left
    assert not left["reason"].startswith("client 1")  # the reason, without the label the entry holds
    assert result["total_weight"] == 3 + 7 + 11  # weights renormalised over the remaining clients
    assert_round_of(result, ups, weights, [0, 2, 3])
    # the same round without the bad client: the same bytes, and the output's header counts the clients
    alone = FedAvgSpec(clients=[{"uri": uris[i]} for i in (0, 2, 3)])
    other = run_job(alone, root, job_id=JOB.replace("abcdef", "bcdefa"))
    assert store.get(other["output"]) == store.get(result["output"])
    assert b'"shardfold_clients":"3"' in store.get(result["output"])[:4096]


def test_without_min_clients_the_first_bad_update_still_fails_the_round(root):
    uris = put_clients(root, updates(3), [1, 2, 3])
    store.delete(uris[2])
    with pytest.raises(ObjectNotFound, match=r"client 2 \("):
        run_job(FedAvgSpec(clients=[{"uri": u} for u in uris]), root)


def test_too_few_usable_updates_fail_the_round_listing_every_one_left_out(root):
    uris = put_clients(root, updates(5), [1, 2, 3, 4, 5])
    store.delete(uris[0])
    store.put(uris[3], b"not a model")
    spec = FedAvgSpec(clients=[{"uri": u} for u in uris], min_clients=4)
    with pytest.raises(TooFewClients) as exc:
        run_job(spec, root)
    msg = str(exc.value)
    assert "needs 4 of its 5 client updates but only 3" in msg
    assert f"client 0 ({uris[0]}): no object" in msg and f"client 3 ({uris[3]})" in msg
    assert [e["client"] for e in exc.value.excluded] == [0, 3]
    assert not store.exists(core.output_uri(spec, root, JOB))
    # three of five is enough at min_fraction 0.6 (0.6 x 5 = 3, whatever float rounding says)
    ok = run_job(FedAvgSpec(clients=[{"uri": u} for u in uris], min_fraction=0.6), root)
    assert ok["clients"] == 3 and [e["client"] for e in ok["excluded"]] == [0, 3]


@pytest.mark.parametrize(
    ("n", "kw", "need"),
    [
        (10, {"min_fraction": 0.3}, 3),  # 0.3 * 10 = 3.0000000000000004 in floats
        (10, {"min_fraction": 0.31}, 4),
        (7, {"min_fraction": 1.0}, 7),
        (7, {"min_clients": 2, "min_fraction": 0.5}, 4),  # both: the larger
        (7, {"min_clients": 6, "min_fraction": 0.5}, 6),
        (7, {}, 7),
        (3, {"min_fraction": 0.01}, 1),
    ],
)
def test_required_clients(n, kw, need):
    spec = FedAvgSpec(clients=[{"uri": f"c{i}"} for i in range(n)], **kw)
    assert spec.required_clients == need and spec.tolerant == bool(kw)


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("min_clients", 0, "greater than or equal to 1"),
        ("min_clients", -2, "greater than or equal to 1"),
        ("min_clients", 4, "more than the 3 client(s) listed"),
        ("min_clients", "two", "integer"),
        ("min_clients", 2.5, "integer"),
        ("min_fraction", 0, "greater than 0"),
        ("min_fraction", 1.5, "less than or equal to 1"),
        ("min_fraction", float("nan"), "finite number"),
        ("min_fraction", "half", "valid number"),
        ("wait_s", -1, "greater than or equal to 0"),
        ("wait_s", float("inf"), "finite number"),
        ("wait_s", MAX_WAIT_S + 1, f"less than or equal to {MAX_WAIT_S}"),
        ("wait_s", 1e300, f"less than or equal to {MAX_WAIT_S}"),
    ],
)
def test_bad_dropout_options_are_refused_naming_the_field(field, value, fragment):
    doc = {"kind": "fedavg", "clients": [{"uri": f"c{i}"} for i in range(3)], field: value}
    with pytest.raises(SpecError) as exc:
        parse_spec(doc)
    assert [e["field"] for e in exc.value.errors] == [field], exc.value.errors
    assert fragment in str(exc.value), str(exc.value)


def test_the_round_takes_the_tensors_most_clients_have_not_client_0s(root):
    ups, weights = updates(4), [2.0, 3.0, 5.0, 7.0]
    uris = put_clients(root, ups, [int(w) for w in weights])
    store.put(uris[0], encode({**good(), "a": good()["a"].reshape(2, 8)}, {"num_examples": "2"}))
    result = run_job(FedAvgSpec(clients=[{"uri": u} for u in uris], min_clients=2), root)
    ((left,),) = [result["excluded"]]
    assert left["client"] == 0 and "tensor 'a' has shape [2, 8], but client 1's has [4, 4]" in left["reason"]
    assert_round_of(result, ups, weights, [1, 2, 3])


def test_a_tie_between_tensor_sets_goes_to_the_earliest_client(root):
    ups = updates(4)
    uris = put_clients(root, ups, [1, 1, 1, 1])
    for i in (1, 3):
        store.put(uris[i], encode({"z": np.ones(3, np.float32)}, {"num_examples": "1"}))
    result = run_job(FedAvgSpec(clients=[{"uri": u} for u in uris], min_clients=2), root)
    assert [e["client"] for e in result["excluded"]] == [1, 3]
    assert all("has no tensor 'a', which client 0 has" in e["reason"] for e in result["excluded"])


def test_a_needed_weight_that_is_missing_leaves_the_client_out(root):
    ups = updates(3)
    uris = put_clients(root, ups, [4, None, 6])
    result = run_job(FedAvgSpec(clients=[{"uri": u} for u in uris], min_fraction=0.5), root)
    assert [e["client"] for e in result["excluded"]] == [1]
    assert "no 'num_examples'" in result["excluded"][0]["reason"]
    assert_round_of(result, ups, [4.0, 0.0, 6.0], [0, 2])
    # a uniform round needs no weight: nobody is left out
    spec = FedAvgSpec(clients=[{"uri": u} for u in uris], min_clients=1, uniform=True)
    uniform = run_job(spec, root, job_id=JOB.replace("abcdef", "fedcba"))
    assert uniform["excluded"] == [] and uniform["clients"] == 3


def test_integer_policy_first_takes_the_first_client_in_the_round(root):
    ups = [{"a": np.full(2, float(i), np.float32), "b": np.full(2, 10 + i, np.int64)} for i in range(3)]
    uris = put_clients(root, ups, [1, 1, 1])
    store.delete(uris[0])
    spec = FedAvgSpec(clients=[{"uri": u} for u in uris], min_clients=2, integer_policy="first")
    assert load(run_job(spec, root)["output"])["b"].tolist() == [11, 11]


def test_an_error_found_while_aggregating_names_the_client_by_its_place_in_the_spec(root):
    ups = updates(4)
    ups[3]["a"][1, 1] = np.nan
    uris = put_clients(root, ups, [1, 1, 1, 1])
    store.delete(uris[1])
    spec = FedAvgSpec(clients=[{"uri": u} for u in uris], min_clients=3)
    with pytest.raises(InvalidModelFile) as exc:
        run_job(spec, root)
    assert f"client 3 ({uris[3]})" in str(exc.value) and exc.value.client == 3


def test_a_round_looks_for_late_updates_until_they_come_or_wait_s_passes(root):
    """The polling step's looks: the gaps (whole seconds, for a Wait state) double up to POLL_MAX_S and never
    pass the deadline, which the first look sets; ready once every update is there or the deadline passed."""
    uris = put_clients(root, updates(3), [1, 2, 3])
    late = store.get(uris[2])
    store.delete(uris[2])
    spec = FedAvgSpec(clients=[{"uri": u} for u in uris], min_clients=2, wait_s=60)
    first = core.await_updates(spec, root, now=1000.0)
    assert first == {"ready": False, "wait_s": core.POLL_FIRST_S, "deadline": 1060.0, "looks": 1}
    second = core.await_updates(spec, root, first, now=1002.0)
    assert second == {"ready": False, "wait_s": 2 * core.POLL_FIRST_S, "deadline": 1060.0, "looks": 2}
    assert core.await_updates(spec, root, {**second, "looks": 9}, now=1003.0)["wait_s"] == core.POLL_MAX_S
    assert core.await_updates(spec, root, second, now=1058.5)["wait_s"] == 2  # the 1.5 s left, whole
    assert core.await_updates(spec, root, second, now=1060.0) == {"ready": True, "looks": 3}
    # a deadline further than wait_s from now (not one the first look set) is held to wait_s
    assert core.await_updates(spec, root, {"deadline": 1e12, "looks": 1}, now=1000.0)["deadline"] == 1060.0
    store.put(uris[2], late)
    assert core.await_updates(spec, root, second, now=1004.0) == {"ready": True, "looks": 3}
    store.delete(uris[2])  # a round that does not wait looks at nothing
    assert core.await_updates(spec.model_copy(update={"wait_s": 0}), root) == {"ready": True, "looks": 0}


def test_a_late_update_joins_the_round_that_waits_for_it(local_client):
    """End to end on the local executor: the polling step looks, waits (the executor's Wait), looks again and
    finds the update that came meanwhile; the round has every client."""
    ups, weights = updates(3), [1.0, 2.0, 3.0]
    uris = [local_client.fedavg.save_update(u, f"late/c{i}.safetensors") for i, u in enumerate(ups)]
    late = store.get(uris[2])
    store.delete(uris[2])
    timer = threading.Timer(0.5, store.put, (uris[2], late))
    timer.start()
    try:
        clients = [{"uri": u, "weight": w} for u, w in zip(uris, weights, strict=True)]
        spec = {"kind": "fedavg", "clients": clients, "min_clients": 2, "wait_s": 30}
        job = local_client.submit(spec)
        final = job.wait(progress=False, timeout_s=60)
    finally:
        timer.cancel()
    assert final.state == "SUCCEEDED", final.error
    result = job.result()
    assert result["excluded"] == [] and result["clients"] == 3
    assert_round_of(result, ups, weights, [0, 1, 2])
    looks = [
        r for r in telemetry.read_records(local_client.store_root, job.job_id) if r["step"] == "await_updates"
    ]
    assert len(looks) == 2  # one before the update came, one after the executor's wait of POLL_FIRST_S


def test_the_plan_document_and_worklist_count_only_the_clients_in_the_round(root):
    uris = put_clients(root, updates(4), [1, 2, 3, 4])
    store.delete(uris[2])
    spec = FedAvgSpec(clients=[{"uri": u} for u in uris], min_clients=3)
    planned = core.prepare(spec, JOB, root, budget=TINY)
    assert planned["clients"] == 3 and planned["left_out"] == 1
    plan = core.load_plan(root, JOB)
    assert [c.index for c in plan.clients] == [0, 1, 3] and plan.clients_listed == 4
    assert plan.params().weights == [1.0, 2.0, 4.0]


def test_truncated_updates_do_not_vote_on_the_rounds_tensors(root):
    """Two truncated files of one shape cannot outvote the one sound update of another shape."""
    sound = {"a": np.arange(5, dtype=np.float32)}
    uris = put_clients(root, [{"a": np.zeros(4, np.float32)}] * 2 + [sound], [1, 1, 1])
    for u in uris[:2]:
        store.put(u, store.get(u)[:-3])
    result = run_job(FedAvgSpec(clients=[{"uri": u} for u in uris], min_clients=1), root)
    assert [e["client"] for e in result["excluded"]] == [0, 1] and result["clients"] == 1
    assert all("truncated" in e["reason"] for e in result["excluded"])
    assert load(result["output"])["a"].tolist() == sound["a"].tolist()


def test_an_update_whose_head_is_refused_is_left_out_naming_the_error(root, monkeypatch):
    """Access denied (S3's answer for a key the role may not read) leaves the client out, not the round."""
    from shardfold.functions.errors import StoreError

    uris = put_clients(root, updates(3), [1, 2, 3])
    real = store.pins

    def pins(batch, failed=None):
        if uris[1] in batch:
            if failed is None:
                raise StoreError(f"HEAD {uris[1]}: AccessDenied")
            failed[uris[1]] = StoreError(f"HEAD {uris[1]}: AccessDenied")
            batch = [u for u in batch if u != uris[1]]
        return real(batch, failed)

    monkeypatch.setattr(store, "pins", pins)
    result = run_job(FedAvgSpec(clients=[{"uri": u} for u in uris], min_clients=2), root)
    ((left,),) = [result["excluded"]]
    assert left["client"] == 1 and "AccessDenied" in left["reason"]
    with pytest.raises(StoreError, match="AccessDenied"):  # every update needed: the round fails
        run_job(FedAvgSpec(clients=[{"uri": u} for u in uris]), root, job_id=JOB.replace("abcdef", "fedcba"))
