"""The wheel as a user installs it: one import package, ``shardfold``, beside the user's own ``functions/``
and ``client/`` packages, in a fresh virtual environment holding the base install only (the lock's
requirements/base.txt), so what needs an extra is refused naming it.

Slow: it builds the wheel and installs the base dependencies (from pip's cache after ``make test``'s own
install, which took the same locked versions), once a run: the test processes of a ``pytest -n`` run share
one wheel and one venv, each with a user project of its own (``--dist worksteal`` hands this module's tests
to several of them near the suite's end, and each built its own, 15 s of CPU apiece)."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow

# A user project laid out as SAM, Firebase and Azure Functions projects are: packages named `functions` and
# `client` of its own, which must neither shadow Shardfold's modules nor be shadowed by them.
USER_FUNCTIONS = "WHO = 'the user'\n"
USER_CLIENT = "class Client:  # the user's own\n    pass\n"

SDK_SCRIPT = r"""
import json, pathlib, sys
import shardfold
from shardfold import Client
uri = pathlib.Path(sys.argv[1]).resolve().as_uri()
spec = {"kind": "getbatch", "items": [{"uri": uri}, {"uri": uri, "start": 0, "length": 5}]}
with Client() as client:
    job = client.submit(spec)
    state = job.wait(progress=False).state
    result = job.result()
import functions, client  # the user's packages, untouched by Shardfold's
print(json.dumps({"version": shardfold.__version__, "state": state, "items": result["items"],
                  "functions": functions.WHO, "client": client.Client.__module__,
                  "shardfold_client": Client.__module__, "heavy": sorted(
                      m for m in ("torch", "opendp", "pyarrow", "cvxpy", "scipy") if m in sys.modules)}))
"""


def built_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """The folder ``name``, built by ``build(folder)`` once for the whole run: in the base temp folder the
    test processes of a ``pytest -n`` run share (each process's own otherwise), by the first process that
    needs it, under a file lock; the others wait for it and reuse it. A build that failed is started over."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "test_wheel" / name
    folder.parent.mkdir(exist_ok=True)
    with open(folder.with_name(name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / ".complete").exists():
            shutil.rmtree(folder, ignore_errors=True)
            build(folder)
            (folder / ".complete").write_text("")
    return folder


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    def build(out: Path) -> None:
        # the locked setuptools of this environment, offline
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(REPO),
        ]
        subprocess.run(cmd, check=True, capture_output=True, timeout=300)

    (path,) = built_once(tmp_path_factory, "wheel", build).glob("shardfold-*.whl")
    return path


@pytest.fixture(scope="session")
def user_venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv with the base lock and the wheel."""

    def build(env_dir: Path) -> None:
        venv.create(env_dir, with_pip=True)
        py = env_dir / "bin" / "python"
        pip = [str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        subprocess.run(
            [*pip, "--require-hashes", "-r", str(REPO / "requirements" / "base.txt")], check=True, timeout=900
        )
        subprocess.run([*pip, "--no-deps", str(wheel)], check=True, timeout=300)

    return built_once(tmp_path_factory, "venv", build)


@pytest.fixture(scope="session")
def user_env(user_venv, tmp_path_factory) -> dict:
    """The venv, and a user project beside it (this test process's own)."""
    project = tmp_path_factory.mktemp("user") / "project"
    (project / "functions").mkdir(parents=True)
    (project / "functions" / "__init__.py").write_text(USER_FUNCTIONS)
    (project / "client").mkdir()
    (project / "client" / "__init__.py").write_text(USER_CLIENT)
    (project / "hello.txt").write_text("hello from the user's project\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDFOLD_", "PYTHON"))}
    env.update(SHARDFOLD_HOME=str(project / ".shardfold"), PYTHONPATH=str(project))
    py = user_venv / "bin" / "python"
    return {"python": py, "shardfold": user_venv / "bin" / "shardfold", "project": project, "env": env}


def run(user_env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*args], cwd=user_env["project"], env=user_env["env"], capture_output=True, text=True, timeout=300
    )


def test_the_wheel_installs_one_import_package_with_the_sample_events(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        top_level = zf.read(next(n for n in names if n.endswith(".dist-info/top_level.txt"))).decode().split()
    assert {n.split("/", 1)[0] for n in names} == {"shardfold", wheel.name.split("-py3")[0] + ".dist-info"}
    assert top_level == ["shardfold"]
    assert {
        "shardfold/functions/kinds.py",
        "shardfold/client/cli.py",
        "shardfold/orchestrator/asl.py",
        "shardfold/infra/program.py",
        "shardfold/infra/Pulumi.yaml",
        "shardfold/events/getbatch_prepare.json",
        "shardfold/events/data/hello.txt",
        "shardfold/events/data/fedavg/client-0.safetensors",
    } <= set(names)


def test_sdk_runs_beside_the_users_own_functions_and_client_packages(user_env):
    done = run(user_env, str(user_env["python"]), "-c", SDK_SCRIPT, "hello.txt")
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["state"] == "SUCCEEDED" and out["items"] == 2
    assert out["functions"] == "the user" and out["client"] == "client"
    assert out["shardfold_client"] == "shardfold.client.sdk"
    assert out["heavy"] == []  # the base install imports no extra's package (none is installed)


def test_cli_runs_getbatch_and_fedavg_and_invokes_the_shipped_sample_events(user_env):
    sh = str(user_env["shardfold"])
    done = run(user_env, sh, "--help")
    assert done.returncode == 0 and "Usage: shardfold" in done.stdout
    events = run(
        user_env, str(user_env["python"]), "-c", "import shardfold.events as e; print(e.__path__[0])"
    )
    samples = Path(events.stdout.strip())
    for kind in ("getbatch", "fedavg"):
        done = run(user_env, sh, "run", "--quiet", str(samples / f"{kind}.json"))
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    # the README's spelling, from a directory with no events/ of its own: the packaged samples
    done = run(user_env, sh, "invoke", "getbatch.prepare", "events/getbatch_prepare.json")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert json.loads(done.stdout)["parts"] >= 1


@pytest.mark.parametrize(("kind", "extra"), [("dpquery", "dp"), ("inference", "inference")])
def test_a_kind_whose_extra_is_missing_is_refused_at_submit_naming_it(user_env, kind, extra):
    samples = REPO / "events"
    done = run(user_env, str(user_env["shardfold"]), "run", "--quiet", str(samples / f"{kind}.json"))
    assert done.returncode == 1
    assert f"pip install 'shardfold[{extra}]'" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr  # one line, no traceback
    assert not (user_env["project"] / ".shardfold" / "jobs").exists() or not any(
        p.name.startswith(kind) for p in (user_env["project"] / ".shardfold" / "jobs").iterdir()
    )  # refused before anything was written


def test_demo_runs_what_is_installed_and_names_the_extra_for_the_rest(user_env):
    done = run(user_env, str(user_env["shardfold"]), "demo", "--no-progress", "--items", "16")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert any(line.split()[:2] == ["getbatch", "SUCCEEDED"] for line in lines), done.stdout
    assert any(line.split()[:2] == ["fedavg", "SUCCEEDED"] for line in lines), done.stdout
    text = " ".join(done.stdout.split())
    assert "dpquery: skipped: the dpquery demo needs the 'dp' extra" in text
    assert "inference: skipped: the inference demo needs the 'inference' extra" in text
