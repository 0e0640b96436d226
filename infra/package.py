"""The Lambda deployment package: ``shardfold.functions`` plus its runtime dependencies, as one zip.

:func:`build_lambda_package` pip-installs the project's runtime dependencies for Lambda's platform
(``manylinux_2_34`` or older: the glibc of the ``python3.12`` runtime on Amazon Linux 2023), CPU
architecture and Python version with ``--only-binary=:all:``, adds ``shardfold/__init__.py`` and the
``functions`` folder as ``shardfold/functions/`` (only: no ``client``, ``orchestrator`` or ``infra``),
strips what Lambda never reads and writes a deterministic zip: sorted entries, fixed timestamps and
permissions, so unchanged code gives byte-identical zips and Pulumi deploys nothing. Builds are cached
under ``.shardfold/build/<key>/`` by a hash of the dependency pins, the architecture, the Python version and
the ``functions/`` sources.

Choices, documented here because they decide what runs on Lambda:

- **Dependencies** are ``[project] dependencies`` from ``pyproject.toml`` (the base install) minus
  :data:`LAMBDA_EXCLUDE` (packages only the client side imports; ``tests/test_lambda_package.py`` checks that
  ``functions/`` never imports them), plus :data:`ZIP_FROM_EXTRAS` (awscrt, GetBatch's S3 client, from the
  ``aws`` extra). :data:`IMAGE_ONLY` (from the ``dp`` and ``inference`` extras, too big for a zip) stays out:
  only the functions of kinds deployed as container images, ``Workflow.lambda_package == "image"``, import
  them; they run from ``Dockerfile.lambda``, which installs the lock's ``requirements/lambda-image.txt``.
  pip resolves the dependencies of what it is given only, so whatever only an excluded package pulls in
  (cvxpy's scipy and solvers) stays out too. ``torch`` (and any ``nvidia-*``/``cuda-*``/``triton``
  distribution) is refused before and after pip runs: it belongs in the GPU worker image only.
- **Which functions** the zip serves: :func:`lambda_handlers` (``package="zip"``): the Tasks of kinds with
  ``lambda_package == "zip"`` and the dispatch function. The zip still holds the whole ``functions``
  package, image kinds' modules included, but their handlers cannot import there and are not deployed from it.
- **boto3/botocore are bundled**, not taken from the runtime: the runtime's copy lags and changes under us,
  and the store uses S3 features (conditional writes) that need a recent botocore.
- **Versions are pinned to the build environment**: every distribution in the dependency closure is
  installed at the version installed where the build runs (the environment the tests ran in), through a pip
  constraints file; a dependency not installed there is resolved from its ``pyproject.toml`` specifier.
- **No bytecode**: ``.pyc`` files are not shipped (``--no-compile``, ``__pycache__`` stripped), so the zip
  does not depend on the build machine's interpreter; Lambda compiles on import.
- **Limits** (https://docs.aws.amazon.com/lambda/latest/dg/gettingstarted-limits.html): the unzipped size
  must be at most 250 MB (262,144,000 bytes), checked at build time with an error naming the largest
  distributions. A zip over 50 MB cannot be uploaded directly with ``CreateFunction``/``UpdateFunctionCode``;
  it must go through S3 (:func:`package_report` says ``direct_upload``); pass ``max_zip_bytes=
  LAMBDA_ZIP_DIRECT_MAX`` to make that an error instead.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from collections.abc import Iterable, Mapping
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardfold.functions.errors import ShardfoldError
from shardfold.functions.log import logger
from shardfold.infra.config import DISPATCH

if TYPE_CHECKING:
    from shardfold.functions.workflow import Workflow


REPO = Path(__file__).resolve().parent.parent
PYPROJECT = REPO / "pyproject.toml"
FUNCTIONS_DIR = REPO / "functions"  # shardfold.functions: the zip holds it as shardfold/functions/
PACKAGE_INIT = REPO / "shardfold" / "__init__.py"  # the import package's root (no imports: cheap in Lambda)
BUILD_ROOT = REPO / ".shardfold" / "build"

DISPATCH_HANDLER = "shardfold.functions.trigger.handler"  # the bucket trigger's Handler setting
LAMBDA_RUNTIME = "python3.12"  # the ``runtime`` of every Shardfold Lambda function
LAMBDA_PYTHON_VERSION = "3.12"
# glibc of each Python runtime's OS: python3.12 and later run on Amazon Linux 2023 (glibc 2.34), python3.11
# on Amazon Linux 2 (glibc 2.26). Wheels tagged for that glibc or an older one run there; pip does not
# expand ``--platform manylinux_2_34_*`` to older versions, so every one is passed.
LAMBDA_GLIBC_MINOR = {"3.11": 26, "3.12": 34, "3.13": 34}
ARCHITECTURES = {"arm64": "aarch64", "x86_64": "x86_64"}  # Lambda's name -> the wheel tag's machine
_ARCH_ALIASES = {"aarch64": "arm64", "amd64": "x86_64", "x86-64": "x86_64"}

LAMBDA_UNZIPPED_MAX = 262_144_000  # "250 MB" (MiB): function code plus layers, unzipped
LAMBDA_ZIP_DIRECT_MAX = 52_428_800  # "50 MB" (MiB): a zip uploaded directly with the API (larger: via S3)

# Dependencies that only the client side (SDK, CLI) imports; `functions/` must not import them.
LAMBDA_EXCLUDE: dict[str, str] = {
    "click": "the CLI only",
    "rich": "the CLI only",
    "safetensors": "shardfold.client.fedavg only; the fedavg functions parse safetensors headers themselves",
    "cryptography": "shardfold.client.fedavg's secure aggregation (the secure extra); the job only sums",
}
# Dependencies of extras that every Lambda function has (the zip, and so the image too): name -> extra.
ZIP_FROM_EXTRAS: dict[str, str] = {"awscrt": "aws"}
# Dependencies of the dp and inference extras too big for the zip (its 250 MiB limit): kept out of it,
# installed only in the container image (Dockerfile.lambda) that the functions of `lambda_package="image"`
# kinds run from. Only those kinds' modules may import them (tests/test_lambda_package.py checks).
IMAGE_ONLY: dict[str, str] = {
    "opendp": "dpquery's Gaussian sampler; its native library alone is about 250 MiB unzipped",
    "pyarrow": "dpquery's datasets and output tables; about 150 MiB unzipped",
    "cvxpy": "dpquery's max_variance loss; pulls in scipy and solvers (about 250 MiB more)",
    "tokenizers": "inference's CPU stage (an image kind: it needs pyarrow); pulls in huggingface_hub, click",
}
# Never in a Lambda package (size limit; GPU code lives in the Batch worker image).
FORBIDDEN_RE = re.compile(r"^(torch|torchvision|torchaudio|triton|nvidia-.*|cuda-.*)$")

PIP_TIMEOUT_S = 900  # one pip run (a cold build downloads about 40 MB)
CACHE_KEEP = 3  # cached builds kept per architecture and Python version
BUILD_FORMAT = 1  # bump when the build steps change, so cached packages are rebuilt
FUNCTIONS_DIST = "shardfold (functions)"  # how package_report names the project's own code
_STRIP_DIRS = {"__pycache__", "tests"}
_ZIP_LEVEL = 6
_STRIP_TOP = {"bin"}  # console scripts pip writes with the build machine's interpreter in the shebang
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)


class PackageError(ShardfoldError):
    """The Lambda package cannot be built as configured."""


class PackageBuildError(PackageError):
    """pip could not install the dependencies for Lambda's platform (no network, no wheel, ...)."""


