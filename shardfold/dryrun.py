"""The moto backend: a whole Shardfold stack inside moto, driven by the unchanged :class:`AwsExecutor`.

Every piece of moto-internal patching lives in this module (tests: ``tests/test_moto_harness.py``). The tests'
moto tier, and the users' dry run (``Client(backend="moto")``, ``--backend moto``; moto: the dev extra).
Usage::

    with MotoStack(workflows) as stack:            # or: outputs = stack.start(); ...; stack.stop()
        executor = AwsExecutor(stack.outputs, workflows)

**Why a server.** moto runs as an in-process ``ThreadedMotoServer`` on an ephemeral port, not as the
``mock_aws`` decorator. Our clients then talk real HTTP to it (``AWS_ENDPOINT_URL``), so every S3 path of
the store works, including GetBatch's awscrt transport, which ``mock_aws`` cannot intercept; the
interpreter's own boto3 clients reach the same server through ``MOTO_PORT``; and nothing patches botocore
globally, so other clients in the process are untouched. The server shares moto's backends with this
process, so the patches below act on it directly.

**IAM, enforced** (moto authenticates and authorizes every request once the stack is up): every role is
created with the policy ``infra`` attaches (:mod:`orchestrator.iam`: a function's from its kind's rights), and
each handler runs under its own role's session (:mod:`functions.credentials`), each Batch container under
the job role, :meth:`MotoStack.dispatch` under the dispatch function's role and moto's own requests for a
state machine (a Distributed Map's ItemReader, a Batch .sync task) under that state machine's role. The SDK,
the CLI and the tests sign as an administrator user (the operator); keys no IAM identity holds are refused.
Where moto's evaluator falls short of AWS's, the harness fills the gap:

* S3 requests are checked by the operation's IAM action (moto 5.2.6 checks ``s3:HeadObject``,
  ``s3:ListObjectsV2``...), a DeleteObjects on each key it names, a copy on its source too;
* Step Functions and Batch requests are checked on the resource ARNs AWS checks (moto checks ``*``);
* a state machine's role must allow ``lambda:InvokeFunction`` on each function a Task calls (moto's
  interpreter calls without asking);
* a bodiless Lambda API call (GetFunctionConfiguration) no longer fails SignatureDoesNotMatch.

Not modelled: conditions (moto ignores them), bucket policies (only ``Principal: *``), permissions
boundaries and session policies, the functions' CloudWatch Logs grants (the harness writes their logs as
the Lambda service does), KMS. A thread a handler starts without carrying its context (the store's pools
and the readers pyarrow calls back carry it) would sign with the process's own keys, the operator's.

**Gaps filled** (moto 5.2.5), never by changing the ASL that AWS runs:

* Lambda: ``LambdaSimpleBackend.invoke`` runs our registered handler in-process (the Lambda function's
  name maps to the registry name) and reports an exception as an ``Unhandled`` function error with
  Lambda's ``{errorType, errorMessage, stackTrace}`` payload, so Retry/Catch see the same error names.
* Distributed Map: moto ignores ``ToleratedFailure*`` (a failed child never fails the Map); the harness
  fails the Map with ``States.ExceedToleratedFailureThreshold`` as AWS does. moto runs children inside
  the parent rather than as executions; the harness records them so ``ListExecutions(mapRunArn=...)`` and
  ``DescribeExecution`` of a child answer as on AWS.
* ``batch:submitJob.sync``: moto passes the ASL's PascalCase parameters to boto3 unconverted; the harness
  converts them (and the response) with botocore's Batch model, and runs each submitted job's container
  in-process through ``functions.container.run`` with the job's environment, so the job succeeds or fails as
  the worker does.
* JSONPath: moto wraps the value of a definite path through an array index (``$[1].stamp``) in a list;
  the harness returns the node itself, as AWS does (our Parallel ``ResultSelector`` relies on it).
* Payload limit (AWS: 256 KiB of UTF-8 JSON, States.DataLimitExceeded): moto checks a state's output and a
  task's result; the harness also checks every state's input (after InputPath), a Task's effective
  Parameters, a Map child's input (after ItemSelector) and a Map's gathered result (unless a ResultWriter
  takes it), which AWS checks even under ``ResultPath: null`` (aws-cdk#24799). As on AWS, ``States.ALL``
  in a Retry or Catch does not match States.DataLimitExceeded (a terminal error): the execution fails with it.
  :func:`gathered_results` tells a test how large each Map's gathered result was.
* ``RedriveExecution`` is not implemented by moto; the harness answers ``ExecutionNotRedrivable`` (a 400,
  not a 500 that clients would retry), and the executor falls back to a restart.

**Speed** (a Map of 10,000 children never finished in moto 5.2.5; each fix below was measured, see
``tests/test_moto_harness.py``), with what moto does unchanged:

* A Distributed Map's worker took its next child by recursing, one frame per child: a worker past ~970
  children raised RecursionError, its job was never closed and the execution stayed RUNNING for ever. The
  harness runs the same steps as a loop.
* With no MaxConcurrency moto started a thread per child; the harness starts at most
  :data:`MAP_WORKER_THREADS` per Map (each takes children until none are left).
* A Lambda Task built a new boto3 client per invocation and went through the server; the harness calls our
  handler directly (same payload, response and error payload; an unknown function still takes moto's path).
* Every JSONPath evaluation built a new PLY parser (~1 ms); parsed paths are cached. The server listed moto's
  package directory on every request to route it; the list is computed once.

What is left is the handlers' own S3 requests, each a real HTTP round trip through botocore and moto's
server (~8-10 ms of CPU on a loaded 2-core machine): a real job's child makes several.

**Outputs**: the keys the ``aws`` backend reads, in the shape ``shardfold deploy`` saves, including
``sizes`` (:func:`stack_sizes`): what ``infra`` would deploy for the same workflows with no config
overrides (a function: the largest ``memory_mb``/``timeout_s`` of the Tasks calling it, /tmp 512 MB; a Batch
entry point: the largest of each resource of its BatchJobs), each naming the ``shardfold:*`` key that
changes it on AWS. The moto functions and job definitions are created with those sizes. There is no
dispatch function here, so ``sizes`` has no ``dispatch`` entry.

One stack per process: moto's backends are process-wide, so a second ``start()`` is refused.
"""

from __future__ import annotations

import copy
import datetime as _dt
import functools
import html
import io
import json
import logging
import math
import os
import re
import sys
import threading
import time
import urllib.parse
import urllib.request
import uuid
import zipfile
from collections.abc import Callable, Mapping
from typing import Any

import boto3
import botocore.session

from shardfold.functions import access, credentials, telemetry
from shardfold.functions.access import Grants, Right
from shardfold.functions.credentials import Credentials
from shardfold.functions.errors import ShardfoldError
from shardfold.functions.log import logger
from shardfold.functions.pricing import DEFAULT_LAMBDA_ARCHITECTURE
from shardfold.functions.workflow import BatchJob, Workflow
from shardfold.infra.sizes import (
    LAMBDA_DEFAULT_EPHEMERAL_MB,
    batch_size,
    batch_steps,
    function_size,
    plan_sizes,
)
from shardfold.orchestrator import iam
from shardfold.orchestrator.asl import StackResolver, compile_workflow
from shardfold.orchestrator.invoke import HandlerFailed, call
from shardfold.orchestrator.registry import (
    handler_path,
    job_definition_name,
    lambda_handler,
    lambda_name,
    name_prefix,
    state_machine_name,
)

# The stack config's default grants (outputPrefixes results/, no other buckets), as the functions get them
GRANTS = Grants()

