"""Stack outputs of a deployed Shardfold: bucket, region, state machine ARNs, function names and sizes.

A stack is named by its Pulumi stack name, the same in every verb: ``shardfold deploy --stack NAME``
(:func:`deploy`: ``pulumi up`` on the program in ``infra/``, through the Pulumi CLI) saves its outputs to
``<stacks dir>/NAME.json``, one per-user place (:func:`stacks_dir`: ``$SHARDFOLD_STACKS_DIR``, else
``$XDG_CONFIG_HOME/shardfold/stacks``, else ``~/.config/shardfold/stacks``), whatever the current directory;
``--stack NAME`` of the other verbs and ``Client(backend="aws", stack="NAME")`` read them from there;
``shardfold destroy --stack NAME`` (:func:`destroy`) tears the stack down and deletes them. Without a name:
``$SHARDFOLD_STACK``, else ``dev``. ``shardfold stack import NAME FILE`` saves outputs written elsewhere
(``pulumi stack output --json``, or the ``./.shardfold/stack.json`` older versions wrote) under a name.

:func:`deployed_sizes` reads the ``sizes`` output (``infra.program`` documents its shape; the moto stack
gives the same): each Lambda function's memory, /tmp and timeout, each Batch job definition's vCPUs, memory,
GPUs and attempt timeout, as deployed after the ``shardfold:*`` config overrides, with the config key that
changes each, so a plan can be checked against what will actually run and a refusal can name the key. A
stack deployed before the output existed lacks it: :class:`SizesMissing` says to redeploy.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, field_validator

from shardfold.client.errors import StackNotFound
from shardfold.functions import extras, jsontext
from shardfold.functions.errors import ShardfoldError

REQUIRED = ("bucket", "state_machine_arns")
DEFAULT_STACK = "dev"
LEGACY_OUTPUTS = Path(".shardfold") / "stack.json"  # where versions before per-user stacks saved them
_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")


def stacks_dir() -> Path:
    """The per-user folder of saved stack outputs, one ``NAME.json`` per stack: ``$SHARDFOLD_STACKS_DIR``,
    else ``$XDG_CONFIG_HOME/shardfold/stacks``, else ``~/.config/shardfold/stacks``."""
    if os.environ.get("SHARDFOLD_STACKS_DIR"):
        return Path(os.environ["SHARDFOLD_STACKS_DIR"]).expanduser()
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config).expanduser() / "shardfold" / "stacks"


def check_stack_name(name: str, *, where: str = "--stack") -> str:
    """``name`` if it is a stack name (Pulumi's: letters, digits, ``-``, ``_``, ``.``); a path is refused
    with how to save that file under a name."""
    if _NAME.fullmatch(name) and not name.endswith(".json"):
        return name
    if "/" in name or name.endswith(".json") or os.sep in name:
        raise StackNotFound(
            f"{where} takes a stack name now, not an outputs file ({name!r}): stack outputs are saved per "
            f"stack name in {stacks_dir()}. Save that file under a name with "
            f"`shardfold stack import NAME {name}` and use `{where.split('=')[0]} NAME`, or run "
            "`shardfold deploy --stack NAME` again"
        )
    raise StackNotFound(
        f"{where}: {name!r} is not a stack name (letters, digits, '-', '_' and '.', as Pulumi allows)"
    )


def stack_name(name: str | None = None) -> str:
    """The stack meant: ``name``, else ``$SHARDFOLD_STACK``, else ``dev``; checked by
    :func:`check_stack_name`."""
    if name:
        return check_stack_name(name)
    if os.environ.get("SHARDFOLD_STACK"):
        return check_stack_name(os.environ["SHARDFOLD_STACK"], where="SHARDFOLD_STACK")
    return DEFAULT_STACK


def outputs_path(name: str | None = None) -> Path:
    """Where the outputs of stack ``name`` (see :func:`stack_name`) are saved."""
    return stacks_dir() / f"{stack_name(name)}.json"


def known_stacks() -> list[str]:
    """Names of the stacks with saved outputs, sorted."""
    d = stacks_dir()
    return sorted(p.stem for p in d.glob("*.json")) if d.is_dir() else []


def _missing(name: str) -> StackNotFound:
    known = known_stacks()
    msg = f"no outputs saved for stack {name!r} (looked in {stacks_dir()}): "
    msg += f"known stacks: {', '.join(known)}; " if known else "no stacks are saved; "
    msg += f"deploy it with `shardfold deploy --stack {name}`, or choose a known one with --stack NAME"
    if LEGACY_OUTPUTS.is_file():
        msg += (
            f". {LEGACY_OUTPUTS} here holds outputs saved by an older shardfold, which are no longer read "
            f"from the current directory: import them with `shardfold stack import {name} {LEGACY_OUTPUTS}`"
        )
    return StackNotFound(msg)


_BUCKET = r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]"
_ARN = r"arn:aws[a-z-]*:[a-z0-9-]+:[a-z0-9-]*:\d{12}:[A-Za-z0-9:/._+=,@-]+"


class _Outputs(BaseModel):
    """The shape of the outputs this client reads (a saved file is anyone's to edit: a malformed one is
    refused here, naming the key, rather than crashing a later verb). Other keys pass unchecked."""

    model_config = ConfigDict(extra="allow", strict=True)

    backend: Literal["aws", "moto"] = "aws"
    bucket: Annotated[str, StringConstraints(pattern=f"^{_BUCKET}$")]
    region: Annotated[str, StringConstraints(pattern=r"^[a-z]{2}(-[a-z]+)+-\d{1,2}$")] | None = None
    endpoint_url: Annotated[str, StringConstraints(pattern=r"^https?://[^\s]+$")] | None = None
    state_machine_arns: dict[
        Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9]*$")],
        Annotated[str, StringConstraints(pattern=f"^{_ARN}$")],
    ] = Field(min_length=1)
    batch_job_queue: Annotated[str, StringConstraints(pattern=f"^{_ARN}$")] | None = None
    output_prefixes: list[Annotated[str, StringConstraints(min_length=1, max_length=1024)]] | None = None
    read_buckets: list[str] = []
    write_buckets: list[str] = []
    sizes: dict[str, Any] | None = None

    @field_validator("output_prefixes")
    @classmethod
    def _prefixes(cls, value: list[str] | None) -> list[str] | None:
        from shardfold.functions.access import SYSTEM_PREFIXES

        for p in value or []:
            folder = p.strip().strip("/") + "/"
            if folder == "/" or ".." in folder.split("/") or "\n" in p:
                raise ValueError(f"{p!r} names no folder of the bucket")
            if any(folder.startswith(s) or s.startswith(folder) for s in SYSTEM_PREFIXES):
                raise ValueError(
                    f"{p!r} overlaps a system prefix of the store ({', '.join(SYSTEM_PREFIXES)})"
                )
        return value

    @field_validator("read_buckets", "write_buckets")
    @classmethod
    def _refs(cls, value: list[str]) -> list[str]:
        from shardfold.functions.access import parse_bucket_ref

        for ref in value:
            try:
                bucket, _ = parse_bucket_ref(ref)
            except ShardfoldError as exc:
                raise ValueError(str(exc)) from None
            if not re.fullmatch(_BUCKET, bucket):
                raise ValueError(f"{ref!r} names no S3 bucket")
        return value


def check_outputs(outputs: dict[str, Any], where: str) -> dict[str, Any]:
    """``outputs`` when they have the shape the client reads; :class:`StackNotFound` naming the key."""
    try:
        _Outputs.model_validate(outputs)
    except ValidationError as exc:
        bad = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5])
        raise StackNotFound(
            f"stack outputs in {where} are malformed ({bad}); re-run `shardfold deploy`"
        ) from None
    except ShardfoldError as exc:  # a bucket reference parse_bucket_ref refuses
        raise StackNotFound(
            f"stack outputs in {where} are malformed ({exc}); re-run `shardfold deploy`"
        ) from None
    return outputs


def load_stack_outputs(source: dict[str, Any] | str | None = None) -> dict[str, Any]:
    """Stack outputs from a dict, or those saved for a stack name (default: :func:`stack_name`); checked for
    required keys and the shape of what the client reads."""
    if isinstance(source, dict):
        outputs = dict(source)
        where = "the outputs passed in"
    else:
        if source is not None and not isinstance(source, str):
            raise StackNotFound(
                f"stack= takes a stack name or a dict of outputs, not {type(source).__name__} ({source!r}): "
                f"save an outputs file under a name with `shardfold stack import NAME {source}`, or pass "
                "json.loads(Path(...).read_text())"
            )
        name = stack_name(source)
        path = outputs_path(name)
        if not path.is_file():
            raise _missing(name)
        try:
            outputs = jsontext.loads(path.read_bytes())
        except jsontext.JSONTextError as exc:
            raise StackNotFound(
                f"stack outputs of {name!r} at {path} are not JSON ({exc}); re-run "
                f"`shardfold deploy --stack {name}`"
            ) from None
        if not isinstance(outputs, dict):
            raise StackNotFound(f"stack outputs of {name!r} at {path} are not a JSON object")
        where = str(path)
    missing = [k for k in REQUIRED if not outputs.get(k)]
    if missing:
        raise StackNotFound(f"stack outputs in {where} lack {missing}; re-run `shardfold deploy`")
    return check_outputs(outputs, where)


# ---- deployed sizes ----------------------------------------------------------------------------------------


class SizesMissing(StackNotFound):
    """The stack outputs have no usable ``sizes`` (a stack deployed before they were exported)."""


@dataclass(frozen=True)
class FunctionSize:
    """A deployed Lambda function: memory (MB), /tmp (MB), timeout (s); ``config[field]`` is the config key
    that changes ``field`` (``'shardfold:functionMemory["getbatch.gather"]'`` for ``"memory_mb"``)."""

    memory_mb: int
    ephemeral_mb: int
    timeout_s: int
    config: Mapping[str, str]


@dataclass(frozen=True)
class BatchSize:
    """A deployed Batch job definition: vCPUs, memory (MiB), GPUs, attempt timeout (s); ``config[field]`` is
    the config key that changes ``field`` (``'shardfold:batchMemory["inference.worker"]'``)."""

    vcpus: int
    memory_mb: int
    gpus: int
    timeout_s: int
    config: Mapping[str, str]


@dataclass(frozen=True)
class DeployedSizes:
    """``functions``: ``{registered function or "dispatch": FunctionSize}``; ``batch``: ``{BatchJob entry
    point: BatchSize}``."""

    functions: Mapping[str, FunctionSize]
    batch: Mapping[str, BatchSize]

    def of(self, name: str) -> FunctionSize | BatchSize:
        """The size of a Lambda function or, failing that, a Batch entry point ``name``; a name the stack
        does not deploy is a :class:`SizesMissing` (the workflow changed since the last deploy)."""
        found = self.functions.get(name) or self.batch.get(name)
        if found is None:
            raise SizesMissing(
                f"the deployed stack has no function or Batch job definition {name!r} (the workflows changed "
                "since it was deployed): redeploy with `shardfold deploy`"
            )
        return found


_FUNCTION_FIELDS = ("memory_mb", "ephemeral_mb", "timeout_s")
_BATCH_FIELDS = ("vcpus", "memory_mb", "gpus", "timeout_s")


def deployed_sizes(outputs: Mapping[str, Any]) -> DeployedSizes:
    """The ``sizes`` of stack outputs (as :func:`load_stack_outputs` returns them).

    Example: ``deployed_sizes(load_stack_outputs()).functions["getbatch.gather"].memory_mb`` -> ``1024``.
    Raises :class:`SizesMissing` when the outputs have no ``sizes`` or a malformed one.
    """
    sizes = outputs.get("sizes")
    if sizes is None:
        raise SizesMissing(
            "the stack outputs do not list the deployed function sizes (the stack was deployed before "
            "Shardfold exported them), so a plan cannot be checked against them: redeploy with "
            "`shardfold deploy`"
        )
    try:
        functions = {
            str(name): FunctionSize(**_entry(entry, _FUNCTION_FIELDS))
            for name, entry in sizes["functions"].items()
        }
        batch = {
            str(name): BatchSize(**_entry(entry, _BATCH_FIELDS)) for name, entry in sizes["batch"].items()
        }
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise SizesMissing(
            f"the stack outputs' sizes are malformed ({type(exc).__name__}: {exc}): redeploy with "
            "`shardfold deploy`"
        ) from exc
    return DeployedSizes(functions=functions, batch=batch)


def _entry(entry: Mapping[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for f in fields:
        value = entry[f]
        # Pulumi's numbers are doubles: a size may come back as 1024.0.
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{f} is {value!r}, not an integer")
        values[f] = value
    config = entry["config"]
    values["config"] = {f: str(config[f]) for f in fields}
    return values


# ---- deploy / destroy: the Pulumi program in infra/, driven through the Pulumi CLI ----------------------

INFRA_DIR = Path(__file__).resolve().parent.parent / "infra"
PULUMI_INSTALL_URL = "https://www.pulumi.com/docs/install/"


class DeployError(ShardfoldError):
    """``shardfold deploy``/``destroy`` cannot run, or Pulumi failed."""


class PulumiNotFound(DeployError):
    """The Pulumi CLI is not installed (or not on PATH)."""


class AwsCredentialsMissing(DeployError):
    """No usable AWS credentials in the environment."""


def pulumi_cli() -> str:
    """Path of the ``pulumi`` executable: on PATH, else where its installer puts it (``~/.pulumi/bin``)."""
    found = shutil.which("pulumi")
    if found:
        return found
    default = Path.home() / ".pulumi" / "bin" / "pulumi"
    if default.is_file() and os.access(default, os.X_OK):
        return str(default)
    raise PulumiNotFound(
        f"the Pulumi CLI (`pulumi`) is not installed or not on PATH: install it from {PULUMI_INSTALL_URL} "
        "(e.g. `curl -fsSL https://get.pulumi.com | sh`), run `pulumi login` (or `pulumi login --local`), "
        "then retry"
    )


def infra_dir() -> Path:
    """The Pulumi project (``infra/`` of the Shardfold checkout)."""
    if not (INFRA_DIR / "Pulumi.yaml").is_file():
        raise DeployError(
            f"no Pulumi program at {INFRA_DIR}: deploy from a Shardfold checkout, installed with "
            "`pip install -e '.[aws]'` (or `make test`)"
        )
    return INFRA_DIR


def aws_identity(region: str | None = None) -> dict[str, str]:
    """``{"Account", "Arn", "UserId"}`` of the AWS credentials in the environment (STS GetCallerIdentity)."""
    import boto3
    import botocore.exceptions

    region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    try:
        sts = boto3.session.Session().client("sts", region_name=region or "us-east-1")
        ident = sts.get_caller_identity()
    except (botocore.exceptions.NoCredentialsError, botocore.exceptions.PartialCredentialsError) as exc:
        raise AwsCredentialsMissing(
            f"no AWS credentials found ({exc}): run `aws configure` or `aws sso login`, or set AWS_PROFILE "
            "or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, then retry"
        ) from exc
    except botocore.exceptions.ClientError as exc:
        raise AwsCredentialsMissing(
            f"the AWS credentials were rejected ({exc.response.get('Error', {}).get('Code', exc)}): refresh "
            "them (`aws sso login`, new access keys) and retry"
        ) from exc
    except botocore.exceptions.BotoCoreError as exc:
        raise AwsCredentialsMissing(f"could not check the AWS credentials with STS: {exc}") from exc
    return {k: ident[k] for k in ("Account", "Arn", "UserId") if k in ident}


def save_stack_outputs(outputs: dict[str, Any], name: str | None = None) -> Path:
    """Save the outputs of stack ``name`` (checked for the keys the aws backend needs) where
    :func:`load_stack_outputs` reads them; return the path."""
    load_stack_outputs(outputs)  # the same checks as a reader applies
    dest = outputs_path(name)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.write_text(json.dumps(outputs, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, dest)
    return dest


def remove_stack_outputs(name: str | None = None) -> Path | None:
    """Delete the saved outputs of stack ``name``; the path deleted, or None when there were none."""
    dest = outputs_path(name)
    if dest.is_file():
        dest.unlink()
        return dest
    return None


def import_stack_outputs(name: str, source: str | os.PathLike) -> Path:
    """Save the outputs JSON file ``source`` (``pulumi stack output --json``, or an old
    ``./.shardfold/stack.json``) as stack ``name``'s; return the path saved to."""
    path = Path(source)
    try:
        outputs = jsontext.loads(path.read_bytes())
    except OSError as exc:
        raise StackNotFound(f"cannot read stack outputs from {path}: {exc.strerror or exc}") from exc
    except jsontext.JSONTextError as exc:
        raise StackNotFound(f"{path} is not JSON ({exc}): expected `pulumi stack output --json`") from None
    if not isinstance(outputs, dict):
        raise StackNotFound(f"{path} holds {type(outputs).__name__}, not the stack outputs object")
    return save_stack_outputs(outputs, check_stack_name(name, where="NAME"))


def _pulumi(args: list[str], *, capture: bool = False) -> subprocess.CompletedProcess[str]:
    cmd = [pulumi_cli(), *args]
    proc = subprocess.run(cmd, capture_output=capture, text=True, check=False)
    if proc.returncode != 0:
        said = (proc.stderr or proc.stdout or "").strip().splitlines()[-5:] if capture else []
        raise DeployError(
            f"`pulumi {' '.join(args)}` failed (exit {proc.returncode})"
            + (": " + " | ".join(said) if said else "; its output above says why")
            + ". If Pulumi is not logged in: `pulumi login`, or `pulumi login --local` with "
            "PULUMI_CONFIG_PASSPHRASE set"
        )
    return proc


def stack_outputs_from_pulumi(stack: str) -> dict[str, Any]:
    """``pulumi stack output --json`` of ``stack``."""
    proc = _pulumi(["stack", "output", "--json", "--stack", stack, "--cwd", str(infra_dir())], capture=True)
    try:
        outputs = json.loads(proc.stdout)
    except json.JSONDecodeError as exc:
        raise DeployError(
            f"`pulumi stack output --json` printed no JSON ({exc}): {proc.stdout[:200]!r}"
        ) from exc
    if not isinstance(outputs, dict):
        raise DeployError(f"`pulumi stack output --json` printed {type(outputs).__name__}, not an object")
    return outputs


def check_deploy_prerequisites(region: str | None = None) -> dict[str, str]:
    """The aws extra (Pulumi's SDK, which the program imports), the Pulumi CLI, the Pulumi program and AWS
    credentials, in that order; returns the AWS identity."""
    extras.require("aws", "shardfold deploy")
    pulumi_cli()
    infra_dir()
    return aws_identity(region)


def deploy(stack: str = DEFAULT_STACK, *, yes: bool = False) -> Path:
    """``pulumi up`` the Shardfold stack ``stack`` (created if new) and save its outputs under its name;
    return their path.

    Without ``yes``, Pulumi shows its preview and asks before changing anything. Call
    :func:`check_deploy_prerequisites` first for a clear error about a missing CLI or credentials.
    """
    stack = check_stack_name(stack)
    cwd = str(infra_dir())
    _pulumi(["stack", "select", "--create", stack, "--cwd", cwd])
    _pulumi(["up", *(["--yes"] if yes else []), "--stack", stack, "--cwd", cwd])
    return save_stack_outputs(stack_outputs_from_pulumi(stack), stack)


def destroy(stack: str = DEFAULT_STACK) -> Path | None:
    """``pulumi destroy --yes`` the stack, then delete its saved outputs (the caller asks first)."""
    stack = check_stack_name(stack)
    _pulumi(["destroy", "--yes", "--stack", stack, "--cwd", str(infra_dir())])
    return remove_stack_outputs(stack)
