"""The two test tiers. ``make test`` runs every test at full strength (what CI runs). ``make test-fast``, the
edit loop, sets ``SHARDFOLD_TEST_TIER=fast``: it deselects the tests marked ``slow`` and runs each property
test on at most :data:`FAST_EXAMPLES` examples (:func:`examples`, and the ``fast`` Hypothesis profile that
``conftest.py`` loads for tests that name no count)."""

from __future__ import annotations

import os

FAST = os.environ.get("SHARDFOLD_TEST_TIER") == "fast"
FAST_EXAMPLES = 10


def examples(n: int) -> int:
    """``n`` Hypothesis examples, or at most :data:`FAST_EXAMPLES` in the fast tier."""
    return min(n, FAST_EXAMPLES) if FAST else n
