"""The Pulumi program (``infra/``) under Pulumi's mocks: no CLI, no AWS.

One stack is built per configuration (module-scoped fixtures); tests read the inputs every resource was
registered with (as the mocks saw them) and the stack outputs. The Lambda package builder is replaced by a
tiny zip: ``tests/test_lambda_package.py`` tests the real package (builds, imports every handler, no torch,
size limits).
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pulumi
import pytest

REPO = Path(__file__).resolve().parent.parent
ACCOUNT = "123456789012"
REGION = "us-east-1"
DEFAULT_VPC = "vpc-0default"
DEFAULT_SUBNETS = ["subnet-0aaa", "subnet-0bbb"]


@dataclass
class Rec:
    typ: str
    name: str
    inputs: dict[str, Any]
    outputs: dict[str, Any]


class Mocks(pulumi.runtime.Mocks):
    """Records every resource; synthesises the outputs AWS would compute (ARNs, URLs, names)."""

    def __init__(self) -> None:
        self.resources: list[Rec] = []
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def new_resource(self, args: pulumi.runtime.MockResourceArgs) -> tuple[str, dict[str, Any]]:
        typ, name, inputs = args.typ, args.name, dict(args.inputs)
        out = dict(inputs)
        physical = inputs.get("name") or f"{name}-a1b2c3d"
        svc_arn = f"{REGION}:{ACCOUNT}"
        rid = physical
        if typ == "aws:s3/bucket:Bucket":
            physical = inputs.get("bucket") or f"{name}-a1b2c3d"
            out.update(bucket=physical, arn=f"arn:aws:s3:::{physical}")
            rid = physical
        elif typ == "aws:iam/role:Role":
            out.update(name=physical, arn=f"arn:aws:iam::{ACCOUNT}:role/{physical}")
        elif typ == "aws:iam/instanceProfile:InstanceProfile":
            out.update(name=physical, arn=f"arn:aws:iam::{ACCOUNT}:instance-profile/{physical}")
        elif typ == "aws:lambda/function:Function":
            out.update(arn=f"arn:aws:lambda:{svc_arn}:function:{physical}", name=physical)
        elif typ == "aws:sfn/stateMachine:StateMachine":
            out.update(arn=f"arn:aws:states:{svc_arn}:stateMachine:{physical}")
        elif typ == "aws:cloudwatch/logGroup:LogGroup":
            out.update(arn=f"arn:aws:logs:{svc_arn}:log-group:{physical}")
        elif typ == "aws:batch/computeEnvironment:ComputeEnvironment":
            out.update(
                name=physical,
                arn=f"arn:aws:batch:{svc_arn}:compute-environment/{physical}",
                ecsClusterArn=f"arn:aws:ecs:{svc_arn}:cluster/AWSBatch-{physical}-0f1e2d3c",
            )
        elif typ == "aws:batch/jobQueue:JobQueue":
            out.update(arn=f"arn:aws:batch:{svc_arn}:job-queue/{physical}")
        elif typ == "aws:batch/jobDefinition:JobDefinition":
            out.update(arn=f"arn:aws:batch:{svc_arn}:job-definition/{physical}:1", revision=1)
        elif typ == "aws:ecr/repository:Repository":
            out.update(
                arn=f"arn:aws:ecr:{svc_arn}:repository/{physical}",
                repositoryUrl=f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/{physical}",
                registryId=ACCOUNT,
            )
        elif typ == "aws:sqs/queue:Queue":
            out.update(
                arn=f"arn:aws:sqs:{svc_arn}:{physical}",
                url=f"https://sqs.{REGION}.amazonaws.com/{ACCOUNT}/{physical}",
            )
        elif typ == "aws:cloudwatch/eventRule:EventRule":
            out.update(arn=f"arn:aws:events:{svc_arn}:rule/{physical}", name=physical)
        elif typ == "docker-build:index:Image":
            out.update(ref=f"{inputs['tags'][0]}@sha256:{'0' * 64}", digest=f"sha256:{'0' * 64}")
        elif typ == "aws:ec2/securityGroup:SecurityGroup":
            rid = "sg-0stack"
        elif typ.startswith("aws:"):
            out.setdefault("arn", f"arn:aws:{typ.split(':')[1].split('/')[0]}:{svc_arn}:{physical}")
        self.resources.append(Rec(typ, name, inputs, out))
        return rid, out

    def call(self, args: pulumi.runtime.MockCallArgs) -> dict[str, Any]:
        self.calls.append((args.token, dict(args.args)))
        token = args.token
        if token == "aws:index/getCallerIdentity:getCallerIdentity":
            return {
                "accountId": ACCOUNT,
                "arn": f"arn:aws:iam::{ACCOUNT}:user/ci",
                "userId": "AIDA",
                "id": ACCOUNT,
            }
        if token == "aws:index/getRegion:getRegion":
            return {"region": REGION, "name": REGION, "id": REGION, "endpoint": f"ec2.{REGION}.amazonaws.com"}
        if token == "aws:index/getPartition:getPartition":
            return {
                "partition": "aws",
                "dnsSuffix": "amazonaws.com",
                "id": "aws",
                "reverseDnsPrefix": "com.amazonaws",
            }
        if token == "aws:ec2/getVpc:getVpc":
            assert args.args.get("default") is True
            return {"id": DEFAULT_VPC, "default": True, "cidrBlock": "172.31.0.0/16"}
        if token == "aws:ec2/getSubnets:getSubnets":
            return {"id": REGION, "ids": DEFAULT_SUBNETS, "filters": args.args.get("filters")}
        if token == "aws:ecr/getAuthorizationToken:getAuthorizationToken":
            return {"userName": "AWS", "password": "token", "proxyEndpoint": "https://ecr", "id": REGION}
        raise AssertionError(f"unexpected call {token}")


# pulumi_aws warns about deprecated resource classes this program does not use. Slow: the whole Pulumi program
# runs under mocks, several times per test.
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"), pytest.mark.slow]

MOCKS = Mocks()
pulumi.runtime.set_mocks(MOCKS, preview=False)

# After set_mocks: these import pulumi_aws and the program.
import toyflow  # noqa: E402,F401  (registers the toy functions)

from shardfold.functions import kinds  # noqa: E402
from shardfold.functions.access import Grants, Right  # noqa: E402
from shardfold.functions.errors import ShardfoldError  # noqa: E402
from shardfold.functions.kinds import WORKFLOWS  # noqa: E402
from shardfold.functions.workflow import BatchJob, Map, Task, Workflow  # noqa: E402
from shardfold.infra import package  # noqa: E402
from shardfold.infra.config import StackConfig  # noqa: E402
from shardfold.infra.gpu import RETRY_ATTEMPTS  # noqa: E402
from shardfold.infra.program import build  # noqa: E402
from shardfold.infra.trigger import event_pattern  # noqa: E402
from shardfold.orchestrator import iam  # noqa: E402
from shardfold.orchestrator.asl import validate  # noqa: E402
from shardfold.orchestrator.registry import lambda_name  # noqa: E402


def image_workflow() -> Workflow:
    """The kind deployed as container-image functions: dpquery when it is registered (its dependencies
    exceed the zip's limit), else a toy kind whose functions no other test kind calls."""
    if "dpquery" in WORKFLOWS:
        return WORKFLOWS["dpquery"]
    return Workflow(
        kind="toyimage",
        steps=(Task("total", "toy.total", memory_mb=3008, timeout_s=600), Task("stamp", "toy.stamp")),
        lambda_package="image",
    )


IMAGE_KIND = image_workflow()
CUSTOM_LAMBDA_IMAGE = f"{ACCOUNT}.dkr.ecr.eu-west-1.amazonaws.com/my-lambda@sha256:{'7' * 64}"


def image_functions(workflows: dict[str, Workflow]) -> set[str]:
    return {s.function for wf in workflows.values() if wf.lambda_package == "image" for s in wf.tasks()}


def gpu_workflow() -> Workflow:
    """A kind with a GPU stage, so the Batch path (job definitions, .sync IAM) is exercised."""
    return Workflow(
        kind="gputoy",
        steps=(
            Task("plan", "toy.plan", memory_mb=256, timeout_s=120),
            Map("squares", items="$.plan.worklist", body=(Task("square", "toy.square", memory_mb=2048),)),
            BatchJob("infer", "toy.batch_double", vcpus=4, memory_mb=15000, gpus=1, timeout_s=1800),
        ),
    )


@dataclass
class Deployed:
    stack: Any
    resources: list[Rec]
    outputs: dict[str, Any]
    zip_path: Path

    def of(self, typ: str) -> list[Rec]:
        return [r for r in self.resources if r.typ == typ]

    def one(self, typ: str) -> Rec:
        found = self.of(typ)
        assert len(found) == 1, f"{len(found)} resources of {typ}: {[r.name for r in found]}"
        return found[0]

    def named(self, typ: str, name: str) -> Rec:
        found = [r for r in self.of(typ) if r.name == name]
        assert found, f"no {typ} named {name}; have {[r.name for r in self.of(typ)]}"
        return found[0]

    def policies(self) -> list[tuple[str, dict[str, Any]]]:
        """Every IAM/resource policy document the stack registers: (resource name, document)."""
        docs = []
        for r in self.resources:
            for key in ("policy", "assumeRolePolicy"):
                value = r.inputs.get(key)
                if isinstance(value, str) and r.typ != "aws:ecr/lifecyclePolicy:LifecyclePolicy":
                    docs.append((f"{r.name}.{key}", json.loads(value)))
        return docs


def _tiny_zip(tmp: Path) -> Path:
    path = tmp / "shardfold-lambda-arm64.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("functions/__init__.py", "")
    return path


def deploy(cfg: StackConfig, workflows: dict[str, Workflow], tmp: Path, monkeypatch: Any) -> Deployed:
    zip_path = _tiny_zip(tmp)
    seen: dict[str, Any] = {}

    def fake_build(arch: str, out_dir: Any, **kw: Any) -> Path:
        seen.update(arch=arch, out_dir=out_dir, **kw)
        return zip_path

    monkeypatch.setattr(package, "build_lambda_package", fake_build)
    MOCKS.resources.clear()
    holder: dict[str, Any] = {}

    @pulumi.runtime.test
    def run() -> pulumi.Output[Any]:
        stack = build(cfg, workflows)
        holder["stack"] = stack
        return pulumi.Output.from_input(stack.outputs).apply(lambda o: holder.update(outputs=o))

    run()
    assert seen["arch"] == cfg.lambda_architecture
    assert seen["python_version"] == cfg.lambda_runtime.removeprefix("python")
    return Deployed(holder["stack"], list(MOCKS.resources), holder["outputs"], zip_path)


@pytest.fixture(scope="module")
def mp():
    with pytest.MonkeyPatch.context() as m:
        yield m


@pytest.fixture(scope="module")
def workflows() -> dict[str, Workflow]:
    return {**WORKFLOWS, "gputoy": gpu_workflow(), IMAGE_KIND.kind: IMAGE_KIND}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, mp, workflows) -> Deployed:
    """The default configuration (stage "test"), with the built-in kinds plus a GPU kind (and an image
    kind: dpquery, else a toy one)."""
    return deploy(StackConfig(stage="test"), workflows, tmp_path_factory.mktemp("pkg"), mp)


