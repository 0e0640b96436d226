"""The user's side of Shardfold: the Python SDK (:class:`Client`, :class:`Job`) and the ``shardfold`` CLI.

``from client import Client``. torch is imported only by :mod:`client.data` (``GetBatchDataset``) and by
:mod:`client.fedavg` when it is handed a torch tensor or asked for ``framework="torch"``.
"""

from client.sdk import Client, Job

__all__ = ["Client", "Job"]
