"""The user's documentation is true: the README's code blocks run as written, every link between the pages
lands on a file and heading that exist, and the SDK reference is what the docstrings say today."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "bench" / "README.md"]
PAGES += [p for p in [REPO / "examples" / "README.md"] if p.exists()]
# Lines of the README's shell blocks not run here, and by which test they are: the suite is `make test`
# itself; `source` only puts .venv/bin on PATH.
NOT_RUN = {
    "make test": "this suite",
    "make demo": (
        "tests/test_telemetry.py::test_every_kind_records_every_task_and_dpquery_withholds_its_"
        "private_steps[local]"
    ),
    "source": "nothing to run",
    "shardfold run events/inference.json": "test_inference_job.py::test_cli_plan_and_run_the_shipped_example",
}


def blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of each fenced code block."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```$", text, re.M | re.S)]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```$", "", page.read_text(), flags=re.M | re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.*)$", text, re.M)}


def test_every_link_between_the_pages_lands():
    broken = []
    for page in PAGES:
        text = re.sub(r"^```.*?^```$", "", page.read_text(), flags=re.M | re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_readme_is_a_front_door():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) < 150, "reference material belongs in docs/"
    headings = re.findall(r"^#{1,6} (.*)$", re.sub(r"^```.*?^```$", "", text, flags=re.M | re.S), re.M)
    assert len(headings) == len(set(headings)), headings
    for kind in ("getbatch", "fedavg", "dpquery", "inference"):
        assert f"events/{kind}.json" in text
    license_head = (REPO / "LICENSE").read_text()[:300].split()
    assert license_head[:4] == ["Apache", "License", "Version", "2.0,"], license_head[:4]  # pyproject's


def test_every_spec_shown_in_the_docs_is_valid():
    import json

    from shardfold.functions.specs import parse_spec

    shown = []
    for page in PAGES:
        for lang, body in blocks(page.read_text()):
            doc = json.loads(body) if lang == "json" else None
            if isinstance(doc, dict) and "kind" in doc:
                parse_spec(doc)  # raises, naming the field, on a spec the docs should not show
                shown.append(doc["kind"])
    assert {"getbatch", "fedavg", "dpquery", "inference"} <= set(shown), shown


def test_the_sdk_reference_is_what_the_docstrings_say():
    spec = importlib.util.spec_from_file_location("sdk_reference", REPO / "docs" / "sdk_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (REPO / "docs" / "sdk-reference.md").read_text() == module.render(), (
        "docs/sdk-reference.md is stale: run `make docs`"
    )


@pytest.mark.slow  # runs a job of every kind, as the README shows
def test_the_readmes_code_blocks_run_as_written(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from shardfold.client.cli import cli

    home = tmp_path / "home"
    monkeypatch.setenv("SHARDFOLD_HOME", str(home))
    monkeypatch.chdir(REPO)  # the README's commands name events/... from the checkout's root
    ran = []
    for lang, body in blocks((REPO / "README.md").read_text()):
        if lang == "python":  # a fresh interpreter, as a user's script
            env = {**os.environ, "PYTHONPATH": str(REPO)}
            done = subprocess.run(
                [sys.executable, "-c", body], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
            )
            assert done.returncode == 0, f"{body}\n{done.stdout}\n{done.stderr}"
            ran.append("python block")
        elif lang == "bash":
            for line in body.splitlines():
                command = line.split("#", 1)[0].strip()
                if not command or any(command.startswith(skip) for skip in NOT_RUN):
                    continue
                argv = shlex.split(command)
                assert argv[0] == "shardfold", f"a README command this test does not know: {line}"
                result = CliRunner().invoke(cli, argv[1:], catch_exceptions=False)  # the CLI's own code path
                assert result.exit_code == 0, f"{command}\n{result.output}"
                ran.append(command)
    assert "python block" in ran and sum(c.startswith("shardfold run") for c in ran) >= 3, ran