@pytest.fixture(scope="module")
def custom(tmp_path_factory, mp) -> Deployed:
    """A configured stack: On-Demand, given network and images, KMS, x86_64, tracing, extra buckets."""
    cfg = StackConfig(
        stage="custom",
        region="eu-west-1",
        lambda_architecture="x86_64",
        function_memory={"getbatch.gather": 3008, "dispatch": 256},
        function_timeout={"getbatch.prepare": 60},
        log_retention_days=30,
        sfn_log_level="ALL",
        tracing=True,
        bucket_name="my-shardfold-bucket",
        force_destroy=True,
        sse_algorithm="aws:kms",
        kms_key_arn=f"arn:aws:kms:{REGION}:{ACCOUNT}:key/1234abcd",
        jobs_expiration_days=30,
        read_buckets=("public-datasets/imagenet",),
        write_buckets=("s3://results-bucket",),
        spot=False,
        vpc_id="vpc-0custom",
        subnet_ids=("subnet-0ccc",),
        security_group_ids=("sg-0given",),
        worker_image=f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/my-worker:v3",
        lambda_image=CUSTOM_LAMBDA_IMAGE,
    )
    workflows = {**WORKFLOWS, "gputoy": gpu_workflow(), IMAGE_KIND.kind: IMAGE_KIND}
    return deploy(cfg, workflows, tmp_path_factory.mktemp("pkg2"), mp)


# --- outputs ------------------------------------------------------------------------------------------------


def test_outputs_are_what_the_aws_backend_reads(stack, workflows):
    from shardfold.client.stack import load_stack_outputs
    from shardfold.orchestrator.aws import AwsExecutor

    out = stack.outputs
    bucket = stack.one("aws:s3/bucket:Bucket").outputs["bucket"]
    assert out["backend"] == "aws" and out["bucket"] == bucket
    assert out["region"] == REGION and out["stage"] == "test" and out["account"] == ACCOUNT
    assert set(out["state_machine_arns"]) == set(workflows)
    lambda_fns = {s.function for wf in workflows.values() for s in wf.tasks()}
    assert set(out["functions"]) == lambda_fns == set(out["function_names"])
    assert out["function_names"]["getbatch.prepare"] == "shardfold-test-getbatch-prepare"
    assert out["batch_job_queue"].endswith(":job-queue/shardfold-test")
    gpu_entry_points = {
        st.entry_point for wf in workflows.values() for st in wf.walk() if isinstance(st, BatchJob)
    }
    assert set(out["batch_job_definitions"]) == gpu_entry_points and "toy.batch_double" in gpu_entry_points
    assert out["dispatch_function"] == "shardfold-test-dispatch"
    assert out["dead_letter_queue"].startswith("https://sqs.")
    assert out["ecr_repository"].endswith("/shardfold-test-worker")
    assert out["worker_image"]
    assert set(out["log_groups"]) == lambda_fns | set(workflows) | {"dispatch", "batch"}
    # the same keys the moto twin of the stack gives, and the client accepts them
    for key in ("bucket", "region", "stage", "functions", "function_names", "state_machine_arns"):
        assert key in out
    loaded = load_stack_outputs(json.loads(json.dumps(out)))
    AwsExecutor(loaded, workflows)  # constructs its clients from the outputs without complaint


def test_outputs_list_every_deployed_size_and_the_key_that_changes_it(stack, workflows):
    from shardfold import dryrun
    from shardfold.client.stack import BatchSize, deployed_sizes

    sizes = stack.outputs["sizes"]
    fns = {r.inputs["name"]: r.inputs for r in stack.of("aws:lambda/function:Function")}
    names = {**stack.outputs["function_names"], "dispatch": stack.outputs["dispatch_function"]}
    assert set(sizes["functions"]) == set(names)
    for function, size in sizes["functions"].items():
        fn = fns[names[function]]
        assert (size["memory_mb"], size["ephemeral_mb"], size["timeout_s"]) == (
            fn["memorySize"],
            fn["ephemeralStorage"]["size"],
            fn["timeout"],
        )
    assert sizes["functions"]["dispatch"]["memory_mb"] == 512
    assert sizes["functions"]["getbatch.gather"]["config"] == {
        "memory_mb": 'shardfold:functionMemory["getbatch.gather"]',
        "ephemeral_mb": 'shardfold:functionEphemeralStorage["getbatch.gather"]',
        "timeout_s": 'shardfold:functionTimeout["getbatch.gather"]',
    }
    assert set(sizes["batch"]) == set(stack.outputs["batch_job_definitions"])
    assert sizes["batch"]["toy.batch_double"] == {
        "vcpus": 4,
        "memory_mb": 15000,
        "gpus": 1,
        "timeout_s": 1800,
        "config": {
            "vcpus": 'shardfold:batchVcpus["toy.batch_double"]',
            "memory_mb": 'shardfold:batchMemory["toy.batch_double"]',
            "gpus": 'shardfold:batchGpus["toy.batch_double"]',
            "timeout_s": 'shardfold:batchTimeout["toy.batch_double"]',
        },
    }
    # what `shardfold deploy` saves (JSON) reads back through the client's accessor
    read = deployed_sizes(json.loads(json.dumps(stack.outputs)))
    assert read.of("getbatch.gather").memory_mb == sizes["functions"]["getbatch.gather"]["memory_mb"]
    assert read.of("toy.batch_double") == BatchSize(
        4, 15000, 1, 1800, sizes["batch"]["toy.batch_double"]["config"]
    )
    # the moto twin reports the same sizes for the same workflows (it has no dispatch function)
    assert sizes["lambda_architecture"] == "arm64"  # the plan prices Lambda at the deployed rate
    twin = dryrun.stack_sizes(workflows)
    assert twin == {
        "functions": {k: v for k, v in sizes["functions"].items() if k != "dispatch"},
        "batch": sizes["batch"],
        "lambda_architecture": "arm64",
    }


def test_size_overrides_show_up_in_the_sizes(custom):
    sizes = custom.outputs["sizes"]["functions"]
    assert sizes["getbatch.gather"]["memory_mb"] == 3008  # shardfold:functionMemory
    assert sizes["dispatch"]["memory_mb"] == 256
    assert sizes["getbatch.prepare"]["timeout_s"] == 60  # shardfold:functionTimeout


