"""The probes that must be refused, through the two entry paths ``test_probes.py`` does not take: the CLI
(``shardfold run`` and ``plan`` on a spec file) and ``shardfold watch`` (a folder of dropped specs), on the
local backend. (The SDK and the bucket trigger, on local and moto: ``test_probes.py``; the moto backend's
CLI and ``watch`` go through the same submit and dispatch.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from probekit import Env, Probe, Refused, classify, seed, snapshot
from test_probes import PROBES

from shardfold.client import Client
from shardfold.client.cli import cli

pytestmark = pytest.mark.slow

LOCAL_REFUSALS = [p for p in PROBES if isinstance(p.expect, Refused) and "local" in p.backends]


@pytest.fixture(scope="module")
def local_env(tmp_path_factory):
    home = tmp_path_factory.mktemp("entry-paths")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SHARDFOLD_HOME", str(home / "store"))
        mp.chdir(home)
        with Client() as client:
            env = Env("local", client, client.store_root, home)
            seed(env)
            yield env


def _spec_file(env: Env, probe: Probe, folder: str, n: int = 0) -> Path:
    path = env.home / folder / f"{n:03d}-{re.sub(r'[^a-z0-9]+', '-', probe.name.lower()).strip('-')}.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(probe.spec(env)))
    return path


def via_cli(env: Env, probe: Probe) -> tuple[str, str]:
    """``shardfold plan``, then ``run``, on the probe as a spec file: the worse of the two outcomes."""
    path = _spec_file(env, probe, "cli")
    expect = probe.as_text or probe.expect  # a spec file is JSON text: NaN and Infinity are refused as such
    before = snapshot(env.root)
    outcomes = []
    for verb in ("plan", "run"):
        result = CliRunner().invoke(cli, [verb, str(path)])
        text = " ".join(result.output.split())
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            state = "crash"
        else:
            state = "refused" if result.exit_code == 1 else "SUCCEEDED"
        after = snapshot(env.root)
        changed = [u for u, d in before.items() if after.get(u) != d]
        outcomes.append((classify(probe, expect, state, text, [text], changed), text))
    return max(outcomes, key=lambda o: o[0] != "clear error")


def via_watch(env: Env, probes: list[Probe]) -> list[tuple[str, str, str]]:
    """``shardfold watch --once`` over a folder holding every probe: ``(name, outcome, message)`` of each,
    from its report."""
    paths = [_spec_file(env, probe, "drop", n) for n, probe in enumerate(probes)]
    before = snapshot(env.root)
    result = CliRunner().invoke(cli, ["watch", str(env.home / "drop"), "--once"])
    after = snapshot(env.root)
    changed = [u for u, d in before.items() if after.get(u) != d]
    out = []
    for probe, path in zip(probes, paths, strict=True):
        error = path.with_name(path.stem + ".error.json")
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            state, message, fields = "crash", repr(result.exception), []
        elif error.exists():
            report = json.loads(error.read_text())
            state, message = "refused", report["error"]
            fields = [e.get("field") for e in report.get("errors", [])] or [message]
        else:
            state, message, fields = "SUCCEEDED", "started", []
        expect = probe.as_text or probe.expect
        out.append((probe.name, classify(probe, expect, state, message, fields, changed), message))
    return out


@pytest.mark.parametrize("probe", LOCAL_REFUSALS, ids=lambda p: p.name)
def test_the_cli_refuses_what_submit_refuses(local_env: Env, probe: Probe):
    outcome, message = via_cli(local_env, probe)
    assert outcome == "clear error", f"{probe.name}: {outcome}: {message}"


def test_watch_refuses_every_one_naming_its_field_and_runs_nothing(local_env: Env):
    wrong = [o for o in via_watch(local_env, LOCAL_REFUSALS) if o[1] != "clear error"]
    assert not wrong, wrong
    assert not list((local_env.home / "store" / "jobs").glob("*/output/*"))  # nothing ran
