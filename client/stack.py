"""Stack outputs of a deployed Shardfold: bucket, region, state machine ARNs and function names.

``shardfold deploy`` saves them to ``.shardfold/stack.json`` (override: ``$SHARDFOLD_STACK``); the AWS
backend reads them from there unless they are passed in.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from client.errors import StackNotFound

REQUIRED = ("bucket", "state_machine_arns")


def stack_path() -> Path:
    """Where the stack outputs live: ``$SHARDFOLD_STACK`` or ``./.shardfold/stack.json``."""
    return Path(os.environ.get("SHARDFOLD_STACK") or Path(".shardfold") / "stack.json")


def load_stack_outputs(source: dict[str, Any] | str | os.PathLike | None = None) -> dict[str, Any]:
    """Stack outputs from a dict, a JSON file path, or the default location; checked for required keys."""
    if isinstance(source, dict):
        outputs = dict(source)
        where = "the outputs passed in"
    else:
        path = Path(source) if source is not None else stack_path()
        if not path.is_file():
            raise StackNotFound(
                f"no stack outputs at {path}: run `shardfold deploy` first, set SHARDFOLD_STACK to the saved "
                "outputs file, or pass Client(backend='aws', stack={...})"
            )
        try:
            outputs = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise StackNotFound(
                f"stack outputs at {path} are not JSON ({exc}); re-run `shardfold deploy`"
            ) from exc
        where = str(path)
    missing = [k for k in REQUIRED if not outputs.get(k)]
    if missing:
        raise StackNotFound(f"stack outputs in {where} lack {missing}; re-run `shardfold deploy`")
    return outputs
