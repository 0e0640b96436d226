"""The arm64 Lambda package imported by an aarch64 CPython, under qemu-user, the way Lambda imports it.

``tests/test_lambda_package.py`` imports the package built for this machine (x86_64) only; the package
Shardfold deploys is arm64. This module builds the arm64 package with ``infra.package.build_lambda_package``,
unzips it as Lambda does (``/var/task``), and runs an aarch64 ``python3`` from a Debian arm64 sysroot under
``qemu-aarch64 -cpu neoverse-n1`` (the core of Graviton2, which Lambda's arm64 functions run on) with
``sys.path`` = the package plus that interpreter's standard library: every zip handler module is imported, the
dispatch handler is called on a sample event, and the aarch64 extension modules it loaded are listed.

Setup, once per machine (as root; CI does not run it, so there the tests here are skipped, saying why)::

    sh tests/arm64/setup.sh

It installs ``qemu-user`` if missing and unpacks Debian trixie's arm64 ``python3.13`` (with libc6 and
libstdc++6) into ``~/.cache/shardfold/arm64-sysroot`` (``SHARDFOLD_ARM64_SYSROOT`` overrides), without
touching the system's apt sources.

What this proves, and what not (README, "What the package tests prove"): Lambda runs ``python3.12``, and no
Debian suite ships an arm64 ``python3.12``, so the package is built here for the sysroot's Python (3.13, or
3.12 if a sysroot provides one): the same distributions at the same versions as the 3.12 arm64 package
(checked below), with the aarch64 wheels of that Python. The sysroot's glibc (2.41) is newer than Amazon Linux
2023's (2.34): that the wheels need no more than 2.34 rests on their ``manylinux_2_34`` (or older) tags, which
``infra.package`` selects, not on this test.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
from test_lambda_package import _IMPORT_CHECK, EVENTS, _build, functions_snapshot  # noqa: F401

from infra import package
from infra.package import LAMBDA_PYTHON_VERSION

pytestmark = pytest.mark.slow

SETUP = "sh tests/arm64/setup.sh"
SYSROOT = Path(os.environ.get("SHARDFOLD_ARM64_SYSROOT") or Path.home() / ".cache/shardfold/arm64-sysroot")
QEMU_CPU = "neoverse-n1"  # Graviton2; qemu's default "max" also emulates pointer authentication, 10x slower
IMPORT_TIMEOUT_S = 600  # about 20 s on a 2-core x86_64 machine
EM_AARCH64 = 183  # ELF e_machine

# Run after _IMPORT_CHECK's handlers: every extension module loaded, so the test can check they are aarch64
# and come from the package (or the interpreter's own lib-dynload), and a little native arithmetic.
_NATIVE_CHECK = r"""
import sys
import numpy as np, ml_dtypes
x = np.arange(8, dtype=np.float32).astype(ml_dtypes.bfloat16)
assert float(x.astype(np.float32).sum()) == 28.0
import awscrt.io, pydantic_core
out["native"] = sorted({m.__file__ for m in list(sys.modules.values())
                        if (getattr(m, "__file__", None) or "").endswith(".so")})
import platform
out["machine"], out["python"] = platform.machine(), platform.python_version()
out["libc"] = platform.libc_ver()
print(json.dumps(out))
"""


def _qemu() -> str | None:
    return shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")


def _sysroot_python() -> tuple[str, str] | None:
    """``(path, version)`` of the sysroot's aarch64 interpreter: Lambda's version if there, else 3.13."""
    for version in (LAMBDA_PYTHON_VERSION, "3.13"):
        python = SYSROOT / "usr" / "bin" / f"python{version}"
        if python.is_file():
            return str(python), version
    return None


@pytest.fixture(scope="module")
def arm64_python() -> tuple[list[str], str]:
    """``(command, version)``: how to run the aarch64 interpreter, or skip saying what is missing."""
    qemu = _qemu()
    if qemu is None:
        pytest.skip(f"qemu-aarch64 is not installed; set it and the arm64 sysroot up once with `{SETUP}`")
    found = _sysroot_python()
    if found is None:
        pytest.skip(f"no arm64 python3.12 or python3.13 under {SYSROOT}; set it up once with `{SETUP}`")
    python, version = found
    return [qemu, "-cpu", QEMU_CPU, "-L", str(SYSROOT), python], version


@pytest.fixture(scope="module")
def arm64_build(arm64_python, tmp_path_factory) -> Path:
    """The arm64 package for the sysroot's Python and Lambda's glibc, unzipped as Lambda does."""
    zip_path = _build("arm64", tmp_path_factory.mktemp("arm64"), arm64_python[1])
    root = tmp_path_factory.mktemp("unzipped-arm64") / "task"
    with zipfile.ZipFile(zip_path) as zf:
        zf.extractall(root)
    return root


def test_arm64_package_imports_every_handler_on_aarch64_python(arm64_python, arm64_build, tmp_path):
    command, version = arm64_python
    handlers = package.lambda_handlers()
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(tmp_path),
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
        "SHARDFOLD_STATE_MACHINES": "{}",
        "POWERTOOLS_LOG_LEVEL": "ERROR",
    }
    script = _IMPORT_CHECK.replace("print(json.dumps(out))\n", "") + _NATIVE_CHECK
    proc = subprocess.run(
        [*command, "-I", "-S", "-c", script, str(arm64_build), json.dumps(handlers)]
        + [str(EVENTS / "dispatch_not_a_job.json")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=IMPORT_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["machine"] == "aarch64" and out["python"].startswith(version + "."), out
    assert out["libc"][0] == "glibc", out["libc"]
    assert out["path"][0] == str(arm64_build)
    assert all(p.startswith(str(SYSROOT)) for p in out["path"][1:]), out["path"]  # no host site-packages
    assert set(out["loaded"]) == set(handlers)
    assert all(f.startswith(str(arm64_build)) for f in out["loaded"].values()), out["loaded"]
    assert all(out["absent"].values()), out["absent"]
    assert "ignored" in out["dispatch"]  # the packaged dispatch handler ran (powertools' parser, pydantic)
    # the package's own native code ran: numpy, ml_dtypes, pydantic_core and awscrt, all aarch64 ELF
    native = [Path(f) for f in out["native"]]
    from_package = {
        p.relative_to(arm64_build).parts[0].split(".")[0] for p in native if p.is_relative_to(arm64_build)
    }
    assert {"numpy", "ml_dtypes", "pydantic_core", "_awscrt"} <= from_package, from_package
    assert all(p.is_relative_to(arm64_build) or p.is_relative_to(SYSROOT) for p in native), native
    assert {int.from_bytes(p.read_bytes()[18:20], "little") for p in native} == {EM_AARCH64}


def test_arm64_package_tested_holds_what_the_deployed_one_does(arm64_python, tmp_path):
    """The package imported above (for the sysroot's Python) and the deployed one (python3.12) hold the same
    distributions at the same versions: only the wheels' Python tags differ."""
    version = arm64_python[1]
    tested = package.package_report(_build("arm64", tmp_path / "tested", version))
    deployed = package.package_report(_build("arm64", tmp_path / "deployed", LAMBDA_PYTHON_VERSION))
    assert set(tested["dists"]) == set(deployed["dists"])
    assert tested["top_level"] == deployed["top_level"]
