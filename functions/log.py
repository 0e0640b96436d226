"""The project's one logger (Powertools' JSON ``Logger``, service ``shardfold``).

It writes to standard error: a library never writes to a program's standard output, which belongs to the
program (``shardfold run --json`` prints the result there, and a user's script its own). Lambda and the
Batch containers send standard error to CloudWatch Logs as they do standard output.
"""

import sys

from aws_lambda_powertools import Logger


class _StandardError:
    """``sys.stderr`` as it is when a line is written (a program, or a test runner, may replace it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


logger = Logger(service="shardfold", stream=_StandardError())
