"""The AWS credentials requests are signed with: the process's own (environment, profile, the function's
role), unless code runs under others (:func:`using`).

On AWS nothing sets them: a Lambda function or Batch container has its role's credentials in its
environment. The moto harness runs every handler in one process, each under the session credentials of its
own function's role, so that the emulator refuses what that role would be refused on AWS. The choice is a
context variable: it holds for the block's thread and for the pool threads the store hands work to
(:func:`functions.telemetry.carried`), and never leaks into another handler running beside it.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import boto3


@dataclass(frozen=True)
class Credentials:
    access_key_id: str
    secret_access_key: str
    session_token: str | None = None

    def __repr__(self) -> str:  # never the secret in a log line or a traceback
        return f"Credentials({self.access_key_id!r})"


_current: contextvars.ContextVar[Credentials | None] = contextvars.ContextVar(
    "shardfold_aws_credentials", default=None
)
_caches: list[dict] = []  # the modules' client caches, keyed by tuples that may hold Credentials


def cache() -> dict:
    """A new client cache, whose clients signed with set credentials :func:`forget` drops."""
    made: dict = {}
    _caches.append(made)
    return made


def forget() -> None:
    """Drop every cached client signed with credentials set by :func:`using` (the moto harness, when its
    stack stops: each stack's roles have sessions of their own, and a CRT client holds threads)."""
    for found in _caches:
        for key in [k for k in list(found) if any(isinstance(x, Credentials) for x in k)]:
            found.pop(key, None)


@contextmanager
def using(credentials: Credentials | None) -> Iterator[None]:
    """Sign the block's requests with ``credentials`` (None: the process's own)."""
    token = _current.set(credentials)
    try:
        yield
    finally:
        _current.reset(token)


def current() -> Credentials | None:
    """The credentials set by :func:`using` here, or None for the process's own."""
    return _current.get()


def session() -> boto3.session.Session:
    """A boto3 session signing with the current credentials."""
    c = _current.get()
    if c is None:
        return boto3.session.Session()
    return boto3.session.Session(
        aws_access_key_id=c.access_key_id,
        aws_secret_access_key=c.secret_access_key,
        aws_session_token=c.session_token,
    )
