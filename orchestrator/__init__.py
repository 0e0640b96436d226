"""Control: workflow plans, their compilation to Amazon States Language, and the executors.

* :mod:`orchestrator.plan` — the plan vocabulary (Task, Map, Parallel, BatchJob, Workflow, Retry).
* :mod:`orchestrator.registry` — function name -> handler, shared by every backend and by infra.
* :mod:`orchestrator.asl` — compile a workflow to ASL; validate ASL (statelint + moto's parser).
* :mod:`orchestrator.local` — LocalExecutor (in-process; the default backend).
* :mod:`orchestrator.aws` — AwsExecutor (Step Functions; also drives the moto backend).
* :mod:`orchestrator.moto_harness` — a whole stack inside moto (dev dependency).
* :mod:`orchestrator.workflows` — ``WORKFLOWS[kind]``, the built-in job kinds.

Nothing is imported here, so ``import orchestrator`` stays cheap; import the module you need.
"""
