"""The x86_64 Lambda package imported by a real CPython 3.12, the Python of Lambda's ``python3.12`` runtime.

``tests/test_lambda_package_arm64.py`` runs the deployed architecture's code (aarch64) but on CPython 3.13,
because no arm64 3.12 is at hand; this module proves the other half, the **3.12 ABI**, on x86_64: it builds
the x86_64 package with ``infra.package.build_lambda_package`` for ``python_version="3.12"``, unzips it as
Lambda does (``/var/task``) and runs a CPython 3.12 with ``-I -S`` and ``sys.path`` = the package plus that
interpreter's standard library (no site-packages): every zip handler module is imported, the dispatch handler
is called on a sample event, and every extension module loaded must be an x86_64 build for CPython 3.12
(``cpython-312`` or the stable ``abi3``) from the package, or the interpreter's own.

The interpreter: ``$SHARDFOLD_PYTHON312``, else ``python3.12`` on ``PATH``, else pyenv's (``~/.pyenv`` or
``$PYENV_ROOT``); with none, the test is skipped, saying so. The wheels are Lambda's (``manylinux_2_34`` or
older) unless this machine's glibc is older, as for the host build in ``tests/test_lambda_package.py``.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
from test_lambda_package import (  # noqa: F401  (functions_snapshot: an autouse fixture)
    EM_MACHINE,
    HOST_ARCH,
    _build,
    _host_glibc,
    _interpreter,
    assert_imported_like_lambda,
    functions_snapshot,
    run_import_check,
)

from shardfold.infra.package import LAMBDA_PYTHON_VERSION

pytestmark = pytest.mark.slow  # builds a package with pip

VERSION = "3.12"
TAG = "cpython-312-x86_64-linux-gnu"  # the extension-module suffix of CPython 3.12 on x86_64 Linux


@pytest.fixture(scope="module")
def python312() -> str:
    python = _interpreter(VERSION)
    if python is None:
        pytest.skip(
            "no CPython 3.12 found: set SHARDFOLD_PYTHON312 to one, put python3.12 on PATH, or "
            "`pyenv install 3.12`"
        )
    return python


@pytest.fixture(scope="module")
def py312_dir(python312, tmp_path_factory) -> Path:
    """The x86_64 package for Python 3.12, unzipped as Lambda does."""
    zip_path = _build("x86_64", tmp_path_factory.mktemp("py312"), VERSION, _host_glibc())
    root = tmp_path_factory.mktemp("unzipped-py312") / "task"
    with zipfile.ZipFile(zip_path) as zf:
        zf.extractall(root)
    return root


def test_lambda_runs_python_312():
    assert LAMBDA_PYTHON_VERSION == VERSION  # if Lambda's runtime moves, this module must follow it


@pytest.mark.skipif(HOST_ARCH != "x86_64", reason="runs the x86_64 package natively: not an x86_64 machine")
def test_x86_64_package_imports_every_handler_on_cpython_312(python312, py312_dir, tmp_path):
    out = run_import_check([python312], py312_dir, tmp_path, native=True)
    assert out["machine"] == "x86_64" and out["python"].startswith(VERSION + "."), out
    assert_imported_like_lambda(out, py312_dir)
    prefix = Path(out["prefix"])
    assert all(Path(p).is_relative_to(prefix) for p in out["path"][1:]), out["path"]  # its stdlib only
    native = [Path(f) for f in out["native"]]
    packaged = [p for p in native if p.is_relative_to(py312_dir)]
    assert all(p in packaged or p.is_relative_to(prefix) for p in native), native
    # numpy, ml_dtypes, pydantic_core and awscrt ran their own native code, built for CPython 3.12 (or its
    # stable ABI), x86_64 ELF
    by_dist = {p.relative_to(py312_dir).parts[0].split(".")[0] for p in packaged}
    assert {"numpy", "ml_dtypes", "pydantic_core", "_awscrt"} <= by_dist, by_dist
    wrong = [p.name for p in packaged if not (p.name.endswith(f".{TAG}.so") or p.name.endswith(".abi3.so"))]
    assert not wrong, f"extension modules not built for CPython 3.12: {wrong}"
    version_specific = {p.relative_to(py312_dir).parts[0] for p in packaged if p.name.endswith(f".{TAG}.so")}
    assert {"numpy", "ml_dtypes", "pydantic_core"} <= version_specific, version_specific
    assert {int.from_bytes(p.read_bytes()[18:20], "little") for p in native} == {EM_MACHINE["x86_64"]}
