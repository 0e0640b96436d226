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

What this proves, and what not (docs/deploy.md): Lambda runs ``python3.12``, and no
Debian suite ships an arm64 ``python3.12``, so the package is built here for the sysroot's Python (3.13, or
3.12 if a sysroot provides one): the same distributions at the same versions as the 3.12 arm64 package
(checked below), with the aarch64 wheels of that Python. The sysroot's glibc (2.41) is newer than Amazon Linux
2023's (2.34): that the wheels need no more than 2.34 rests on their ``manylinux_2_34`` (or older) tags, which
``infra.package`` selects, not on this test.
"""

from __future__ import annotations

import os
import shutil
import zipfile
from pathlib import Path

import pytest
from test_lambda_package import (  # noqa: F401  (functions_snapshot: an autouse fixture)
    _build,
    assert_imported_like_lambda,
    functions_snapshot,
    run_import_check,
)

from shardfold.infra import package
from shardfold.infra.package import LAMBDA_PYTHON_VERSION

pytestmark = pytest.mark.slow

SETUP = "sh tests/arm64/setup.sh"
SYSROOT = Path(os.environ.get("SHARDFOLD_ARM64_SYSROOT") or Path.home() / ".cache/shardfold/arm64-sysroot")
QEMU_CPU = "neoverse-n1"  # Graviton2; qemu's default "max" also emulates pointer authentication, 10x slower
IMPORT_TIMEOUT_S = 600  # about 20 s on a 2-core x86_64 machine
EM_AARCH64 = 183  # ELF e_machine


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
    out = run_import_check(command, arm64_build, tmp_path, native=True, timeout=IMPORT_TIMEOUT_S)
    assert out["machine"] == "aarch64" and out["python"].startswith(version + "."), out
    assert out["libc"][0] == "glibc", out["libc"]
    assert_imported_like_lambda(out, arm64_build)
    assert all(p.startswith(str(SYSROOT)) for p in out["path"][1:]), out["path"]  # the sysroot's stdlib
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
