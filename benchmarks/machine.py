"""One line describing the machine a benchmark ran on."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def describe() -> str:
    cpu = platform.machine()
    flags: set[str] = set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name") and cpu == platform.machine():
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    levels = (("amx_bf16", "AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))
    isa = next((name for flag, name in levels if flag in flags), "baseline")
    mem = ""
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        kb = int(meminfo.read_text().split()[1])
        mem = f", {kb / 2**20:.0f} GiB RAM"
    import torch

    return f"{cpu} ({isa}), {os.cpu_count()} cores{mem}, torch {torch.__version__}, {torch.get_num_threads()} threads"