ACCOUNT = "123456789012"  # moto's default account
# Threads that run one Distributed Map's children (its MaxConcurrency when lower). On AWS the children run
# side by side; in moto they share one process and its GIL, so more threads only add contention.
MAP_WORKER_THREADS = 8
MOTO_CONFIG = {
    "stepfunctions": {"execute_state_machine": True},
    "lambda": {"use_docker": False},
    "batch": {"use_docker": False},
}


# --- patch bookkeeping ------------------------------------------------------------------------------------

_lock = threading.RLock()
_installed = 0
_originals: list[tuple[Any, str, Any]] = []
_lambda_functions: dict[str, str] = {}  # Lambda function name -> registry function name
_map_children: dict[str, list[dict[str, Any]]] = {}  # map run ARN -> child execution records
_child_records: dict[str, dict[str, Any]] = {}  # child execution ARN -> its record (DescribeExecution)
_gathered: dict[str, dict[str, dict[str, int]]] = {}  # execution ARN -> Map state -> its gathered result
_active: MotoStack | None = None  # the one running stack (moto's backends are process-wide)
_signers: dict[str, Credentials] = {}  # Lambda function name, BATCH_ROLE, DISPATCH_ROLE -> its role's session
_role_signers: dict[
    str, Credentials
] = {}  # role ARN -> its session (the state machines' roles, for moto's clients)
BATCH_ROLE = "batch"  # the Batch containers' role in _signers
DISPATCH_ROLE = "dispatch"  # the dispatch function's role in _signers


_MISSING = object()


