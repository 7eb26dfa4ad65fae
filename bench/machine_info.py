"""Machine description and result saving shared by the benchmarks."""

from __future__ import annotations

import contextlib
import os
import platform
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8", "amx_tile")


def machine() -> dict:
    cpu = platform.processor() or ""
    flags: list[str] = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == (platform.processor() or ""):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                # The vector units that decide a CPU's float32 and int8 speed (and, with them, its training
                # trajectory: kernels differ between them); "Intel(R) Xeon(R) Processor" alone does not say.
                flags = [f for f in line.split(":", 1)[1].split() if f in CPU_FLAGS]
    except OSError:
        pass
    mem_gib = None
    with contextlib.suppress(ValueError, OSError):
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    return {
        "cpu": cpu, "cpu_flags": flags, "cores": os.cpu_count(), "memory_gib": mem_gib,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "platform": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def save(name: str, payload: dict) -> Path:
    from rlt2t.common.io import atomic_write_json

    path = RESULTS / f"{name}.json"
    atomic_write_json(path, {"machine": machine(), **payload})
    return path