class ForbiddenDependency(PackageError):
    """A distribution that must never be in a Lambda package (torch, CUDA) would end up in it."""


class PackageTooLarge(PackageError):
    """The package exceeds one of Lambda's size limits."""


def canonical(name: str) -> str:
    """PEP 503 normalised distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def lambda_arch(arch: str) -> str:
    """Lambda's architecture name (``arm64`` or ``x86_64``) for ``arch`` or one of its aliases."""
    name = _ARCH_ALIASES.get(arch.lower(), arch.lower())
    if name not in ARCHITECTURES:
        raise PackageError(f"unknown Lambda architecture {arch!r}; use one of {sorted(ARCHITECTURES)}")
    return name


def glibc_minor(python_version: str) -> int:
    """The glibc minor version (2.x) of the Lambda runtime for ``python_version``."""
    if python_version not in LAMBDA_GLIBC_MINOR:
        raise PackageError(
            f"no Lambda Python runtime {python_version!r} is known here; use one of "
            f"{sorted(LAMBDA_GLIBC_MINOR)}"
        )
    return LAMBDA_GLIBC_MINOR[python_version]


def pip_platforms(arch: str, glibc: int = LAMBDA_GLIBC_MINOR[LAMBDA_PYTHON_VERSION]) -> list[str]:
    """The ``pip --platform`` tags for Lambda's ``arch``: ``manylinux_2_<glibc>`` down to the oldest glibc
    the architecture has wheels for (2.17 on aarch64, 2.5 on x86_64), plus their legacy aliases."""
    machine = ARCHITECTURES[lambda_arch(arch)]
    oldest = 17 if machine == "aarch64" else 5
    tags = [f"manylinux_2_{m}_{machine}" for m in range(glibc, oldest - 1, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    return tags + [f"{alias}_{machine}" for m, alias in legacy.items() if m >= oldest]


def _requirement_name(req: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    if not match:
        raise PackageError(f"cannot read the requirement {req!r} in {PYPROJECT}")
    return canonical(match.group(1))


def extra_requirement(name: str, extra: str, pyproject: Path | None = None) -> str:
    """The requirement of distribution ``name`` in ``extra`` of ``pyproject.toml`` (e.g. ``awscrt>=0.27``)."""
    project = tomllib.loads((PYPROJECT if pyproject is None else pyproject).read_text())["project"]
    for req in project.get("optional-dependencies", {}).get(extra, []):
        if _requirement_name(req) == canonical(name):
            return req
    raise PackageError(f"the {extra!r} extra of {pyproject or PYPROJECT} has no {name!r}")


def lambda_requirements(pyproject: Path | None = None) -> list[str]:
    """The requirements installed into the package: the project's base dependencies (of
    ``pyproject.toml``) minus :data:`LAMBDA_EXCLUDE` and :data:`IMAGE_ONLY`, plus :data:`ZIP_FROM_EXTRAS`.
    Refuses torch and CUDA distributions."""
    pyproject = PYPROJECT if pyproject is None else pyproject
    if not pyproject.is_file():
        raise PackageError(f"no {pyproject}: build the Lambda package from a Shardfold checkout")
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    left_out = {canonical(x) for x in (*LAMBDA_EXCLUDE, *IMAGE_ONLY)}
    reqs = [d for d in deps if _requirement_name(d) not in left_out]
    bad = [r for r in reqs if FORBIDDEN_RE.match(_requirement_name(r))]
    if bad:
        raise ForbiddenDependency(
            f"{bad} are runtime dependencies in {pyproject}, but nothing GPU-sized may go into a Lambda "
            "package; move them to the 'inference' extra (the GPU worker image installs it)"
        )
    reqs += [extra_requirement(n, extra, pyproject) for n, extra in ZIP_FROM_EXTRAS.items()]
    return sorted(reqs, key=_requirement_name)


def _marker_tools() -> tuple[Any, Any]:
    try:
        from packaging.markers import Marker
        from packaging.requirements import Requirement
    except ImportError:  # pip vendors packaging, and pip is needed for the build anyway
        from pip._vendor.packaging.markers import Marker  # type: ignore[no-redef]
        from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    return Marker, Requirement


def _target_environment(arch: str, python_version: str) -> dict[str, str]:
    return {
        "python_version": python_version,
        "python_full_version": f"{python_version}.0",
        "implementation_name": "cpython",
        "implementation_version": f"{python_version}.0",
        "platform_python_implementation": "CPython",
        "platform_machine": ARCHITECTURES[lambda_arch(arch)],
        "platform_system": "Linux",
        "sys_platform": "linux",
        "os_name": "posix",
        "platform_release": "",
        "platform_version": "",
    }


def pinned_versions(requirements: Iterable[str], arch: str, python_version: str) -> dict[str, str]:
    """``{distribution: version}`` for the closure of ``requirements`` (markers evaluated for Lambda's
    platform), taken from the distributions installed where this runs. Refuses torch and CUDA."""
    _, Requirement = _marker_tools()
    env = _target_environment(arch, python_version)
    pins: dict[str, str] = {}
    queue = [(Requirement(r), "") for r in requirements]
    seen: set[tuple[str, frozenset[str]]] = set()
    while queue:
        req, via = queue.pop()
        name = canonical(req.name)
        if FORBIDDEN_RE.match(name):
            raise ForbiddenDependency(
                f"{name} would be installed into the Lambda package (required by {via or 'pyproject.toml'}); "
                "GPU libraries belong in the worker image only"
            )
        extras = frozenset(req.extras)
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            continue  # not installed here: pip resolves it from the specifier
        pins[name] = dist.version
        for spec in dist.requires or []:
            sub = Requirement(spec)
            if sub.marker is not None and not any(
                sub.marker.evaluate({**env, "extra": e}) for e in ({""} | set(extras))
            ):
                continue
            queue.append((sub, name))
    return dict(sorted(pins.items()))


def _source_files(root: Path) -> list[Path]:
    return sorted(
        p
        for p in root.rglob("*")
        if p.is_file() and not (_STRIP_DIRS & set(p.relative_to(root).parts)) and p.suffix != ".pyc"
    )


def sources_digest(root: Path | None = None) -> str:
    """sha256 over the ``functions`` package's files (paths and bytes) and the ``shardfold`` package root."""
    root = FUNCTIONS_DIR if root is None else root
    h = hashlib.sha256(PACKAGE_INIT.read_bytes())
    for path in _source_files(root):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def build_key(
    arch: str, python_version: str = LAMBDA_PYTHON_VERSION, glibc: int | None = None
) -> tuple[str, dict[str, Any]]:
    """The cache key of a build and the inputs it hashes."""
    arch = lambda_arch(arch)
    reqs = lambda_requirements()
    inputs = {
        "format": BUILD_FORMAT,
        "arch": arch,
        "platforms": pip_platforms(arch, glibc_minor(python_version) if glibc is None else glibc),
        "python_version": python_version,
        "requirements": reqs,
        "pins": pinned_versions(reqs, arch, python_version),
        "functions": sources_digest(),
    }
    return _key(inputs), inputs


def _key(inputs: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
    return f"{inputs['arch']}-py{inputs['python_version']}-{digest[:20]}"


def build_lambda_package(
    arch: str,
    out_dir: str | os.PathLike[str],
    *,
    python_version: str = LAMBDA_PYTHON_VERSION,
    max_zip_bytes: int | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    glibc: int | None = None,
) -> Path:
    """Build (or take from the cache) the Lambda zip for ``arch`` (``arm64`` or ``x86_64``) and copy it to
    ``out_dir/shardfold-lambda-<arch>.zip``; return that path.

    ``python_version`` is the runtime's (``3.12`` for :data:`LAMBDA_RUNTIME`; ``python3.11`` runs on Amazon
    Linux 2, whose glibc 2.26 many current wheels, numpy's among them, no longer support). ``glibc``
    overrides the runtime's glibc minor version (tests build for the host's Python and glibc to import the
    result).

    Raises :class:`PackageTooLarge` when the unzipped size exceeds Lambda's 250 MiB or the zip exceeds
    ``max_zip_bytes``, :class:`ForbiddenDependency` for torch or CUDA, and :class:`PackageBuildError` when
    pip fails (it needs the package index reachable, or its cache warm).
    """
    arch = lambda_arch(arch)
    key, inputs = build_key(arch, python_version, glibc)
    cache = Path(cache_dir) if cache_dir is not None else BUILD_ROOT
    entry = cache / key
    zip_path = entry / "package.zip"
    if zip_path.is_file():
        logger.info("lambda package from cache", extra={"key": key})
    else:
        cache.mkdir(parents=True, exist_ok=True)
        zip_path = _build(inputs, cache) / "package.zip"
    report = package_report(zip_path)
    _check_size(report, max_zip_bytes)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dest = out / f"shardfold-lambda-{arch}.zip"
    if not dest.is_file() or _sha256(dest) != report["sha256"]:
        tmp = dest.with_suffix(".zip.tmp")
        shutil.copyfile(zip_path, tmp)
        os.replace(tmp, dest)
    return dest


def _build(inputs: dict[str, Any], cache: Path) -> Path:
    """Build into a temporary directory under ``cache``, then move it to its key's entry; return that."""
    work = Path(tempfile.mkdtemp(prefix=f".{_key(inputs)}-", dir=cache))
    try:
        site = work / "site"
        _pip_install(inputs, site, work)
        _check_forbidden_installed(site)
        _strip(site)
        (site / "shardfold").mkdir()
        shutil.copyfile(PACKAGE_INIT, site / "shardfold" / "__init__.py")
        shutil.copytree(
            FUNCTIONS_DIR,
            site / "shardfold" / "functions",
            ignore=lambda d, names: [n for n in names if n in _STRIP_DIRS or n.endswith(".pyc")],
        )
        # the key names what was copied, even if functions/ changed while pip ran
        inputs = {**inputs, "functions": sources_digest(site / "shardfold" / "functions")}
        entry = cache / _key(inputs)
        unzipped = sum(p.stat().st_size for p in site.rglob("*") if p.is_file())
        if unzipped > LAMBDA_UNZIPPED_MAX:
            sizes = _dist_sizes_dir(site)
            raise PackageTooLarge(
                f"the {inputs['arch']} Lambda package is {_mib(unzipped)} unzipped, over Lambda's "
                f"{_mib(LAMBDA_UNZIPPED_MAX)} limit; largest: {_largest_text(sizes)}. Drop or replace "
                "a heavy runtime dependency in pyproject.toml (or add a client-only one to LAMBDA_EXCLUDE)"
            )
        _write_zip(site, work / "package.zip")
        (work / "inputs.json").write_text(json.dumps(inputs, indent=1, sort_keys=True))
        shutil.rmtree(site)
        try:
            os.replace(work, entry)
        except OSError:  # a concurrent build of the same key won: identical contents, keep that one
            if not (entry / "package.zip").is_file():
                raise
        prune(cache, keep=entry)
        return entry
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)


def prune(cache: Path, keep: Path) -> None:
    """Drop all but the newest :data:`CACHE_KEEP` builds of ``keep``'s kind: its name up to the last dash
    (a zip's architecture and Python version, or the emulator's image folder)."""
    prefix = keep.name.rsplit("-", 1)[0] + "-"
    entries = [p for p in cache.glob(prefix + "*") if p.is_dir() and p != keep]
    entries.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[CACHE_KEEP - 1 :]:
        shutil.rmtree(old, ignore_errors=True)


def _pip_install(inputs: dict[str, Any], site: Path, work: Path) -> None:
    reqs = work / "requirements.txt"
    reqs.write_text("".join(f"{r}\n" for r in inputs["requirements"]))
    constraints = work / "constraints.txt"
    constraints.write_text("".join(f"{n}=={v}\n" for n, v in inputs["pins"].items()))
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--target",
        str(site),
        *(arg for tag in inputs["platforms"] for arg in ("--platform", tag)),
        "--implementation",
        "cp",
        "--python-version",
        inputs["python_version"],
        "--only-binary=:all:",
        "--no-compile",
        "--disable-pip-version-check",
        "--no-input",
        "--progress-bar",
        "off",
        "-r",
        str(reqs),
        "-c",
        str(constraints),
    ]
    logger.info(
        "building the lambda package", extra={"arch": inputs["arch"], "python": inputs["python_version"]}
    )
    logger.debug("pip", extra={"cmd": cmd})
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise PackageBuildError(
            f"pip did not finish installing the Lambda dependencies within {PIP_TIMEOUT_S} s; is the package "
            "index (PyPI) reachable?"
        ) from exc
    if proc.returncode != 0:
        said = f"{proc.stdout}\n{proc.stderr}".strip()
        tail = "\n".join(line for line in said.splitlines()[-20:] if line.strip())
        markers = ("(from versions: none)", "no matching distributions available", "Could not fetch URL")
        if any(m in said for m in markers):
            tail = (
                "pip found no usable wheel of a dependency: either the package index is unreachable "
                "(network, proxy, PIP_INDEX_URL) or the pinned version has no wheel for this platform and "
                "Python.\n" + tail
            )
        raise PackageBuildError(
            f"pip could not install the Lambda dependencies for {inputs['platforms'][0]} / Python "
            f"{inputs['python_version']} (exit {proc.returncode}). It downloads binary wheels from the "
            "package index (PyPI), so the index must be reachable or pip's cache warm; a dependency without "
            f"a wheel for this platform cannot go into the package. pip said:\n{tail}"
        )


def _check_forbidden_installed(site: Path) -> None:
    found = sorted(
        canonical(d.name.split("-")[0])
        for d in site.glob("*.dist-info")
        if FORBIDDEN_RE.match(canonical(d.name.split("-")[0]))
    )
    found += [t for t in ("torch", "triton") if (site / t).exists()]
    if found:
        raise ForbiddenDependency(
            f"{sorted(set(found))} ended up in the Lambda package; nothing in it may pull in torch or CUDA"
        )


def _strip(site: Path) -> None:
    for name in _STRIP_TOP:
        shutil.rmtree(site / name, ignore_errors=True)
    for path in sorted(site.rglob("*"), reverse=True):
        if path.is_dir() and path.name in _STRIP_DIRS:
            shutil.rmtree(path)
        elif path.is_file() and path.suffix == ".pyc":
            path.unlink()
    # RECORD keeps only what is still there (and stays deterministic), so package_report can attribute
    # every file to its distribution.
    for record in site.glob("*.dist-info/RECORD"):
        rows = list(csv.reader(io.StringIO(record.read_text())))
        kept = [r for r in rows if r and _inside(site, r[0]) and (site / r[0]).is_file()]
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(sorted(kept))
        record.write_text(buf.getvalue())


def _inside(site: Path, rel: str) -> bool:
    return not rel.startswith(("/", "..")) and ".." not in Path(rel).parts


def _write_zip(site: Path, dest: Path) -> None:
    files = sorted((p for p in site.rglob("*") if p.is_file()), key=lambda p: p.relative_to(site).as_posix())
    # zlib's default level: level 9 made the 38 MiB zip no smaller and took 2.5 times as long (8.4 s vs 3.4 s)
    with zipfile.ZipFile(dest, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=_ZIP_LEVEL) as zf:
        for path in files:
            info = zipfile.ZipInfo(path.relative_to(site).as_posix(), date_time=_ZIP_DATE)
            mode = 0o755 if path.stat().st_mode & stat.S_IXUSR else 0o644
            info.external_attr = (stat.S_IFREG | mode) << 16
            info.create_system = 3  # unix, so Lambda honours the permissions
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, path.read_bytes(), compresslevel=_ZIP_LEVEL)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _dist_of(names: dict[str, int], records: dict[str, list[str]]) -> dict[str, int]:
    owner = {f: dist for dist, paths in records.items() for f in paths}
    sizes: dict[str, int] = {}
    for name, size in names.items():
        dist = owner.get(name)
        if dist is None:
            top = name.split("/", 1)[0]
            dist = FUNCTIONS_DIST if top == "shardfold" else f"(unowned) {top}"
        sizes[dist] = sizes.get(dist, 0) + size
    return sizes


def _dist_label(dist_info: str, metadata_text: str | None) -> str:
    name, version = dist_info.removesuffix(".dist-info").rsplit("-", 1)
    if metadata_text:
        meta = dict(
            line.split(": ", 1) for line in metadata_text.split("\n\n", 1)[0].splitlines() if ": " in line
        )
        name, version = meta.get("Name", name), meta.get("Version", version)
    return f"{canonical(name)}=={version}"


def _dist_sizes_dir(site: Path) -> dict[str, int]:
    names = {p.relative_to(site).as_posix(): p.stat().st_size for p in site.rglob("*") if p.is_file()}
    records: dict[str, list[str]] = {}
    for info in site.glob("*.dist-info"):
        meta = info / "METADATA"
        label = _dist_label(info.name, meta.read_text(errors="replace") if meta.is_file() else None)
        rec = info / "RECORD"
        rows = csv.reader(io.StringIO(rec.read_text())) if rec.is_file() else []
        records[label] = [r[0] for r in rows if r] + [f"{info.name}/{f.name}" for f in info.iterdir()]
    return _dist_of(names, records)


def _largest_text(sizes: dict[str, int], n: int = 6) -> str:
    top = sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0]))[:n]
    return ", ".join(f"{name} {_mib(size)}" for name, size in top)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def package_report(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Facts about a Lambda zip, read from the zip itself.

    Keys: ``path``, ``sha256`` (hex), ``source_code_hash`` (base64 sha256, as Lambda reports it),
    ``zip_bytes``, ``unzipped_bytes``, ``files``, ``dists`` (``{"name==version": unzipped bytes}``, the
    project's own code as ``"shardfold (functions)"``), ``largest`` (the ten biggest, ``[name, bytes]``),
    ``has_torch`` (any torch, triton, ``nvidia-*`` or ``cuda-*`` distribution or module),
    ``top_level`` (top-level names in the zip), ``direct_upload`` (zip small enough to upload without
    S3), ``fits`` (within Lambda's unzipped limit) and ``limits``.
    """
    path = Path(path)
    with zipfile.ZipFile(path) as zf:
        infos = [i for i in zf.infolist() if not i.is_dir()]
        names = {i.filename: i.file_size for i in infos}
        records: dict[str, list[str]] = {}
        for n in names:
            parts = n.split("/")
            if len(parts) == 2 and parts[0].endswith(".dist-info") and parts[1] == "RECORD":
                meta = f"{parts[0]}/METADATA"
                text = zf.read(meta).decode(errors="replace") if meta in names else None
                rows = csv.reader(io.StringIO(zf.read(n).decode()))
                owned = [r[0] for r in rows if r]
                owned += [m for m in names if m.startswith(parts[0] + "/")]
                records[_dist_label(parts[0], text)] = owned
    dists = _dist_of(names, records)
    top_level = sorted({n.split("/", 1)[0] for n in names})
    dist_names = [d.split("==", 1)[0] for d in dists]
    has_torch = any(FORBIDDEN_RE.match(d) for d in dist_names) or any(
        t in top_level for t in ("torch", "triton", "nvidia")
    )
    zip_bytes = path.stat().st_size
    unzipped = sum(names.values())
    return {
        "path": str(path),
        "sha256": _sha256(path),
        "source_code_hash": base64.b64encode(bytes.fromhex(_sha256(path))).decode(),
        "zip_bytes": zip_bytes,
        "unzipped_bytes": unzipped,
        "files": len(names),
        "dists": dict(sorted(dists.items(), key=lambda kv: (-kv[1], kv[0]))),
        "largest": [[k, v] for k, v in sorted(dists.items(), key=lambda kv: (-kv[1], kv[0]))[:10]],
        "has_torch": has_torch,
        "top_level": top_level,
        "direct_upload": zip_bytes <= LAMBDA_ZIP_DIRECT_MAX,
        "fits": unzipped <= LAMBDA_UNZIPPED_MAX,
        "limits": {"unzipped_bytes": LAMBDA_UNZIPPED_MAX, "zip_direct_upload_bytes": LAMBDA_ZIP_DIRECT_MAX},
    }


def _check_size(report: dict[str, Any], max_zip_bytes: int | None) -> None:
    if report["has_torch"]:
        raise ForbiddenDependency(f"{report['path']} holds torch or CUDA libraries; rebuild it")
    if not report["fits"]:
        raise PackageTooLarge(
            f"{report['path']} is {_mib(report['unzipped_bytes'])} unzipped, over Lambda's "
            f"{_mib(LAMBDA_UNZIPPED_MAX)} limit; largest: {_largest_text(report['dists'])}"
        )
    if max_zip_bytes is not None and report["zip_bytes"] > max_zip_bytes:
        raise PackageTooLarge(
            f"{report['path']} is {_mib(report['zip_bytes'])} zipped, over {_mib(max_zip_bytes)} (a direct "
            f"upload's limit is {_mib(LAMBDA_ZIP_DIRECT_MAX)}: upload it through S3 instead); "
            f"largest: {_largest_text(report['dists'])}"
        )
    if not report["direct_upload"]:
        logger.warning(
            "lambda package over the direct-upload limit: deploy it through S3",
            extra={"zip_bytes": report["zip_bytes"]},
        )


def function_packages(workflows: Mapping[str, Workflow] | None = None) -> dict[str, str]:
    """``{function: "zip" | "image"}`` for every function deployed as a Lambda function: each workflow's
    Task functions (not BatchJob entry points, which run in the worker image), packaged as their kind's
    ``Workflow.lambda_package`` says, plus the dispatch function (always the zip). A function that two
    kinds call, one of them an image kind, runs from the image (which has every dependency)."""

    if workflows is None:
        from shardfold.functions.kinds import WORKFLOWS

        workflows = WORKFLOWS
    out = {DISPATCH: "zip"}
    for wf in workflows.values():
        for step in wf.tasks():
            if out.get(step.function) != "image":
                out[step.function] = wf.lambda_package
    return dict(sorted(out.items()))


def lambda_handlers(
    package: str | None = "zip", workflows: Mapping[str, Workflow] | None = None
) -> dict[str, str]:
    """``{Lambda function: handler setting}`` for the functions deployed from ``package``: ``"zip"`` (the
    default: the functions this module's zip must import, the dispatch function among them), ``"image"``
    (those run from ``Dockerfile.lambda``'s image) or ``None`` (all). See :func:`function_packages`."""
    from shardfold.orchestrator.registry import lambda_handler

    if package not in ("zip", "image", None):
        raise PackageError(f"package must be 'zip', 'image' or None, not {package!r}")
    out: dict[str, str] = {}
    for function, kind in function_packages(workflows).items():
        if package is None or kind == package:
            out[function] = DISPATCH_HANDLER if function == DISPATCH else lambda_handler(function)
    return out
