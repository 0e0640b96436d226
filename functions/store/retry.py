"""Which failures are worth retrying, and how long to wait before the next try."""

from __future__ import annotations

import random
from dataclasses import dataclass

# HTTP statuses that mean "try again later": throttling (429, S3's 503 SlowDown) and server faults.
TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})
# S3 error codes that mean the same, for clients that report a code rather than a status.
TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "TooManyRequests",
        "RequestLimitExceeded",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "InternalError",
        "ServiceUnavailable",
        "503",
        "500",
        "502",
        "504",
        "429",
    }
)


class TransientError(Exception):
    """A read failed for a reason that may go away (throttling, 5xx, a dropped connection).

    Transports raise it; the GetBatch engine retries it with backoff. It is not a user error: if it
    persists past the retry budget the item fails with :class:`functions.errors.BatchItemError`.
    """

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter (the AWS architecture blog's recommendation)."""

    max_attempts: int = 8
    base_s: float = 0.1
    cap_s: float = 10.0

    def delay(self, attempt: int) -> float:
        """Seconds to wait before attempt number ``attempt + 1`` (``attempt`` counts from 1)."""
        return random.uniform(0.0, min(self.cap_s, self.base_s * (2 ** (attempt - 1))))
