"""The GPU queue: AWS Batch compute environment, job queue, job definitions, ECR repository, worker image.

* **Compute environment**: MANAGED, ``SPOT`` (``SPOT_PRICE_CAPACITY_OPTIMIZED``) or ``EC2``
  (``BEST_FIT_PROGRESSIVE``) per ``shardfold:spot``, ``minvCpus`` 0 so it costs nothing idle, GPU instance
  types and the ECS-optimized GPU AMI (``gpuImageType``). Batch acts through its service-linked role
  (``AWSServiceRoleForBatch``, created by AWS on first use), so the stack defines no service role.
* **Instances** get a role of their own (the ECS agent and the image pull): ECS agent actions on the
  environment's own ECS cluster and its container instances, pull from the worker's ECR repository, and
  writing the Batch log group. ``instanceRoleManagedPolicy`` swaps in AWS's
  ``AmazonEC2ContainerServiceforEC2Role`` instead (wildcard actions, so off by default).
* **Job queue**: one, priority 1, on that environment; jobs stuck ``RUNNABLE`` (no capacity for the asked
  GPUs, or asking more than the environment can ever give) are cancelled after ``runnableTimeoutSeconds``.
* **Job definitions**: one per ``BatchJob`` entry point of the workflows (named as
  ``orchestrator.asl.NamingResolver`` predicts): ``python -m functions.container``, ``resourceRequirements``
  from the step (VCPU, MEMORY, GPU) and its ``timeout_s`` as the attempt duration, each replaced by
  ``shardfold:batchVcpus``/``batchMemory``/``batchGpus``/``batchTimeout`` where set (:func:`sized_workflows`
  applies them to the steps themselves, so the states that submit the jobs, which override the job
  definition's resources and timeout, carry them too), a job role with the workers' S3 access, logs to the
  stack's log group, and retries: Spot reclaim (``Host EC2*``) and exit code 75 (``EX_TEMPFAIL``) are
  retried, anything else EXITs, 3 attempts at most. With no ``BatchJob`` in any workflow there is none
  (nor an image build).
* **Worker image**, in this order: ``shardfold:workerImage`` (any URI; an ECR one in this account gets pull
  access); else, when the ``pulumi-docker-build`` package is installed and ``buildWorkerImage`` is true, the
  repo's ``Dockerfile`` built for linux/amd64 and pushed to the ECR repository (pinned by digest); else
  ``<repository>:latest``, with a warning that it must be pushed before a GPU job runs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pulumi
import pulumi_aws as aws

from shardfold.functions.container import EXIT_TRANSIENT
from shardfold.functions.errors import ShardfoldError
from shardfold.functions.workflow import BATCH_ATTEMPTS, BatchJob, Map, Parallel, Step, Workflow
from shardfold.infra.config import BATCH_SIZE_KEYS, StackConfig, size_key
from shardfold.infra.context import Component, Context
from shardfold.infra.functions import base_environment
from shardfold.infra.instances import placement_problem
from shardfold.infra.sizes import batch_steps
from shardfold.orchestrator import iam
from shardfold.orchestrator.registry import job_definition_name

REPO_ROOT = Path(__file__).resolve().parent.parent
WORKER_DOCKERFILE = REPO_ROOT / "Dockerfile"
WORKER_COMMAND = ["python", "-m", "shardfold.functions.container"]
EX_TEMPFAIL = EXIT_TRANSIENT
RETRY_ATTEMPTS = BATCH_ATTEMPTS  # the local executor follows the same table (orchestrator.local_batch)
RUNNABLE_REASONS = (
    "CAPACITY:INSUFFICIENT_INSTANCE_CAPACITY",
    "MISCONFIGURATION:COMPUTE_ENVIRONMENT_MAX_RESOURCE",
    "MISCONFIGURATION:JOB_RESOURCE_REQUIREMENT",
)
_ECR_URI = re.compile(
    r"^(?P<account>\d{12})\.dkr\.ecr\.(?P<region>[a-z0-9-]+)\.amazonaws\.com(\.cn)?/(?P<repo>[^:@]+)"
)


def sized_workflows(workflows: Mapping[str, Workflow], cfg: StackConfig) -> dict[str, Workflow]:
    """The workflows with the ``shardfold:batch*`` overrides applied to their BatchJob steps (every step of
    an entry point gets the configured value). Refuses a key naming an entry point no workflow runs, and a
    step asking more vCPUs than ``shardfold:maxVcpus`` lets the compute environment have, and one that no
    instance type in ``shardfold:gpuInstanceTypes`` could place (:mod:`infra.instances`)."""
    overrides = cfg.batch_overrides()
    known = set(batch_steps(workflows))
    for fld, values in overrides.items():
        unknown = sorted(set(values) - known)
        if unknown:
            raise ShardfoldError(
                f"shardfold:{BATCH_SIZE_KEYS[fld]} names unknown BatchJob entry points {unknown}; "
                f"known: {sorted(known)}"
            )

    def resize(steps: tuple[Step, ...]) -> tuple[Step, ...]:
        out: list[Step] = []
        for step in steps:
            if isinstance(step, BatchJob):
                changes = {f: v[step.entry_point] for f, v in overrides.items() if step.entry_point in v}
                step = replace(step, **changes) if changes else step
            elif isinstance(step, Map):
                step = replace(step, body=resize(step.body))
            elif isinstance(step, Parallel):
                step = replace(step, branches=tuple(resize(b) for b in step.branches))
            out.append(step)
        return tuple(out)

    sized = {
        kind: replace(wf, steps=resize(wf.steps)) if any(overrides.values()) else wf
        for kind, wf in workflows.items()
    }
    for entry_point, step in batch_steps(sized).items():
        problem = placement_problem(step.vcpus, step.memory_mb, step.gpus, cfg.gpu_instance_types)
        if problem:
            raise ShardfoldError(
                f"BatchJob {entry_point!r} {problem}, so it would never be placed: set "
                f"{size_key('batchMemory', entry_point)} (or batchVcpus / batchGpus) lower, or allow a "
                "larger type in shardfold:gpuInstanceTypes"
            )
        if step.vcpus > cfg.max_vcpus:
            raise ShardfoldError(
                f"BatchJob {entry_point!r} asks for {step.vcpus} vCPUs but the GPU compute environment has "
                f"at most shardfold:maxVcpus = {cfg.max_vcpus}, so it would never start: raise maxVcpus or "
                f"set {size_key('batchVcpus', entry_point)}"
            )
    return sized


def retry_strategy() -> dict[str, Any]:
    """The job definitions' retry table (AWS Batch retries an unmatched failure, so it ends in EXIT)."""
    return {
        "attempts": RETRY_ATTEMPTS,
        "evaluateOnExit": [
            # Spot reclaim or a lost host: "Host EC2 (instance i-...) terminated."
            {"onStatusReason": "Host EC2*", "action": "RETRY"},
            # The worker asks for a retry of a transient fault by exiting with EX_TEMPFAIL.
            {"onExitCode": str(EX_TEMPFAIL), "action": "RETRY"},
            {"onReason": "*", "action": "EXIT"},
        ],
    }


