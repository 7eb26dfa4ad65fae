"""Giving the memory of a heavy request back to the system.

On CPU, torch allocates tensors with the C library's ``malloc``. A long sampling call allocates and frees
tensors of every size at every decoding step (the KV cache grows by one position per step, the logits and
noise of each step come and go), and glibc keeps what is freed in its heaps for reuse: after a
maximum-cost request the policy server's resident memory stayed far above its level before, the tensors
themselves long gone (``bench/serve_soak.py`` measures it; its findings are in ``bench/findings/serve_load.md``).
``malloc_trim(0)`` hands the free pages of every heap back (``madvise(MADV_DONTNEED)``); it takes
milliseconds, so the batcher calls :func:`release_memory` after heavy work only, on its worker thread,
between calls (``rlt2t.services.batching``, ``release_after_cost``).

Python's own objects (the lists of a response) return to the system through ``pymalloc`` by themselves
once freed; nothing here forces a garbage collection, which could pause every thread of a busy server.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys

log = logging.getLogger("rlt2t.services.memory")


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS, Windows)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        log.info("no malloc_trim in this C library: freed heap memory stays with the process until reused")
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release_memory() -> bool:
    """Return the freed pages of the C heaps to the system; True if the C library could (glibc)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
