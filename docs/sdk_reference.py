"""Write the SDK's API reference, docs/sdk-reference.md, from the docstrings (``make docs``).

Each documented name gets its signature and its docstring as written; ``tests/test_docs.py`` fails when the
committed page differs from what this prints, so the reference cannot drift from the code.

    .venv/bin/python docs/sdk_reference.py > docs/sdk-reference.md
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# (module, names): classes list their public methods and properties. client.data needs torch and is
# documented when torch is installed (the inference extra).
SECTIONS = [
    ("shardfold.client.sdk", ["Client", "Job"]),
    ("shardfold.client.fedavg", ["FedAvg", "encode_update", "decode_update", "to_numpy", "UpdateError"]),
    (
        "shardfold.client.dpquery",
        ["DPQuery", "LabelledArray", "table_to_array", "ResidualMeasurement", "to_mbi"],
    ),
    ("shardfold.client.inference", ["Inference", "spec", "run", "load"]),
    ("shardfold.client.data", ["GetBatchDataset"]),
]


def _signature(obj: object, name: str) -> str:
    """``name(params) -> returns`` with annotations as written (the modules postpone them: strings)."""
    try:
        sig = inspect.signature(obj)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return name
    P = inspect.Parameter
    params, star_done = [], False
    for p in sig.parameters.values():
        if p.kind is P.KEYWORD_ONLY and not star_done:
            params.append("*")
        star_done = star_done or p.kind in (P.KEYWORD_ONLY, P.VAR_POSITIONAL)
        text = {P.VAR_POSITIONAL: "*", P.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        if p.annotation is not P.empty:
            text += f": {_annotation(p.annotation)}"
        if p.default is not P.empty:
            text += f" = {p.default!r}"
        params.append(text)
    out = f"{name}({', '.join(params)})"
    if sig.return_annotation is not P.empty:
        out += f" -> {_annotation(sig.return_annotation)}"
    return out


def _annotation(annotation: object) -> str:
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def _doc(obj: object) -> str:
    return inspect.getdoc(obj) or "(no docstring)"


def _members(cls: type) -> list[tuple[str, object]]:
    out = []
    for name, member in cls.__dict__.items():
        if name.startswith("_") and name != "__init__":
            continue
        if name == "__init__" and not member.__doc__:
            continue
        if isinstance(member, property | staticmethod | classmethod) or inspect.isfunction(member):
            out.append((name, member))
    return out


def render() -> str:
    lines = [
        "# Python SDK reference",
        "",
        "Generated from the docstrings by `docs/sdk_reference.py` (`make docs`); the guide is "
        "[sdk.md](sdk.md).",
        "",
    ]
    for module_name, names in SECTIONS:
        module = importlib.import_module(module_name)
        lines += [f"## `{module_name}`", "", _doc(module).split("\n\n")[0], ""]
        for name in names:
            obj = getattr(module, name)
            kind = "class" if inspect.isclass(obj) else "function"
            lines += [
                f"### `{name}`",
                "",
                "```python",
                f"{kind} {_signature(obj, name)}",
                "```",
                "",
                _doc(obj),
                "",
            ]
            if not inspect.isclass(obj) or issubclass(obj, BaseException) or hasattr(obj, "_fields"):
                continue
            for member_name, member in _members(obj):
                if isinstance(member, property):
                    target = member.fget
                    lines += [f"#### `{name}.{member_name}`", "", "*property*", "", _doc(target), ""]
                    continue
                target = member.__func__ if isinstance(member, staticmethod | classmethod) else member
                head = _signature(target, f"{name}.{member_name}")
                lines += [f"#### `{name}.{member_name}`", "", "```python", head, "```", "", _doc(target), ""]
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