def _patch(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
    original = (
        owner.__dict__.get(name, _MISSING) if isinstance(owner, type) else getattr(owner, name, _MISSING)
    )
    _originals.append((owner, name, original))
    setattr(owner, name, make(getattr(owner, name, None)))


def install_patches() -> None:
    """Apply every patch (reference-counted: nested stacks share one installation)."""
    global _installed
    with _lock:
        _installed += 1
        if _installed > 1:
            return
        _patch_lambda()
        _patch_map_child_records()
        _patch_map_failure_tolerance()
        _patch_map_workers()
        _patch_map_children_api()
        _patch_definite_json_paths()
        _patch_json_path_parsing()
        _patch_server_dispatch()
        _patch_redrive()
        _patch_batch()
        _patch_data_limits()
        _patch_map_gathered_limit()
        _patch_data_limit_uncaught()
        _patch_resource_arns()
        _patch_s3_actions()
        _patch_signature_payload()
        _patch_interpreter_credentials()


def uninstall_patches() -> None:
    global _installed
    with _lock:
        _installed = max(0, _installed - 1)
        if _installed:
            return
        while _originals:
            owner, name, original = _originals.pop()
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        _lambda_functions.clear()
        _signers.clear()
        _role_signers.clear()
        credentials.forget()  # the clients signed with this stack's sessions
        _streams.clear()
        _logs_client.cache_clear()
        _map_children.clear()
        _child_records.clear()
        _gathered.clear()


# --- Lambda: our handlers, in-process ---------------------------------------------------------------------


def _run_handler(fn: Any, body: bytes | str | None) -> tuple[bytes, bool]:
    """Run the registered handler behind moto function ``fn`` on the JSON ``body``: Lambda's response
    payload and whether it is a function error (``Unhandled``, with Lambda's error payload)."""
    registered = _lambda_functions.get(fn.function_name)
    if registered is None:
        error = {"errorType": "Runtime.HandlerNotFound", "errorMessage": f"{fn.function_name} has no handler"}
        return json.dumps(error).encode(), True
    event = json.loads(body or b"{}")
    memory_mb = int(fn.memory_size or 1024)
    group, stream = _log_stream(fn.function_name)
    context = {"aws_request_id": str(uuid.uuid4()), "log_group_name": group, "log_stream_name": stream}
    started = time.perf_counter()
    failed = False
    with telemetry.captured_log() as lines, credentials.using(_signers[fn.function_name]):
        try:
            result = call(
                handler_path(registered),
                event,
                function_name=registered,
                memory_mb=memory_mb,
                timeout_s=int(fn.timeout or 900),
                context=context,
            )
        except HandlerFailed as failure:
            result, failed = failure.payload(), True
    _write_lambda_log(context, lines, time.perf_counter() - started, memory_mb)
    return json.dumps(result).encode(), failed


def _write_lambda_log(context: dict[str, Any], lines: list[str], seconds: float, memory_mb: int) -> None:
    """What Lambda writes to CloudWatch Logs for one invocation: START, the function's lines, END and the
    REPORT line (its Max Memory Used: this process's peak, which the harness shares with every task)."""
    rid = context["aws_request_id"]
    ms = seconds * 1000
    peak = telemetry.peak_rss_mib() or 0
    messages = [
        f"START RequestId: {rid} Version: $LATEST",
        *lines,
        f"END RequestId: {rid}",
        f"REPORT RequestId: {rid}\tDuration: {ms:.2f} ms\tBilled Duration: {math.ceil(ms)} ms\t"
        f"Memory Size: {memory_mb} MB\tMax Memory Used: {math.ceil(peak)} MB\t",
    ]
    _put_log(context["log_group_name"], context["log_stream_name"], messages)


def _write_batch_log(stream: str, lines: list[str]) -> None:
    """A Batch container's lines in ``/aws/batch/job``, in the stream DescribeJobs names (as awslogs)."""
    group = "/aws/batch/job"
    _create_log(group)
    _create_log(group, stream)
    if lines:
        _put_log(group, stream, lines)


def _put_log(group: str, stream: str, messages: list[str]) -> None:
    """Write ``messages`` to a log stream, each stamped now."""
    now = int(time.time() * 1000)
    events = [{"timestamp": now, "message": m} for m in messages]
    _logs_client().put_log_events(logGroupName=group, logStreamName=stream, logEvents=events)


def _create_log(group: str, stream: str | None = None) -> None:
    """Create a log group, or a stream in it, unless it exists."""
    logs = _logs_client()
    try:
        if stream is None:
            logs.create_log_group(logGroupName=group)
        else:
            logs.create_log_stream(logGroupName=group, logStreamName=stream)
    except logs.exceptions.ResourceAlreadyExistsException:
        pass


_streams: dict[tuple[str, int], tuple[str, str]] = {}


@functools.cache
def _logs_client() -> Any:
    return boto3.session.Session().client("logs")  # the operator's (boto3's default session keeps old keys)


def _log_stream(function: str) -> tuple[str, str]:
    """The log group and stream of ``function``'s invocations on this thread: as Lambda gives each execution
    environment a stream (``YYYY/MM/DD/[$LATEST]<id>``), the harness gives one to each of its threads."""
    key = (function, threading.get_ident())
    found = _streams.get(key)
    if found is None:
        group = f"/aws/lambda/{function}"
        stream = f"{_dt.datetime.now(_dt.UTC):%Y/%m/%d}/[$LATEST]{uuid.uuid4().hex}"
        _create_log(group)
        _logs_client().create_log_stream(logGroupName=group, logStreamName=stream)
        found = _streams[key] = (group, stream)
    return found


def _patch_lambda() -> None:
    from moto.awslambda.utils import get_backend
    from moto.awslambda_simple.models import LambdaSimpleBackend
    from moto.stepfunctions.parser.asl.component.state.exec.state_task import lambda_eval_utils

    def make(_original: Any) -> Any:
        def invoke(self, function_name, qualifier, body, headers, response_headers):  # moto's signature
            fn = self.get_function(function_name, qualifier)  # unknown functions fail as on AWS
            payload, failed = _run_handler(fn, body)
            if failed:
                response_headers["x-amz-function-error"] = "Unhandled"
            return payload

        return invoke

    def make_task_invoke(original: Any) -> Any:
        def _invoke_lambda_function(parameters, region, state_credentials):
            # A Task state's invocation, without the HTTP round trip: moto's interpreter builds a new boto3
            # client for every call (tens of ms of CPU) and sends it through the server. Our functions are
            # called directly, with the same payload bytes, response and error payload as Invoke returns;
            # anything else (an unknown function) takes moto's own path and fails as it does there.
            name = str(parameters.get("FunctionName", ""))
            with _lock:
                ours = name.rsplit(":function:", 1)[-1].split(":")[0] in _lambda_functions
            if not ours:
                return original(parameters, region, state_credentials)
            fn = get_backend(ACCOUNT, region).get_function(name, None)
            _require(state_credentials, "lambda:InvokeFunction", fn.function_arn, "Invoke")
            payload, failed = _run_handler(fn, parameters.get("Payload"))
            response: dict[str, Any] = {
                "StatusCode": 200,
                "ExecutedVersion": "$LATEST",
                "Payload": lambda_eval_utils._from_payload(io.BytesIO(payload)),
            }
            if failed:
                response["FunctionError"] = "Unhandled"
            return response

        return _invoke_lambda_function

    _patch(LambdaSimpleBackend, "invoke", make)
    _patch(lambda_eval_utils, "_invoke_lambda_function", make_task_invoke)


# --- Distributed Map: failure tolerance and child executions ----------------------------------------------


def _patch_map_child_records() -> None:
    """Record each Distributed Map child as the execution AWS would have started for it."""
    from moto.stepfunctions.parser.asl.component.state.exec.state_map.iteration.itemprocessor import (
        distributed_item_processor_worker as dipw,
    )
    from moto.stepfunctions.parser.asl.eval.program_state import ProgramEnded, ProgramError, ProgramStopped

    def make_eval_input(original: Any) -> Any:
        def _eval_input(self, env_frame):
            original(self, env_frame)
            # The child's input after ItemSelector: what AWS shows as the child execution's input.
            env_frame._shardfold_child_input = copy.deepcopy(env_frame.states.get_input())

        return _eval_input

    def make_eval_job(original: Any) -> Any:
        def _eval_job(self, env, job):
            started = _dt.datetime.now(_dt.UTC)
            original(self, env, job)
            state = env.program_state()
            record: dict[str, Any] = {"status": "SUCCEEDED", "error": None, "cause": None}
            if isinstance(state, ProgramError):
                details = state.error or {}
                record.update(status="FAILED", error=details.get("error"), cause=details.get("cause"))
            elif isinstance(state, ProgramStopped):
                record["status"] = "ABORTED"
            elif not isinstance(state, ProgramEnded | type(None)) and job.job_output is None:
                record["status"] = "FAILED"
            arn = self._map_run_record.map_run_arn
            head, _, _ = arn.rpartition(":")
            record.update(
                executionArn=f"{head.replace(':mapRun:', ':execution:', 1)}:{uuid.uuid4()}",
                mapRunArn=arn,
                index=job.job_index,
                input=json.dumps(getattr(env, "_shardfold_child_input", job.job_input)),
                startDate=started,
                stopDate=_dt.datetime.now(_dt.UTC),
            )
            with _lock:
                _map_children.setdefault(arn, []).append(record)
                _child_records[record["executionArn"]] = record

        return _eval_job

    _patch(dipw.DistributedItemProcessorWorker, "_eval_input", make_eval_input)
    _patch(dipw.DistributedItemProcessorWorker, "_eval_job", make_eval_job)


def _patch_map_failure_tolerance() -> None:
    """Fail a Distributed Map whose failed children exceed its ``ToleratedFailure*`` (moto ignores them)."""
    from moto.stepfunctions.parser.asl.component.state.exec.state_map.iteration import (
        distributed_iteration_component as dic,
    )

    def make_map_run(original: Any) -> Any:
        def _map_run(self, env, eval_input):
            original(self, env, eval_input)
            if not env.is_running():
                return  # stopped (StopExecution): the execution ends ABORTED, not failed
            record = eval_input.map_run_record
            failed = record.item_counter.failed.get() + record.item_counter.timed_out.get()
            total = max(1, record.item_counter.total.get())
            # AWS's defaults are 0 and 0%: any failed child fails the Map. (When only one of the two is
            # set, the other's 0 must not count; our compiler only ever sets the percentage.)
            over_count = failed > (record.tolerated_failure_count or 0)
            over_pct = failed * 100.0 / total > (record.tolerated_failure_percentage or 0.0)
            if failed and over_count and over_pct:
                cause = (
                    f"The specified tolerated failure threshold was exceeded: {failed} of "
                    f"{record.item_counter.total.get()} items failed"
                )
                raise _states_failure(env, "StatesExceedToleratedFailureThreshold", cause, map_run=True)

        return _map_run

    _patch(dic.DistributedIterationComponent, "_map_run", make_map_run)


def _patch_map_workers() -> None:
    """Run a Distributed Map's children on a few threads, each taking children in a loop (speed)."""
    from moto.stepfunctions.parser.asl.component.state.exec.state_map.iteration import (
        distributed_iteration_component as dic,
    )
    from moto.stepfunctions.parser.asl.component.state.exec.state_map.iteration.itemprocessor import (
        distributed_item_processor_worker as dipw,
    )

    def make_launch_worker(original: Any) -> Any:
        def _launch_worker(self, env, eval_input, job_pool):
            # moto starts one thread per child when MaxConcurrency is 0 (10,000 children: 10,000 threads
            # fighting over the GIL). Every worker takes jobs from the pool until it is empty, so a few
            # threads run every child; MaxConcurrency below the cap is kept.
            with _lock:
                launched = getattr(job_pool, "_shardfold_workers", 0)
                if launched >= MAP_WORKER_THREADS:
                    return None
                job_pool._shardfold_workers = launched + 1
            return original(self, env=env, eval_input=eval_input, job_pool=job_pool)

        return _launch_worker

    def make_eval_pool(_original: Any) -> Any:
        def _eval_pool(self, job, worker_frame):
            # moto's worker recurses once per job it takes (a worker of a 4-wide Map over 10,000 children
            # goes 2,500 calls deep, past the recursion limit); the same steps, as a loop.
            if job is None:
                self._env.delete_frame(worker_frame)
                return
            while True:
                job_frame = worker_frame.open_inner_frame()
                self._eval_job(env=job_frame, job=job)
                worker_frame.delete_frame(job_frame)
                if isinstance(job.job_output, Exception) or self.stopped():
                    self._env.delete_frame(worker_frame)
                    self._job_pool.close_job(job)
                    return
                next_job = self._job_pool.next_job()
                if next_job is None:
                    self._env.delete_frame(worker_frame)
                    self._job_pool.close_job(job)
                    return
                self._job_pool.close_job(job)
                job = next_job

        return _eval_pool

    _patch(dipw.DistributedItemProcessorWorker, "_eval_pool", make_eval_pool)
    _patch(dic.DistributedIterationComponent, "_launch_worker", make_launch_worker)


def gathered_results(execution_arn: str) -> dict[str, dict[str, int]]:
    """Each Distributed Map state of the execution (by state name) that gathered its children's outputs:
    ``{"children": how many, "bytes": the gathered array's UTF-8 JSON size}``, the size the 256 KiB limit
    is checked on. Listed once every child ran; a Map whose ResultWriter takes the outputs is not."""
    with _lock:
        return copy.deepcopy(_gathered.get(execution_arn, {}))


def _child_row(child: dict[str, Any]) -> dict[str, Any]:
    """A Map child's record as ListExecutions lists it (DescribeExecution adds its input, error and cause)."""
    return {
        "executionArn": child["executionArn"],
        "stateMachineArn": child["mapRunArn"].rpartition(":")[0].replace(":mapRun:", ":stateMachine:", 1),
        "name": child["executionArn"].rsplit(":", 1)[-1],
        "status": child["status"],
        "startDate": child["startDate"],
        "stopDate": child["stopDate"],
        "mapRunArn": child["mapRunArn"],
    }


def _patch_map_children_api() -> None:
    from moto.core.responses import ActionResult
    from moto.stepfunctions.responses import StepFunctionResponse

    def make_list(original: Any) -> Any:
        def list_executions(self):
            map_run_arn = self._get_param("mapRunArn")
            if not map_run_arn:
                return original(self)
            status = self._get_param("statusFilter")
            with _lock:
                children = list(_map_children.get(map_run_arn, []))
            rows = [
                _child_row(c)
                for c in sorted(children, key=lambda c: c["index"])
                if status is None or c["status"] == status
            ]
            limit = self._get_int_param("maxResults") or len(rows)
            return ActionResult({"executions": rows[:limit]})

        return list_executions

    def make_describe(original: Any) -> Any:
        def describe_execution(self):
            with _lock:
                child = _child_records.get(self._get_param("executionArn") or "")
            if child is None:
                return original(self)
            out = {**_child_row(child), "input": child["input"]}
            out.update({k: child[k] for k in ("error", "cause") if child[k] is not None})
            return ActionResult(out)

        return describe_execution

    _patch(StepFunctionResponse, "list_executions", make_list)
    _patch(StepFunctionResponse, "describe_execution", make_describe)


# --- Fail states and redrive -----------------------------------------------------------------------------


_DEFINITE_PATH = re.compile(
    r"^\$(?:\.[A-Za-z_][A-Za-z0-9_]*|\[\d+\])*\[\d+\](?:\.[A-Za-z_][A-Za-z0-9_]*|\[\d+\])*$"
)
_PATH_STEP = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]")


