"""The Pulumi program (``pulumi up`` in ``infra/``, or ``shardfold deploy``): read the ``shardfold:*``
config, build the stack, export its outputs (``shardfold.infra.program`` lists them). Pulumi runs it with
the virtual environment Pulumi.yaml names, where Shardfold is installed."""

import pulumi

from shardfold.infra import config, program

stack = program.build(config.load())
for key, value in stack.outputs.items():
    pulumi.export(key, value)
