"""The GPU worker image: ``Dockerfile`` and ``.dockerignore`` read as text (no Docker engine here): the entry
point, a non-root user, a pinned base and torch, and no secrets or local state in the build context."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# What building shardfold.functions takes: the project's metadata and its package root beside functions/
BUILD_SOURCES = {"pyproject.toml", "setup.py", "README.md", "shardfold", "functions"}
NEEDED = ["pyproject.toml", "setup.py", "README.md", "shardfold/__init__.py"]
SECRET_PATHS = [
    ".shardfold/stack.json",
    ".shardfold/build/arm64/package.zip",
    ".venv/bin/python",
    ".git/config",
    ".env",
    ".env.production",
    ".aws/credentials",
    "infra/Pulumi.dev.yaml",
    "functions/__pycache__/worker.cpython-312.pyc",
    "functions/store/server.pem",
]


def instructions(text: str) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` in order, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


@pytest.fixture(scope="module")
def dockerfile() -> list[tuple[str, str]]:
    return instructions((REPO / "Dockerfile").read_text())


def final_stage(instrs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    starts = [i for i, (word, _) in enumerate(instrs) if word == "FROM"]
    return instrs[starts[-1] :]


def test_entry_point_is_the_batch_worker_as_a_non_root_user(dockerfile):
    final = final_stage(dockerfile)
    entry = [args for word, args in final if word == "ENTRYPOINT"]
    assert len(entry) == 1 and json.loads(entry[0]) == [
        "python",
        "-m",
        "shardfold.functions.container",
    ]  # exec form
    users = [(i, args) for i, (word, args) in enumerate(final) if word == "USER"]
    assert users, "the final stage must switch to a non-root USER"
    index, user = users[-1]
    assert user.split(":")[0] not in ("root", "0")
    assert index < next(i for i, (word, _) in enumerate(final) if word == "ENTRYPOINT")
    worker = (REPO / "functions" / "container.py").read_text()
    assert "def main()" in worker and '__name__ == "__main__"' in worker


def test_base_image_and_torch_are_pinned_to_the_project(dockerfile):
    args = dict(a.split("=", 1) for word, a in dockerfile if word == "ARG" and "=" in a)
    base = args["PYTHON_IMAGE"]
    assert re.fullmatch(r"python:3\.12\.\d+-slim-bookworm(@sha256:[0-9a-f]{64})?", base), base
    assert all(a.startswith("${PYTHON_IMAGE}") for word, a in dockerfile if word == "FROM")
    runs = " ".join(a for word, a in dockerfile if word == "RUN")
    inference = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    torch_pin = next(r for r in inference["inference"] if r.startswith("torch"))
    assert f'pip install "{torch_pin}"' in runs  # the image runs the torch the tests ran
    # the rest from the lock, hash-checked; the project itself without resolving anything again
    assert "pip install --require-hashes -r requirements/worker.txt" in runs
    assert "pip install --no-deps ." in runs
    assert (REPO / "requirements" / "worker.txt").is_file()
    lock = (REPO / "requirements" / "worker.txt").read_text()
    assert "\nsentence-transformers==" in lock and "\ntorch==" not in lock  # inference, torch left out


def test_no_secrets_or_local_state_are_copied(dockerfile):
    assert not [a for word, a in dockerfile if word == "ADD"], "use COPY (ADD fetches URLs, unpacks archives)"
    sources = []
    for word, args in dockerfile:
        if word == "COPY" and "--from=" not in args:
            parts = [p for p in args.split() if not p.startswith("--")]
            sources += parts[:-1]
    assert sources and set(sources) <= BUILD_SOURCES | {"requirements/worker.txt"}, sources
    ignore = (REPO / ".dockerignore").read_text()
    for path in SECRET_PATHS:
        assert dockerignored(ignore, path), f"{path} would be in the build context"
    for path in [*NEEDED, "requirements/worker.txt", "functions/container.py", "functions/getbatch/core.py"]:
        assert not dockerignored(ignore, path), f"{path} is needed by the build but ignored"


def _pattern_re(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def dockerignored(ignore: str, path: str) -> bool:
    """Whether ``.dockerignore`` keeps ``path`` out of the context: the last pattern matching the path or
    one of its parent directories decides; ``!`` re-includes (Docker's rules)."""
    excluded = False
    parents = ["/".join(path.split("/")[: n + 1]) for n in range(path.count("/") + 1)]
    for line in ignore.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        rx = _pattern_re(line.lstrip("!").strip("/"))
        if any(rx.match(p) for p in parents):
            excluded = not negate
    return excluded


def test_the_dockerignore_reader_follows_dockers_rules():
    assert dockerignored("**\n!functions\n**/__pycache__", "client/cli.py")
    assert not dockerignored("**\n!functions\n**/__pycache__", "functions/store/s3.py")
    assert dockerignored("**\n!functions\n**/__pycache__", "functions/__pycache__/x.pyc")
    assert not dockerignored("", ".env")