def _patch_definite_json_paths() -> None:
    import moto.stepfunctions.parser.asl.parse.asl_parser  # noqa: F401 (loads every module that uses it)
    import moto.stepfunctions.parser.asl.utils.json_path as json_path
    import moto.stepfunctions.parser.backend.execution  # noqa: F401

    original = json_path.extract_json

    def extract_json(path: str, data: Any) -> Any:
        # moto wraps the value of any path that passes through an array index in a list ($[1].stamp ->
        # [value]); on AWS a definite reference path yields the node itself. Our Parallel ResultSelector
        # relies on that ($[i].<task>), so definite paths with an index are resolved here.
        if not _DEFINITE_PATH.match(path):
            return original(path, data)
        node = data
        for name, index in _PATH_STEP.findall(path[1:]):
            try:
                node = node[name] if name else node[int(index)]
            except (KeyError, IndexError, TypeError):
                raise json_path.NoSuchJsonPathError(json_path=path, data=data) from None
        return node

    # Modules import the function by name, so each module's reference is replaced.
    for name, module in list(sys.modules.items()):
        if name.startswith("moto.stepfunctions.parser") and getattr(module, "extract_json", None) is original:
            _patch(module, "extract_json", lambda _orig: extract_json)


def _patch_json_path_parsing() -> None:
    import moto.stepfunctions.parser.asl.component.common.path.result_path as result_path
    import moto.stepfunctions.parser.asl.utils.json_path as json_path

    # moto parses a path every time it evaluates one, and jsonpath_ng builds a new PLY parser (its lexer
    # and LR tables) per parse: ~1 ms each, several per state. Parsed paths are immutable; cache them.
    for module in (json_path, result_path):
        _patch(module, "parse", lambda original: functools.lru_cache(maxsize=4096)(original))


def _patch_server_dispatch() -> None:
    import moto.backends as backends

    # The server looks up every request's Host among moto's service modules, and list_of_moto_modules
    # lists moto's package directory for it (a listdir and ~180 stat calls per request); the list is fixed.
    def make(original: Any) -> Any:
        modules = tuple(original())
        return lambda: iter(modules)

    _patch(backends, "list_of_moto_modules", make)


def _patch_redrive() -> None:
    from moto.core.exceptions import ServiceException
    from moto.stepfunctions.responses import StepFunctionResponse

    def make(_original: Any) -> Any:
        def redrive_execution(self):
            # moto has no RedriveExecution; answer like AWS refusing one (a 400), not with a 500 that
            # clients retry, so the executor falls back to a restart at once.
            # ServiceException (moto >= 5.2; 5.2.6 removed AWSError) is serialised through the botocore
            # model, where ExecutionNotRedrivable is a 400.
            raise ServiceException("ExecutionNotRedrivable", "moto does not implement RedriveExecution")

        return redrive_execution

    _patch(StepFunctionResponse, "redrive_execution", make)


# --- the 256 KiB payload limit ---------------------------------------------------------------------------

# AWS Step Functions quota: a state's input or output, a task's result and the parameters it is given may
# be at most 256 KiB of UTF-8 JSON ("Maximum input or output size for a task, state, or execution",
# docs.aws.amazon.com/step-functions/latest/dg/service-quotas.html); over it the state fails with
# States.DataLimitExceeded, which States.ALL does not match (docs: "States.ALL ... can't catch the
# States.DataLimitExceeded terminal error type"). A Distributed Map's gathered result counts even under
# ResultPath null (aws-cdk#24799). moto (5.2.5) checks a state's output and a task's result
# (CommonStateField._verify_size_quota, with moto's 256 * 1024 bound); the rest is added here.
DATA_LIMIT_ERROR = "States.DataLimitExceeded"


def _patch_data_limits() -> None:
    """Check a state's input (after InputPath), a task's Parameters and a Map child's input (after
    ItemSelector) against the limit."""
    from moto.stepfunctions.parser.asl.component.state.exec.state_map.iteration.itemprocessor import (
        distributed_item_processor_worker as dipw,
    )
    from moto.stepfunctions.parser.asl.component.state.exec.state_task.state_task import StateTask
    from moto.stepfunctions.parser.asl.component.state.state import CommonStateField
    from moto.stepfunctions.parser.quotas import MAX_STATE_SIZE_UTF8_BYTES, is_within_size_quota

    def make_state_input(original: Any) -> Any:
        def _eval_state_input(self, env):
            original(self, env)
            self._verify_size_quota(env=env, value=env.stack[-1])  # the input after InputPath

        return _eval_state_input

    def make_parameters(original: Any) -> Any:
        def _eval_parameters(self, env):
            parameters = original(self, env)
            self._verify_size_quota(env=env, value=parameters)  # what the task is given
            return parameters

        return _eval_parameters

    def make_child_input(original: Any) -> Any:
        def _eval_input(self, env_frame):
            original(self, env_frame)
            # A child's input after ItemSelector is a child execution's input: the same limit. (Over it, the
            # child fails; the Map fails by its failure tolerance, as on AWS.)
            value = env_frame.states.get_input()
            if not is_within_size_quota(value):
                cause = f"a Map child's input is over {MAX_STATE_SIZE_UTF8_BYTES}"
                raise _states_failure(env_frame, "StatesStatesDataLimitExceeded", cause)

        return _eval_input

    _patch(CommonStateField, "_eval_state_input", make_state_input)
    _patch(StateTask, "_eval_parameters", make_parameters)
    _patch(dipw.DistributedItemProcessorWorker, "_eval_input", make_child_input)


