"""The adversarial campaign's table: every probe through every entry path, judged as the tests judge it.

    .venv/bin/python tests/adversarial/campaign.py [--json FILE]      (or: make test-campaign)

Paths: the SDK and the bucket trigger (``dispatch``) on the local store and on the moto stack (the compiled
ASL on moto's interpreter, with the S3 store); the CLI (``plan`` and ``run`` of a spec file) and ``watch`` (a
folder of dropped specs) on the local store. A probe that must be refused goes through every path; one that
is accepted and must fail or hold (the store cannot know before the job reads) through the SDK. Outcomes
are :data:`probekit.OUTCOMES`; the tests (``test_probes.py``, ``test_entry_paths.py``) assert each probe's
outcome is a clear error or a safe result, so this prints what they check, counted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from probekit import OUTCOMES, Env, Refused, seed  # noqa: E402
from test_entry_paths import via_cli, via_watch  # noqa: E402
from test_probes import PROBES, via_sdk, via_trigger  # noqa: E402

from shardfold.client import Client  # noqa: E402


def _env(backend: str, home: Path) -> tuple[Env, Client]:
    os.environ["SHARDFOLD_HOME"] = str(home / "store")
    if backend == "moto":
        for var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
            os.environ.pop(var, None)
        os.environ.update(
            AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
            SHARDFOLD_S3_TRANSPORT="boto3",
        )  # fmt: skip
    client = Client(backend=backend)
    env = Env(backend, client, client.store_root, home)
    seed(env)
    return env, client


def run() -> dict[str, dict[str, list[str]]]:
    """``{path: {outcome: [probe names]}}`` over every path and probe."""
    table: dict[str, dict[str, list[str]]] = {}

    def note(path: str, name: str, outcome: str) -> None:
        table.setdefault(path, {}).setdefault(outcome, []).append(name)

    for backend in ("local", "moto"):
        with tempfile.TemporaryDirectory(prefix=f"campaign-{backend}-") as tmp:
            env, client = _env(backend, Path(tmp))
            os.chdir(tmp)
            try:
                probes = [p for p in PROBES if backend in p.backends]
                for probe in probes:
                    note(f"SDK, {backend}", probe.name, via_sdk(env, probe)[0])
                    if isinstance(probe.expect, Refused):
                        note(f"bucket trigger, {backend}", probe.name, via_trigger(env, probe)[0])
                if backend == "local":
                    refusals = [p for p in probes if isinstance(p.expect, Refused)]
                    for probe in refusals:
                        note("CLI plan/run, local", probe.name, via_cli(env, probe)[0])
                    for name, outcome, _ in via_watch(env, refusals):
                        note("watch, local", name, outcome)
            finally:
                client.close()
    return table


def print_table(table: dict[str, dict[str, list[str]]]) -> None:
    widths = [26, 6] + [max(6, len(o)) for o in OUTCOMES]
    head = ["path", "inputs", *OUTCOMES]
    print(" | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)))
    print("-|-".join("-" * w for w in widths))
    total: Counter = Counter()
    for path, outcomes in table.items():
        counts = Counter({o: len(names) for o, names in outcomes.items()})
        total.update(counts)
        row = [path, str(sum(counts.values())), *(str(counts.get(o, 0)) for o in OUTCOMES)]
        print(" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    row = ["all paths", str(sum(total.values())), *(str(total.get(o, 0)) for o in OUTCOMES)]
    print(" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    print(f"{len(PROBES)} distinct inputs; the last four columns must be 0")
    for path, outcomes in table.items():
        for outcome in OUTCOMES[2:]:
            for name in outcomes.get(outcome, []):
                print(f"  {outcome}: {name} ({path})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the table here")
    args = parser.parse_args()
    table = run()
    print_table(table)
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1, sort_keys=True))
    bad = sum(len(table[p].get(o, [])) for p in table for o in OUTCOMES[2:])
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
