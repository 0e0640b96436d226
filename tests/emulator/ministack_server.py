"""MiniStack, with the gaps the emulator tier fills; run by the emulator's own venv (``.venv-emulator``).

It imports ``ministack`` only, never Shardfold: the Lambda functions run from their zips (and the image
kinds from the image's files) on this interpreter, so nothing of the project may be importable here.

Where MiniStack 1.5.33 differs from AWS in a way our workflows meet, this fills the gap, never by changing
the ASL AWS runs (docs/deploy.md lists the differences):

* ``arn:aws:states:::batch:submitJob.sync`` is not implemented (MiniStack's Batch is a control-plane stub
  whose jobs succeed at once). Here the job is recorded in MiniStack's Batch (DescribeJobs and ListJobs
  answer for it), then its container runs as Batch would run it: ``python -m shardfold.functions.container``
  (``SHARDFOLD_CONTAINER_PYTHON``: an interpreter with the worker image's packages) with the job
  definition's and the overrides' environment, signed as the job role; exit 75 is retried up to the job
  definition's attempts, as its retry strategy says; the job ends SUCCEEDED or FAILED and the task with it.
* A Python handler's exception reaches Step Functions as ``Runtime.HandlerError`` whatever it is; on AWS
  its ``errorType`` is the exception's class name, which Retry and Catch match. The worker script reports
  the class name here.

Environment: MiniStack's own (``BIND_HOST``, ``GATEWAY_PORT``, ``AUTH``...), plus
``SHARDFOLD_CONTAINER_PYTHON`` and ``SHARDFOLD_CONTAINER_LOGS`` (a folder for the containers' output).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

from ministack import app
from ministack.core import lambda_runtime
from ministack.services import batch, lambda_svc, stepfunctions

EXIT_TRANSIENT = (
    75  # functions.container: a transient fault, which the job definition's retry strategy retries
)
BATCH_SYNC = "arn:aws:states:::batch:submitJob"  # .sync is stripped before MiniStack's dispatch table


def _env_list(items: list[dict] | None, name: str = "name", value: str = "value") -> dict[str, str]:
    return {
        str(i.get(name) or i.get(name.title())): str(i.get(value) or i.get(value.title()) or "")
        for i in items or []
    }


def _definition(ref: str) -> dict:
    """The registered job definition an ARN or ``name[:revision]`` names (its latest revision by default)."""
    tail = ref.rsplit("job-definition/", 1)[-1]
    name, _, revision = tail.partition(":")
    revisions = batch._job_definitions.get(name) or []
    if not revisions:
        raise stepfunctions._ExecutionError("Batch.ClientException", f"no job definition {ref}")
    if revision:
        return next((d for d in revisions if str(d.get("revision")) == revision), revisions[-1])
    return revisions[-1]


def _job_credentials(role_arn: str, job_id: str) -> dict[str, str]:
    """A session of the job role, as Batch hands one to the container (MiniStack registers it with STS)."""
    account = role_arn.split(":")[4] if role_arn.count(":") >= 5 else "000000000000"
    config = {
        "Role": role_arn,
        "FunctionArn": f"arn:aws:lambda:{os.environ.get('AWS_DEFAULT_REGION', 'us-east-1')}:{account}"
        f":function:batch-{job_id[:8]}",
        "FunctionName": f"batch-{job_id[:8]}",
    }
    return lambda_runtime.execution_credentials(config)


def _run_container(job: dict, definition: dict, overrides: dict, attempt: int) -> int:
    props = definition.get("containerProperties") or {}
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/tmp"),
        "AWS_REGION": os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
        "AWS_DEFAULT_REGION": os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{os.environ['GATEWAY_PORT']}",
        **_env_list(props.get("environment")),
        **_env_list(overrides.get("environment") or overrides.get("Environment")),
        "AWS_BATCH_JOB_ID": job["jobId"],
        "AWS_BATCH_JOB_ATTEMPT": str(attempt),
    }
    role = props.get("jobRoleArn") or definition.get("jobRoleArn")
    if role:
        env.update(_job_credentials(role, job["jobId"]))
    logs = os.environ.get("SHARDFOLD_CONTAINER_LOGS") or "."
    with open(os.path.join(logs, f"{job['jobName']}-{attempt}.log"), "ab") as out:
        command = [os.environ["SHARDFOLD_CONTAINER_PYTHON"], "-m", "shardfold.functions.container"]
        return subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT, check=False).returncode


def submit_job_sync(resource: str, input_data: dict) -> dict:
    """``batch:submitJob.sync``: record the job, run its container to the end, answer as DescribeJobs."""
    params = stepfunctions._pascal_to_camel(input_data)
    status, _, body = batch._submit_job(params)
    answer = json.loads(body or b"{}")
    if status >= 400:
        raise stepfunctions._ExecutionError("Batch.ClientException", answer.get("message", str(answer)))
    job = batch._jobs[answer["jobId"]]
    definition = _definition(str(params.get("jobDefinition", "")))
    attempts = int((definition.get("retryStrategy") or {}).get("attempts") or 1)
    job.update(status="RUNNING", statusReason="", stoppedAt=None)
    code = 1
    for attempt in range(1, attempts + 1):
        code = _run_container(job, definition, params.get("containerOverrides") or {}, attempt)
        if code != EXIT_TRANSIENT:
            break
    job.update(
        status="SUCCEEDED" if code == 0 else "FAILED",
        statusReason="Essential container in task exited" if code else "",
        stoppedAt=int(time.time() * 1000),
        container={"exitCode": code},
    )
    if code != 0:
        raise stepfunctions._ExecutionError("States.TaskFailed", json.dumps(job))
    return {k[:1].upper() + k[1:]: v for k, v in job.items()}


# The worker's report of a failed invocation carries the exception's class, as AWS's errorType.
_REPORT = 'json.dumps({"status": "error", "error": str(e), "trace": traceback.format_exc()})'
_NAMED = (
    'json.dumps({"status": "error", "error": "[" + type(e).__name__ + "] " + str(e), '
    '"trace": traceback.format_exc()})'
)
_NAMED_RE = re.compile(r"^\[([A-Za-z_][A-Za-z0-9_.]*)\] (.*)$", re.S)


def _name_errors() -> None:
    script = lambda_runtime._PYTHON_WORKER_SCRIPT
    if script.count(_REPORT) != 1:
        sys.exit("ministack_server: MiniStack's worker script changed; update the errorType patch")
    lambda_runtime._PYTHON_WORKER_SCRIPT = script.replace(_REPORT, _NAMED)
    original = lambda_svc._execute_function_warm

    def _execute_function_warm(func, event, request_id):
        out = original(func, event, request_id)
        body = out.get("body") if isinstance(out, dict) else None
        if out.get("error") and isinstance(body, dict) and body.get("errorType") == "Runtime.HandlerError":
            named = _NAMED_RE.match(str(body.get("errorMessage", "")))
            if named:
                body["errorType"], body["errorMessage"] = named.group(1), named.group(2)
        return out

    lambda_svc._execute_function_warm = _execute_function_warm


def main() -> None:
    if not os.environ.get("SHARDFOLD_CONTAINER_PYTHON"):
        sys.exit("ministack_server: set SHARDFOLD_CONTAINER_PYTHON (the Batch containers' interpreter)")
    stepfunctions._SERVICE_DISPATCH[BATCH_SYNC] = submit_job_sync
    _name_errors()
    app.main()


if __name__ == "__main__":
    main()
