"""A local job run in a process of its own: ``python -m client.detached JOB_ID KIND SPEC_URI``.

Started by ``Client.submit(spec, detach=True)`` (``shardfold run --no-wait`` on the local backend) in a new
session, so the job outlives the process that submitted it. It starts the job through the local executor,
as submit would have in-process, and exits when the job has ended; its output goes to
``jobs/<id>/detached.log``. ``shardfold wait ID`` (``Job.wait``) follows the job from any process.
"""

from __future__ import annotations

import sys

from shardfold.client.sdk import Client


def main(argv: list[str]) -> int:
    job_id, kind, spec_uri = argv
    with Client() as client:
        client.executor.start(job_id, kind, spec_uri)
        status = client.executor.wait(job_id)
    return 0 if status.state == "SUCCEEDED" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
