"""Machine description and result saving shared by the benchmarks."""

from __future__ import annotations

import contextlib
import os
import platform
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    with contextlib.suppress(ValueError, OSError):
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    return {
        "cpu": cpu, "cores": os.cpu_count(), "memory_gib": mem_gib, "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "platform": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def save(name: str, payload: dict) -> Path:
    from rlt2t.common.io import atomic_write_json

    path = RESULTS / f"{name}.json"
    atomic_write_json(path, {"machine": machine(), **payload})
    return path