def _patch_map_gathered_limit() -> None:
    """Check a Distributed Map's gathered result against the limit (unless a ResultWriter takes it), and
    record its size for :func:`gathered_results`."""
    from moto.stepfunctions.parser.asl.component.state.exec.state_map import state_map
    from moto.stepfunctions.parser.asl.utils.encoding import to_json_str
    from moto.stepfunctions.parser.quotas import MAX_STATE_SIZE_UTF8_BYTES

    def make_map_execution(original: Any) -> Any:
        def _eval_execution(self, env):
            original(self, env)
            if self.result_writer is None and env.is_running():
                # env.stack[-1]: every child's output, gathered; ResultSelector/ResultPath come later.
                gathered = env.stack[-1]
                size = len(to_json_str(gathered).encode())  # as moto's is_within_size_quota counts it
                execution = env.states.context_object.context_object_data["Execution"]["Id"]
                record = {"children": len(gathered), "bytes": size}
                with _lock:
                    _gathered.setdefault(execution, {})[self.name] = record
                if size >= MAX_STATE_SIZE_UTF8_BYTES:
                    cause = (
                        f"The state/task '{self.name}' returned a result with a size exceeding the maximum "
                        f"number of bytes service limit: {len(gathered)} children's outputs gathered"
                    )
                    raise _states_failure(env, "StatesStatesDataLimitExceeded", cause)

        return _eval_execution

    _patch(state_map.StateMap, "_eval_execution", make_map_execution)


def _patch_data_limit_uncaught() -> None:
    """A Retry or Catch matches States.DataLimitExceeded only by its name: ``States.ALL`` does not."""
    from moto.stepfunctions.parser.asl.component.common.error_name.error_equals_decl import ErrorEqualsDecl

    def make_error_equals(original: Any) -> Any:
        def _eval_body(self, env):
            error_name = env.stack[-1]
            terminal = getattr(error_name, "error_name", None) == DATA_LIMIT_ERROR
            if terminal and not any(
                getattr(n, "error_name", None) == DATA_LIMIT_ERROR for n in self.error_names
            ):
                env.stack.pop()
                env.stack.append(False)  # States.ALL (or anything else) does not match it
                return
            original(self, env)

        return _eval_body

    _patch(ErrorEqualsDecl, "_eval_body", make_error_equals)


def _states_failure(env: Any, error_type: str, cause: str, map_run: bool = False) -> Exception:
    """moto's failure of a state with the States error ``error_type`` (a ``StatesErrorNameType`` member) and
    ``cause``: a Map run's (``map_run``) or a task's, with the event details each has."""
    from moto.stepfunctions.parser import api
    from moto.stepfunctions.parser.asl.component.common.error_name.failure_event import (
        FailureEvent,
        FailureEventException,
    )
    from moto.stepfunctions.parser.asl.component.common.error_name.states_error_name import StatesErrorName
    from moto.stepfunctions.parser.asl.component.common.error_name.states_error_name_type import (
        StatesErrorNameType,
    )
    from moto.stepfunctions.parser.asl.eval.event.event_detail import EventDetails

    error = getattr(StatesErrorNameType, error_type)
    named = {"error": error.to_name(), "cause": cause}
    details = (
        EventDetails(mapRunFailedEventDetails=api.MapRunFailedEventDetails(**named))
        if map_run
        else EventDetails(executionFailedEventDetails=api.ExecutionFailedEventDetails(**named))
    )
    event_type = api.HistoryEventType.MapRunFailed if map_run else api.HistoryEventType.TaskFailed
    failure = FailureEvent(env, StatesErrorName(typ=error), event_type, details)
    return FailureEventException(failure)


# --- IAM: every request signed by a role, and checked against its policy ------------------------------------


def _permitted(role_arn: str, action: str, resource: str) -> bool:
    """Whether the inline policies of ``role_arn`` allow ``action`` on ``resource`` (moto's evaluator: an
    explicit Deny wins, one Allow is needed)."""
    from moto.iam.access_control import IAMPolicy, PermissionResult
    from moto.iam.models import iam_backends

    backend = iam_backends[ACCOUNT]["aws"]
    role = backend.get_role_by_arn(role_arn)
    results = [IAMPolicy(doc).is_action_permitted(action, resource) for doc in role.policies.values()]
    return PermissionResult.DENIED not in results and PermissionResult.PERMITTED in results


def _require(state_credentials: Any, action: str, resource: str, operation: str) -> None:
    """The state machine's role must allow what its integration does, as on AWS: moto's interpreter calls
    services without asking. A refusal fails the task with the service's 403 message ("User: <role> is not
    authorized to perform: <action> on resource: <arn>"); the error name is the interpreter's, not checked
    against AWS's."""
    role = getattr(state_credentials, "role_arn", None)
    if role is None or _permitted(role, action, resource):
        return
    from botocore.exceptions import ClientError

    message = f"User: {role} is not authorized to perform: {action} on resource: {resource}"
    error = {"Code": "AccessDeniedException", "Message": message}
    meta = {"HTTPStatusCode": 403, "RequestId": str(uuid.uuid4())}
    raise ClientError({"Error": error, "ResponseMetadata": meta}, operation)


def _batch_arn(region: str, what: str, name_or_arn: str) -> str:
    return (
        name_or_arn
        if name_or_arn.startswith("arn:")
        else f"arn:aws:batch:{region}:{ACCOUNT}:{what}/{name_or_arn}"
    )


# The request field naming each Step Functions action's resource (AWS's resource types for the action).
_SFN_RESOURCE_FIELD = {
    "StartExecution": "stateMachineArn",
    "StartSyncExecution": "stateMachineArn",
    "ListExecutions": "stateMachineArn",
    "DescribeStateMachine": "stateMachineArn",
    "DescribeExecution": "executionArn",
    "StopExecution": "executionArn",
    "GetExecutionHistory": "executionArn",
    "RedriveExecution": "executionArn",
    "ListMapRuns": "executionArn",
    "DescribeMapRun": "mapRunArn",
}


def _resource_arns(response: Any) -> list[str] | None:
    """The resources AWS authorizes a Step Functions or Batch request on (moto checks every action of
    those services against ``*``, so a policy scoped to ARNs, as ours are, would refuse everything)."""
    name = type(response).__name__
    if name not in ("StepFunctionResponse", "BatchResponse"):
        return None
    try:
        body = json.loads(response.body or "{}")
    except ValueError:
        return None
    action = response._get_action()
    if name == "StepFunctionResponse":
        field = _SFN_RESOURCE_FIELD.get(action)
        return [body[field]] if field and isinstance(body.get(field), str) else None
    region = response.region
    if action == "SubmitJob":
        return [
            _batch_arn(region, "job-queue", str(body.get("jobQueue", ""))),
            _batch_arn(region, "job-definition", str(body.get("jobDefinition", ""))),
        ]
    if action == "TerminateJob":
        return [f"arn:aws:batch:{region}:{ACCOUNT}:job/{body.get('jobId', '')}"]
    return None


# S3 operations whose IAM action has another name (AWS's Service Authorization Reference for S3); moto 5.2.6
# checks a policy for the operation's own name ("s3:HeadObject"), which no policy grants or needs to.
S3_IAM_ACTIONS = {
    "HeadObject": "GetObject",
    "HeadBucket": "ListBucket",
    "ListObjects": "ListBucket",
    "ListObjectsV2": "ListBucket",
    "CreateMultipartUpload": "PutObject",
    "UploadPart": "PutObject",
    "UploadPartCopy": "PutObject",
    "CompleteMultipartUpload": "PutObject",
    "CopyObject": "PutObject",
    "DeleteObjects": "DeleteObject",
    "ListParts": "ListMultipartUploadParts",
}


