"""The adversarial suite's backends: one client per backend, seeded (see :mod:`probekit`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from probekit import Env, seed

from shardfold.client import Client


def pytest_collection_modifyitems(config, items):
    """A probe runs only on the backends it applies to (``Probe.backends``: a local file is the user's own
    on the local store, a refusal on S3): the other pairings are deselected, not skipped."""
    keep, drop = [], []
    here = Path(__file__).parent
    for item in items:
        if item.path.parent != here:
            keep.append(item)
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        probe, backend = params.get("probe"), params.get("env")
        (
            drop if probe is not None and backend is not None and backend not in probe.backends else keep
        ).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="module", params=["local", "moto"])
def env(request, tmp_path_factory):
    """A seeded client on each backend."""
    home = tmp_path_factory.mktemp(f"adversarial-{request.param}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SHARDFOLD_HOME", str(home / "store"))
        if request.param == "moto":
            for var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
                mp.delenv(var, raising=False)
            mp.setenv("AWS_ACCESS_KEY_ID", "testing")
            mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
            mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
            mp.setenv("SHARDFOLD_S3_TRANSPORT", "boto3")  # in-process moto answers botocore only
        with Client(backend=request.param) as client:
            e = Env(request.param, client, client.store_root, home)
            seed(e)
            yield e
