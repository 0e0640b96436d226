"""The Pulumi program (``pulumi up`` in ``infra/``, or ``shardfold deploy``): read the ``shardfold:*``
config, build the stack, export its outputs (``infra.program`` lists them)."""

import sys
from pathlib import Path

# Pulumi runs this file with infra/ as the working directory; the project packages live one level up.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pulumi  # noqa: E402

from infra import config, program  # noqa: E402

stack = program.build(config.load())
for key, value in stack.outputs.items():
    pulumi.export(key, value)
