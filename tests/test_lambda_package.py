"""The Lambda deployment package (``infra.package``): builds, holds no torch, fits Lambda's limits and
imports every handler in an interpreter that sees nothing but the package.

The builds download wheels from the package index (PyPI): with no index reachable these tests FAIL, naming
the cause. Each architecture is built once per test run, and builds are cached under ``.shardfold/build/``
by a hash of their inputs, so a re-run with unchanged sources and dependencies builds nothing.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import platform
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from shardfold.infra import package
from shardfold.infra.package import (
    IMAGE_ONLY,
    LAMBDA_EXCLUDE,
    LAMBDA_PYTHON_VERSION,
    LAMBDA_UNZIPPED_MAX,
    ForbiddenDependency,
    PackageBuildError,
    PackageError,
    PackageTooLarge,
)

REPO = Path(__file__).resolve().parent.parent
EVENTS = REPO / "events"
HOST_ARCH = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "arm64", "arm64": "arm64"}[
    platform.machine().lower()
]
OTHER_ARCH = "arm64" if HOST_ARCH == "x86_64" else "x86_64"
EM_MACHINE = {"x86_64": 62, "arm64": 183}  # ELF e_machine of each architecture


def _interpreter(version: str) -> str | None:
    """A CPython ``version`` interpreter on this machine: ``$SHARDFOLD_PYTHON<major><minor>`` (e.g.
    ``SHARDFOLD_PYTHON312``), this one if it is that version, ``python<version>`` on PATH, then pyenv's."""
    override = os.environ.get(f"SHARDFOLD_PYTHON{version.replace('.', '')}")
    if f"{sys.version_info[0]}.{sys.version_info[1]}" == version and not override:
        return sys.executable
    root = os.environ.get("PYENV_ROOT") or str(Path.home() / ".pyenv")
    candidates = [override] if override else [shutil.which(f"python{version}")]
    if not override:
        candidates += sorted(glob.glob(f"{root}/versions/{version}.*/bin/python{version}"), reverse=True)
    for candidate in filter(None, candidates):
        try:
            probe = subprocess.run(
                [candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                capture_output=True,
                text=True,
                check=False,
            )
        except OSError:
            continue
        if probe.returncode == 0 and probe.stdout.strip() == version:  # a pyenv shim may not resolve
            return candidate
    return None


@pytest.fixture(scope="module", autouse=True)
def functions_snapshot(tmp_path_factory):
    """Build from a copy of ``functions/`` taken once, so every build and cache lookup of the session sees
    the same sources (the cache key is their hash) even if files change while the suite runs."""
    snap = tmp_path_factory.mktemp("src") / "functions"
    shutil.copytree(REPO / "functions", snap, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(package, "FUNCTIONS_DIR", snap)
        yield snap


def _host_glibc() -> int:
    """Lambda's glibc (2.34), or this machine's if older: the host build's wheels must load here."""
    libc, libc_version = platform.libc_ver()
    host = int(libc_version.split(".")[1]) if libc == "glibc" and libc_version else 17
    return min(package.LAMBDA_GLIBC_MINOR[LAMBDA_PYTHON_VERSION], host)


def _build(
    arch: str, out: Path, python_version: str = LAMBDA_PYTHON_VERSION, glibc: int | None = None
) -> Path:
    try:
        return package.build_lambda_package(arch, out, python_version=python_version, glibc=glibc)
    except PackageBuildError as exc:
        pytest.fail(
            f"building the {arch} Lambda package needs the package index (PyPI) reachable, or pip's cache "
            f"warm for these wheels: {exc}",
            pytrace=False,
        )


@pytest.fixture(scope="module")
def host_build(tmp_path_factory) -> tuple[Path, str, str]:
    """``(zip, python, version)``: the package for this machine's architecture, built for Lambda's Python
    when an interpreter of that version is here (else for this interpreter's), so it can be imported."""
    python = _interpreter(LAMBDA_PYTHON_VERSION)
    if python is None:
        python = sys.executable
        version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    else:
        version = LAMBDA_PYTHON_VERSION
    return _build(HOST_ARCH, tmp_path_factory.mktemp("host"), version, _host_glibc()), python, version


@pytest.fixture(scope="module")
def host_dir(host_build, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("unzipped") / "task"  # Lambda unpacks to /var/task
    with zipfile.ZipFile(host_build[0]) as zf:
        zf.extractall(root)
    return root


@pytest.fixture(scope="module")
def other_zip(tmp_path_factory) -> Path:
    """The other architecture's package (arm64 on an x86_64 machine), for Lambda's Python."""
    return _build(OTHER_ARCH, tmp_path_factory.mktemp("other"))


# ---- what goes in ---------------------------------------------------------------------------------------


def test_requirements_are_the_runtime_deps_minus_client_only_ones_and_never_torch():
    reqs = package.lambda_requirements()
    names = {package._requirement_name(r) for r in reqs}
    assert {"boto3", "numpy", "pydantic", "aws-lambda-powertools", "awscrt", "ml-dtypes"} <= names
    assert not names & {package.canonical(n) for n in LAMBDA_EXCLUDE}
    assert not names & {package.canonical(n) for n in IMAGE_ONLY}
    assert "torch" not in names
    pins = package.pinned_versions(reqs, "arm64", LAMBDA_PYTHON_VERSION)
    assert pins["numpy"] == metadata.version("numpy")  # what the tests run is what ships
    assert pins["botocore"] == metadata.version("botocore")  # boto3 is bundled, with its closure
    assert not any(package.FORBIDDEN_RE.match(n) for n in pins)
    # nothing only the image-only dependencies pull in (cvxpy's scipy and solvers) is in the closure
    assert not set(pins) & image_only_closure()


def _project() -> dict:
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _extras_deps(*extras: str) -> list[str]:
    every = _project()["optional-dependencies"]
    return [r for extra in extras for r in every[extra]]


def image_only_closure() -> set[str]:
    """Distributions the image-only dependencies bring that the zip's requirements do not: all must stay
    out of the zip."""
    image_reqs = [
        r for r in _extras_deps("dp", "inference") if package._requirement_name(r) in set(IMAGE_ONLY)
    ]
    assert {package._requirement_name(r) for r in image_reqs} == set(IMAGE_ONLY)  # from those extras, all
    every = package.pinned_versions(image_reqs, "arm64", LAMBDA_PYTHON_VERSION)
    zipped = package.pinned_versions(package.lambda_requirements(), "arm64", LAMBDA_PYTHON_VERSION)
    only = set(every) - set(zipped)
    assert set(IMAGE_ONLY) <= only and "scipy" in only  # installed here: the tests run dpquery
    return only


def test_image_only_dependencies_come_from_extras_never_the_base_install():
    # locally dpquery and inference need the dp and inference extras; on AWS their functions run the image
    base = {package._requirement_name(r) for r in _project()["dependencies"]}
    extras = {package._requirement_name(r): r for r in _extras_deps("dp", "inference")}
    assert {"opendp", "pyarrow", "cvxpy", "tokenizers"} <= set(IMAGE_ONLY) <= set(extras)
    assert not set(IMAGE_ONLY) & base
    assert extras["opendp"] == "opendp==0.16.0"  # measurements record the sampler's version
    assert not set(IMAGE_ONLY) & set(LAMBDA_EXCLUDE)
    # the zip's one dependency from an extra is named by the extra it comes from
    assert {package._requirement_name(r) for r in _extras_deps("aws")} >= set(package.ZIP_FROM_EXTRAS)


# Parsed in a child process: CPython 3.11.7 keeps the AST converter's recursion depth in per-interpreter
# state (gh-106905), so an ``ast.parse`` racing another thread of this process (pulumi's mocks leave some)
# fails with "AST constructor recursion depth mismatch": seen in CI, on a fresh thread too.
_IMPORTS_SCRIPT = r"""
import ast, json, sys
def top(module):  # the distribution's name, or shardfold's subpackage (shardfold.client)
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "shardfold" else parts[0]
out = {}
for path in sys.argv[1:]:
    names = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Import):
            names |= {top(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(top(node.module))
    out[path] = sorted(names)
print(json.dumps(out))
"""


@functools.cache
def _all_imports() -> dict[Path, set[str]]:
    """The top-level names each ``.py`` file under ``functions/`` imports (absolute imports only; for the
    project's own modules, the subpackage: ``shardfold.functions``, ``shardfold.client``, ...)."""
    paths = sorted(str(p) for p in (REPO / "functions").rglob("*.py"))
    argv = [sys.executable, "-c", _IMPORTS_SCRIPT, *paths]
    done = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=120)
    return {Path(k): set(v) for k, v in json.loads(done.stdout).items()}


def _imports(path: Path) -> set[str]:
    return _all_imports()[path]


def test_image_only_dependencies_are_imported_only_by_image_kinds():
    """A module importing opendp, pyarrow or cvxpy must live in the package of an image kind's handlers (the
    zip test below imports every zip handler, so a zip kind reaching them would fail there too)."""
    image_packages = {h.rsplit(".", 2)[0] for h in package.lambda_handlers("image").values()}
    zip_packages = {h.rsplit(".", 2)[0] for h in package.lambda_handlers("zip").values()}
    image_only = set(IMAGE_ONLY)
    for path in sorted((REPO / "functions").rglob("*.py")):
        used = _imports(path) & image_only
        if used:
            module = "shardfold." + ".".join(path.relative_to(REPO).with_suffix("").parts)
            assert any(module.startswith(p + ".") for p in image_packages - zip_packages), (
                f"{module} imports {sorted(used)}, which only the container image has; move it into an image "
                f"kind's package (Workflow.lambda_package='image'): {sorted(image_packages)}"
            )


def test_function_packages_follow_the_kinds():
    import toyflow  # noqa: F401  (registers the toy functions)

    from shardfold.functions.workflow import Task, Workflow

    zipped = Workflow("a", (Task("p", "toy.plan"), Task("t", "toy.total")))
    imaged = Workflow("b", (Task("t", "toy.total"), Task("s", "toy.stamp")), lambda_package="image")
    assert package.function_packages({"a": zipped, "b": imaged}) == {
        "dispatch": "zip",
        "toy.plan": "zip",
        "toy.stamp": "image",
        "toy.total": "image",  # called by both: the image has every dependency
    }
    assert package.function_packages({"b": imaged, "a": zipped})["toy.total"] == "image"
    assert set(package.lambda_handlers("image", {"b": imaged})) == {"toy.stamp", "toy.total"}
    assert package.lambda_handlers(None, {"b": imaged})["dispatch"] == "shardfold.functions.trigger.handler"
    with pytest.raises(PackageError, match="package must be"):
        package.lambda_handlers("tar")


def test_functions_imports_nothing_from_the_other_packages_or_client_only_deps():
    forbidden = {"shardfold.client", "shardfold.orchestrator", "shardfold.infra"}
    forbidden |= {n.replace("-", "_") for n in LAMBDA_EXCLUDE}
    offenders = {
        str(p.relative_to(REPO)): sorted(_imports(p) & forbidden)
        for p in sorted((REPO / "functions").rglob("*.py"))
        if _imports(p) & forbidden
    }
    assert not offenders, f"functions/ must import none of {sorted(forbidden)}: {offenders}"


def test_torch_in_the_dependencies_is_refused(tmp_path, monkeypatch):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "x"\ndependencies = ["numpy>=1.26", "torch==2.13.0"]\n')
    with pytest.raises(ForbiddenDependency, match="torch"):
        package.lambda_requirements(pyproject)
    # ... also when it comes in through a dependency
    monkeypatch.setattr(package.metadata, "distribution", _fake_distribution({"fancy": ["torch>=2"]}))
    with pytest.raises(ForbiddenDependency, match="torch.*required by fancy"):
        package.pinned_versions(["fancy"], "arm64", "3.12")


def _fake_distribution(requires: dict[str, list[str]]):
    class Dist:
        def __init__(self, name: str):
            self.version, self.requires = "1.0", requires[name]

    def distribution(name: str):
        if name not in requires:
            raise metadata.PackageNotFoundError(name)
        return Dist(name)

    return distribution


def test_installed_torch_or_cuda_wheels_are_refused(tmp_path):
    site = tmp_path / "site"
    (site / "numpy-2.4.6.dist-info").mkdir(parents=True)
    package._check_forbidden_installed(site)
    (site / "nvidia_cublas_cu12-12.8.4.1.dist-info").mkdir()
    with pytest.raises(ForbiddenDependency, match="nvidia-cublas-cu12"):
        package._check_forbidden_installed(site)


def test_architectures():
    assert package.lambda_arch("aarch64") == "arm64" and package.lambda_arch("AMD64") == "x86_64"
    assert package.pip_platforms("arm64")[0] == "manylinux_2_34_aarch64"
    assert "manylinux2014_aarch64" in package.pip_platforms("arm64")
    with pytest.raises(PackageError, match="unknown Lambda architecture"):
        package.lambda_arch("riscv64")
    # python3.11 runs on Amazon Linux 2 (glibc 2.26), python3.12 and later on Amazon Linux 2023 (2.34)
    assert package.pip_platforms("x86_64", package.glibc_minor("3.11"))[0] == "manylinux_2_26_x86_64"
    assert package.glibc_minor("3.13") == 34
    with pytest.raises(PackageError, match="no Lambda Python runtime '3.9'"):
        package.glibc_minor("3.9")


# ---- the zip ------------------------------------------------------------------------------------------


def test_zip_is_deterministic(tmp_path):
    tree = tmp_path / "tree"
    (tree / "pkg").mkdir(parents=True)
    (tree / "pkg" / "b.py").write_text("B = 2\n")
    (tree / "pkg" / "a.py").write_text("A = 1\n")
    (tree / "pkg" / "_ext.so").write_bytes(b"\x7fELF")
    (tree / "pkg" / "_ext.so").chmod(0o755)
    package._write_zip(tree, tmp_path / "1.zip")
    os.utime(tree / "pkg" / "a.py", (1_000_000_000, 1_000_000_000))  # mtimes must not matter
    package._write_zip(tree, tmp_path / "2.zip")
    assert (tmp_path / "1.zip").read_bytes() == (tmp_path / "2.zip").read_bytes()
    with zipfile.ZipFile(tmp_path / "1.zip") as zf:
        infos = zf.infolist()
    assert [i.filename for i in infos] == ["pkg/_ext.so", "pkg/a.py", "pkg/b.py"]
    assert {i.date_time for i in infos} == {(1980, 1, 1, 0, 0, 0)}
    assert [(i.external_attr >> 16) & 0o777 for i in infos] == [0o755, 0o644, 0o644]


@pytest.mark.slow  # builds a package with pip
def test_host_package_fits_lambda_and_holds_only_functions_and_their_deps(host_build):
    zip_path = host_build[0]
    report = package.package_report(zip_path)
    assert report["has_torch"] is False
    assert report["fits"] and report["unzipped_bytes"] <= LAMBDA_UNZIPPED_MAX
    assert report["zip_bytes"] == zip_path.stat().st_size
    top = set(report["top_level"])
    assert "shardfold" in top and {"numpy", "boto3", "botocore", "pydantic", "awscrt"} <= top
    assert not top & {"client", "orchestrator", "infra", "torch", "click", "rich", "safetensors", "bin"}
    assert "functions" not in top  # the project's code is shardfold/functions/, under its one name
    assert report["dists"][package.FUNCTIONS_DIST] > 0
    assert report["unzipped_bytes"] < 150 * 2**20  # far under the limit without the image-only deps
    assert not any(d.startswith("(unowned)") for d in report["dists"]), report["dists"]
    with zipfile.ZipFile(zip_path) as zf:
        names = zf.namelist()
    assert names == sorted(names)
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]


# Run by an interpreter with ``-I -S`` and ``sys.path`` = the unzipped package + its standard library, as
# Lambda imports a zip: import every handler, look for what must be absent, call the dispatch handler.
_IMPORT_CHECK = r"""
import importlib, importlib.util, json, sys
root = sys.argv[1]
sys.path.insert(0, root)
handlers = json.loads(sys.argv[2])
out = {"path": sys.path, "loaded": {}, "absent": {}}
for function, setting in handlers.items():
    module, _, name = setting.rpartition(".")
    mod = importlib.import_module(module)
    assert callable(getattr(mod, name)), setting
    out["loaded"][function] = mod.__file__
for name in ("torch", "click", "rich", "client", "orchestrator", "infra", "functions", "shardfold.client",
             "shardfold.orchestrator", "shardfold.infra", "opendp", "pyarrow", "cvxpy", "scipy"):
    out["absent"][name] = importlib.util.find_spec(name) is None
from shardfold.functions.trigger import handler
out["dispatch"] = handler(json.load(open(sys.argv[3])), None)
"""

# Then (``native=True``): a little native arithmetic, and every extension module loaded, so a test can check
# their architecture, their CPython ABI and that they come from the package (or the interpreter's own).
_NATIVE_CHECK = r"""
import numpy as np, ml_dtypes
x = np.arange(8, dtype=np.float32).astype(ml_dtypes.bfloat16)
assert float(x.astype(np.float32).sum()) == 28.0
import awscrt.io, pydantic_core
out["native"] = sorted({m.__file__ for m in list(sys.modules.values())
                        if (getattr(m, "__file__", None) or "").endswith(".so")})
import platform
out["machine"], out["python"] = platform.machine(), platform.python_version()
out["libc"] = platform.libc_ver()
out["prefix"] = sys.base_prefix
"""


def run_import_check(
    command: list[str], root: Path, tmp_path: Path, *, native: bool = False, timeout: float | None = None
) -> dict:
    """Run the import check with the interpreter ``command`` on the package unzipped at ``root`` (Lambda's
    ``/var/task``) and return what it found; fail with its stderr if it failed."""
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(tmp_path),
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
        "SHARDFOLD_STATE_MACHINES": "{}",
        "POWERTOOLS_LOG_LEVEL": "ERROR",
    }
    script = _IMPORT_CHECK + (_NATIVE_CHECK if native else "") + "print(json.dumps(out))\n"
    proc = subprocess.run(
        [*command, "-I", "-S", "-c", script, str(root), json.dumps(package.lambda_handlers())]
        + [str(EVENTS / "dispatch_not_a_job.json")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_imported_like_lambda(out: dict, root: Path) -> None:
    """What every import check must show: the package first on ``sys.path`` and no site-packages, every zip
    handler loaded from the package, nothing it must not hold, and the packaged dispatch handler ran."""
    handlers = package.lambda_handlers()
    assert out["path"][0] == str(root), out["path"]
    assert not [p for p in out["path"] if "site-packages" in p or str(REPO) in p], out["path"]
    assert set(out["loaded"]) == set(handlers)
    assert all(f.startswith(str(root)) for f in out["loaded"].values()), out["loaded"]
    assert all(out["absent"].values()), out["absent"]
    assert "ignored" in out["dispatch"]  # the packaged dispatch handler ran (powertools' parser, pydantic)


@pytest.mark.slow  # builds a package with pip
def test_host_package_imports_every_handler_in_isolation(host_build, host_dir, tmp_path):
    """Each Lambda handler imports, with ``sys.path`` = the package plus the standard library only."""
    _, python, _ = host_build
    handlers = package.lambda_handlers()
    assert "dispatch" in handlers and "getbatch.prepare" in handlers and "getbatch.gather" in handlers
    assert not set(handlers) & set(package.lambda_handlers("image"))  # those run from Dockerfile.lambda
    assert_imported_like_lambda(run_import_check([python], host_dir, tmp_path), host_dir)


@pytest.mark.slow  # builds a package with pip
@pytest.mark.parametrize("which", ["host", "other"])
def test_zips_hold_none_of_the_image_only_dependencies(which, request):
    zip_path = (
        request.getfixturevalue("host_build")[0] if which == "host" else request.getfixturevalue("other_zip")
    )
    report = package.package_report(zip_path)
    dists = {d.split("==", 1)[0] for d in report["dists"]}
    assert not dists & image_only_closure(), sorted(dists & image_only_closure())
    assert not set(report["top_level"]) & {"opendp", "pyarrow", "cvxpy", "scipy", "scs", "osqp", "clarabel"}


@pytest.mark.slow  # builds a package with pip
def test_other_arch_package_fits_has_no_torch_and_is_built_for_that_cpu(other_zip):
    report = package.package_report(other_zip)
    assert report["has_torch"] is False and report["fits"]
    assert {"shardfold", "numpy", "awscrt"} <= set(report["top_level"])
    with zipfile.ZipFile(other_zip) as zf:
        libs = [n for n in zf.namelist() if n.endswith(".so") or ".so." in n]
        machines = {int.from_bytes(zf.open(n).read(20)[18:20], "little") for n in libs}
    assert libs and machines == {EM_MACHINE[OTHER_ARCH]}


@pytest.mark.slow  # builds a package with pip
def test_a_second_build_comes_from_the_cache_byte_identical(host_build, tmp_path, monkeypatch):
    zip_path, _, version = host_build

    def no_pip(*args, **kwargs):
        raise AssertionError("pip ran for a cached build")

    monkeypatch.setattr(package, "_pip_install", no_pip)
    again = package.build_lambda_package(HOST_ARCH, tmp_path, python_version=version, glibc=_host_glibc())
    assert again.read_bytes() == zip_path.read_bytes()


@pytest.mark.slow  # builds a package with pip
def test_size_limits_name_the_largest_distributions(host_build, monkeypatch):
    report = package.package_report(host_build[0])
    monkeypatch.setattr(package, "LAMBDA_UNZIPPED_MAX", 2**20)
    report = package.package_report(host_build[0])
    with pytest.raises(PackageTooLarge, match=r"over Lambda's 1\.0 MiB limit; largest: numpy=="):
        package._check_size(report, None)
    monkeypatch.undo()
    report = package.package_report(host_build[0])
    with pytest.raises(PackageTooLarge, match=r"zipped, over 1\.0 MiB .*through S3"):
        package._check_size(report, max_zip_bytes=2**20)


def test_report_spots_torch_in_a_zip(tmp_path):
    bad = tmp_path / "bad.zip"
    with zipfile.ZipFile(bad, "w") as zf:
        zf.writestr("torch/__init__.py", "")
        zf.writestr("functions/__init__.py", "")
    report = package.package_report(bad)
    assert report["has_torch"] is True
    with pytest.raises(ForbiddenDependency):
        package._check_size(report, None)


@pytest.mark.slow  # builds a package with pip
def test_an_unreachable_index_is_a_clear_build_error(tmp_path, monkeypatch):
    # what the builds above raise (and the fixture turns into a test failure) when PyPI cannot be reached
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no configured mirrors or find-links either
    for var in ("PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens there
    monkeypatch.setenv("PIP_RETRIES", "0")
    with pytest.raises(PackageBuildError, match=r"(?s)index \(PyPI\).*unreachable"):
        package.build_lambda_package("arm64", tmp_path / "out", cache_dir=tmp_path / "cache")
    assert not list((tmp_path / "cache").iterdir())  # nothing half-built is cached


def test_the_build_cache_keeps_the_newest_few_of_each_kind(tmp_path):
    """Every change to functions/ makes a new build (the emulator's image folder is about 1 GB): older ones of
    the same architecture and Python version, or of the image, are dropped; other kinds are left alone."""
    names = [f"x86_64-py3.12-{i:04x}" for i in range(5)] + [f"emulator-image-{i:04x}" for i in range(5)]
    for age, name in enumerate(reversed(names)):
        (tmp_path / name).mkdir()
        os.utime(tmp_path / name, (1_000_000 - age, 1_000_000 - age))
    (tmp_path / "arm64-py3.12-0000").mkdir()
    package.prune(tmp_path, keep=tmp_path / "x86_64-py3.12-0000")
    package.prune(tmp_path, keep=tmp_path / "emulator-image-0001")
    left = sorted(p.name for p in tmp_path.iterdir())
    newest = package.CACHE_KEEP - 1  # besides the one kept
    assert (
        left
        == sorted(
            ["arm64-py3.12-0000", "x86_64-py3.12-0000", "emulator-image-0001"]
            + [n for n in names if n.startswith("x86_64")][-newest:]  # the newest are last
            + [n for n in names if n.startswith("emulator") and n != "emulator-image-0001"][-newest:]
        )
    )
