"""Every script in ``examples/`` runs as a user would run it: ``python examples/<name>.py``, from another
folder, on a fresh store, exits 0 and prints what it is for. A new example is picked up by the glob."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each example runs jobs (the inference one starts torch)

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.py"))
TIMEOUT_S = 300  # a deadline, not a timing assumption

# A line each example must print: the point of the example, not incidental wording.
EXPECTED = {
    "getbatch_archive.py": [
        "6 items, 0 errors",
        "tar member scores-first-rows.csv",
        "stream 2: sample-001.txt (27 bytes)",
        "-> error:",
    ],
    "fedavg_average.py": ["3 clients, total weight 400", "matches numpy's weighted mean bit for bit"],
    "dpquery_release.py": [
        "released counts by sex and region",
        "std_error",
        "graduates aged 18-47",
        "remaining 0.9756",
    ],
    "inference_embed.py": [
        "embeddings (3, 384) float32",
        "cosine(cat, kitten) =",
        "the same model as a Hugging Face folder: largest difference",
    ],
    "inference_classify.py": ["4 rows labelled", "positive (", "negative ("],
    "inference_generate.py": ["4 rows, 1 with an error", "capital [stop] 'The capital of France is Paris.'"],
    "torch_dataloader.py": ["images (16, 3, 8, 8) torch.float32", "one epoch: 64 samples in 4 batches"],
}


def run_example(script: Path, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """``python <script>`` in ``cwd``, with ``env`` over this process's environment (none without
    SHARDFOLD_HOME: the examples' own choice of store is what some tests check)."""
    environ = {k: v for k, v in os.environ.items() if k != "SHARDFOLD_HOME"}
    environ.update(OMP_NUM_THREADS="1", **env)
    return subprocess.run(
        [sys.executable, str(script)], cwd=cwd, env=environ, capture_output=True, text=True, timeout=TIMEOUT_S
    )


def test_every_example_says_what_it_must_print():
    names = [p.name for p in EXAMPLES]
    assert sorted(EXPECTED) == names, "add a new example's key output lines to EXPECTED (or drop a stale one)"


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(script, tmp_path):
    if script.name == "inference_generate.py":
        from hf_models import smollm2

        smollm2()  # the model the example uses by default (`make models` has made it already)
    home = tmp_path / "home"
    done = run_example(script, tmp_path, SHARDFOLD_HOME=str(home))
    assert done.returncode == 0, f"{script.name} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    for line in EXPECTED.get(script.name, []):
        assert line in done.stdout, f"{script.name} did not print {line!r}:\n{done.stdout}"
    assert done.stdout.strip(), f"{script.name} printed nothing"
    assert not (tmp_path / ".shardfold").exists(), "an example wrote a store into the working directory"


def test_an_example_without_shardfold_home_uses_a_temporary_store(tmp_path):
    """Unset, the examples make a temporary store (under TMPDIR, here the test's own) and say where."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    done = run_example(REPO / "examples" / "getbatch_archive.py", tmp_path, TMPDIR=str(tmp))
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    stores = list(tmp.glob("shardfold-example-*"))
    assert len(stores) == 1 and f"store: {stores[0].as_uri()}" in done.stdout, done.stdout
    assert not (tmp_path / ".shardfold").exists()


def test_an_example_runs_under_a_tmpdir_too_long_for_a_socket(tmp_path):
    """getbatch reads local files in worker processes, forked from a fork server that listens on a UNIX
    socket under TMPDIR; a socket's path holds at most 107 bytes, so a long TMPDIR moves it to /tmp."""
    tmp = tmp_path / ("t" * 100)
    tmp.mkdir()
    done = run_example(REPO / "examples" / "getbatch_archive.py", tmp_path, TMPDIR=str(tmp))
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