def container_properties(
    step: BatchJob,
    *,
    image: str,
    job_role_arn: str,
    log_group: str,
    region: str,
    environment: Mapping[str, str],
) -> dict[str, Any]:
    requirements = [
        {"type": "VCPU", "value": str(step.vcpus)},
        {"type": "MEMORY", "value": str(step.memory_mb)},
    ]
    if step.gpus:
        requirements.append({"type": "GPU", "value": str(step.gpus)})
    return {
        "image": image,
        "command": list(WORKER_COMMAND),
        "jobRoleArn": job_role_arn,
        "resourceRequirements": requirements,
        "environment": [{"name": k, "value": v} for k, v in sorted(environment.items())],
        "logConfiguration": {
            "logDriver": "awslogs",
            "options": {
                "awslogs-group": log_group,
                "awslogs-region": region,
                "awslogs-stream-prefix": "worker",
            },
        },
    }


def ecr_repository_arn(image: str, partition: str) -> str | None:
    """The ARN of the ECR repository an image URI lives in, or None when it is not in ECR."""
    m = _ECR_URI.match(image)
    if not m:
        return None
    return f"arn:{partition}:ecr:{m['region']}:{m['account']}:repository/{m['repo']}"


def instance_statements(
    *,
    partition: str,
    region: str,
    account: str,
    cluster_arn: str,
    repository_arns: list[str],
    log_group_arn: str,
) -> list[dict[str, Any]]:
    """The GPU instances' policy: the ECS agent on this environment's cluster, image pull, job logs."""
    cluster_name = cluster_arn.rsplit("/", 1)[-1]
    instances = f"arn:{partition}:ecs:{region}:{account}:container-instance/{cluster_name}/*"
    out = [
        iam.statement(
            [
                "ecs:RegisterContainerInstance",
                "ecs:DeregisterContainerInstance",
                "ecs:UpdateContainerInstancesState",
                "ecs:SubmitContainerStateChange",
                "ecs:SubmitTaskStateChange",
                "ecs:SubmitAttachmentStateChanges",
            ],
            cluster_arn,
            sid="EcsAgentCluster",
        ),
        iam.statement(["ecs:Poll", "ecs:StartTelemetrySession"], instances, sid="EcsAgentInstance"),
        # Resource "*": DiscoverPollEndpoint and GetAuthorizationToken have no resource type
        # (iam.WILDCARD_RESOURCE_ACTIONS).
        iam.statement(["ecs:DiscoverPollEndpoint", "ecr:GetAuthorizationToken"], "*", sid="NoResourceType"),
        iam.log_stream_statement(log_group_arn, sid="JobLogs"),
    ]
    if repository_arns:
        out.insert(
            2,
            iam.statement(
                ["ecr:BatchCheckLayerAvailability", "ecr:GetDownloadUrlForLayer", "ecr:BatchGetImage"],
                repository_arns,
                sid="PullWorkerImage",
            ),
        )
    return out


