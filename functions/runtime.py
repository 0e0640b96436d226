"""What every handler shares: the logger, event validation and loading a job's spec from the store."""

from __future__ import annotations

from typing import Any, TypeVar

from aws_lambda_powertools import Logger
from aws_lambda_powertools.utilities.parser import parse
from pydantic import BaseModel, ConfigDict, ValidationError

from functions import store
from functions.errors import SpecError
from functions.specs import JobSpec, parse_spec

logger = Logger(service="shardfold")

M = TypeVar("M", bound=BaseModel)


class JobEvent(BaseModel):
    """The workflow input every task sees: the job, its spec in the store, the store root."""

    model_config = ConfigDict(extra="allow")  # a task sees the whole state, including earlier results

    job_id: str
    spec_uri: str
    store_root: str


def parse_event(event: Any, model: type[M]) -> M:
    """Validate a handler's event with Powertools' parser; a bad event names every field at fault."""
    try:
        return parse(event=event, model=model)
    except ValidationError as exc:
        fields = "; ".join(f"{'.'.join(map(str, e['loc'])) or '<event>'}: {e['msg']}" for e in exc.errors())
        raise SpecError(f"invalid {model.__name__}: {fields}") from exc
    except Exception as exc:  # Powertools wraps non-dict input in its own error type
        raise SpecError(f"invalid {model.__name__}: {exc}") from exc


def load_spec(spec_uri: str, kind: str) -> JobSpec:
    """The validated spec of a job, checked to be of the kind the handler serves."""
    spec = parse_spec(store.get(spec_uri))
    if spec.kind != kind:
        raise SpecError(f"{spec_uri} is a {spec.kind!r} spec, but this handler runs {kind!r} jobs")
    return spec