def test_batch_overrides_size_the_job_definition_the_states_and_the_sizes(tmp_path, monkeypatch):
    cfg = StackConfig(
        stage="bsize",
        batch_vcpus={"toy.batch_double": 8},
        batch_memory={"toy.batch_double": 30000},
        batch_gpus={"toy.batch_double": 2},
        batch_timeout={"toy.batch_double": 7200},
        gpu_instance_types=("g5.12xlarge",),  # 48 vCPUs, 192 GiB, 4 GPUs: room for the larger job
    )
    d = deploy(cfg, {"gputoy": gpu_workflow()}, tmp_path, monkeypatch)
    jd = d.one("aws:batch/jobDefinition:JobDefinition").inputs
    reqs = {r["type"]: r["value"] for r in json.loads(jd["containerProperties"])["resourceRequirements"]}
    assert reqs == {"VCPU": "8", "MEMORY": "30000", "GPU": "2"}
    assert jd["timeout"]["attemptDurationSeconds"] == 7200
    # the submitting state overrides the job definition's resources, so it carries the configured ones too
    asl = json.loads(d.one("aws:sfn/stateMachine:StateMachine").inputs["definition"])
    params = asl["States"]["infer"]["Parameters"]
    assert {r["Type"]: r["Value"] for r in params["ContainerOverrides"]["ResourceRequirements"]} == reqs
    assert params["Timeout"] == {"AttemptDurationSeconds": 7200}
    size = d.outputs["sizes"]["batch"]["toy.batch_double"]
    assert (size["vcpus"], size["memory_mb"], size["gpus"], size["timeout_s"]) == (8, 30000, 2, 7200)


def test_bad_batch_sizes_are_refused_with_the_key_named():
    from shardfold.infra.gpu import sized_workflows

    with pytest.raises(ShardfoldError, match=r"batchVcpus\['toy.batch_double'\] = 32 .*1\.\.16 \(maxVcpus\)"):
        StackConfig(batch_vcpus={"toy.batch_double": 32})
    with pytest.raises(ShardfoldError, match="batchTimeout.*at least 60"):
        StackConfig(batch_timeout={"toy.batch_double": 10})
    with pytest.raises(ShardfoldError, match="batchMemory.*at least 4"):
        StackConfig(batch_memory={"toy.batch_double": "lots"})
    with pytest.raises(
        ShardfoldError, match=r"shardfold:batchMemory names unknown BatchJob entry points \['toy.typo'\]"
    ):
        sized_workflows({"gputoy": gpu_workflow()}, StackConfig(batch_memory={"toy.typo": 1024}))
    # a step asking more vCPUs than the environment may ever have would wait RUNNABLE until cancelled
    with pytest.raises(
        ShardfoldError, match=r'raise maxVcpus or set shardfold:batchVcpus\["toy.batch_double"\]'
    ):
        sized_workflows({"gputoy": gpu_workflow()}, StackConfig(max_vcpus=2))


def test_every_job_definition_fits_an_allowed_instance_type():
    """A job asking more than any allowed instance registers would sit RUNNABLE until cancelled."""
    from shardfold.functions.kinds import WORKFLOWS
    from shardfold.infra.gpu import sized_workflows
    from shardfold.infra.instances import INSTANCES, placement_problem, registrable_mb
    from shardfold.infra.sizes import batch_steps

    # the shipped defaults fit the default types (the inference worker once asked for all 16 GiB)
    cfg = StackConfig()
    for entry_point, step in batch_steps(sized_workflows(WORKFLOWS, cfg)).items():
        assert placement_problem(step.vcpus, step.memory_mb, step.gpus, cfg.gpu_instance_types) is None, (
            entry_point
        )
    assert registrable_mb(16) < 16384 and registrable_mb(8) <= 7985 - 32  # the AWS guide's m4.large example
    with pytest.raises(ShardfoldError, match=r'batchMemory\["inference.worker"\].*gpuInstanceTypes'):
        sized_workflows(WORKFLOWS, StackConfig(batch_memory={"inference.worker": 16384}))
    with pytest.raises(ShardfoldError, match=r"needs 4 vCPUs, 15000 MiB and 2 GPU"):
        sized_workflows(WORKFLOWS, StackConfig(batch_gpus={"inference.worker": 2}))
    # a larger type, or a whole family, makes room; an unlisted type is not judged
    sized_workflows(WORKFLOWS, StackConfig(batch_gpus={"inference.worker": 2}, gpu_instance_types=("g5",)))
    sized_workflows(
        WORKFLOWS, StackConfig(batch_memory={"inference.worker": 16384}, gpu_instance_types=("g5.2xlarge",))
    )
    assert placement_problem(4, 10**6, 1, ["x9.huge"]) is None
    assert all(i.registrable_mb < i.memory_gib * 1024 for i in INSTANCES.values())


def cpu_kinds() -> dict:
    """The built-in kinds without a GPU (BatchJob) step: what a stack with shardfold:batch=false can run."""
    return {k: wf for k, wf in WORKFLOWS.items() if not any(isinstance(st, BatchJob) for st in wf.walk())}


def test_outputs_without_the_gpu_queue(tmp_path, monkeypatch):
    d = deploy(StackConfig(stage="nogpu", batch=False), cpu_kinds(), tmp_path, monkeypatch)
    assert "batch_job_queue" not in d.outputs and "ecr_repository" not in d.outputs
    assert not d.of("aws:batch/computeEnvironment:ComputeEnvironment")
    assert not [r for r in d.of("aws:ecr/repository:Repository") if r.name.endswith("-worker")]
    with pytest.raises(ShardfoldError, match="shardfold:batch is false"):
        build(StackConfig(stage="nogpu2", batch=False), {"gputoy": gpu_workflow()})


def test_no_batch_job_means_no_image_and_no_job_definition(tmp_path, monkeypatch):
    d = deploy(StackConfig(stage="cpuonly"), cpu_kinds(), tmp_path, monkeypatch)
    assert d.outputs["batch_job_definitions"] == {} and d.outputs["sizes"]["batch"] == {}
    assert "worker_image" not in d.outputs
    assert not d.of("aws:batch/jobDefinition:JobDefinition")
    # the queue is still there (it costs nothing idle) for kinds that add a GPU stage later
    assert d.one("aws:batch/jobQueue:JobQueue")


# --- bucket ---------------------------------------------------------------------------------------------