def ecr_lifecycle_policy() -> dict[str, Any]:
    """Untagged images expire after a week; at most 10 images are kept."""
    return {
        "rules": [
            {
                "rulePriority": 1,
                "description": "expire untagged images after 7 days",
                "selection": {
                    "tagStatus": "untagged",
                    "countType": "sinceImagePushed",
                    "countUnit": "days",
                    "countNumber": 7,
                },
                "action": {"type": "expire"},
            },
            {
                "rulePriority": 2,
                "description": "keep the 10 most recent images",
                "selection": {"tagStatus": "any", "countType": "imageCountMoreThan", "countNumber": 10},
                "action": {"type": "expire"},
            },
        ]
    }


def docker_build_available() -> bool:
    try:
        import pulumi_docker_build  # noqa: F401
    except ImportError:
        return False
    return True


def ecr_repository(parent: Component, name: str) -> aws.ecr.Repository:
    """A private ECR repository ``name`` under ``parent``: scanned on push, AES256, the
    :func:`ecr_lifecycle_policy`, deleted with its images only when ``shardfold:forceDestroy`` is on.
    Shared by the worker image and the Lambda image (``infra.lambda_image``)."""
    repository = aws.ecr.Repository(
        name,
        name=name,
        image_scanning_configuration=aws.ecr.RepositoryImageScanningConfigurationArgs(scan_on_push=True),
        image_tag_mutability="MUTABLE",  # :latest moves; consumers pin the digest when built here
        encryption_configurations=[aws.ecr.RepositoryEncryptionConfigurationArgs(encryption_type="AES256")],
        force_delete=parent.ctx.cfg.force_destroy,
        opts=parent.child(),
    )
    aws.ecr.LifecyclePolicy(
        f"{name}-lifecycle",
        repository=repository.name,
        policy=json.dumps(ecr_lifecycle_policy()),
        opts=parent.child(),
    )
    return repository


