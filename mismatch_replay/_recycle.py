"""Large per-batch arrays handed out again once nothing refers to them any more.

Design
------
A replay allocates the same few large arrays for every batch of ~1M tokens: m2po's inputs
(l^2 and |dp|, which its store keeps as views until the step is resolved, a batch or two
later), each token's sequence id (kept there too), the kernel's flag words and its scatter
counts. An array of megabytes comes fresh from the operating system each time, and every one
of its pages faults and is zeroed on first touch: with the zeros of the group codes, the
kernel's page faults per 20M-token sweep went from ~33k to ~8k and the sequence ids' from
~15k to none once these arrays were reused (`perf record -e page-faults`,
benchmarks/README.md).

A `Recycler` keeps the arrays it hands out (a few per name) and hands one out again only when
nothing but the recycler refers to it. A view keeps its base array alive and counted (numpy
points every slice at the array that owns the memory), so an array that m2po's store, a
thread or a caller still holds through any view is never given out twice; the test is
CPython's reference count, which tests/test_recycle.py pins down. Nothing is shipped when a
Tally is pickled (Ray): a recycler arrives empty.
"""

from __future__ import annotations

import math
import sys

import numpy as np

# References to a pooled array while `Recycler._take` looks at it: the pool's list, the loop
# variable and getrefcount's own argument. One more means somebody still uses it.
_IDLE_REFS = 3


class Recycler:
    """Arrays by name, reused when idle; at most `keep` kept per name."""

    def __init__(self, keep: int = 8):
        self.keep = keep
        self._pools: dict[str, list[np.ndarray]] = {}
        self.reused = 0  # hand-outs served by an idle array (tests, benchmarks)

    def __getstate__(self):
        return {"keep": self.keep}

    def __setstate__(self, state):
        self.__init__(state["keep"])

    def _take(self, name: str, size: int, dtype: np.dtype) -> np.ndarray:
        pool = self._pools.setdefault(name, [])
        for a in pool:
            if a.dtype == dtype and a.size >= size and sys.getrefcount(a) == _IDLE_REFS:
                self.reused += 1
                return a[:size]
        a = np.empty(max(size, 1), dtype)
        if len(pool) < self.keep:
            pool.append(a)
        else:  # full: the new array replaces the smallest idle one, or is not kept
            for i, b in enumerate(pool):
                if sys.getrefcount(b) == _IDLE_REFS and b.size < a.size:
                    pool[i] = a
                    break
        return a[:size]

    def empty(self, name: str, shape, dtype=np.float64) -> np.ndarray:
        """An uninitialised C-contiguous array of `shape`."""
        shape = (shape,) if isinstance(shape, int | np.integer) else tuple(shape)
        return self._take(name, math.prod(shape), np.dtype(dtype)).reshape(shape)

    def zeros(self, name: str, shape, dtype=np.float64) -> np.ndarray:
        """`empty`, zero-filled (a memset of warm pages, not fresh ones)."""
        out = self.empty(name, shape, dtype)
        out.fill(0)
        return out
