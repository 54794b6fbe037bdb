"""Give freed memory back to the operating system between steps (glibc only; a no-op elsewhere).

glibc raises its mmap threshold after large blocks are freed, so later large tensors come from the heap
and their memory stays with the process once freed: a training step's activations then show up in RSS
long after the step. Pinning the threshold at 1 MiB keeps large tensors mmapped, returned on free.
Measured on SmolLM2-135M + LoRA (4 x 8 completions, 32 tokens): peak RSS 4.4 GB -> 3.5 GB, RSS between
steps 3.8 GB -> 1.5 GB, same speed.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def return_freed_memory(threshold_bytes: int = 1 << 20) -> bool:
    """Set glibc's mmap and trim thresholds (process-wide); returns whether it took effect."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mmap_set = bool(libc.mallopt(M_MMAP_THRESHOLD, threshold_bytes))
        return mmap_set and bool(libc.mallopt(M_TRIM_THRESHOLD, threshold_bytes))
    except (OSError, AttributeError):
        return False