def push_image(
    parent: Component,
    name: str,
    repository: aws.ecr.Repository,
    dockerfile: Path,
    platform: str,
    tag: str = "latest",
) -> Any:
    """Build ``dockerfile`` (context: the repo root, filtered by ``.dockerignore``) for one ``platform``
    (``linux/amd64``, ``linux/arm64``) with pulumi-docker-build and push it to ``repository:tag``.
    Returns the ``pulumi_docker_build.Image``: ``ref`` is ``<repository>:<tag>@sha256:...``, ``digest`` the
    pushed manifest's digest. Only call it when :func:`docker_build_available`."""
    import pulumi_docker_build as docker_build

    token = aws.ecr.get_authorization_token_output(
        registry_id=repository.registry_id, opts=parent.ctx.invoke_opts()
    )
    return docker_build.Image(
        name,
        context=docker_build.BuildContextArgs(location=str(REPO_ROOT)),
        dockerfile=docker_build.DockerfileArgs(location=str(dockerfile)),
        platforms=[platform],
        push=True,
        tags=[repository.repository_url.apply(lambda url: f"{url}:{tag}")],
        registries=[
            docker_build.RegistryArgs(
                address=repository.repository_url,
                username=token.user_name,
                password=token.password,
            )
        ],
        opts=parent.child(),
    )


