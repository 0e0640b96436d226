"""Writes a test makes from a hook inside a running task, as someone outside the job (another user, a racing
client): signed with the process's own credentials, not the task's role, and outside the task's reach."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from shardfold.functions import credentials, store


@contextmanager
def outside_the_task() -> Iterator[None]:
    with credentials.using(None), store.scoped(lambda uri, write, prefix: None):
        yield
