"""Give freed memory back to the operating system between steps (glibc only; a no-op elsewhere, and under the
mimalloc the rlvr command preloads: rlvr/platform/allocator.py).

glibc raises its mmap threshold after large blocks are freed, so later large tensors come from the heap
and their memory stays with the process once freed: a training step's activations then show up in RSS
long after the step. Pinning the threshold keeps large tensors mmapped, returned on free.
Measured on SmolLM2-135M + LoRA (4 x 8 completions, 32 tokens), threshold 1 MiB: peak RSS 4.4 GB -> 3.5 GB,
RSS between steps 3.8 GB -> 1.5 GB, same speed.

512 KiB (``train.heap_threshold_kb``) rather than 1 MiB for a lean run: the lean step splits a micro-batch into
per-group pieces, so many of its tensors are 0.25-1 MiB (per layer: the prompt's keys/values copied to every row,
mb x P x H_kv x 4 bytes; completion keys/values; prompt-pass MLP outputs). Below the threshold they come
from the heap, and the holes they leave keep freed heap resident. Measured, lean GRPO LoRA step, peak RSS
and step time at thresholds 1 MiB / 512 KiB / 256 KiB / 128 KiB:
- benchmarks/memory.py's batch (4 x 8 completions of 64 tokens, micro-batch 16): 3,004 / 2,732 / 2,569 /
  2,570 MB; 21-23 / 23-24 / 22-24 / 25-27 s;
- the demo's batch (8 x 8 completions of 12 tokens, micro-batch 32): 2,482-2,540 / 2,082 / 2,001-2,007 MB;
  4-5 / 5 / 6 / - s.
512 KiB takes most of the saving at no measurable cost there; 256 KiB the rest, at ~20 % on small batches.

Where page faults are slow that saving costs time, since every step faults its activations in again: on a 2-core VM
that maps fresh memory at ~2 GB/s (vs 10-20 GB/s to rewrite mapped memory), a LoRA step with checkpointing took
1.45-1.7x as long at 512 KiB as with glibc's defaults (benchmarks/vs_trl.py; peak RSS 1.6 vs 2.8 GB). The default is
therefore glibc's (``train.heap_threshold_kb: 0``); 512 is the setting for a lean run.
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