class GpuQueue(Component):
    """``queue_arn``, ``job_definition_arns`` {entry point: Output}, ``job_definition_names``, ``image``."""

    def __init__(self, ctx: Context, workflows: Mapping[str, Workflow], bucket: pulumi.Output[str]):
        super().__init__("GpuQueue", f"{ctx.cfg.name_prefix}-gpu", ctx)
        cfg = ctx.cfg
        prefix = cfg.name_prefix
        steps = batch_steps(workflows)

        self.repository = ecr_repository(self, f"{prefix}-worker")
        self.image: pulumi.Output[str] | None = self._image(steps) if steps else None

        self.log_group = aws.cloudwatch.LogGroup(
            f"{prefix}-batch-logs",
            name=f"/aws/batch/{prefix}",
            retention_in_days=cfg.log_retention_days,
            opts=self.child(),
        )

        # --- network -------------------------------------------------------------------------------------
        vpc_id: pulumi.Input[str]
        if cfg.vpc_id:
            vpc_id = cfg.vpc_id
        else:
            vpc_id = aws.ec2.get_vpc_output(default=True, opts=ctx.invoke_opts()).id
        if cfg.subnet_ids:
            subnets: pulumi.Input[list[str]] = list(cfg.subnet_ids)
        else:
            subnets = aws.ec2.get_subnets_output(
                filters=[aws.ec2.GetSubnetsFilterArgs(name="vpc-id", values=[vpc_id])],
                opts=ctx.invoke_opts(),
            ).ids
        if cfg.security_group_ids:
            security_groups: pulumi.Input[list[str]] = list(cfg.security_group_ids)
        else:
            # Outbound only (ECR, S3, the ECS and Batch endpoints); nothing may connect in.
            self.security_group = aws.ec2.SecurityGroup(
                f"{prefix}-gpu-sg",
                vpc_id=vpc_id,
                description=f"Shardfold {cfg.stage} GPU workers: egress only",
                egress=[
                    aws.ec2.SecurityGroupEgressArgs(
                        protocol="-1",
                        from_port=0,
                        to_port=0,
                        cidr_blocks=["0.0.0.0/0"],
                        ipv6_cidr_blocks=["::/0"],
                        description="AWS endpoints and the data the workers read",
                    )
                ],
                opts=self.child(),
            )
            security_groups = [self.security_group.id]

        # --- roles ---------------------------------------------------------------------------------------
        self.instance_role = aws.iam.Role(
            f"{prefix}-gpu-instance-role",
            assume_role_policy=iam.to_json(iam.assume_role("ec2.amazonaws.com")),
            description=f"Shardfold {cfg.stage}: Batch GPU instances (ECS agent)",
            managed_policy_arns=[
                ctx.partition.apply(
                    lambda p: f"arn:{p}:iam::aws:policy/service-role/AmazonEC2ContainerServiceforEC2Role"
                )
            ]
            if cfg.instance_role_managed_policy
            else None,
            opts=self.child(),
        )
        self.instance_profile = aws.iam.InstanceProfile(
            f"{prefix}-gpu-instance-profile", role=self.instance_role.name, opts=self.child()
        )
        self.job_role = aws.iam.Role(
            f"{prefix}-gpu-job-role",
            assume_role_policy=iam.to_json(iam.assume_role("ecs-tasks.amazonaws.com")),
            description=f"Shardfold {cfg.stage}: Batch worker containers",
            opts=self.child(),
        )
        job_policy_deps = [ctx.partition, bucket]
        rights = iam.batch_rights(workflows)  # one role for every container: the rights of their kinds
        self.job_policy = aws.iam.RolePolicy(
            f"{prefix}-gpu-job-policy",
            role=self.job_role.id,
            policy=pulumi.Output.all(*job_policy_deps).apply(
                lambda v: iam.to_json(
                    iam.document(
                        *iam.batch_job_statements(v[0], v[1], cfg.grants(), rights, cfg.kms_key_arn),
                        iam.xray_statement() if cfg.tracing else None,
                    )
                )
            ),
            opts=self.child(),
        )

        # --- compute environment and queue ---------------------------------------------------------------
        self.compute_environment = aws.batch.ComputeEnvironment(
            f"{prefix}-gpu",
            type="MANAGED",
            state="ENABLED",
            compute_resources=aws.batch.ComputeEnvironmentComputeResourcesArgs(
                type="SPOT" if cfg.spot else "EC2",
                allocation_strategy="SPOT_PRICE_CAPACITY_OPTIMIZED" if cfg.spot else "BEST_FIT_PROGRESSIVE",
                min_vcpus=0,
                max_vcpus=cfg.max_vcpus,
                instance_types=list(cfg.gpu_instance_types),
                subnets=subnets,
                security_group_ids=security_groups,
                instance_role=self.instance_profile.arn,
                ec2_configurations=[
                    aws.batch.ComputeEnvironmentComputeResourcesEc2ConfigurationArgs(
                        image_type=cfg.gpu_image_type
                    )
                ],
                tags={"shardfold:stage": cfg.stage, "Name": f"{prefix}-gpu-worker"},
            ),
            opts=self.child(),
        )
        if not cfg.instance_role_managed_policy:
            repo_arns: list[pulumi.Input[str]] = [self.repository.arn]
            if cfg.worker_image:
                repo_arns.append(ctx.partition.apply(lambda p: ecr_repository_arn(cfg.worker_image, p) or ""))
            self.instance_policy = aws.iam.RolePolicy(
                f"{prefix}-gpu-instance-policy",
                role=self.instance_role.id,
                policy=pulumi.Output.all(
                    ctx.partition,
                    ctx.region,
                    ctx.account_id,
                    self.compute_environment.ecs_cluster_arn,
                    self.log_group.arn,
                    *repo_arns,
                ).apply(
                    lambda v: iam.to_json(
                        iam.document(
                            *instance_statements(
                                partition=v[0],
                                region=v[1],
                                account=v[2],
                                cluster_arn=v[3],
                                log_group_arn=v[4],
                                repository_arns=sorted({a for a in v[5:] if a}),
                            )
                        )
                    )
                ),
                opts=self.child(),
            )
        self.queue = aws.batch.JobQueue(
            f"{prefix}-queue",
            name=prefix,
            state="ENABLED",
            priority=1,
            compute_environment_orders=[
                aws.batch.JobQueueComputeEnvironmentOrderArgs(
                    order=1, compute_environment=self.compute_environment.arn
                )
            ],
            job_state_time_limit_actions=[
                aws.batch.JobQueueJobStateTimeLimitActionArgs(
                    action="CANCEL",
                    state="RUNNABLE",
                    reason=reason,
                    max_time_seconds=cfg.runnable_timeout_seconds,
                )
                for reason in RUNNABLE_REASONS
            ],
            opts=self.child(),
        )
        self.queue_arn: pulumi.Output[str] = self.queue.arn

        # --- job definitions -----------------------------------------------------------------------------
        env = base_environment(cfg, bucket)
        self.job_definitions: dict[str, aws.batch.JobDefinition] = {}
        self.job_definition_names: dict[str, str] = {}
        for entry_point, step in sorted(steps.items()):
            name = job_definition_name(entry_point, cfg.stage)
            props = pulumi.Output.all(
                self.image, self.job_role.arn, self.log_group.name, ctx.region, pulumi.Output.all(**env)
            ).apply(
                lambda v, step=step: json.dumps(
                    container_properties(
                        step, image=v[0], job_role_arn=v[1], log_group=v[2], region=v[3], environment=v[4]
                    ),
                    sort_keys=True,
                )
            )
            rs = retry_strategy()
            self.job_definitions[entry_point] = aws.batch.JobDefinition(
                name,
                name=name,
                type="container",
                platform_capabilities=["EC2"],
                container_properties=props,
                retry_strategy=aws.batch.JobDefinitionRetryStrategyArgs(
                    attempts=rs["attempts"],
                    evaluate_on_exits=[
                        aws.batch.JobDefinitionRetryStrategyEvaluateOnExitArgs(
                            action=e["action"],
                            on_status_reason=e.get("onStatusReason"),
                            on_exit_code=e.get("onExitCode"),
                            on_reason=e.get("onReason"),
                        )
                        for e in rs["evaluateOnExit"]
                    ],
                ),
                timeout=aws.batch.JobDefinitionTimeoutArgs(attempt_duration_seconds=step.timeout_s),
                propagate_tags=True,
                opts=self.child(depends_on=[self.job_policy]),
            )
            self.job_definition_names[entry_point] = name
        self.job_definition_arns = {e: jd.arn for e, jd in self.job_definitions.items()}
        self.register_outputs({"batch_job_queue": self.queue_arn})

    def _image(self, steps: Mapping[str, BatchJob]) -> pulumi.Output[str]:
        cfg = self.ctx.cfg
        if cfg.worker_image:
            return pulumi.Output.from_input(cfg.worker_image)
        if cfg.build_worker_image and docker_build_available():
            return self._build_image()
        pulumi.log.warn(
            "no worker image: set shardfold:workerImage, or install pulumi-docker-build (pip install "
            "pulumi-docker-build) to build the Dockerfile here. The job definitions use "
            "<ECR repository>:latest; push the image there before running a GPU job: "
            "docker build --platform linux/amd64 -t <repository_url>:latest . && docker push ...",
            resource=self,
        )
        return self.repository.repository_url.apply(lambda url: f"{url}:latest")

    def _build_image(self) -> pulumi.Output[str]:
        name = f"{self.ctx.cfg.name_prefix}-worker-image"
        # linux/amd64: the GPU instance types are x86_64
        image = push_image(self, name, self.repository, WORKER_DOCKERFILE, "linux/amd64")
        # ref is <repository>:latest@sha256:<digest>: the job definitions pin the pushed image.
        return image.ref