def _patch_s3_actions() -> None:
    """S3 requests are authorized as AWS does: by the IAM action of the operation, on every key a
    DeleteObjects names (moto checks the bucket), and on the source of a copy too (moto does not)."""
    from moto.iam.access_control import S3IAMRequest

    def make(original: Any) -> Any:
        def check_action_permitted(self, resource):
            service, _, operation = self._action.partition(":")
            if service != "s3":
                return original(self, resource)
            self._action = f"s3:{S3_IAM_ACTIONS.get(operation, operation)}"
            if operation in ("DeleteObject", "DeleteObjects") and "/" not in resource.partition(":::")[2]:
                body = self._body.decode() if isinstance(self._body, bytes) else str(self._body or "")
                for key in re.findall(r"<Key>(.*?)</Key>", body, re.S):
                    original(self, f"{resource}/{html.unescape(key)}")
                return None
            source = self._headers.get("x-amz-copy-source")
            if operation in ("CopyObject", "UploadPartCopy") and source:
                action, self._action = self._action, "s3:GetObject"
                original(self, "arn:aws:s3:::" + urllib.parse.unquote(source.split("?")[0]).lstrip("/"))
                self._action = action
            return original(self, resource)

        return check_action_permitted

    _patch(S3IAMRequest, "check_action_permitted", make)


def _patch_signature_payload() -> None:
    """moto recomputes a signature over the request's body, or, when the body is empty, over a dict that for
    some services (Lambda) holds the headers: every bodiless Lambda call (GetFunctionConfiguration,
    ListFunctions) then fails SignatureDoesNotMatch. A bodiless GET, HEAD or DELETE is signed over nothing."""
    from moto.iam.access_control import IAMRequestBase

    def make(original: Any) -> Any:
        def _create_aws_request(self):
            if not self._body and self._method in ("GET", "HEAD", "DELETE"):
                saved, self._data = self._data, b""
                try:
                    return original(self)
                finally:
                    self._data = saved
            return original(self)

        return _create_aws_request

    _patch(IAMRequestBase, "_create_aws_request", make)


def _patch_resource_arns() -> None:
    from moto.core.authorization import ActionAuthenticatorMixin

    def make(original: Any) -> Any:
        def _authenticate_and_authorize_normal_action(self, resource="*"):
            for arn in _resource_arns(self) or [resource]:
                original(self, arn)

        return _authenticate_and_authorize_normal_action

    _patch(ActionAuthenticatorMixin, "_authenticate_and_authorize_normal_action", make)


def _patch_interpreter_credentials() -> None:
    """moto's interpreter signs its own requests (a Distributed Map's ItemReader, a Batch .sync task) with
    fixed keys no IAM identity holds; the harness signs them with the state machine's role, as AWS does."""
    from moto.stepfunctions.parser.asl.component.state.exec.state_map.item_reader.eval import resource_eval_s3
    from moto.stepfunctions.parser.asl.component.state.exec.state_task import lambda_eval_utils
    from moto.stepfunctions.parser.asl.component.state.exec.state_task.service import state_task_service_batch

    def make(original: Any) -> Any:
        def boto_client_for(region, service, state_credentials=None):
            client = original(region=region, service=service, state_credentials=state_credentials)
            signer = _role_signers.get(getattr(state_credentials, "role_arn", None) or "")
            if signer is None:
                return client
            return boto3.client(
                service,
                region_name=region,
                endpoint_url=client.meta.endpoint_url,
                config=client.meta.config,
                aws_access_key_id=signer.access_key_id,
                aws_secret_access_key=signer.secret_access_key,
                aws_session_token=signer.session_token,
            )

        return boto_client_for

    for module in (resource_eval_s3, lambda_eval_utils, state_task_service_batch):
        _patch(module, "boto_client_for", make)


# --- Batch: .sync parameters and in-process containers ----------------------------------------------------


def _batch_operation(action: str) -> Any:
    # moto passes "submitJob" (the ASL resource's action) or "describe_jobs" (boto3's method name)
    name = "".join(p[:1].upper() + p[1:] for p in action.split("_"))
    return botocore.session.get_session().get_service_model("batch").operation_model(name)


def _patch_batch() -> None:
    from moto.batch_simple.models import BatchSimpleBackend
    from moto.stepfunctions.parser.asl.component.state.exec.state_task.service import state_task_service_batch

    StateTaskServiceBatch = state_task_service_batch.StateTaskServiceBatch

    def make_params(_original: Any) -> Any:
        def _normalise_parameters(self, parameters, boto_service_name=None, service_action_name=None):
            # ASL says JobName/ContainerOverrides.Environment[].Name...; boto3 wants jobName/name...
            op = _batch_operation(service_action_name or self.resource.api_action)
            self._to_boto_request(parameters, op.input_shape)

        return _normalise_parameters

    def make_response(_original: Any) -> Any:
        def _normalise_response(self, response, boto_service_name=None, service_action_name=None):
            # ...and the task's output is PascalCase again (JobId, which the .sync poller reads).
            op = _batch_operation(service_action_name or self.resource.api_action)
            self._from_boto_response(response, op.output_shape)

        return _normalise_response

    def make_finish(original: Any) -> Any:
        def _mark_job_as_finished(self, include_start_attempt, job):
            props = job.job_definition.container_properties or {}
            overrides = job.container_overrides or {}
            items = [*(props.get("environment", []) or []), *(overrides.get("environment", []) or [])]
            env = {item["name"]: item["value"] for item in items}
            if "SHARDFOLD_HANDLER" not in env:
                return original(self, include_start_attempt, job)  # not one of ours: moto's default
            self.backend._jobs[job.job_id] = job
            job.job_started_at = _dt.datetime.now()
            job.log_stream_name = job._stream_name
            if include_start_attempt:
                job._start_attempt()
            # the container's entry point, in-process
            from shardfold.functions.container import run as run_worker

            env["AWS_BATCH_JOB_ID"] = job.job_id  # as Batch sets it in the container
            try:
                # the container's log stream, as Batch's awslogs; its requests signed by the job role
                with telemetry.captured_log() as lines, credentials.using(_signers[BATCH_ROLE]):
                    try:
                        run_worker(env)
                    finally:
                        _write_batch_log(job.log_stream_name, lines)
            except Exception as exc:
                logger.warning(
                    "batch job failed", extra={"job": job.job_name, "error": f"{type(exc).__name__}: {exc}"}
                )
                job.job_stopped_reason = f"{type(exc).__name__}: {exc}"
                job._mark_stopped(success=False)
            else:
                job._mark_stopped(success=True)

        return _mark_job_as_finished

    _patch(StateTaskServiceBatch, "_normalise_parameters", make_params)
    _patch(StateTaskServiceBatch, "_normalise_response", make_response)
    _patch(BatchSimpleBackend, "_mark_job_as_finished", make_finish)


# --- the server and the stack -----------------------------------------------------------------------------


def _dummy_zip() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("shardfold_placeholder.py", "# moto never runs this: the harness calls the handler\n")
    return buf.getvalue()


def stack_sizes(workflows: Mapping[str, Workflow], *, batch: bool = True) -> dict[str, Any]:
    """The ``sizes`` output for ``workflows`` as a stack with the default configuration has it
    (:mod:`infra.sizes`; ``infra.program`` documents the shape), no ARNs."""
    functions = {
        fn: function_size(fn, memory_mb, timeout_s, LAMBDA_DEFAULT_EPHEMERAL_MB)
        for fn, (memory_mb, timeout_s) in sorted(plan_sizes(workflows).items())
    }
    jobs = {ep: batch_size(step) for ep, step in sorted(batch_steps(workflows).items())} if batch else {}
    return {
        "functions": functions,
        "batch": jobs,
        "lambda_architecture": DEFAULT_LAMBDA_ARCHITECTURE,  # what the stack deploys by default
    }


