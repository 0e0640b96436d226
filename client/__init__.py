"""The user's side of Shardfold: the Python SDK (:class:`Client`, :class:`Job`) and the ``shardfold`` CLI.

``from shardfold import Client`` (or ``from shardfold.client import Client``). torch is imported only by
:mod:`client.data` (``GetBatchDataset``) and by :mod:`client.fedavg` when it is handed a torch tensor or
asked for ``framework="torch"``. The SDK (and boto3 with it) is imported on first use, so ``shardfold
--help`` does not pay for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardfold.client.sdk import Client, Job

__all__ = ["Client", "Job"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from shardfold.client import sdk

        return getattr(sdk, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