def test_bucket_is_private_encrypted_tls_only_and_notifies_eventbridge(stack):
    bucket = stack.one("aws:s3/bucket:Bucket")
    assert bucket.inputs.get("forceDestroy") is False  # destroy never deletes data unless configured
    pab = stack.one("aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock").inputs
    for flag in ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls", "restrictPublicBuckets"):
        assert pab[flag] is True
    own = stack.one("aws:s3/bucketOwnershipControls:BucketOwnershipControls").inputs
    assert own["rule"]["objectOwnership"] == "BucketOwnerEnforced"
    sse = stack.one("aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration")
    (rule,) = sse.inputs["rules"]
    assert rule["applyServerSideEncryptionByDefault"]["sseAlgorithm"] == "AES256"

    (policy,) = [json.loads(r.inputs["policy"]) for r in stack.of("aws:s3/bucketPolicy:BucketPolicy")]
    arn = bucket.outputs["arn"]
    statements = policy["Statement"]
    assert all(s["Effect"] == "Deny" for s in statements), "the bucket policy grants nothing"
    (tls,) = statements
    assert tls["Principal"] == "*" and tls["Action"] == "s3:*"
    assert sorted(tls["Resource"]) == sorted([arn, f"{arn}/*"])
    assert tls["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}

    notif = stack.one("aws:s3/bucketNotification:BucketNotification").inputs
    assert notif["eventbridge"] is True


def test_bucket_lifecycle_expires_only_temporary_data_by_default(stack, custom):
    (lc,) = stack.of("aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration")
    rules = {r["id"]: r for r in lc.inputs["rules"]}
    assert set(rules) == {"expire-tmp", "abort-incomplete-multipart-uploads"}
    assert (
        rules["expire-tmp"]["filter"]["prefix"] == "tmp/" and rules["expire-tmp"]["expiration"]["days"] == 7
    )
    assert (
        rules["abort-incomplete-multipart-uploads"]["abortIncompleteMultipartUpload"]["daysAfterInitiation"]
        == 2
    )
    assert all(r["status"] == "Enabled" for r in rules.values())
    (lc,) = custom.of("aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration")
    jobs = {r["id"]: r for r in lc.inputs["rules"]}["expire-jobs"]
    assert jobs["filter"]["prefix"] == "jobs/" and jobs["expiration"]["days"] == 30


def test_configured_bucket(custom):
    bucket = custom.one("aws:s3/bucket:Bucket")
    assert bucket.inputs["bucket"] == "my-shardfold-bucket" and bucket.inputs["forceDestroy"] is True
    sse = custom.one("aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration")
    (rule,) = sse.inputs["rules"]
    assert rule["applyServerSideEncryptionByDefault"] == {
        "sseAlgorithm": "aws:kms",
        "kmsMasterKeyId": f"arn:aws:kms:{REGION}:{ACCOUNT}:key/1234abcd",
    }
    assert rule["bucketKeyEnabled"] is True
    assert custom.one("aws:ecr/repository:Repository").inputs["forceDelete"] is True  # lambdaImage: no other
    provider = custom.one("pulumi:providers:aws").inputs
    assert provider["region"] == "eu-west-1"


# --- Lambda -------------------------------------------------------------------------------------------------


def test_one_function_per_handler_sized_from_the_plan(stack, workflows):
    from shardfold.orchestrator.registry import lambda_handler

    fns = {r.inputs["name"]: r.inputs for r in stack.of("aws:lambda/function:Function")}
    expected: dict[str, tuple[int, int]] = {}
    for wf in workflows.values():
        for s in wf.tasks():
            m, t = expected.get(s.function, (0, 0))
            expected[s.function] = (max(m, s.memory_mb), max(t, s.timeout_s))
    assert set(fns) == {stack.outputs["function_names"][f] for f in expected} | {"shardfold-test-dispatch"}
    images = image_functions(workflows)
    assert images, "the test stack has a kind deployed as container images"
    for function, (memory, timeout) in expected.items():
        fn = fns[stack.outputs["function_names"][function]]
        if function in images:
            assert fn["imageConfig"]["commands"] == [lambda_handler(function)]
        else:
            assert fn["handler"] == lambda_handler(function)
        assert (fn["memorySize"], fn["timeout"]) == (memory, timeout)
    dispatch = fns["shardfold-test-dispatch"]
    assert dispatch["handler"] == "shardfold.functions.trigger.handler"
    assert (
        json.loads(dispatch["environment"]["variables"]["SHARDFOLD_STATE_MACHINES"])
        == (stack.outputs["state_machine_arns"])
    )
    bucket = stack.outputs["bucket"]
    for fn in fns.values():
        assert fn["architectures"] == ["arm64"]
        if fn.get("packageType") != "Image":
            assert fn["runtime"] == "python3.12" and fn["code"].path == str(stack.zip_path)
        env = fn["environment"]["variables"]
        assert env["POWERTOOLS_SERVICE_NAME"] == "shardfold" and env["SHARDFOLD_HOME"] == f"s3://{bucket}"
        assert fn["loggingConfig"]["logGroup"] == f"/aws/lambda/{fn['name']}"
        assert fn["tracingConfig"]["mode"] == "PassThrough"
        assert fn["ephemeralStorage"]["size"] == 512
    # every function has its own role
    roles = [fn["role"] for fn in fns.values()]
    assert len(set(roles)) == len(roles)
    groups = {r.inputs["name"]: r.inputs for r in stack.of("aws:cloudwatch/logGroup:LogGroup")}
    for fn in fns.values():
        assert groups[f"/aws/lambda/{fn['name']}"]["retentionInDays"] == 14


def test_function_overrides_and_architecture(custom):
    fns = {r.inputs["name"]: r.inputs for r in custom.of("aws:lambda/function:Function")}
    assert fns["shardfold-custom-getbatch-gather"]["memorySize"] == 3008
    assert fns["shardfold-custom-getbatch-prepare"]["timeout"] == 60
    assert fns["shardfold-custom-dispatch"]["memorySize"] == 256
    assert all(
        f["architectures"] == ["x86_64"] and f["tracingConfig"]["mode"] == "Active" for f in fns.values()
    )
    groups = [r.inputs for r in custom.of("aws:cloudwatch/logGroup:LogGroup")]
    assert {g["retentionInDays"] for g in groups} == {30}


def test_bad_config_is_refused_with_the_key_named(tmp_path, monkeypatch):
    with pytest.raises(ShardfoldError, match="lambdaArchitecture"):
        StackConfig(lambda_architecture="armv7")
    with pytest.raises(ShardfoldError, match="logRetentionDays"):
        StackConfig(log_retention_days=10)
    with pytest.raises(ShardfoldError, match="functionMemory"):
        StackConfig(function_memory={"getbatch.gather": 20000})
    with pytest.raises(ShardfoldError, match="stage"):
        StackConfig(stage="Has_Upper")
    for prefix in ("ledger/", "jobs/x", "", "a/../b", "res*"):  # never a system prefix, nothing vague
        with pytest.raises(ShardfoldError, match="outputPrefixes"):
            StackConfig(output_prefixes=(prefix,))
    from shardfold.infra.functions import function_specs

    with pytest.raises(ShardfoldError, match="unknown functions"):
        function_specs(WORKFLOWS, StackConfig(function_timeout={"getbatch.typo": 10}))


def test_a_package_with_torch_is_refused(tmp_path):
    from shardfold.infra.functions import LambdaCode

    path = tmp_path / "bad.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("functions/__init__.py", "")
        zf.writestr("torch/__init__.py", "")
    with pytest.raises(ShardfoldError, match="torch"):
        LambdaCode.from_zip(path)
    code = LambdaCode.from_zip(_tiny_zip(tmp_path))
    assert code.direct_upload and code.function_args()["code"].path.endswith(".zip")


def test_a_package_over_the_direct_upload_limit_goes_through_the_bucket(tmp_path, monkeypatch):
    from shardfold.infra import functions as infra_functions

    real = infra_functions.LambdaCode.from_zip
    monkeypatch.setattr(
        infra_functions.LambdaCode,
        "from_zip",
        classmethod(lambda cls, path: replace(real(path), direct_upload=False)),
    )
    d = deploy(StackConfig(stage="bigzip", batch=False), cpu_kinds(), tmp_path, monkeypatch)
    obj = d.one("aws:s3/bucketObjectv2:BucketObjectv2").inputs
    assert obj["key"].startswith("deploy/lambda-") and obj["source"].path == str(d.zip_path)
    zipped = [fn for fn in d.of("aws:lambda/function:Function") if fn.inputs.get("packageType") != "Image"]
    assert len(zipped) > 3
    for fn in zipped:
        assert "code" not in fn.inputs
        assert fn.inputs["s3Key"] == obj["key"] and fn.inputs["s3Bucket"] == d.outputs["bucket"]


# --- Step Functions -----------------------------------------------------------------------------------------


def _resources_in(asl: Any) -> set[str]:
    """Every ``Resource`` string anywhere in an ASL document."""
    found: set[str] = set()
    if isinstance(asl, dict):
        for k, v in asl.items():
            if k == "Resource" and isinstance(v, str):
                found.add(v)
            else:
                found |= _resources_in(v)
    elif isinstance(asl, list):
        for v in asl:
            found |= _resources_in(v)
    return found


def test_state_machines_validate_and_call_only_deployed_functions(stack, workflows):
    machines = {r.inputs["name"]: r.inputs for r in stack.of("aws:sfn/stateMachine:StateMachine")}
    assert set(machines) == {f"shardfold-test-{k}" for k in workflows}
    deployed = set(stack.outputs["functions"].values())
    for kind, wf in workflows.items():
        sm = machines[f"shardfold-test-{kind}"]
        assert sm["type"] == "STANDARD"
        asl = json.loads(sm["definition"])
        validate(asl)
        lambdas = {r for r in _resources_in(asl) if r.startswith("arn:aws:lambda:")}
        wanted = {stack.outputs["functions"][s.function] for s in wf.tasks()}
        assert lambdas == wanted and lambdas <= deployed
        others = _resources_in(asl) - lambdas
        assert others <= {"arn:aws:states:::s3:getObject", "arn:aws:states:::batch:submitJob.sync"}
        log = sm["loggingConfiguration"]
        assert log["level"] == "ERROR" and log["includeExecutionData"] is False
        assert log["logDestination"].startswith("arn:aws:logs:") and log["logDestination"].endswith(":*")
        assert f"/aws/vendedlogs/states/shardfold-test-{kind}" in log["logDestination"]
    # the GPU kind's BatchJob state names the deployed queue and job definition
    gpu = json.loads(machines["shardfold-test-gputoy"]["definition"])
    params = gpu["States"]["infer"]["Parameters"]
    assert params["JobQueue"] == stack.outputs["batch_job_queue"]
    assert params["JobDefinition"] == stack.outputs["batch_job_definitions"]["toy.batch_double"]


def test_state_machine_roles_are_scoped(stack):
    docs = dict(stack.policies())
    getbatch = docs["shardfold-test-getbatch-policy.policy"]
    by_sid = {s["Sid"]: s for s in getbatch["Statement"]}
    fns = stack.outputs["functions"]
    invoke = set(by_sid["InvokeFunctions"]["Resource"])
    assert invoke == {fns[f] for f in ("getbatch.prepare", "getbatch.gather", "getbatch.assemble")} | {
        f"{fns[f]}:*" for f in ("getbatch.prepare", "getbatch.gather", "getbatch.assemble")
    }
    sm_arn = f"arn:aws:states:{REGION}:{ACCOUNT}:stateMachine:shardfold-test-getbatch"
    assert by_sid["MapStartChildren"]["Resource"] == sm_arn == stack.outputs["state_machine_arns"]["getbatch"]
    assert by_sid["MapReadManifest"] == {
        "Sid": "MapReadManifest",
        "Effect": "Allow",
        "Action": ["s3:GetObject"],
        "Resource": f"arn:aws:s3:::{stack.outputs['bucket']}/jobs/*",
    }
    assert not any(sid.startswith("Batch") for sid in by_sid), "no Batch rights without a BatchJob"
    gpu = {s["Sid"]: s for s in docs["shardfold-test-gputoy-policy.policy"]["Statement"]}
    submit = gpu["BatchSubmit"]["Resource"]
    assert stack.outputs["batch_job_queue"] in submit
    assert f"arn:aws:batch:{REGION}:{ACCOUNT}:job-definition/shardfold-test-toy-batch_double:*" in submit
    assert stack.outputs["batch_job_definitions"]["toy.batch_double"].rsplit(":", 1)[0] in submit
    assert gpu["BatchSyncRule"]["Resource"].endswith(":rule/StepFunctionsGetEventsForBatchJobsRule")
    trust = docs["shardfold-test-getbatch-role.assumeRolePolicy"]["Statement"][0]
    assert trust["Principal"] == {"Service": "states.amazonaws.com"}
    assert trust["Condition"] == {"StringEquals": {"aws:SourceAccount": ACCOUNT}}


# --- IAM ------------------------------------------------------------------------------------------------


def _statements(doc: dict[str, Any]) -> list[dict[str, Any]]:
    st = doc["Statement"]
    return st if isinstance(st, list) else [st]


def _as_list(v: Any) -> list[Any]:
    return v if isinstance(v, list) else [v]


@pytest.mark.parametrize("which", ["stack", "custom"])
def test_no_wildcard_actions_and_only_allowlisted_wildcard_resources(which, request):
    d: Deployed = request.getfixturevalue(which)
    docs = d.policies()
    assert len(docs) > 20
    wildcard_actions_seen: set[str] = set()
    for where, doc in docs:
        for st in _statements(doc):
            actions = _as_list(st["Action"])
            if st["Effect"] == "Deny":  # the bucket's TLS rule, or a worker's reads stopping short of ledger/
                ledger = st.get("Sid") == "NoLedger" and actions == ["s3:GetObject"]
                assert where.endswith("-jobs-policy.policy") or ledger, f"{where}: an unexpected Deny"
                continue
            for a in actions:
                assert "*" not in a and "?" not in a, f"{where}: wildcard action {a}"
            for res in _as_list(st.get("Resource", [])):
                if res == "*":
                    extra = set(actions) - set(iam.WILDCARD_RESOURCE_ACTIONS)
                    assert not extra, f"{where}: {extra} on Resource '*'"
                    wildcard_actions_seen |= set(actions)
                else:
                    assert res.startswith("arn:aws:"), f"{where}: {res}"
                    if "*" in res:  # a wildcard only inside a named resource: keys, versions, executions
                        head = res.split("*", 1)[0]
                        assert head.count(":") >= 5 or head.startswith("arn:aws:s3:::"), f"{where}: {res}"
            if "Resource" not in st:  # a trust policy, or the Lambda image repository's (scoped) policy
                lambda_pull = where.endswith("-lambda-policy.policy") and st["Condition"]["StringLike"].get(
                    "aws:SourceArn"
                )
                assert actions == ["sts:AssumeRole"] or lambda_pull, where
    # the allowlist holds nothing the stack does not use (tracing on in the custom stack uses xray)
    if which == "custom":
        stack_seen = set()
        for _, doc in request.getfixturevalue("stack").policies():
            for st in _statements(doc):
                if st["Effect"] == "Allow" and st.get("Resource") == "*":
                    stack_seen |= set(_as_list(st["Action"]))
        assert stack_seen | wildcard_actions_seen == set(iam.WILDCARD_RESOURCE_ACTIONS)


def test_check_policy_refuses_what_the_rules_forbid():
    with pytest.raises(ShardfoldError, match="wildcard action"):
        iam.check_policy(iam.document(iam.statement(["s3:Get*"], "arn:aws:s3:::b/*")))
    with pytest.raises(ShardfoldError, match="Resource"):
        iam.check_policy(iam.document(iam.statement(["s3:GetObject"], "*")))
    iam.check_policy(iam.document(iam.statement(["batch:DescribeJobs"], "*")))


def test_worker_roles_reach_the_bucket_and_only_the_configured_buckets(stack, custom):
    docs = dict(stack.policies())
    bucket = stack.outputs["bucket"]
    gather = {s["Sid"]: s for s in docs["shardfold-test-getbatch-gather-policy.policy"]["Statement"]}
    # writes: the job's folders and the output prefixes, never ledger/; reads: the whole bucket
    assert set(_as_list(gather["WriteObjects"]["Resource"])) == {
        f"arn:aws:s3:::{bucket}/{p}/*" for p in ("jobs", "results")
    }
    assert gather["ReadObjects"]["Resource"] == f"arn:aws:s3:::{bucket}/*"
    assert gather["WriteObjects"]["Action"] == [
        "s3:AbortMultipartUpload",
        "s3:DeleteObject",
        "s3:GetObject",
        "s3:PutObject",
    ]
    assert gather["WriteList"]["Resource"] == f"arn:aws:s3:::{bucket}"
    assert gather["Logs"]["Resource"] == (
        f"arn:aws:logs:{REGION}:{ACCOUNT}:log-group:/aws/lambda/shardfold-test-getbatch-gather:*"
    )
    assert set(gather) == {"Logs", "WriteObjects", "WriteList", "ReadObjects", "ReadList", "NoLedger"}

    cdocs = dict(custom.policies())
    c = {s["Sid"]: s for s in cdocs["shardfold-custom-getbatch-gather-policy.policy"]["Statement"]}
    assert set(c["WriteObjects"]["Resource"]) == {
        *(f"arn:aws:s3:::my-shardfold-bucket/{p}/*" for p in ("jobs", "results")),
        "arn:aws:s3:::results-bucket/*",
    }
    assert c["ReadObjects"] == {
        "Sid": "ReadObjects",
        "Effect": "Allow",
        "Action": ["s3:GetObject"],
        "Resource": ["arn:aws:s3:::my-shardfold-bucket/*", "arn:aws:s3:::public-datasets/imagenet/*"],
    }
    assert c["BucketKey"]["Resource"] == f"arn:aws:kms:{REGION}:{ACCOUNT}:key/1234abcd"
    assert "XRay" in c
    sm = {s["Sid"]: s for s in cdocs["shardfold-custom-getbatch-policy.policy"]["Statement"]}
    assert sm["BucketKey"]["Action"] == ["kms:Decrypt", "kms:GenerateDataKey"] and "XRay" in sm

    dispatch = {s["Sid"]: s for s in docs["shardfold-test-dispatch-policy.policy"]["Statement"]}
    # submit writes the job's records and claims its outputs
    assert dispatch["JobObjects"]["Resource"] == [
        f"arn:aws:s3:::{bucket}/jobs/*",
        f"arn:aws:s3:::{bucket}/claims/*",
    ]
    # the plan check sizes inputs before a job starts: the trigger reads what the workers read, writes none
    assert dispatch["ReadObjects"]["Resource"] == f"arn:aws:s3:::{bucket}/*"
    assert set(_as_list(dispatch["StartJobs"]["Resource"])) == set(
        stack.outputs["state_machine_arns"].values()
    )
    assert dispatch["StartJobs"]["Action"] == ["states:StartExecution"]


def test_each_function_reaches_what_its_kind_declares_and_nothing_else(stack):
    """The roles derive from JobKind.rights: the ledger for the kinds that keep budgets (DP-FedAvg's
    included), outputs and inputs for those that declare them, every job folder for all."""
    docs = dict(stack.policies())
    bucket = f"arn:aws:s3:::{stack.outputs['bucket']}"
    grants = Grants()
    roles = {
        f"{lambda_name(fn, 'test')}-policy.policy": fn
        for fn in stack.outputs["functions"]
        if fn.split(".")[0] in kinds.names()  # not the tests' toy functions
    }
    assert roles and {fn.split(".")[0] for fn in roles.values()} == set(kinds.names())
    for name, function in roles.items():
        rights = kinds.find(function.split(".")[0]).rights
        by_sid = {s["Sid"]: s for s in docs[name]["Statement"]}
        writes = set(_as_list(by_sid["WriteObjects"]["Resource"]))
        reads = set(_as_list(by_sid.get("ReadObjects", {}).get("Resource", [])))
        assert (f"{bucket}/ledger/*" in writes) == (Right.LEDGER in rights), name
        assert all((f"{bucket}/{p}*" in writes) == (Right.OUTPUTS in rights) for p in grants.output_prefixes)
        assert (f"{bucket}/*" in reads) == (Right.INPUTS in rights), name
        denied = by_sid.get(
            "NoLedger", {}
        )  # reading the bucket stops short of the ledgers, as the task's check
        assert (denied.get("Resource") == f"{bucket}/ledger/*") == (Right.LEDGER not in rights), name
        assert f"{bucket}/jobs/*" in writes and f"{bucket}/claims/*" not in writes, name
    fedavg = {n for n, fn in roles.items() if fn.startswith("fedavg.")}
    assert fedavg and all(f"{bucket}/ledger/*" in json.dumps(docs[n]) for n in fedavg)  # DP-FedAvg's budget
    job_role = {s["Sid"]: s for s in docs["shardfold-test-gpu-job-policy.policy"]["Statement"]}
    batch_kinds = {k.name for k in kinds.every() if any(isinstance(s, BatchJob) for s in k.workflow.walk())}
    batch_ledger = any(Right.LEDGER in kinds.find(k).rights for k in batch_kinds)
    assert (f"{bucket}/ledger/*" in _as_list(job_role["WriteObjects"]["Resource"])) == batch_ledger


# --- AWS Batch ----------------------------------------------------------------------------------------------


def test_gpu_compute_environment_queue_and_job_definition(stack):
    ce = stack.one("aws:batch/computeEnvironment:ComputeEnvironment").inputs
    assert ce["type"] == "MANAGED" and "serviceRole" not in ce  # the service-linked role
    res = ce["computeResources"]
    assert res["type"] == "SPOT" and res["allocationStrategy"] == "SPOT_PRICE_CAPACITY_OPTIMIZED"
    assert res["minVcpus"] == 0 and res["maxVcpus"] == 16
    assert res["instanceTypes"] == ["g5.xlarge", "g4dn.xlarge"]
    assert res["ec2Configurations"] == [{"imageType": "ECS_AL2023_NVIDIA"}]
    assert res["subnets"] == DEFAULT_SUBNETS and res["securityGroupIds"] == ["sg-0stack"]
    assert res["instanceRole"].startswith(f"arn:aws:iam::{ACCOUNT}:instance-profile/")
    sg = stack.one("aws:ec2/securityGroup:SecurityGroup").inputs
    assert sg["vpcId"] == DEFAULT_VPC and not sg.get("ingress")
    assert ("aws:ec2/getVpc:getVpc", {"default": True}) in [(t, a) for t, a in MOCKS.calls]

    queue = stack.one("aws:batch/jobQueue:JobQueue").inputs
    assert queue["name"] == "shardfold-test" and queue["state"] == "ENABLED"
    (order,) = queue["computeEnvironmentOrders"]
    assert order["computeEnvironment"].startswith(f"arn:aws:batch:{REGION}:{ACCOUNT}:compute-environment/")
    limits = queue["jobStateTimeLimitActions"]
    assert {a["reason"] for a in limits} >= {"CAPACITY:INSUFFICIENT_INSTANCE_CAPACITY"}
    assert all(a["action"] == "CANCEL" and a["state"] == "RUNNABLE" for a in limits)

    jd = stack.named("aws:batch/jobDefinition:JobDefinition", "shardfold-test-toy-batch_double").inputs
    assert jd["name"] == "shardfold-test-toy-batch_double" and jd["type"] == "container"
    assert jd["platformCapabilities"] == ["EC2"]
    props = json.loads(jd["containerProperties"])
    assert props["command"] == ["python", "-m", "shardfold.functions.container"]
    reqs = {r["type"]: r["value"] for r in props["resourceRequirements"]}
    assert reqs == {"GPU": "1", "VCPU": "4", "MEMORY": "15000"}
    assert props["jobRoleArn"].startswith(f"arn:aws:iam::{ACCOUNT}:role/")
    assert props["logConfiguration"]["options"]["awslogs-group"] == "/aws/batch/shardfold-test"
    env = {e["name"]: e["value"] for e in props["environment"]}
    assert env["SHARDFOLD_HOME"] == f"s3://{stack.outputs['bucket']}"
    assert props["image"] == stack.outputs["worker_image"]
    retry = jd["retryStrategy"]
    assert retry["attempts"] == RETRY_ATTEMPTS == 3
    table = retry["evaluateOnExits"]
    assert table[0] == {"action": "RETRY", "onStatusReason": "Host EC2*"}
    assert {"action": "RETRY", "onExitCode": "75"} in table
    assert table[-1] == {"action": "EXIT", "onReason": "*"}, "an unmatched failure must not be retried"
    assert jd["timeout"]["attemptDurationSeconds"] == 1800

    repo = stack.named("aws:ecr/repository:Repository", "shardfold-test-worker").inputs
    assert repo["imageScanningConfiguration"]["scanOnPush"] is True and repo["forceDelete"] is False
    lifecycle = json.loads(
        stack.named("aws:ecr/lifecyclePolicy:LifecyclePolicy", "shardfold-test-worker-lifecycle").inputs[
            "policy"
        ]
    )
    assert [r["rulePriority"] for r in lifecycle["rules"]] == [1, 2]


def test_gpu_instance_role_is_scoped_to_its_cluster(stack):
    docs = dict(stack.policies())
    inst = {s["Sid"]: s for s in docs["shardfold-test-gpu-instance-policy.policy"]["Statement"]}
    ce = stack.one("aws:batch/computeEnvironment:ComputeEnvironment").outputs
    assert inst["EcsAgentCluster"]["Resource"] == ce["ecsClusterArn"]
    cluster = ce["ecsClusterArn"].rsplit("/", 1)[-1]
    assert inst["EcsAgentInstance"]["Resource"].endswith(f":container-instance/{cluster}/*")
    worker_repo = stack.named("aws:ecr/repository:Repository", "shardfold-test-worker")
    assert inst["PullWorkerImage"]["Resource"] == worker_repo.outputs["arn"]
    trust = docs["shardfold-test-gpu-instance-role.assumeRolePolicy"]["Statement"][0]
    assert trust["Principal"] == {"Service": "ec2.amazonaws.com"}
    job_trust = docs["shardfold-test-gpu-job-role.assumeRolePolicy"]["Statement"][0]
    assert job_trust["Principal"] == {"Service": "ecs-tasks.amazonaws.com"}
    # the worker asks Batch whether a claim's holder ended; DescribeJobs takes no resource ARN
    job = {s["Sid"]: s for s in docs["shardfold-test-gpu-job-policy.policy"]["Statement"]}
    assert job["ClaimHolderAlive"]["Action"] in ("batch:DescribeJobs", ["batch:DescribeJobs"])
    assert job["ClaimHolderAlive"]["Resource"] == "*"
    role = stack.named("aws:iam/role:Role", "shardfold-test-gpu-instance-role").inputs
    assert not role.get("managedPolicyArns")


def test_configured_gpu_queue(custom):
    res = custom.one("aws:batch/computeEnvironment:ComputeEnvironment").inputs["computeResources"]
    assert res["type"] == "EC2" and res["allocationStrategy"] == "BEST_FIT_PROGRESSIVE"
    assert res["subnets"] == ["subnet-0ccc"] and res["securityGroupIds"] == ["sg-0given"]
    assert not custom.of("aws:ec2/securityGroup:SecurityGroup")
    jd = custom.named("aws:batch/jobDefinition:JobDefinition", "shardfold-custom-toy-batch_double")
    props = json.loads(jd.inputs["containerProperties"])
    assert props["image"] == f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/my-worker:v3"
    docs = dict(custom.policies())
    pull = {s["Sid"]: s for s in docs["shardfold-custom-gpu-instance-policy.policy"]["Statement"]}[
        "PullWorkerImage"
    ]
    assert f"arn:aws:ecr:{REGION}:{ACCOUNT}:repository/my-worker" in _as_list(pull["Resource"])


def test_worker_image_fallback_without_a_build_provider(stack, monkeypatch):
    # Without pulumi-docker-build (and no workerImage) the job definition runs <repository>:latest.
    from shardfold.infra import gpu

    if gpu.docker_build_available():
        pytest.skip("pulumi-docker-build is installed: the image is built, see the next test")
    assert stack.outputs["worker_image"] == f"{stack.outputs['ecr_repository']}:latest"


def test_worker_image_built_with_docker_build_when_available(tmp_path, monkeypatch):
    pytest.importorskip("pulumi_docker_build")
    d = deploy(StackConfig(stage="built"), {"gputoy": gpu_workflow()}, tmp_path, monkeypatch)
    image = d.one("docker-build:index:Image").inputs
    assert image["push"] is True and image["platforms"] == ["linux/amd64"]
    assert image["dockerfile"]["location"] == str(REPO / "Dockerfile")
    assert image["tags"] == [f"{d.outputs['ecr_repository']}:latest"]
    assert image["registries"][0]["address"] == d.outputs["ecr_repository"]
    # the job definition pins the pushed image by digest
    assert d.outputs["worker_image"] == f"{d.outputs['ecr_repository']}:latest@sha256:{'0' * 64}"
    props = json.loads(d.one("aws:batch/jobDefinition:JobDefinition").inputs["containerProperties"])
    assert props["image"] == d.outputs["worker_image"]


# --- container-image Lambda functions (kinds with lambda_package="image") -----------------------------------


def _functions_by(d: Deployed) -> dict[str, dict[str, Any]]:
    """``{registered function: Function inputs}``."""
    by_name = {r.inputs["name"]: r.inputs for r in d.of("aws:lambda/function:Function")}
    return {fn: by_name[name] for fn, name in d.outputs["function_names"].items()}


def test_dpquery_deploys_as_container_images():
    # opendp, pyarrow and cvxpy are far over the zip's 250 MiB: dpquery is an image kind
    if "dpquery" not in WORKFLOWS:
        pytest.skip("dpquery is not registered")
    assert WORKFLOWS["dpquery"].lambda_package == "image"
    assert set(package.lambda_handlers("image")) >= set(WORKFLOWS["dpquery"].functions())


def test_image_kind_functions_run_the_image_and_zip_kinds_are_unchanged(stack, workflows):
    from shardfold.infra.gpu import docker_build_available
    from shardfold.orchestrator.registry import lambda_handler

    images = image_functions(workflows)
    assert images and images >= set(IMAGE_KIND.functions())
    repo = stack.named("aws:ecr/repository:Repository", "shardfold-test-lambda")
    assert stack.outputs["lambda_ecr_repository"] == repo.outputs["repositoryUrl"]
    if docker_build_available():
        assert stack.outputs["lambda_image"] == f"{repo.outputs['repositoryUrl']}@sha256:{'0' * 64}"
    else:
        assert stack.outputs["lambda_image"] == f"{repo.outputs['repositoryUrl']}:latest"
    for function, fn in _functions_by(stack).items():
        assert fn["architectures"] == ["arm64"]
        if function in images:
            assert fn["packageType"] == "Image" and fn["imageUri"] == stack.outputs["lambda_image"]
            assert fn["imageConfig"] == {"commands": [lambda_handler(function)]}
            assert not {"handler", "runtime", "code", "s3Key", "sourceCodeHash"} & set(fn), fn
        else:
            assert "packageType" not in fn and "imageUri" not in fn and "imageConfig" not in fn
            assert fn["handler"] == lambda_handler(function) and fn["runtime"] == "python3.12"
            assert fn["code"].path == str(stack.zip_path)
    # the image functions' roles are like every function's: their log group and the bucket, nothing of ECR
    docs = dict(stack.policies())
    for function in images:
        role = docs[f"{stack.outputs['function_names'][function]}-policy.policy"]
        assert not [a for st in _statements(role) for a in _as_list(st["Action"]) if a.startswith("ecr:")]


def test_the_lambda_repository_lets_only_this_stacks_image_functions_pull(stack, workflows):
    (policy,) = stack.of("aws:ecr/repositoryPolicy:RepositoryPolicy")
    assert policy.inputs["repository"] == "shardfold-test-lambda"
    (st,) = json.loads(policy.inputs["policy"])["Statement"]
    assert st["Effect"] == "Allow" and st["Principal"] == {"Service": "lambda.amazonaws.com"}
    assert st["Action"] == ["ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer"]
    assert "Resource" not in st  # a repository policy applies to its repository
    arns = [stack.outputs["functions"][f] for f in sorted(image_functions(workflows))]
    assert set(st["Condition"]["StringLike"]["aws:SourceArn"]) == set(arns) | {f"{a}:*" for a in arns}
    assert set(st["Condition"]) == {"StringLike"}
    zip_arns = {a for f, a in stack.outputs["functions"].items() if f not in image_functions(workflows)}
    assert not zip_arns & set(st["Condition"]["StringLike"]["aws:SourceArn"])
    repo = stack.named("aws:ecr/repository:Repository", "shardfold-test-lambda").inputs
    assert repo["imageScanningConfiguration"]["scanOnPush"] is True and repo["forceDelete"] is False
    assert stack.named("aws:ecr/lifecyclePolicy:LifecyclePolicy", "shardfold-test-lambda-lifecycle")


def test_a_configured_lambda_image_is_used_as_given(custom, workflows):
    images = image_functions(workflows)
    fns = _functions_by(custom)
    for function in images:
        assert fns[function]["imageUri"] == CUSTOM_LAMBDA_IMAGE
        assert fns[function]["architectures"] == ["x86_64"]  # the image must be built for it (docs/deploy.md)
    assert custom.outputs["lambda_image"] == CUSTOM_LAMBDA_IMAGE
    assert "lambda_ecr_repository" not in custom.outputs
    assert not custom.of("aws:ecr/repositoryPolicy:RepositoryPolicy")  # not ours to change
    assert [r.name for r in custom.of("aws:ecr/repository:Repository")] == ["shardfold-custom-worker"]


def test_without_a_build_the_functions_run_latest_and_a_warning_says_what_to_push(tmp_path, monkeypatch):
    warnings: list[str] = []
    monkeypatch.setattr(pulumi.log, "warn", lambda msg, *a, **kw: warnings.append(msg))
    cfg = StackConfig(stage="push", batch=False, build_lambda_image=False, lambda_architecture="x86_64")
    d = deploy(cfg, {IMAGE_KIND.kind: IMAGE_KIND}, tmp_path, monkeypatch)
    assert not d.of("docker-build:index:Image")
    url = d.outputs["lambda_ecr_repository"]
    assert d.outputs["lambda_image"] == f"{url}:latest"
    assert {f["imageUri"] for f in _functions_by(d).values() if f.get("packageType")} == {f"{url}:latest"}
    (warning,) = [w for w in warnings if "Lambda image" in w]
    assert "shardfold:lambdaImage" in warning and "shardfold-push-lambda" in warning
    assert "--platform linux/amd64" in warning and "Dockerfile.lambda" in warning
    # no image kind: no Lambda image, repository or output
    d = deploy(
        StackConfig(stage="zips", batch=False), {"getbatch": WORKFLOWS["getbatch"]}, tmp_path, monkeypatch
    )
    assert "lambda_image" not in d.outputs and not d.of("aws:ecr/repository:Repository")


@pytest.mark.parametrize(("arch", "platform"), [("arm64", "linux/arm64"), ("x86_64", "linux/amd64")])
def test_lambda_image_built_with_docker_build_when_available(arch, platform, tmp_path, monkeypatch):
    pytest.importorskip("pulumi_docker_build")
    cfg = StackConfig(stage="lbuilt", batch=False, lambda_architecture=arch)
    d = deploy(cfg, {IMAGE_KIND.kind: IMAGE_KIND}, tmp_path, monkeypatch)
    image = d.one("docker-build:index:Image").inputs
    url = d.outputs["lambda_ecr_repository"]
    assert image["push"] is True and image["platforms"] == [platform]  # one platform: Lambda needs that
    assert image["dockerfile"]["location"] == str(REPO / "Dockerfile.lambda")
    assert image["context"]["location"] == str(REPO)
    assert image["tags"] == [f"{url}:latest"] and image["registries"][0]["address"] == url
    # pinned by digest alone: Lambda refuses the <repository>:<tag>@<digest> form of the build's ref
    assert d.outputs["lambda_image"] == f"{url}@sha256:{'0' * 64}"
    for fn in _functions_by(d).values():
        assert fn["imageUri"] == d.outputs["lambda_image"] and fn["architectures"] == [arch]


def test_lambda_image_config_is_checked():
    with pytest.raises(ShardfoldError, match="lambdaImage must be a private Amazon ECR image"):
        StackConfig(lambda_image="public.ecr.aws/lambda/python:3.12")
    with pytest.raises(ShardfoldError, match="lambdaImage must be a private Amazon ECR image"):
        StackConfig(lambda_image=f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/repo")  # a tag or digest
    with pytest.raises(ShardfoldError, match="lambdaImage must be in the stack's Region eu-west-1"):
        StackConfig(region="eu-west-1", lambda_image=f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/repo:v1")
    StackConfig(lambda_image=f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/team/repo:v1")


# --- event trigger ------------------------------------------------------------------------------------------


def _matches(pattern: dict[str, Any], event: dict[str, Any]) -> bool:
    """EventBridge's matcher as moto implements it (the operators used: exact strings and wildcard)."""
    from moto.events.models import EventPattern

    return EventPattern.load(json.dumps(pattern)).matches_event(event)


def _event(name: str, key: str | None = None, bucket: str | None = None) -> dict[str, Any]:
    event = json.loads((REPO / "events" / name).read_text())
    if key is not None:
        event["detail"]["object"]["key"] = key
    if bucket is not None:
        event["detail"]["bucket"]["name"] = bucket
    return event


def test_event_pattern_matches_the_sample_spec_event_and_nothing_outside_jobs():
    sample = _event("dispatch_object_created.json")
    bucket = sample["detail"]["bucket"]["name"]
    pattern = event_pattern(bucket)
    assert _matches(pattern, sample)
    assert _matches(pattern, _event("dispatch_object_created.json", key="jobs/a%20b.json"))
    for key in (
        "data/jobs.json",
        "jobs.json",
        "tmp/jobs/x.json",
        "jobs/x.tar",
        "jobs/x.json.tmp",
        "Jobs/x.json",
    ):
        assert not _matches(pattern, _event("dispatch_object_created.json", key=key)), key
    assert not _matches(pattern, _event("dispatch_object_created.json", bucket="someone-elses"))
    deleted = dict(sample, **{"detail-type": "Object Deleted"})
    assert not _matches(pattern, deleted)
    # Nested JSON under jobs/ matches (EventBridge cannot exclude it); the dispatch function ignores it.
    from shardfold.functions.trigger import ignore_reason

    for key in ("jobs/j-1/status.json", "jobs/nightly-batch.status.json"):
        assert _matches(pattern, _event("dispatch_object_created.json", key=key))
        assert ignore_reason(f"s3://{bucket}/{key}")


def test_rule_target_dlq_and_permission(stack):
    rule = stack.one("aws:cloudwatch/eventRule:EventRule")
    assert json.loads(rule.inputs["eventPattern"]) == event_pattern(stack.outputs["bucket"])
    target = stack.one("aws:cloudwatch/eventTarget:EventTarget").inputs
    dispatch_arn = f"arn:aws:lambda:{REGION}:{ACCOUNT}:function:shardfold-test-dispatch"
    assert target["arn"] == dispatch_arn and target["rule"] == rule.outputs["name"]
    dlq = stack.one("aws:sqs/queue:Queue")
    assert target["deadLetterConfig"]["arn"] == dlq.outputs["arn"]
    assert target["retryPolicy"] == {"maximumRetryAttempts": 8, "maximumEventAgeInSeconds": 3600}
    assert dlq.inputs["sqsManagedSseEnabled"] is True
    perm = stack.one("aws:lambda/permission:Permission").inputs
    assert perm["principal"] == "events.amazonaws.com" and perm["action"] == "lambda:InvokeFunction"
    assert perm["sourceArn"] == rule.outputs["arn"] and perm["function"] == "shardfold-test-dispatch"
    qp = json.loads(stack.one("aws:sqs/queuePolicy:QueuePolicy").inputs["policy"])
    (st,) = qp["Statement"]
    assert st["Principal"] == {"Service": "events.amazonaws.com"} and st["Action"] == ["sqs:SendMessage"]
    assert st["Condition"] == {"ArnEquals": {"aws:SourceArn": rule.outputs["arn"]}}
    async_cfg = stack.one("aws:lambda/functionEventInvokeConfig:FunctionEventInvokeConfig").inputs
    assert async_cfg["destinationConfig"]["onFailure"]["destination"] == dlq.outputs["arn"]


# --- the program entry point and its config -----------------------------------------------------------------


def test_config_keys_are_read_with_their_defaults(monkeypatch):
    from shardfold.infra import config

    monkeypatch.setattr(pulumi, "get_stack", lambda: "My_Stack")
    pulumi.runtime.set_all_config(
        {
            "shardfold:gpuInstanceTypes": '["g6.xlarge", "g6.2xlarge"]',
            "shardfold:spot": "false",
            "shardfold:maxVcpus": "64",
            "shardfold:functionMemory": '{"getbatch.gather": 2048}',
            "shardfold:batchMemory": '{"inference.worker": 30000}',
            "shardfold:readBuckets": "datasets-a, datasets-b/images",
            "shardfold:lambdaImage": f"{ACCOUNT}.dkr.ecr.ap-southeast-2.amazonaws.com/shardfold-lambda:v2",
            "shardfold:buildLambdaImage": "false",
            "aws:region": "ap-southeast-2",
        }
    )
    try:
        cfg = config.load()
    finally:
        pulumi.runtime.set_all_config({})
    assert cfg.stage == "my-stack" and cfg.region == "ap-southeast-2"
    assert cfg.gpu_instance_types == ("g6.xlarge", "g6.2xlarge") and cfg.spot is False and cfg.max_vcpus == 64
    assert cfg.function_memory == {"getbatch.gather": 2048}
    assert cfg.batch_memory == {"inference.worker": 30000} and cfg.batch_vcpus == {}
    assert cfg.read_buckets == ("datasets-a", "datasets-b/images")
    assert cfg.lambda_image == f"{ACCOUNT}.dkr.ecr.ap-southeast-2.amazonaws.com/shardfold-lambda:v2"
    assert cfg.build_lambda_image is False and StackConfig().build_lambda_image is True
    defaults = StackConfig()
    assert (cfg.lambda_architecture, cfg.log_retention_days, cfg.force_destroy) == ("arm64", 14, False)
    assert (defaults.sse_algorithm, defaults.batch, defaults.worker_image) == ("AES256", True, None)


def test_main_exports_the_outputs(tmp_path, monkeypatch):
    import runpy

    zip_path = _tiny_zip(tmp_path)
    monkeypatch.setattr(package, "build_lambda_package", lambda arch, out_dir, **kw: zip_path)
    # the whole built-in program: every kind, the GPU queue and the worker image included
    pulumi.runtime.set_all_config({"shardfold:stage": "main", "shardfold:buildWorkerImage": "false"})
    exported: dict[str, Any] = {}
    monkeypatch.setattr(pulumi, "export", lambda k, v: exported.__setitem__(k, v))

    @pulumi.runtime.test
    def run() -> pulumi.Output[Any]:
        runpy.run_path(str(REPO / "infra" / "__main__.py"), run_name="__main__")
        return pulumi.Output.from_input(exported).apply(lambda o: exported.update(resolved=o))

    try:
        run()
    finally:
        pulumi.runtime.set_all_config({})
    out = exported["resolved"]
    assert out["stage"] == "main" and out["bucket"].startswith("shardfold-main-jobs")
    assert set(out["state_machine_arns"]) == set(WORKFLOWS)
    assert set(out["sizes"]["batch"]) == set(out["batch_job_definitions"])
    assert set(out["sizes"]["functions"]) == set(out["functions"]) | {"dispatch"}


def test_a_policy_breaking_the_rules_stops_the_program(tmp_path, monkeypatch):
    allowed = dict(iam.WILDCARD_RESOURCE_ACTIONS)
    del allowed["batch:DescribeJobs"]
    monkeypatch.setattr(iam, "WILDCARD_RESOURCE_ACTIONS", allowed)
    with pytest.raises(Exception, match="batch:DescribeJobs"):
        deploy(StackConfig(stage="broken"), {"gputoy": gpu_workflow()}, tmp_path, monkeypatch)


def test_names_follow_the_naming_scheme_the_asl_tools_predict(stack, workflows):
    from shardfold.orchestrator.asl import NamingResolver

    naming = NamingResolver(region=REGION, account=ACCOUNT, stage="test")
    for function, arn in stack.outputs["functions"].items():
        assert arn == naming.function_arn(function)
    step = next(s for s in workflows["gputoy"].walk() if isinstance(s, BatchJob))
    assert stack.outputs["batch_job_queue"] == naming.batch_job_queue(step)
    deployed = stack.outputs["batch_job_definitions"][step.entry_point]
    assert deployed.rsplit(":", 1)[0] == naming.batch_job_definition(step)  # plus the revision


def test_long_role_names_are_cut_to_fit_iam():
    from shardfold.infra.context import role_name_args

    assert role_name_args("shardfold-dev-getbatch-gather-role") == {}
    long = "shardfold-sixteen-chars-x-averyveryverylongkind-averyverylongstep-role"
    (name,) = role_name_args(long).values()
    assert len(name) == 64 and name != role_name_args(long + "2")["name"]


def test_deployed_handlers_are_the_ones_the_package_is_checked_for(stack):
    # tests/test_lambda_package.py imports every handler of infra.package.lambda_handlers() from the built
    # zip; every zip function deployed for the built-in kinds must be among them, with the same handler,
    # and every built-in image function among lambda_handlers("image"), its handler the image's command.
    zipped, imaged = package.lambda_handlers(), package.lambda_handlers("image")
    assert not set(zipped) & set(imaged) and "dispatch" in zipped
    fns = {r.inputs["name"]: r.inputs for r in stack.of("aws:lambda/function:Function")}
    builtin = {s.function for wf in WORKFLOWS.values() for s in wf.tasks()}
    assert builtin | {"dispatch"} == set(zipped) | set(imaged)
    for function in builtin | {"dispatch"}:
        fn = fns[stack.outputs["function_names"].get(function, stack.outputs["dispatch_function"])]
        if function in imaged:
            assert fn["packageType"] == "Image" and fn["imageConfig"]["commands"] == [imaged[function]]
        else:
            assert fn["handler"] == zipped[function] and "packageType" not in fn
