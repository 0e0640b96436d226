"""Control: the compilation of workflows to Amazon States Language, and the executors that run them.

The workflows themselves are data in :mod:`functions` (the vocabulary in :mod:`functions.workflow`, each
kind's in ``functions/<kind>/workflow.py``, registered by :mod:`functions.kinds`), because the bucket
trigger, which ships only ``functions/``, sizes a job against its workflow before starting it.

* :mod:`orchestrator.registry` — function name -> handler, shared by every backend and by infra.
* :mod:`orchestrator.asl` — compile a workflow to ASL; validate ASL (statelint + moto's parser).
* :mod:`orchestrator.local` — LocalExecutor (in-process; the default backend).
* :mod:`orchestrator.aws` — AwsExecutor (Step Functions; and the moto backend: :mod:`shardfold.dryrun`).

Nothing is imported here, so ``import orchestrator`` stays cheap; import the module you need.
"""
