"""Shardfold: serverless batch computation on AWS Step Functions, Lambda and Batch, with a local backend
that runs the same handlers and workflows.

``from shardfold import Client`` is the public entry (``Client()`` is local; ``Client(backend="aws")``
uses the deployed stack). The repository's folders install as subpackages: ``shardfold.functions`` (what
runs in Lambda and Batch), ``shardfold.orchestrator`` (workflows to ASL, the executors),
``shardfold.client`` (SDK and CLI), ``shardfold.infra`` (the Pulumi program) and ``shardfold.events``
(sample events and specs).

Nothing is imported here but on first use: a Lambda function imports ``shardfold.functions`` alone (its
package holds neither the SDK nor the CLI), and ``shardfold --help`` does not pay for the SDK.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from shardfold.client.sdk import Client, Job

__all__ = ["Client", "Job", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("Client", "Job"):
        from shardfold.client import sdk

        return getattr(sdk, name)
    raise AttributeError(f"module 'shardfold' has no attribute {name!r}")
