"""The getbatch workflow: prepare → Map(gather one part each) → assemble.

The prepare step writes the part list as a work list (Distributed Map's ``ItemReader`` reads it on AWS), each
gather task writes one TAR fragment, and assemble joins them server-side into one archive plus a per-item
status file. Nothing but references crosses the control plane, so a 100,000-item request stays far below
the 256 KiB state limit.
"""

from __future__ import annotations

from shardfold.functions.workflow import Map, Task, Workflow

# gather waits on the network for S3 objects (a thread locally), but keeps an interpreter busy reading local
# files: prepare marks those parts' work-list entries "process", so the local executor runs them in worker
# processes, side by side on the cores. Its memory is the engine's byte budget plus the fragment's write
# buffer, whatever the objects' sizes.
PREPARE = Task("prepare", "getbatch.prepare", memory_mb=512, timeout_s=300)
GATHER_PART = Task("gather_part", "getbatch.gather", mode_from="$.item.mode", memory_mb=1024, timeout_s=900)
GATHER = Map("gather", items="$.prepare.worklist", body=(GATHER_PART,), max_concurrency=64)
ASSEMBLE = Task("assemble", "getbatch.assemble", memory_mb=512, timeout_s=900)

WORKFLOW = Workflow(
    kind="getbatch",
    comment="GetBatch: many objects fetched into one ordered TAR",
    steps=(PREPARE, GATHER, ASSEMBLE),
)
