"""Compute layer: everything that runs inside a Lambda function or an AWS Batch container.

Imports nothing from ``orchestrator``, ``client`` or ``infra`` and never needs torch.
"""
