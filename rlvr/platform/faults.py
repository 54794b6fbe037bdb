"""Fault injection for crash tests: ``RLVR_FAULT=NAME@STEP`` SIGKILLs the process at that point;
``RLVR_FAULT=NAME@STEP:oom`` raises the out-of-memory error a GPU's allocator raises there, ``:hang`` stops there
for good (a stuck process), ``:sleepN`` pauses there N seconds (a slow one). In a job of several
learners (torchrun), ``RLVR_FAULT_RANK=R`` makes only rank R fail.

Points: ``after_generate`` (completions sampled, nothing updated), ``after_update`` (weights updated, step
not yet logged or checkpointed), ``checkpoint_file_written`` (one checkpoint file on disk, the rest not),
``diloco_delta`` (a DiLoCo learner at the end of round STEP, its delta not yet published), and in ``rlvr serve``,
``adapter_load`` (the n-th adapter load, files checked, model not yet changed). Servers
the learner restarts do not inherit the variable, so an injected fault fires once.
Without the variable this is a dictionary lookup and nothing else.
"""

from __future__ import annotations

import os
import signal


def fault_point(name: str, step: int) -> None:
    fault = os.environ.get("RLVR_FAULT")
    if fault and os.environ.get("RLVR_FAULT_RANK", os.environ.get("RANK", "0")) != os.environ.get("RANK", "0"):
        return  # a job of several learners: only rank RLVR_FAULT_RANK fails
    if fault == f"{name}@{step}":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == f"{name}@{step}:hang":  # a learner that stops answering (the others' collectives time out)
        import time

        time.sleep(1 << 30)
    if fault and fault.startswith(f"{name}@{step}:sleep"):  # a learner slower than the others
        import time

        time.sleep(float(fault.rsplit(":sleep", 1)[1]))
    if fault == f"{name}@{step}:oom":  # what a device allocator raises when it runs out
        import torch

        raise torch.OutOfMemoryError(f"injected out-of-memory at {name}@{step} (RLVR_FAULT)")
