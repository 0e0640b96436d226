"""Deployment: the Pulumi program (``infra/__main__.py``) and its components.

Modules: ``config`` (every ``shardfold:*`` key and default), ``storage`` (bucket), ``functions`` (Lambda),
``lambda_image`` (the container image of the functions too big for the zip, its ECR repository),
``workflows`` (Step Functions), ``gpu`` (AWS Batch, ECR, worker image), ``trigger`` (EventBridge rule,
dispatch function, dead-letter queue), ``iam`` (policy documents and the wildcard-resource allowlist),
``program`` (the whole stack and its outputs), ``sizes`` (what each function and job definition is given,
without Pulumi: the moto harness and the emulator size their stacks with it), ``package`` (the Lambda
package builder). Importing this
package imports nothing from Pulumi, so the CLI can use ``infra.package`` without it.
"""
