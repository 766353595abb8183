"""The cyclic garbage collector paused over a bulk decode.

Decoding a manifest of a hundred thousand tensors creates millions of small acyclic objects
(JSON dicts and lists, entries, boxes); each allocation burst triggers collections that walk
every live object of the process: on the shared 2-core machine of ``benchmarks/results/``, the
20 MB manifest of 100,000 blocks took 5-9 s to ``json.loads`` with the collector on and 1.4 s
with it paused, the same process back to back (issue #25). Nothing decoded there forms a cycle
(reference counting frees it all), and the input is bounded (``MAX_MANIFEST_BYTES``), so pausing
costs no memory.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused() -> Iterator[None]:
    """Disable the cyclic collector for the block, and enable it again after if it was on."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
