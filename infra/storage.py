"""The job bucket: encrypted, private, TLS-only, with lifecycle rules and EventBridge notifications.

Lifecycle (S3 filters match a key prefix or object tags, never a pattern like ``jobs/*/fragments/``):

* ``tmp/`` objects expire after ``tempExpirationDays`` (7): the place for scratch data with no value once
  its job is over. The built-in kinds keep their scratch objects (getbatch ``fragments/``, fedavg ``parts/``)
  under ``jobs/<id>/`` and delete them when the job's last step succeeds; a failed job keeps them on purpose,
  because ``resume`` reuses them. They are not expired by a rule, since a rule on ``jobs/`` would also take
  the results.
* Incomplete multipart uploads (an assemble or a large put that died) are aborted after
  ``abortIncompleteUploadDays`` (2): their parts are billed but invisible, and no resume uses them (a
  resumed step starts a new upload).
* ``jobsExpirationDays`` (default 0: off) expires everything under ``jobs/``: specs, reports, statuses,
  results and leftovers of failed jobs. Opt in when results are copied elsewhere or are disposable.

S3 delivers every bucket event to EventBridge (``BucketNotification(eventbridge=True)``); the trigger's rule
(``infra.trigger``) picks the job specs.
"""

from __future__ import annotations

import pulumi
import pulumi_aws as aws

from shardfold.infra.context import Component, Context
from shardfold.orchestrator import iam

TEMP_PREFIX = "tmp/"
JOBS_PREFIX = "jobs/"


def deny_insecure_transport(bucket_arn: str) -> dict:
    """The bucket policy: deny all S3 actions over plain HTTP.

    A Deny of every action is the documented way to enforce TLS (AWS's ``s3-bucket-ssl-requests-only``
    rule); ``iam.check_policy`` accepts ``s3:*`` only in a Deny, which grants nothing.
    """
    return {
        "Version": iam.VERSION,
        "Statement": [
            {
                "Sid": "DenyInsecureTransport",
                "Effect": "Deny",
                "Principal": "*",
                "Action": "s3:*",
                "Resource": [bucket_arn, f"{bucket_arn}/*"],
                "Condition": {"Bool": {"aws:SecureTransport": "false"}},
            }
        ],
    }


def lifecycle_rules(
    temp_days: int, abort_days: int, jobs_days: int
) -> list[aws.s3.BucketLifecycleConfigurationRuleArgs]:
    rules = [
        aws.s3.BucketLifecycleConfigurationRuleArgs(
            id="expire-tmp",
            status="Enabled",
            filter=aws.s3.BucketLifecycleConfigurationRuleFilterArgs(prefix=TEMP_PREFIX),
            expiration=aws.s3.BucketLifecycleConfigurationRuleExpirationArgs(days=temp_days),
        ),
        aws.s3.BucketLifecycleConfigurationRuleArgs(
            id="abort-incomplete-multipart-uploads",
            status="Enabled",
            filter=aws.s3.BucketLifecycleConfigurationRuleFilterArgs(prefix=""),
            abort_incomplete_multipart_upload=aws.s3.BucketLifecycleConfigurationRuleAbortIncompleteMultipartUploadArgs(
                days_after_initiation=abort_days
            ),
        ),
    ]
    if jobs_days:
        rules.append(
            aws.s3.BucketLifecycleConfigurationRuleArgs(
                id="expire-jobs",
                status="Enabled",
                filter=aws.s3.BucketLifecycleConfigurationRuleFilterArgs(prefix=JOBS_PREFIX),
                expiration=aws.s3.BucketLifecycleConfigurationRuleExpirationArgs(days=jobs_days),
            )
        )
    return rules


class Storage(Component):
    """The bucket and its settings. ``bucket_name``/``bucket_arn`` are Outputs."""

    def __init__(self, ctx: Context):
        super().__init__("Storage", f"{ctx.cfg.name_prefix}-storage", ctx)
        cfg = ctx.cfg
        bucket_args = {"force_destroy": cfg.force_destroy}
        if cfg.bucket_name:
            bucket_args["bucket"] = cfg.bucket_name
        # Physical name: bucketName, else the resource name plus a random suffix (bucket names are global).
        self.bucket = aws.s3.Bucket(f"{cfg.name_prefix}-jobs", **bucket_args, opts=self.child())
        self.bucket_name: pulumi.Output[str] = self.bucket.bucket
        self.bucket_arn: pulumi.Output[str] = self.bucket.arn

        # ACLs off: the bucket owner owns every object, and only IAM policies grant access.
        aws.s3.BucketOwnershipControls(
            f"{cfg.name_prefix}-jobs-ownership",
            bucket=self.bucket.id,
            rule=aws.s3.BucketOwnershipControlsRuleArgs(object_ownership="BucketOwnerEnforced"),
            opts=self.child(),
        )
        self.public_access_block = aws.s3.BucketPublicAccessBlock(
            f"{cfg.name_prefix}-jobs-public-access",
            bucket=self.bucket.id,
            block_public_acls=True,
            block_public_policy=True,
            ignore_public_acls=True,
            restrict_public_buckets=True,
            opts=self.child(),
        )
        sse = aws.s3.BucketServerSideEncryptionConfigurationRuleApplyServerSideEncryptionByDefaultArgs(
            sse_algorithm=cfg.sse_algorithm,
            kms_master_key_id=cfg.kms_key_arn,
        )
        aws.s3.BucketServerSideEncryptionConfiguration(
            f"{cfg.name_prefix}-jobs-sse",
            bucket=self.bucket.id,
            rules=[
                aws.s3.BucketServerSideEncryptionConfigurationRuleArgs(
                    apply_server_side_encryption_by_default=sse,
                    # S3 Bucket Keys cut KMS requests (and their cost) by orders of magnitude.
                    bucket_key_enabled=cfg.sse_algorithm == "aws:kms",
                )
            ],
            opts=self.child(),
        )
        # After the public access block, so a policy change never races an open bucket.
        self.policy = aws.s3.BucketPolicy(
            f"{cfg.name_prefix}-jobs-policy",
            bucket=self.bucket.id,
            policy=self.bucket.arn.apply(lambda arn: _policy_json(deny_insecure_transport(arn))),
            opts=self.child(depends_on=[self.public_access_block]),
        )
        aws.s3.BucketLifecycleConfiguration(
            f"{cfg.name_prefix}-jobs-lifecycle",
            bucket=self.bucket.id,
            rules=lifecycle_rules(
                cfg.temp_expiration_days, cfg.abort_incomplete_upload_days, cfg.jobs_expiration_days
            ),
            opts=self.child(),
        )
        self.notification = aws.s3.BucketNotification(
            f"{cfg.name_prefix}-jobs-eventbridge",
            bucket=self.bucket.id,
            eventbridge=True,
            opts=self.child(),
        )
        self.register_outputs({"bucket": self.bucket_name})


def _policy_json(doc: dict) -> str:
    return iam.to_json(doc)
