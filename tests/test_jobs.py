"""Job ids, relative spec URIs and the trigger's key filter: properties over generated inputs."""

from __future__ import annotations

import datetime as dt
import re

from hypothesis import given
from hypothesis import strategies as st

from shardfold.functions.jobs import JOB_ID_RE, kind_of, new_job_id
from shardfold.functions.specs import parse_spec, resolve_relative
from shardfold.functions.trigger import ignore_reason, report_uris

kinds = st.from_regex(r"[a-z][a-z0-9]{0,11}", fullmatch=True)
segment = st.one_of(
    st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.\- ]{0,15}", fullmatch=True),
    st.sampled_from(["jobs", "x.status", "y.error", "spec.json"]),
).filter(lambda s: s not in (".", ".."))


@given(kinds, st.datetimes(min_value=dt.datetime(2000, 1, 1), max_value=dt.datetime(2999, 12, 31)))
def test_job_ids_parse_back_and_are_execution_names(kind, when):
    job_id = new_job_id(kind, when.replace(tzinfo=dt.UTC))
    assert JOB_ID_RE.match(job_id) and kind_of(job_id) == kind
    # a valid Step Functions execution name: <= 80 chars of letters, digits, '-' and '_'
    assert len(job_id) <= 80 and re.fullmatch(r"[A-Za-z0-9_-]+", job_id)


@given(st.lists(segment, min_size=1, max_size=4), st.lists(segment, min_size=1, max_size=3))
def test_relative_uris_land_beside_the_spec(base_dirs, rel):
    base = "file:///" + "/".join(base_dirs) + "/spec.json"
    doc = {"kind": "getbatch", "items": [{"uri": "./" + "/".join(rel), "name": "./keep-me"}]}
    out = parse_spec(doc, base_uri=base)
    assert out.items[0].uri == "file:///" + "/".join(base_dirs + rel)
    assert out.items[0].name == "./keep-me"  # only fields declared as URIs move
    assert parse_spec(doc).items[0].uri == "/".join(rel)  # no spec file: a key under the store root
    assert resolve_relative("../" * (len(base_dirs) + 3) + "z", base) == "file:///z"  # never above the root


@given(
    st.lists(segment, min_size=1, max_size=4),
    st.sampled_from([".json", ".status.json", ".error.json", ".txt"]),
)
def test_only_direct_json_children_of_jobs_are_specs(parts, suffix):
    key = "/".join(parts) + suffix
    reason = ignore_reason(f"s3://bucket/{key}")
    is_spec = (
        len(parts) == 2
        and parts[0] == "jobs"
        and suffix == ".json"
        and not key.endswith((".status.json", ".error.json"))
    )
    assert (reason is None) == is_spec
    if is_spec:
        status, error = report_uris(f"s3://bucket/{key}")
        # the reports written beside a spec never look like specs themselves: no trigger loop
        assert ignore_reason(status) and ignore_reason(error)


def test_the_submit_time_reads_back_from_a_job_id():
    import datetime as dt

    from shardfold.functions.jobs import new_job_id, submitted_at

    when = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    assert submitted_at(new_job_id("getbatch", when)) == "2026-01-02T03:04:05"
    assert submitted_at("not-a-job-id") is None and submitted_at("getbatch-2026-x") is None
