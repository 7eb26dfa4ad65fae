"""Which int8 matrix products CTranslate2 uses on this CPU: set before ``ctranslate2`` loads (it reads its
environment once).

On an x86 CPU without VNNI (AVX2 only: AMD Zen 1-3, older Xeons) CTranslate2 picks oneDNN for int8 products
on AMD, whose u8·s8 pairs saturate in 16 bits: an int8 export then scores about 0.5 nats per token off its
float32 weights (measured on a 2-core AMD EPYC with AVX2: 0.51 mean |Δ log p| per token; 0.06 with MKL, which
it uses by default on Intel). There MKL is asked for, unless ``CT2_USE_MKL`` is already set.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from pathlib import Path

log = logging.getLogger("rlt2t.ct2")

VNNI_FLAGS = ("avx512_vnni", "avx_vnni")


def cpu_flags(cpuinfo: str) -> set[str]:
    """The first ``flags`` line of /proc/cpuinfo's text (empty off x86 Linux)."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return set(value.split())
    return set()


def prefer_accurate_int8(env: MutableMapping[str, str] | None = None, cpuinfo: str | None = None) -> bool:
    """Ask CTranslate2 for MKL's int8 products on an x86 CPU without VNNI, unless ``CT2_USE_MKL`` is set;
    returns whether it did."""
    env = os.environ if env is None else env
    if "CT2_USE_MKL" in env:
        return False
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = cpu_flags(cpuinfo)
    if "avx2" not in flags or any(f in flags for f in VNNI_FLAGS):
        return False
    env["CT2_USE_MKL"] = "1"
    log.debug("CT2_USE_MKL=1: this CPU has no VNNI, and oneDNN's int8 products saturate without it")
    return True
