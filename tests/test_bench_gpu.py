"""bench/gpu.py, the GPU machine's benchmark script, end to end in its dry mode on this CPU: every method
runs the project's code and its peer and the table prints (the GPU figures come from a GPU machine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def test_the_gpu_benchmark_runs_dry_and_prints_its_table(tmp_path):
    out = tmp_path / "gpu.json"
    run = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu.py"), "--dry", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert any(line.startswith("method") and "GPU busy %" in line for line in lines)
    for method in ("encode, worker path", "encode, peer", "generate, engine", "generate, peer"):
        assert any(line.startswith(method) for line in lines), run.stdout
    doc = json.loads(out.read_text())
    assert doc["dry"] and len(doc["results"]) == 4
    assert all(r["s"] > 0 and r["tokens"] > 0 for r in doc["results"])
    assert doc["results"][0]["cosine"] > 0.999  # the worker path's vectors are the peer's (float32 on a CPU)
