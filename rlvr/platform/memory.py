"""Give freed memory back to the operating system between steps (glibc only; a no-op elsewhere, and under the
mimalloc the rlvr command preloads: rlvr/platform/allocator.py).

glibc raises its mmap threshold after large blocks are freed, so later large tensors come from the heap
and their memory stays with the process once freed: a training step's activations then show up in RSS
long after the step. Pinning the threshold keeps large tensors mmapped, returned on free: peak RSS and the RSS
between steps drop, at no cost in time where page faults are cheap.

512 KiB (``train.heap_threshold_kb``) rather than 1 MiB for a lean run: the lean step splits a micro-batch into
per-group pieces, so many of its tensors are 0.25-1 MiB (per layer: the prompt's keys/values copied to every row,
mb x P x H_kv x 4 bytes; completion keys/values; prompt-pass MLP outputs). Below the threshold they come
from the heap, and the holes they leave keep freed heap resident. 512 KiB takes most of the saving; 256 KiB the
rest, at a cost in step time on small batches.

Where page faults are slow that saving costs time, since every step faults its activations in again (a VM that
maps fresh memory several times slower than it rewrites mapped memory). The default is therefore glibc's
(``train.heap_threshold_kb: 0``); 512 is the setting for a lean run. The measured peaks and step times per
threshold and machine: docs/experiments/performance.md, "The train step and the allocator"; BENCHMARKS.md,
"rlvr vs TRL".
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def return_freed_memory(threshold_bytes: int = 512 << 10) -> bool:
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