def _role(
    clients: Mapping[str, Any], name: str, service: str, policy: Mapping[str, Any], signer: str | None = None
) -> str:
    """Create role ``name`` (trusting ``service``) with ``policy`` inline, as ``infra`` does, and keep a
    session of it (``signer``: also under that name in ``_signers``); its ARN."""
    arn = clients["iam"].create_role(
        RoleName=name, AssumeRolePolicyDocument=iam.to_json(iam.assume_role(service))
    )["Role"]["Arn"]
    clients["iam"].put_role_policy(
        RoleName=name, PolicyName=f"{name}-policy", PolicyDocument=iam.to_json(policy)
    )
    assumed = clients["sts"].assume_role(RoleArn=arn, RoleSessionName=name[:64], DurationSeconds=43200)
    c = assumed["Credentials"]
    session = Credentials(c["AccessKeyId"], c["SecretAccessKey"], c["SessionToken"])
    with _lock:
        _role_signers[arn] = session
        if signer is not None:
            _signers[signer] = session
    return arn


def build_stack(
    workflows: Mapping[str, Workflow],
    *,
    region: str,
    bucket: str,
    stage: str,
    endpoint_url: str,
    batch: bool = True,
) -> dict[str, Any]:
    """Create the stack inside a running moto and return its outputs, in the shape ``shardfold deploy``
    saves (``sizes`` included): the bucket; one Lambda function per registered function the workflows call;
    the Batch queue and job definitions; one state machine per workflow from the compiled ASL; and the roles
    of each, with the policies ``infra`` attaches (:mod:`orchestrator.iam`: a function's from its kind's
    rights), each with a session the harness signs that role's requests with."""
    kw = {"region_name": region, "endpoint_url": endpoint_url}
    clients = {s: boto3.client(s, **kw) for s in ("iam", "sts", "s3", "lambda", "stepfunctions")}
    if region == "us-east-1":
        clients["s3"].create_bucket(Bucket=bucket)
    else:
        clients["s3"].create_bucket(Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": region})

    outputs: dict[str, Any] = {
        "backend": "moto",
        "region": region,
        "bucket": bucket,
        "stage": stage,
        "endpoint_url": endpoint_url,
        "functions": {},
        "function_names": {},
        "log_groups": {},  # as the real stack's: where `shardfold logs` may follow a record
        "state_machine_arns": {},
        "sizes": stack_sizes(workflows, batch=batch),
        "output_prefixes": list(GRANTS.output_prefixes),
        "read_buckets": list(GRANTS.read_buckets),
        "write_buckets": list(GRANTS.write_buckets),
    }
    _build_functions(clients, outputs)
    definition_names: dict[str, str] = {}
    if outputs["sizes"]["batch"]:
        definition_names = _build_batch(clients, boto3.client("batch", **kw), workflows, outputs)
    _build_state_machines(clients, workflows, definition_names, outputs)
    _build_dispatch_role(clients, workflows, outputs)
    return outputs


def _build_functions(clients: Mapping[str, Any], outputs: dict[str, Any]) -> None:
    """One Lambda function per entry of the ``sizes`` output, each with its own role, run by the harness."""
    code = _dummy_zip()
    region, bucket, stage = outputs["region"], outputs["bucket"], outputs["stage"]
    logs = f"arn:aws:logs:{region}:{ACCOUNT}:log-group"
    for function, size in outputs["sizes"]["functions"].items():
        name = lambda_name(function, stage)
        statements = iam.worker_statements("aws", bucket, GRANTS, iam.function_rights(function))
        policy = iam.lambda_policy(f"{logs}:/aws/lambda/{name}", statements, tracing=False)
        role = _role(clients, f"{name}-role", "lambda.amazonaws.com", policy, signer=name)
        fn = clients["lambda"].create_function(
            FunctionName=name,
            Runtime="python3.11",
            Role=role,
            Handler=lambda_handler(function),
            Code={"ZipFile": code},
            MemorySize=size["memory_mb"],
            Timeout=size["timeout_s"],
            EphemeralStorage={"Size": size["ephemeral_mb"]},
        )
        outputs["functions"][function] = fn["FunctionArn"]
        outputs["function_names"][function] = name
        outputs["log_groups"][function] = f"/aws/lambda/{name}"
        with _lock:
            _lambda_functions[name] = function


def _build_batch(
    clients: Mapping[str, Any], client: Any, workflows: Mapping[str, Workflow], outputs: dict[str, Any]
) -> dict[str, str]:
    """The job role, the compute environment, queue and one job definition per entry point (run under the
    job role); ``{entry point: job definition name}``."""
    bucket, stage = outputs["bucket"], outputs["stage"]
    job_role = _role(
        clients,
        f"{name_prefix(stage)}-batch-job-role",
        "ecs-tasks.amazonaws.com",
        iam.document(*iam.batch_job_statements("aws", bucket, GRANTS, iam.batch_rights(workflows))),
        signer=BATCH_ROLE,
    )
    # moto wants a service role for the compute environment (AWS uses Batch's service-linked role)
    service_role = clients["iam"].create_role(
        RoleName=f"{name_prefix(stage)}-batch-service-role",
        AssumeRolePolicyDocument=iam.to_json(iam.assume_role("batch.amazonaws.com")),
    )["Role"]["Arn"]
    ce = client.create_compute_environment(
        computeEnvironmentName=name_prefix(stage),
        type="UNMANAGED",
        state="ENABLED",
        serviceRole=service_role,
    )
    queue = client.create_job_queue(
        jobQueueName=name_prefix(stage),
        state="ENABLED",
        priority=1,
        computeEnvironmentOrder=[{"order": 1, "computeEnvironment": ce["computeEnvironmentArn"]}],
    )
    outputs["batch_job_queue"] = queue["jobQueueArn"]
    outputs["batch_job_definitions"] = {}
    names: dict[str, str] = {}
    for entry_point, size in outputs["sizes"]["batch"].items():
        requirements = [
            {"type": "VCPU", "value": str(size["vcpus"])},
            {"type": "MEMORY", "value": str(size["memory_mb"])},
        ]
        if size["gpus"]:
            requirements.append({"type": "GPU", "value": str(size["gpus"])})
        names[entry_point] = job_definition_name(entry_point, stage)
        jd = client.register_job_definition(
            jobDefinitionName=names[entry_point],
            type="container",
            containerProperties={
                "image": "shardfold-worker:moto",
                "command": ["python", "-m", "shardfold.functions.container"],
                "resourceRequirements": requirements,
                "jobRoleArn": job_role,
            },
            timeout={"attemptDurationSeconds": size["timeout_s"]},
        )
        outputs["batch_job_definitions"][entry_point] = jd["jobDefinitionArn"]
    outputs["log_groups"]["batch"] = telemetry.BATCH_LOG_GROUP
    return names


def _build_state_machines(
    clients: Mapping[str, Any],
    workflows: Mapping[str, Workflow],
    definition_names: Mapping[str, str],
    outputs: dict[str, Any],
) -> None:
    """One state machine per workflow, from its compiled ASL, with the role ``infra`` gives it."""
    region, bucket, stage = outputs["region"], outputs["bucket"], outputs["stage"]
    resolver = StackResolver(outputs)
    for kind, wf in workflows.items():
        name = state_machine_name(kind, stage)
        statements = iam.state_machine_statements(
            wf,
            partition="aws",
            region=region,
            account=ACCOUNT,
            name=name,
            bucket=bucket,
            function_arns=[outputs["functions"][f] for f in dict.fromkeys(t.function for t in wf.tasks())],
            queue=outputs.get("batch_job_queue"),
            definition_names=[definition_names[s.entry_point] for s in wf.walk() if isinstance(s, BatchJob)],
            tracing=False,
        )
        role = _role(clients, f"{name}-role", "states.amazonaws.com", iam.document(*statements))
        definition = json.dumps(compile_workflow(wf, resolver))
        sm = clients["stepfunctions"].create_state_machine(name=name, definition=definition, roleArn=role)
        outputs["state_machine_arns"][kind] = sm["stateMachineArn"]


def _build_dispatch_role(
    clients: Mapping[str, Any], workflows: Mapping[str, Workflow], outputs: dict[str, Any]
) -> None:
    """The dispatch function's role: moto has no trigger; :meth:`MotoStack.dispatch` runs the handler
    under it."""
    region, bucket, stage = outputs["region"], outputs["bucket"], outputs["stage"]
    states = f"arn:aws:states:{region}:{ACCOUNT}:stateMachine"
    statements = iam.dispatch_statements(
        "aws",
        bucket,
        state_machine_arns=[f"{states}:{state_machine_name(k, stage)}" for k in workflows],
        dlq_arn=None,
        kms_key_arn=None,
        read_refs=access.reach({Right.INPUTS}, GRANTS, bucket)[0],
    )
    policy = iam.document(*statements)
    _role(
        clients, f"{name_prefix(stage)}-dispatch-role", "lambda.amazonaws.com", policy, signer=DISPATCH_ROLE
    )


OPERATOR = "shardfold-operator"


def running() -> MotoStack | None:
    """The moto stack running in this process, if any."""
    return _active


def _operator(endpoint: str, region: str) -> dict[str, str]:
    """An IAM user allowed everything, standing for the person at the SDK and CLI (and for AWS's services
    where they act themselves, e.g. Lambda writing a function's log); the environment that signs as it."""
    client = boto3.client("iam", region_name=region, endpoint_url=endpoint)
    client.create_user(UserName=OPERATOR)
    admin = {"Version": iam.VERSION, "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
    client.put_user_policy(UserName=OPERATOR, PolicyName="administrator", PolicyDocument=json.dumps(admin))
    key = client.create_access_key(UserName=OPERATOR)["AccessKey"]
    return {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}


class MotoStack:
    """An in-process moto server holding a whole stack; ``start()`` returns the stack outputs."""

    def __init__(
        self,
        workflows: Mapping[str, Workflow] | None = None,
        *,
        region: str = "us-east-1",
        bucket: str = "shardfold-moto",
        stage: str = "moto",
    ):
        if workflows is None:
            from shardfold.functions.kinds import WORKFLOWS

            workflows = WORKFLOWS
        self.workflows = dict(workflows)
        self.region = region
        self.bucket = bucket
        self.stage = stage
        self.outputs: dict[str, Any] = {}
        self._server: Any = None
        self._saved_env: dict[str, str | None] = {}
        self._saved_levels: dict[str, int] = {}
        self._saved_auth: tuple[Any, int] | None = None
        self._patched = False

    @property
    def endpoint_url(self) -> str:
        return self.outputs["endpoint_url"]

    def start(self) -> dict[str, Any]:
        global _active
        with _lock:
            if _active is not None:
                # moto's backends are process-wide: a second stack would reset the first one's state.
                raise ShardfoldError("a moto stack is already running in this process; stop it first")
            _active = self
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        logger.info("moto stack up", extra={"endpoint": self.endpoint_url, "kinds": sorted(self.workflows)})
        return self.outputs

    def _start(self) -> None:
        from moto.server import ThreadedMotoServer

        # werkzeug logs one line per request, and the interpreter logs every caught task failure with its
        # whole state tree; the executor reports the job's error itself.
        for name, level in (("werkzeug", logging.ERROR), ("moto.stepfunctions.parser", logging.CRITICAL)):
            self._saved_levels[name] = logging.getLogger(name).level
            logging.getLogger(name).setLevel(level)
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        self._set_env(
            {
                "AWS_ENDPOINT_URL": endpoint,  # our boto3 clients, the store's S3 client and its CRT client
                "MOTO_PORT": str(port),  # the interpreter's own clients call localhost:$MOTO_PORT
                "AWS_ACCESS_KEY_ID": "testing",  # never real credentials against a fake endpoint
                "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_SESSION_TOKEN": None,
                "AWS_REGION": self.region,
                "AWS_DEFAULT_REGION": self.region,
                **GRANTS.env(),  # the deployed functions' grants: the tasks check them as on AWS
            }
        )
        self._post("/moto-api/reset", {})
        self._post("/moto-api/config", MOTO_CONFIG)
        install_patches()
        self._patched = True
        self._set_env(_operator(endpoint, self.region))  # the person at the SDK and CLI from here on
        boto3.DEFAULT_SESSION = None  # boto3.client() keeps the keys it first read: read the operator's
        self.outputs = build_stack(
            self.workflows, region=self.region, bucket=self.bucket, stage=self.stage, endpoint_url=endpoint
        )
        # what the dispatch function's environment holds on AWS (MotoStack.dispatch runs it here)
        self._set_env(
            {"SHARDFOLD_STATE_MACHINES": json.dumps(self.outputs["state_machine_arns"], sort_keys=True)}
        )
        self._enforce_iam()

    def _enforce_iam(self) -> None:
        """From now on every request is authenticated and checked against its signer's policies (moto's
        switch is process-wide, as the server is; :meth:`stop` restores it)."""
        from moto import settings
        from moto.core.authorization import ActionAuthenticatorMixin

        self._saved_auth = (settings.INITIAL_NO_AUTH_ACTION_COUNT, ActionAuthenticatorMixin.request_count)
        settings.INITIAL_NO_AUTH_ACTION_COUNT = 0
        ActionAuthenticatorMixin.request_count = 0

    def credentials(self, who: str) -> Credentials:
        """The session credentials the harness signs ``who``'s requests with: a workflow function
        (``"getbatch.gather"``), ``"batch"`` (the Batch containers) or ``"dispatch"``."""
        name = self.outputs["function_names"].get(who, who)
        try:
            return _signers[name]
        except KeyError:
            raise ShardfoldError(f"no role signs for {who!r}; known: {sorted(_signers)}") from None

    def dispatch(self, event: Mapping[str, Any]) -> dict[str, Any]:
        """The bucket trigger's handler on ``event`` (an S3 "Object Created" event), as the deployed dispatch
        function runs it: under its role (the stack's state machines are in the environment from start)."""
        from shardfold.functions import trigger

        with credentials.using(_signers[DISPATCH_ROLE]):
            return trigger.handler(dict(event), None)

    def stop(self) -> None:
        """Stop the server and undo every patch, environment variable and log level (safe to call twice)."""
        global _active
        if self._saved_auth is not None:
            from moto import settings
            from moto.core.authorization import ActionAuthenticatorMixin

            settings.INITIAL_NO_AUTH_ACTION_COUNT, ActionAuthenticatorMixin.request_count = self._saved_auth
            self._saved_auth = None
        if self._patched:
            uninstall_patches()
            self._patched = False
        if self._server is not None:
            self._server.stop()
            self._server = None
        for name, level in self._saved_levels.items():
            logging.getLogger(name).setLevel(level)
        self._saved_levels.clear()
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved_env.clear()
        boto3.DEFAULT_SESSION = None
        with _lock:
            if _active is self:
                _active = None

    def __enter__(self) -> MotoStack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _set_env(self, values: dict[str, str | None]) -> None:
        for key, value in values.items():
            self._saved_env.setdefault(key, os.environ.get(key))
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    def _post(self, path: str, body: dict[str, Any]) -> None:
        host, port = self._server.get_host_and_port()
        req = urllib.request.Request(
            f"http://{host}:{port}{path}", data=json.dumps(body).encode(), method="POST"
        )
        with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310 (our own local server)
            resp.read()
