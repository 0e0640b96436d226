"""The ``shardfold`` command line: a thin layer over the SDK that prints with rich.

Errors a user can cause (:class:`ShardfoldError`) print one red line and exit 1; anything else is a bug and
keeps its traceback.

SIGTERM, SIGHUP and SIGINT (Ctrl-C) end the command at once: the local jobs it runs are recorded INTERRUPTED
and their worker processes killed (:meth:`client.sdk.Client.interrupt`), it prints the command that resumes
each, and exits with 128 + the signal number without waiting for handler threads.

Rich reads ``[...]`` in a printed string as markup. Our own styling is markup; every piece of text that came
from a user or the store (spec fields, error messages, URIs, job ids, result values, file names, table
cells) goes through :func:`_t` first, so ``[/]`` or ``[link=...]`` in it prints as written.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import logging
import math
import os
import re
import signal
import sys
import time
from operator import methodcaller
from pathlib import Path
from typing import Any

import click
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from shardfold.functions.errors import ShardfoldError
from shardfold.functions.extras import MissingExtra
from shardfold.functions.report import STEP_COLUMNS, step_row
from shardfold.functions.report import tables as report_tables
from shardfold.functions.tables import Table as TextTable
from shardfold.functions.tables import size_text

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)

BACKEND_CHOICES = click.Choice(["local", "aws", "moto"])
# The sample events and specs, shipped in the wheel as shardfold.events (the repository's events/ folder).
SAMPLE_EVENTS = Path(str(importlib.resources.files("shardfold.events")))
# Handlers that are not workflow steps (so not in orchestrator.registry) but can be invoked like one.
EXTRA_HANDLERS = {"dispatch": "shardfold.functions.trigger:handler"}
LOGS_POLL_S = 1.0  # how often `shardfold logs --follow` looks for new lines


_CLIENTS: list[Any] = []  # the clients this command made, for the jobs an interrupt stopped
_STOPPED_BY: list[int] = []  # the signal that interrupted this command, once one has


class Interrupted(KeyboardInterrupt):
    """SIGTERM, SIGHUP or SIGINT arrived; raised in the main thread so every ``with`` block unwinds."""


def _on_signal(signum: int, frame: Any) -> None:
    if _STOPPED_BY:  # already stopping: let the clean-up finish
        return
    _STOPPED_BY.append(signum)
    raise Interrupted(signal.Signals(signum).name)


_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _visible(text: str) -> str:
    """``text`` with control characters shown as escapes: a log line may hold raw ANSI sequences (a
    terminal would obey them: move the cursor, retitle the window, hide what follows)."""
    return _CONTROLS.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _finite(doc: Any) -> Any:
    """``doc`` with NaN and infinities as null: JSON has no such numbers (``json.dumps`` would write
    ``Infinity``, which other parsers refuse)."""
    if isinstance(doc, float) and not math.isfinite(doc):
        return None
    if isinstance(doc, dict):
        return {k: _finite(v) for k, v in doc.items()}
    if isinstance(doc, list | tuple):
        return [_finite(v) for v in doc]
    return doc


def _print_json(doc: Any) -> None:
    out.print_json(json.dumps(_finite(doc), allow_nan=False))


def _t(value: Any) -> str:
    """``value`` as text that rich prints literally (its ``[`` never opens markup)."""
    return escape(str(value))


class ShardfoldGroup(click.Group):
    """Turns user errors into one red line and exit code 1, with no traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ShardfoldError as exc:
            err.print(f"[bold red]error:[/] {_t(exc)}", soft_wrap=True)
            ctx.exit(1)
        except OSError as exc:  # the machine's (a full disk, an I/O error): said in one line too
            where = f" ({exc.filename})" if exc.filename else ""
            err.print(f"[bold red]error:[/] {_t(exc.strerror or exc)}{_t(where)}", soft_wrap=True)
            ctx.exit(1)
        except KeyboardInterrupt as exc:
            why = str(exc) or "SIGINT"
            stopped = [job_id for client in _CLIENTS for job_id in client.interrupted]
            err.print(f"[yellow]interrupted[/] ({_t(why)})", soft_wrap=True)
            for job_id in stopped:
                err.print(
                    f"job [bold]{_t(job_id)}[/] INTERRUPTED; resume with: shardfold resume {_t(job_id)}",
                    soft_wrap=True,
                )
            signum = _STOPPED_BY[0] if _STOPPED_BY else signal.SIGINT
            ctx.exit(128 + int(signum))


STACK_HELP = (
    "deployed stack NAME whose saved outputs --backend aws uses: the same name as `shardfold deploy --stack` "
    "($SHARDFOLD_STACK; default dev)"
)


def _complete_job_ids(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[str]:
    """Shell completion of job ids: those in the backend's store that start with what was typed (the local
    store unless --backend says otherwise; nothing when the backend cannot be reached)."""
    try:
        backend = ctx.params.get("backend") or os.environ.get("SHARDFOLD_BACKEND", "local")
        with _client(backend, ctx.params.get("stack")) as client:
            return sorted(st.job_id for st in client.jobs() if st.job_id.startswith(incomplete))
    except Exception:  # noqa: BLE001 - completion must never print an error into the user's shell
        return []


def _complete_kinds(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[str]:
    from shardfold.functions import kinds

    return [k for k in kinds.names() if k.startswith(incomplete)]


def backend_option(f: Any) -> Any:
    f = click.option("--stack", metavar="NAME", default=None, help=STACK_HELP)(f)
    return click.option(
        "--backend",
        "-b",
        type=BACKEND_CHOICES,
        default="local",
        envvar="SHARDFOLD_BACKEND",
        show_default=True,
        help="where jobs run ($SHARDFOLD_BACKEND)",
    )(f)


def _client(backend: str, stack: str | None = None) -> Any:
    from shardfold.client import Client
    from shardfold.client.errors import BackendError

    if stack is not None and backend != "aws":
        raise BackendError(
            f"--stack {stack} selects a deployed stack, which only --backend aws uses (this is --backend "
            f"{backend}): add --backend aws"
        )
    client = Client(backend=backend, stack=stack)
    _CLIENTS.append(client)
    return client


def _fmt_cell(v: Any) -> str:
    """A plan detail value: integers with separators, floats to 4 significant digits."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return str(v)
    return f"{v:,}" if isinstance(v, int) else f"{v:.4g}"


def _kv_text(k: str, v: Any) -> str:
    return str(size_text(v) if k == "bytes" else json.dumps(v) if isinstance(v, dict | list) else v)


def _print_kv(title: str, data: dict[str, Any]) -> None:
    """Labelled values: a table at a terminal; piped, one ``label  value`` line each, never wrapped (a URI
    stays whole for grep and copy)."""
    if not out.is_terminal:
        width = max((len(k) for k in data), default=0)
        out.print(title, markup=False, highlight=False, soft_wrap=True)
        for k, v in data.items():
            out.print(f"  {k.ljust(width)}  {_kv_text(k, v)}", markup=False, highlight=False, soft_wrap=True)
        return
    table = Table(title=_t(title), show_header=False, title_justify="left")
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    for k, v in data.items():
        table.add_row(_t(k), _t(_kv_text(k, v)))
    out.print(table)


def _state_style(state: str) -> str:
    return {
        "SUCCEEDED": "green",
        "FAILED": "red",
        "CANCELLED": "yellow",
        "RUNNING": "cyan",
        "INTERRUPTED": "magenta",
    }.get(state, "white")


def _step_counts(steps: dict[str, Any] | None) -> list[tuple[str, Any, Any]]:
    """``(name, done, total)`` of each step entry: a dict {done, total} or an object with those attributes."""
    return [
        (name, c.get("done", 0), c.get("total"))
        if isinstance(c, dict)
        else (name, getattr(c, "done", 0), getattr(c, "total", None))
        for name, c in (steps or {}).items()
    ]


def _step_text(name: str, done: Any, total: Any) -> str:
    """One step's count as the status lines write it ("infer 3/8", "prepare 0/?")."""
    return f"{name} {done}/{total if total is not None else '?'}"


def _steps_text(steps: dict[str, Any] | None) -> str:
    return ", ".join(_step_text(*c) for c in _step_counts(steps))


def _status_dict(status: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(status):
        return dataclasses.asdict(status)
    return dict(status)


def _print_table(table: Any) -> None:
    """A :class:`functions.tables.Table` (a kind's plan details or result table); numeric columns right.
    Piped, plain padded columns, never wrapped."""
    if not out.is_terminal:
        cells = [list(table.columns)] + [[_fmt_cell(v) for v in row] for row in table.rows]
        widths = [max(len(str(r[i])) for r in cells) for i in range(len(table.columns))]
        right = [bool(table.rows) and all(_numeric(row[i]) for row in table.rows) for i in range(len(widths))]
        out.print(table.title, markup=False, highlight=False, soft_wrap=True)
        for r in cells:
            parts = zip(r, widths, right, strict=True)
            line = "  ".join(str(v).rjust(w) if rj else str(v).ljust(w) for v, w, rj in parts)
            out.print("  " + line.rstrip(), markup=False, highlight=False, soft_wrap=True)
        return
    extra = Table(title=_t(table.title), title_justify="left", box=box.SIMPLE_HEAD)
    for i, col in enumerate(table.columns):
        numeric = bool(table.rows) and all(_numeric(row[i]) for row in table.rows)
        extra.add_column(_t(col), justify="right" if numeric else "left", overflow="fold")
    for row in table.rows:
        extra.add_row(*(_t(_fmt_cell(v)) for v in row))
    out.print(extra)


def _numeric(v: Any) -> bool:
    """A cell to right-justify: a number, or a figure already formatted ("1,024", "54/512", "EC2 30 s")."""
    if isinstance(v, bool):
        return False
    return isinstance(v, int | float) or (
        isinstance(v, str) and re.fullmatch(r"[-\d.,/ ]+|EC2 .*", v) is not None
    )


def _print_result(result: dict[str, Any]) -> None:
    """The result as its kind's view shows it (:attr:`functions.kinds.JobKind.result_view`)."""
    from shardfold.functions import kinds

    kind = result.get("kind")
    view = kinds.find(kind).result_view(result) if kind in kinds.packages() else None
    if view is None:
        _print_kv("result", result)
        return
    _print_kv("result", view.summary)
    for table in view.tables:
        _print_table(table)
    for note in view.notes:
        out.print(_t(note), soft_wrap=True)


def _wait_and_report(job: Any) -> None:
    status = job.wait(progress=True, console=err)
    style = _state_style(status.state)
    out.print(f"job [bold]{_t(job.job_id)}[/] [{style}]{_t(status.state)}[/]")
    if status.state != "SUCCEEDED":
        raise _ended_badly(job, status)
    _print_result(job.result())
    if job.client.backend == "moto":
        err.print(MOTO_NOTE)


def _ended_badly(job: Any, status: Any) -> Exception:
    from shardfold.client.errors import ended_badly

    return ended_badly(job.job_id, status.state, status.error)


MOTO_NOTE = (
    "[yellow]note:[/] the moto backend's bucket lives in this process: the s3:// objects above are gone "
    "when it ends (use --backend local to keep outputs, or read them inside one Client(backend='moto'))"
)


@click.group(cls=ShardfoldGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="shardfold", message="%(prog)s %(version)s")
@click.option("-v", "--verbose", count=True, help="show the JSON logs (-v: info, -vv: debug)")
def cli(verbose: int) -> None:
    """Shardfold: serverless batch jobs on AWS Step Functions and Lambda, or locally.

    Local jobs live in a store folder: ./.shardfold in the working directory, or $SHARDFOLD_HOME (set it
    once, e.g. in your shell's profile, to see the same jobs from every directory). Every verb names the
    store it used."""
    # The library logs JSON lines for CloudWatch; at a terminal they would drown the tables, so the CLI
    # shows only errors unless asked (an explicit POWERTOOLS_LOG_LEVEL wins).
    if verbose or not os.environ.get("POWERTOOLS_LOG_LEVEL"):
        level = {0: logging.ERROR, 1: logging.INFO}.get(verbose, logging.DEBUG)
        logging.getLogger("shardfold").setLevel(level)
        # worker processes of the local executor (CPU-bound steps) build their own loggers from the env
        os.environ["POWERTOOLS_LOG_LEVEL"] = logging.getLevelName(level)


@cli.command()
@click.argument("spec", type=click.Path(exists=True, dir_okay=False, allow_dash=True))
@backend_option
@click.option(
    "--no-wait", is_flag=True, help="print the job id and return at once (locally the job runs on, detached)"
)
@click.option(
    "--quiet", "-q", is_flag=True, help="print only the job id (and, waiting, no progress or result)"
)
@click.option("--json", "as_json", is_flag=True, help="print the result as JSON once the job succeeds")
@click.option(
    "--upload",
    is_flag=True,
    help="copy the local files SPEC names as inputs into the store first (uploads/<hash>/<name>): how a "
    "spec for this machine runs on --backend aws or moto",
)
def run(
    spec: str, backend: str, stack: str | None, no_wait: bool, quiet: bool, as_json: bool, upload: bool
) -> None:
    """Submit the job in SPEC (a JSON file; - reads it from standard input), show progress and print its
    result."""
    source: Any = sys.stdin.read() if spec == "-" else Path(spec)
    with _client(backend, stack) as client:
        # --no-wait on the local backend: the job runs in a process of its own, which outlives this one
        job = client.submit(source, detach=no_wait and backend == "local", upload=upload)
        if quiet or as_json:
            (out if quiet else err).print(job.job_id, highlight=False, markup=False)
        else:
            out.print(
                f"submitted [bold]{_t(job.job_id)}[/] ({_t(job.kind)}) on {backend}, "
                f"store {_t(_where(client))}"
            )
        if no_wait:
            if backend == "moto":
                err.print("[yellow]note:[/] moto state lives in this process; waiting anyway")
            else:
                return
        if as_json:
            _print_json(_result_quietly(job))
            return
        if quiet:
            status = job.wait(progress=False)
            if status.state != "SUCCEEDED":
                raise _ended_badly(job, status)
            return
        _wait_and_report(job)


def _print_model() -> None:
    """The prices and model numbers behind every estimate (functions.pricing.MODEL), with their sources."""
    from shardfold.functions import pricing

    table = Table(title="what the estimate assumes", title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("number", "value", "unit", "source"):
        table.add_column(col, justify="right" if col == "value" else "left")
    for name, value, unit, source in pricing.MODEL:
        table.add_row(name, f"{value:.10g}", unit, source)
    out.print(table)


@cli.command()
@click.argument("spec", type=click.Path(exists=True, dir_okay=False))
@backend_option
@click.option("--json", "as_json", is_flag=True, help="print the plan as JSON")
@click.option("--explain", is_flag=True, help="also list every price and model number, and its source")
def plan(spec: str, backend: str, stack: str | None, as_json: bool, explain: bool) -> None:
    """Dry run: steps, tasks, memory per task, S3 requests and an AWS cost estimate. Runs nothing.

    Some kinds add their own tables (dpquery: the privacy and accuracy plan)."""
    with _client(backend, stack) as client:
        report = client.plan(Path(spec))
    if explain and not as_json:
        _print_model()
    if as_json:
        _print_json(report.to_dict())
        return
    rows = [step_row(s.name, s.tasks, s.peak_mb, s.memory_mb, dataclasses.asdict(s)) for s in report.steps]
    _print_table(TextTable(f"plan: {report.kind}, {report.items:,} items", STEP_COLUMNS, rows))
    cost = Table(title="cost if run on AWS", title_justify="left", box=box.SIMPLE_HEAD)
    cost.add_column("component")
    cost.add_column("USD (us-east-1)", justify="right")
    for k, v in report.cost_usd.items():
        cost.add_row(f"[bold]{_t(k)}[/]" if k == "total" else _t(k), f"{v:.6f}")
    out.print(cost)
    out.print(f"state transitions: {report.transitions:,}")
    for detail in report.details:  # kind-specific tables (e.g. dpquery's privacy and accuracy plan)
        _print_table(detail)
    for s in report.steps:  # the estimator's reasons: what each task's peak is made of
        if s.why:
            out.print(f"[dim]- {_t(s.name)} peak: {_t(s.why)}[/]")
    for note in report.notes:
        out.print(f"[dim]- {_t(note)}[/]")


JSON_HELP = "print the outcome as JSON on stdout (progress and notes stay on stderr)"


@cli.command()
@click.argument("job_id", shell_complete=_complete_job_ids)
@backend_option
@click.option("--json", "as_json", is_flag=True, help="print the result as JSON once the job succeeds")
def wait(job_id: str, backend: str, stack: str | None, as_json: bool) -> None:
    """Follow a running job (from `run --no-wait`, or another terminal) to its end and print its result."""
    with _client(backend, stack) as client:
        job = client.job(job_id)
        if as_json:
            _print_json(_result_quietly(job))
        else:
            _wait_and_report(job)


def _result_quietly(job: Any) -> dict[str, Any]:
    """The job's result once it succeeds, waiting without progress; JobFailed naming why it did not."""
    status = job.wait(progress=False)
    if status.state != "SUCCEEDED":
        raise _ended_badly(job, status)
    return job.result()


@cli.command()
@click.argument("job_id", shell_complete=_complete_job_ids)
@backend_option
@click.option("--json", "as_json", is_flag=True, help="print the status record as JSON")
def status(job_id: str, backend: str, stack: str | None, as_json: bool) -> None:
    """Show a job's state and per-step progress."""
    with _client(backend, stack) as client:
        st = client.job(job_id).status()
    data = _status_dict(st)
    if as_json:
        _print_json(data)
        return
    steps = data.pop("steps", None)
    data["steps"] = _steps_text(steps)
    _print_kv(f"job {st.job_id}", {k: v for k, v in data.items() if v not in (None, "")})


@cli.command()
@backend_option
@click.option(
    "--state", "states", multiple=True, help="only jobs in this state (repeatable): RUNNING, FAILED, ..."
)
@click.option(
    "--kind",
    "kinds_",
    multiple=True,
    help="only jobs of this kind (repeatable)",
    shell_complete=_complete_kinds,
)
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True, help="newest N jobs")
@click.option("--json", "as_json", is_flag=True, help="print the status records as JSON")
def jobs(
    backend: str,
    stack: str | None,
    states: tuple[str, ...],
    kinds_: tuple[str, ...],
    limit: int,
    as_json: bool,
) -> None:
    """List the jobs on a backend, newest first."""
    with _client(backend, stack) as client:
        statuses = client.jobs()
        where = _where(client)
    wanted = {s.upper() for s in states}
    chosen = [
        st for st in statuses if (not wanted or st.state in wanted) and (not kinds_ or st.kind in kinds_)
    ]
    chosen = sorted(chosen, key=_submitted, reverse=True)[:limit]
    if as_json:
        _print_json([_status_dict(st) for st in chosen])
        return
    if not chosen:
        match = " match" if wanted or kinds_ else ""
        hint = " ($SHARDFOLD_HOME or another directory's .shardfold may hold yours)" * (backend == "local")
        out.print(f"no jobs in the {_t(backend)} store {_t(where)}{match}{hint}")
        return
    if out.is_terminal:
        _print_jobs_table(chosen, f"jobs ({_t(backend)}, store {_t(where)}), newest first")
    else:  # piped: whole values, one line per job, for grep and awk
        headers = ["job id", "kind", "state", "submitted", "steps", "error"]
        rows = [
            [
                st.job_id,
                st.kind,
                st.state,
                _submitted(st).replace("T", " "),
                _steps_text(st.steps),
                st.error or "",
            ]
            for st in chosen
        ]
        _print_table(TextTable(f"jobs ({backend}, store {where}), newest first", headers, rows))
    if len(chosen) == limit and len(statuses) > limit:
        err.print(f"[dim]the newest {limit}; --limit N shows more[/]")


def _print_jobs_table(chosen: list[Any], title: str) -> None:
    """The jobs at a terminal: id, kind, state and age whole; the steps summed up; the error folds."""
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("job id", no_wrap=True, min_width=max(len(st.job_id) for st in chosen))
    for h in ("kind", "state", "age", "progress"):
        table.add_column(h, no_wrap=True)
    table.add_column("error", overflow="fold", ratio=1)
    now = time.time()
    for st in chosen:
        state = f"[{_state_style(st.state)}]{_t(st.state)}[/]"
        age = _age(_submitted(st), now)
        table.add_row(_t(st.job_id), _t(st.kind), state, age, _t(_steps_summary(st)), _t(st.error or ""))
    out.print(table)


def _print_ids(done: str, job_ids: list[str], as_json: bool) -> None:
    """What a verb did to which jobs: ``{done: [ids]}`` as JSON, or a count and one id per line."""
    if as_json:
        _print_json({done: job_ids})
    else:
        out.print(f"{done} {len(job_ids)} job(s)" + "".join(f"\n  {_t(j)}" for j in job_ids))


def _where(client: Any) -> str:
    """The store a client uses, as a user would type it: a local folder's path, else its URI."""
    root = client.store_root
    return root[len("file://") :] if root.startswith("file://") else root


def _age(submitted: str, now: float) -> str:
    """How long ago an ISO UTC time was, in its largest unit ("45s", "12m", "3h", "5d"); "" if unknown."""
    import datetime as _dt

    try:
        then = _dt.datetime.fromisoformat(submitted).replace(tzinfo=_dt.UTC).timestamp()
    except ValueError:
        return ""
    secs = max(0.0, now - then)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if secs >= size:
            return f"{int(secs // size)}{unit}"
    return f"{int(secs)}s"


def _steps_summary(status: Any) -> str:
    """A job's progress in a few words: the step under way and its count ("infer 3/8"), else how many
    steps ran ("5 steps")."""
    counts = _step_counts(status.steps)
    open_ = [(n, d, t) for n, d, t in counts if t is None or d < t]
    if status.state == "RUNNING" and open_:
        return _step_text(*open_[0])
    return f"{len(counts)} step{'s' if len(counts) != 1 else ''}" if counts else ""


def _submitted(status: Any) -> str:
    from shardfold.functions.jobs import submitted_at

    return submitted_at(status.job_id) or status.started_at or ""


@cli.command()
@click.argument("job_id", shell_complete=_complete_job_ids)
@backend_option
@click.option("--json", "as_json", is_flag=True, help="print the raw result.json")
def result(job_id: str, backend: str, stack: str | None, as_json: bool) -> None:
    """Print a finished job's result."""
    with _client(backend, stack) as client:
        res = client.job(job_id).result()
    if as_json:
        _print_json(res)
    else:
        _print_result(res)
        if backend == "moto":
            err.print(MOTO_NOTE)


@cli.command()
@click.argument("job_id", shell_complete=_complete_job_ids)
@backend_option
@click.option("--step", help="only this step's tasks (a workflow step name, as `shardfold report` lists)")
@click.option("--task", type=int, help="only this Map item's task")
@click.option("--follow", "-f", is_flag=True, help="keep printing new lines until the job ends")
@click.option(
    "--json", "as_json", is_flag=True, help="one JSON object per line: step, task, attempt and the line"
)
def logs(
    job_id: str,
    backend: str,
    stack: str | None,
    step: str | None,
    task: int | None,
    follow: bool,
    as_json: bool,
) -> None:
    """Print the log lines of a job's tasks: each line after its step, task and attempt."""
    with _client(backend, stack) as client:
        job = client.job(job_id)
        printed: dict[tuple[str, Any, Any], int] = {}  # lines already printed per attempt
        while True:
            shown: dict[tuple[str, Any, Any], int] = {}
            finished = job.status().finished  # read before the lines, so the last pass sees every line
            for record, line in job.logs(step=step, task=task):
                key = (record["step"], record.get("task"), record.get("attempt"))
                shown[key] = shown.get(key, 0) + 1
                if shown[key] <= printed.get(key, 0):
                    continue
                if as_json:
                    doc = {**dict(zip(("step", "task", "attempt"), key, strict=True)), "line": line}
                    out.print(json.dumps(doc), soft_wrap=True, highlight=False, markup=False)
                    continue
                item = "-" if record.get("task") is None else record["task"]
                where = f"{record['step']}[{item}]#{record.get('attempt')}"
                out.print(f"[dim]{_t(where)}[/] {_t(_visible(line))}", soft_wrap=True, highlight=False)
            printed = shown
            if not follow or finished:
                return
            time.sleep(LOGS_POLL_S)


@cli.command()
@click.argument("job_id", shell_complete=_complete_job_ids)
@backend_option
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
@click.option(
    "--html",
    "html",
    type=click.Path(dir_okay=False),
    help="write a self-contained HTML report to this file and print one line (with --json, the JSON too)",
)
def report(job_id: str, backend: str, stack: str | None, as_json: bool, html: str | None) -> None:
    """What a job did against its plan: per step tasks, memory, requests, time and cost; SLA,
    responsiveness, scaling and the estimator's reasons."""
    with _client(backend, stack) as client:
        doc = client.job(job_id).report()
    if html:
        from shardfold.client.report_html import render

        Path(html).write_text(render(doc))
    if as_json:
        _print_json(doc)
    elif html:
        out.print(f"wrote the HTML report of {_t(doc['job_id'])} to {_t(html)}")
    else:
        _print_report(doc)


def _print_report(doc: dict[str, Any]) -> None:
    """``shardfold report``: the summary, the plan, actual and cost tables, then the notes and reasons."""
    summary = _report_summary(doc)
    _print_kv(f"report: {doc['kind']}", summary)
    for table in report_tables(doc):
        _print_table(table)
    worst = [
        f"{s['name']}: peak {s['actual']['peak_mb']:.0f} MiB"
        + ("" if s["actual"]["worst_task"] is None else f" in task {s['actual']['worst_task']}")
        + (" (process shared with other tasks)" if "shared" in s["actual"]["memory_scope"] else "")
        for s in doc["steps"]
        if s["actual"]["peak_mb"] is not None
    ]
    withheld = [s["name"] for s in doc["steps"] if s["actual"]["withheld"]]
    for line in worst + [f"figures withheld (private data): {', '.join(withheld)}"] * bool(withheld):
        out.print(f"[dim]- {_t(line)}[/]")
    for reason in doc["interpretability"]:
        out.print(f"[dim]- {_t(reason)}[/]")


def _report_summary(doc: dict[str, Any]) -> dict[str, str]:
    """The report's labelled values: job, state, tasks, cost, then its SLA, responsiveness and scaling."""
    summary = {
        "job": doc["job_id"],
        "state": doc["state"],
        "tasks": f"{doc['tasks']:,} ({doc['attempts']:,} attempts)",
        "cost": f"${doc['cost']['actual']['total']:.6f} actual, "
        f"${doc['cost']['plan'].get('total', 0.0):.6f} planned",
    }
    if doc.get("error"):
        summary["error"] = doc["error"]
    sla = doc["sla"]
    if sla["elapsed_s"] is not None:
        met = "" if sla["met"] is None else (" (deadline met)" if sla["met"] else " (deadline MISSED)")
        deadline = f" of {sla['deadline_s']:g} s" if sla["deadline_s"] else ""
        summary["elapsed"] = f"{sla['elapsed_s']:.2f} s{deadline}{met}"
    r = doc["responsiveness"]
    if r["first_task_s"] is not None:
        first = "-" if r["first_result_s"] is None else f"{r['first_result_s']:.2f} s"
        summary["responsiveness"] = (
            f"first task ran after {r['first_task_s']:.2f} s, first result after {first}"
        )
    sc = doc["scaling"]
    summary["scaling"] = (
        f"at most {sc['peak_running']} tasks at once; the count changed direction {sc['reversals']} times"
    )
    for name, st in (sc.get("steps") or {}).items():
        if st["peak"]:
            summary[f"  {name}"] = (
                f"{st['peak']} of {st['allowed']} allowed at most; {st['task_s']:.2f} task-s of idle slots "
                f"while work waited (mean {st['mean']:.2f} below the allowance)"
            )
    return summary


@cli.command()
@click.argument("job_id", shell_complete=_complete_job_ids)
@backend_option
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
def cancel(job_id: str, backend: str, stack: str | None, as_json: bool) -> None:
    """Stop a running job; what it already committed stays readable."""
    with _client(backend, stack) as client:
        job = client.job(job_id)
        job.cancel()
        if as_json:
            _print_json({"job_id": job.job_id, "state": job.status().state})
            return
    out.print(f"cancelled [bold]{_t(job.job_id)}[/]")


@cli.command()
@click.argument("job_ids", nargs=-1, required=True, metavar="JOB_ID...", shell_complete=_complete_job_ids)
@backend_option
@click.option("--yes", "-y", is_flag=True, help="do not ask before deleting")
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
def delete(job_ids: tuple[str, ...], backend: str, stack: str | None, yes: bool, as_json: bool) -> None:
    """Delete ended jobs: each one's whole folder (spec, status, result, outputs inside it). An output the
    spec placed elsewhere and a dpquery job's budget-ledger entry stay. `clean` frees scratch only."""
    with _client(backend, stack) as client:
        chosen = [client.job(j).job_id for j in job_ids]  # every id resolved before anything is deleted
        if not yes:
            if not sys.stdin.isatty():
                raise click.UsageError("deleting needs --yes when the input is not a terminal")
            click.confirm(f"delete {len(chosen)} job(s): {', '.join(chosen)}?", abort=True, err=True)
        deleted = [client.delete(j) for j in chosen]
    _print_ids("deleted", deleted, as_json)


@cli.command()
@click.argument("job_id", shell_complete=_complete_job_ids)
@backend_option
@click.option("--no-wait", is_flag=True, help="return once the job is restarted")
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP + "; the result once it succeeds")
def resume(job_id: str, backend: str, stack: str | None, no_wait: bool, as_json: bool) -> None:
    """Re-run the unfinished tasks of a failed or cancelled job."""
    with _client(backend, stack) as client:
        job = client.job(job_id).resume()
        if as_json:
            _print_json({"job_id": job.job_id, "state": "RUNNING"} if no_wait else _result_quietly(job))
            return
        out.print(f"resumed [bold]{_t(job.job_id)}[/]")
        if not no_wait:
            _wait_and_report(job)


@cli.command()
@backend_option
@click.option(
    "--older-than",
    "older_than",
    type=click.FloatRange(min=0, max=36500),
    default=0.0,
    help="only jobs ended at least DAYS ago (0 to 36500)",
)
@click.option("--failed", is_flag=True, help="FAILED and CANCELLED jobs too (they can no longer be resumed)")
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
def clean(backend: str, stack: str | None, older_than: float, failed: bool, as_json: bool) -> None:
    """Remove ended jobs' scratch objects and journals; specs, status, results and outputs stay."""
    if older_than != older_than:  # nan passes FloatRange's comparisons
        raise click.BadParameter("must be a number of days, not nan", param_hint="'--older-than'")
    with _client(backend, stack) as client:
        cleaned = client.clean(older_than * 86400, failed=failed)
    _print_ids("cleaned", cleaned, as_json)


@cli.command()
@click.argument("kind", shell_complete=_complete_kinds)
@click.option("--region", default="us-east-1", show_default=True, help="region in the placeholder ARNs")
@click.option("--account", default="123456789012", show_default=True, help="account in the placeholder ARNs")
@click.option("--stage", default="dev", show_default=True, help="stage suffix of the function names")
def asl(kind: str, region: str, account: str, stage: str) -> None:
    """Print the Amazon States Language of KIND's workflow (JSONPath, validated)."""
    from shardfold.client.backends import compile_asl

    _print_json(compile_asl(kind, region=region, account=account, stage=stage))


def stack_name_option(f: Any) -> Any:
    return click.option(
        "--stack",
        "stack_name",
        metavar="NAME",
        default=None,
        help="Pulumi stack name, also the name its outputs are saved under ($SHARDFOLD_STACK; default dev)",
    )(f)


def _deploy_stack_name(stack_name: str | None) -> str:
    from shardfold.client import stack as st

    if os.environ.get("SHARDFOLD_PULUMI_STACK"):
        raise st.DeployError(
            "SHARDFOLD_PULUMI_STACK is no longer read: the stack name is --stack NAME or $SHARDFOLD_STACK in "
            "every verb; unset SHARDFOLD_PULUMI_STACK (set SHARDFOLD_STACK to its value instead)"
        )
    return st.stack_name(stack_name)


@cli.command("deploy")
@stack_name_option
@click.option("--yes", "-y", is_flag=True, help="apply without Pulumi's preview and prompt")
def deploy_cmd(stack_name: str | None, yes: bool) -> None:
    """Deploy or update Shardfold on AWS (`pulumi up` on infra/) and save the stack outputs under its name.

    Needs the Pulumi CLI (logged in) and AWS credentials; `--backend aws --stack NAME` then uses the saved
    outputs (in ~/.config/shardfold/stacks/NAME.json; `shardfold stack list` shows them).
    """
    from shardfold.client import stack as st

    name = _deploy_stack_name(stack_name)
    ident = st.check_deploy_prerequisites()
    account = f"{_t(ident['Account'])} ({_t(ident['Arn'])})"
    out.print(f"deploying stack [bold]{_t(name)}[/] to AWS account {account}")
    path = st.deploy(name, yes=yes)
    saved = st.load_stack_outputs(name)
    workflows = ", ".join(sorted(saved["state_machine_arns"]))
    out.print(
        f"[green]deployed[/] stack {_t(name)}: bucket {_t(saved['bucket'])}, "
        f"{len(saved['state_machine_arns'])} workflows ({_t(workflows)})"
    )
    how = "--backend aws" + ("" if name == st.DEFAULT_STACK else f" --stack {name}")
    out.print(
        f"stack outputs saved to {_t(path)}; run jobs with `shardfold run SPEC {_t(how)}`", soft_wrap=True
    )


@cli.command("destroy")
@stack_name_option
@click.option("--yes", "-y", is_flag=True, help="do not ask for confirmation")
def destroy_cmd(stack_name: str | None, yes: bool) -> None:
    """Tear down the Shardfold stack (`pulumi destroy`) and delete its saved outputs.

    A bucket that still holds objects is deleted only with `shardfold:forceDestroy` set; otherwise Pulumi
    stops at it: empty it (or set the key and `shardfold deploy` again) and re-run.
    """
    from shardfold.client import stack as st

    name = _deploy_stack_name(stack_name)
    ident = st.check_deploy_prerequisites()
    if not yes:
        click.confirm(
            f"Destroy every resource of Shardfold stack '{name}' in AWS account {ident['Account']}?",
            abort=True,
            err=True,
        )
    removed = st.destroy(name)
    out.print(f"[green]destroyed[/] stack {_t(name)}" + (f"; removed {_t(removed)}" if removed else ""))


@cli.group("stack")
def stack_group() -> None:
    """The saved outputs of deployed stacks, one per stack name ($SHARDFOLD_STACKS_DIR or
    ~/.config/shardfold/stacks)."""


@stack_group.command("list")
def stack_list() -> None:
    """The stacks with saved outputs: name, bucket, region and file."""
    from shardfold.client import stack as st

    names = st.known_stacks()
    if not names:
        where = _t(st.stacks_dir())
        hint = "deploy one with `shardfold deploy --stack NAME`"
        out.print(f"no stacks saved in {where}; {hint}", soft_wrap=True)
        return
    table = Table(box=box.SIMPLE_HEAD)
    for col in ("stack", "bucket", "region", "outputs"):
        table.add_column(col, overflow="fold")
    for name in names:
        path = st.outputs_path(name)
        try:
            saved = json.loads(path.read_text())
            bucket, region = str(saved.get("bucket", "-")), str(saved.get("region", "-"))
        except (OSError, ValueError, AttributeError):
            bucket, region = "(unreadable)", "-"
        table.add_row(_t(name), _t(bucket), _t(region), _t(path))
    out.print(table)


@stack_group.command("show")
@click.argument("name", required=False)
def stack_show(name: str | None) -> None:
    """Print the saved outputs of stack NAME ($SHARDFOLD_STACK; default dev) as JSON."""
    from shardfold.client import stack as st

    _print_json(st.load_stack_outputs(st.stack_name(name)))


@stack_group.command("import")
@click.argument("name")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
def stack_import(name: str, file: str) -> None:
    """Save the outputs JSON FILE (`pulumi stack output --json`, or an old ./.shardfold/stack.json) as stack
    NAME's, for `--stack NAME`."""
    from shardfold.client import stack as st

    path = st.import_stack_outputs(name, file)
    out.print(f"[green]imported[/] {_t(file)} as stack {_t(name)} ({_t(path)})", soft_wrap=True)


def _find_event(event: str) -> Path:
    candidates = [Path(event)]
    for base in (Path("events"), SAMPLE_EVENTS):
        candidates += [base / event, base / f"{event}.json"]
    if event.startswith("events/"):  # the README's spelling, run where there is no events/ folder
        candidates += [SAMPLE_EVENTS / event.removeprefix("events/")]
    for path in candidates:
        if path.is_file():
            return path
    samples = sorted(p.stem for p in SAMPLE_EVENTS.glob("*.json"))
    raise ShardfoldError(
        f"no event file {event!r} (looked in ., events/ and the samples: {', '.join(samples)})"
    )


def _resolve_handler(name: str) -> str:
    """The ``module:function`` path of a registered name, an extra handler, or a path given as such."""
    from shardfold.client.backends import handler_target
    from shardfold.orchestrator.registry import import_handler

    target = EXTRA_HANDLERS.get(name) or (name if ":" in name else handler_target(name))
    try:
        import_handler(target)  # a name that cannot load is the user's error, not the handler's
    except ShardfoldError as exc:
        raise ShardfoldError(f"handler {name!r} -> {target!r} cannot be loaded: {exc}") from exc
    return target


def _stage_event(payload: Any, path: Path) -> Any:
    """Make a sample task event runnable here, as ``sam local invoke`` would.

    A ``spec_uri`` of ``./file.json`` (relative to the event file) is validated and written to the job's
    ``jobs/<id>/spec.json`` in the local store, as the SDK does on submit; a missing ``store_root`` is the
    local store root. Other events pass unchanged.
    """
    if not isinstance(payload, dict) or "job_id" not in payload:
        return payload
    from shardfold.functions.jobs import spec_key
    from shardfold.functions.store.uri import join as uri_join
    from shardfold.functions.store.uri import store_root as local_root

    root = payload.setdefault("store_root", local_root())
    spec_uri = payload.get("spec_uri")
    if isinstance(spec_uri, str) and spec_uri.startswith(("./", "../")):
        from shardfold.client.sdk import validate_spec
        from shardfold.functions import store

        spec = validate_spec(path.parent / spec_uri)
        payload["spec_uri"] = uri_join(root, spec_key(payload["job_id"]))
        store.put_json(payload["spec_uri"], spec.model_dump(mode="json", exclude_none=True))
    return payload


def _dispatch_here(event: dict[str, Any]) -> None:
    """The bucket trigger on an "Object Created" event, run against the local store: the event's key is read
    under the local store root (its bucket is AWS's, which this machine need not reach), the job starts on
    the local executor through the trigger's own dispatch, and the command follows it to its end."""
    from shardfold.functions import store
    from shardfold.functions.store.uri import join as uri_join
    from shardfold.functions.store.uri import split_s3
    from shardfold.functions.trigger import delivery_from_event, dispatch, ignore_reason, spec_uri_from_event

    bucket, key = split_s3(spec_uri_from_event(event))
    with _client("local") as client:
        spec_uri = uri_join(client.store_root, key)
        if ignore_reason(spec_uri, client.store_root) is None:
            if not store.exists(spec_uri):
                raise ShardfoldError(
                    f"the event names s3://{bucket}/{key}, which is read here under the local store root, "
                    f"and there is no {spec_uri}: put a job spec there and invoke again (or drop specs into "
                    "a folder that `shardfold watch` follows)"
                )
            err.print(f"[dim]s3://{_t(bucket)}/{_t(key)} read here as {_t(spec_uri)}[/]", soft_wrap=True)

        report = dispatch(
            spec_uri,
            client.start,
            root=client.store_root,
            grants=client.grants,
            runs_here=client.runs_here,
            delivery=delivery_from_event(event),
        )
        _print_json(report)
        if "job_id" in report:
            final = client.job(report["job_id"]).wait(progress=False)
            ended = {"state": final.state} | ({"error": final.error} if final.error else {})
            _print_kv(f"job {report['job_id']}", ended)
            if final.state != "SUCCEEDED":
                sys.exit(1)
        elif "errors" in report:
            sys.exit(1)


@cli.command()
@click.argument("kind", shell_complete=_complete_kinds)
def schema(kind: str) -> None:
    """Print the JSON Schema of KIND's spec (for an editor's completion and checks of spec files)."""
    from shardfold.functions import kinds

    _print_json(kinds.find(kind).spec.model_json_schema())


@cli.command()
@click.argument("handler")
@click.argument("event")
def invoke(handler: str, event: str) -> None:
    """Run one handler (a registered name like getbatch.prepare, or dispatch) on EVENT, a JSON file.

    EVENT may name a file under events/ without its extension (getbatch_prepare, then getbatch_gather, step
    through a job's first two steps by hand). The handler runs as the executors run it: JSON in and
    out, the 256 KiB state limit, a Lambda context. Prints its JSON result, or a Lambda-style error object
    (exit 1).
    """
    from shardfold.orchestrator.invoke import HandlerFailed, call

    target = _resolve_handler(handler)
    path = _find_event(event)
    try:
        payload = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ShardfoldError(f"event {path} is not JSON: {exc}") from exc
    if target == EXTRA_HANDLERS["dispatch"] and payload.get("detail-type") == "Object Created":
        _dispatch_here(payload)
        return
    payload = _stage_event(payload, path)
    try:
        res = call(target, payload, function_name=handler)  # the executors' path to a handler
    except HandlerFailed as failure:  # reported as Lambda does; a user error's message says it all
        payload = failure.payload()
        if failure.user_error:
            del payload["stackTrace"]
        _print_json(payload)
        sys.exit(1)
    _print_json(res)


def _watch_status_update(report_path: Path, job: Any) -> bool:
    """Refresh a dispatched spec's status report with the job's current state; True once it ended."""
    st = job.status()
    data = json.loads(report_path.read_text())
    data["state"] = st.state
    if st.error:
        data["error"] = st.error
    from shardfold.functions import store

    store.put_json(report_path.resolve().as_uri(), data)
    return st.state in ("SUCCEEDED", "FAILED", "CANCELLED")


@cli.command()
@click.argument("directory", type=click.Path(file_okay=False))
@backend_option
@click.option("--once", is_flag=True, help="dispatch the specs there now, wait for their jobs, and exit")
@click.option("--interval", type=float, default=1.0, show_default=True, help="seconds between polls")
def watch(directory: str, backend: str, stack: str | None, once: bool, interval: float) -> None:
    """Local twin of the bucket trigger: start a job for each new *.json spec dropped in DIRECTORY.

    Writes <name>.status.json (job id, state) or <name>.error.json (every validation error) beside each spec.
    """
    from shardfold.functions.trigger import REPORT_SUFFIXES, dispatch, report_uris

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    seen: dict[Path, tuple[int, int]] = {}
    running: dict[Path, Any] = {}  # status report path -> Job, refreshed until the job ends
    with _client(backend, stack) as client:
        if not once:
            out.print(f"watching {_t(root.resolve())} for job specs (Ctrl-C to stop)")
        try:
            while True:
                for path in sorted(root.glob("*.json")):
                    if path.name.endswith(REPORT_SUFFIXES):
                        continue
                    stamp = (path.stat().st_mtime_ns, path.stat().st_size)
                    if seen.get(path) == stamp:
                        continue
                    seen[path] = stamp
                    name = _t(path.name)
                    try:
                        report = dispatch(
                            path.resolve().as_uri(),
                            client.start,
                            root=client.store_root,
                            deployed=client.deployed,
                            grants=client.grants,
                            runs_here=client.runs_here,
                            delivery=f"{stamp[0]}:{stamp[1]}",  # this save of the file
                        )
                    except ShardfoldError as exc:  # e.g. the store did not answer: report, keep watching
                        err.print(f"[red]✗[/] {name}: {_t(exc)} (save it again to retry)", soft_wrap=True)
                        continue
                    if "ignored" in report:
                        err.print(f"[dim]- {name}: ignored ({_t(report['ignored'])})[/]")
                        continue
                    if "errors" in report:
                        err.print(f"[red]✗[/] {name}: {len(report['errors'])} error(s)")
                        for e in report["errors"]:
                            err.print(f"    {_t(e['field'])}: {_t(e['error'])}", soft_wrap=True)
                        continue
                    out.print(
                        f"[green]→[/] {name}: job [bold]{_t(report['job_id'])}[/] ({_t(report['kind'])})"
                    )
                    status_path = Path(report_uris(str(path.resolve()))[0])
                    running[status_path] = client.job(report["job_id"])
                for status_path, job in list(running.items()):
                    if once:
                        job.wait(progress=False)
                    if _watch_status_update(status_path, job):
                        state = job.status().state
                        out.print(f"  {_t(job.job_id)} [{_state_style(state)}]{_t(state)}[/]")
                        del running[status_path]
                if once:
                    return
                time.sleep(interval)
        except KeyboardInterrupt:
            for job_id in client.interrupt("shardfold watch stopped"):
                err.print(
                    f"job [bold]{_t(job_id)}[/] INTERRUPTED; resume with: shardfold resume {_t(job_id)}"
                )
            out.print("stopped")


@cli.command()
@click.option(
    "--items",
    "n_items",
    type=click.IntRange(min=8),
    default=300,
    show_default=True,
    help="objects in the getbatch demo's request",
)
@click.option("--kind", "kinds", multiple=True, help="only these kinds (default: all)")
@click.option("--progress/--no-progress", default=True, help="draw progress bars")
def demo(n_items: int, kinds: tuple[str, ...], progress: bool) -> None:
    """Run every job kind end to end on generated data (local backend) and verify the outputs."""
    from shardfold.client.demo import DEMOS

    selected = kinds or tuple(DEMOS)
    unknown = [k for k in selected if k not in DEMOS]
    if unknown:
        raise ShardfoldError(f"no demo for {unknown}; available: {sorted(DEMOS)}")
    rows, skipped, failed = [], {}, {}
    wait = methodcaller("wait", progress=progress, console=err)  # each demo's job, with bars on stderr
    with _client("local") as client:
        for kind in selected:
            out.print(f"[bold]{_t(kind)}[/]: generating its inputs and running the job")
            try:
                rows.append(DEMOS[kind](client, items=n_items, wait=wait))
            except MissingExtra as exc:  # not installed here: the others still run
                skipped[kind] = str(exc)
            except ShardfoldError as exc:  # failed: said below, after what the others did
                failed[kind] = str(exc)
    # collapsed padding keeps the table within 80 columns, the width rich assumes when output is piped
    table = Table(
        title="shardfold demo (local backend)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        collapse_padding=True,
        pad_edge=False,
    )
    for col in ("kind", "state", "inputs", "tasks", "bytes", "err", "s", "ok"):
        table.add_column(col, justify="left" if col in ("kind", "state", "ok") else "right", no_wrap=True)
    for r in rows:
        table.add_row(
            _t(r.kind),
            f"[{_state_style(r.state)}]{_t(r.state)}[/]",
            _t(f"{r.items:,} {r.items_label}"),
            _t(f"{r.parts} {r.parts_label}"),
            size_text(r.bytes),
            str(r.errors),
            f"{r.seconds:.2f}",
            "[green]yes[/]" if r.verified else "[red]no[/]",
        )
    out.print(table)
    for r in rows:
        for check in r.checks:
            out.print(f"[green]✓[/] {_t(r.kind)}: {_t(check)}")
        out.print(f"  {_t(r.kind)} job {_t(r.job_id)}: `shardfold result {_t(r.job_id)}`", soft_wrap=True)
    for kind, why in skipped.items():
        out.print(f"[yellow]-[/] {_t(kind)}: skipped: {_t(why)}", soft_wrap=True)
    for kind, why in failed.items():
        out.print(f"[red]✗[/] {_t(kind)}: {_t(why)}", soft_wrap=True)
    if failed:
        sys.exit(1)


def main() -> None:
    """Console-script entry point (``shardfold``)."""
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, _on_signal)
    # Interrupted, the CLI kills its process pool and leaves with os._exit: the pool's semaphores are then
    # unlinked by multiprocessing's resource tracker (a child started with this interpreter's -W options),
    # which also warns of them as "leaked". They are not: say nothing of them to the user.
    sys.warnoptions.append("ignore:resource_tracker:UserWarning")
    try:
        cli(prog_name="shardfold")
    except SystemExit as exc:
        if not _STOPPED_BY:
            raise
        # interrupted: the jobs are recorded and their workers killed; a handler thread still blocked in
        # a task would hold up the interpreter's exit, so leave now
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exc.code if isinstance(exc.code, int) else 1)


if __name__ == "__main__":
    main()
