"""Fixtures shared across the suite."""

import pytest


@pytest.fixture
def aws_env(monkeypatch):
    """Dummy credentials and no endpoint override, so boto3 talks to moto (never to a real account)."""
    for var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    # in-process moto answers botocore only: the CRT client (GetBatch's default, submit's size probe) talks
    # HTTP, so it needs a moto server (tests/test_get_batch.py's crt_bucket); here reads go through boto3
    monkeypatch.setenv("SHARDFOLD_S3_TRANSPORT", "boto3")
