"""Python's cyclic garbage collector, made to wait while the platform's own work allocates many small objects.

A task, a submission or a GetBatch allocates a few small objects per item (a parsed item, a read's bytes,
a status row), none of them in cycles, and each young collection re-walks them: a fifth of a 50,000-item
local batch's time, a fifth of its submission's. While any such work runs in the process, the collector's
first threshold is raised (it is process-wide, so the last one to end restores it); collection still
happens, less often.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

# new container objects before a young collection while the work runs (Python's default is 700)
THRESHOLD_WHILE_BUSY = 50_000

_lock = threading.Lock()
_users = 0
_saved: tuple[int, int, int] | None = None


@contextlib.contextmanager
def relaxed() -> Iterator[None]:
    """Raise the collector's first threshold to :data:`THRESHOLD_WHILE_BUSY` inside the block."""
    global _users, _saved
    with _lock:
        if _users == 0:
            _saved = gc.get_threshold()
            gc.set_threshold(max(THRESHOLD_WHILE_BUSY, _saved[0]), *_saved[1:])
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0 and _saved is not None:
                gc.set_threshold(*_saved)
