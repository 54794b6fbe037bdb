"""The memory allocator a run uses: mimalloc, preloaded when ``rlvr`` starts, where it is installed.

A training step allocates and frees thousands of activation tensors of a few sizes, interleaved with tensors kept
for backward. glibc's malloc serves most of them from one heap and reuses the holes they leave badly: a LoRA step's
peak holds far more than its live tensors, and glibc's remedies either cost time (mmapping every block from 512 KiB
up, ``train.heap_threshold_kb``, faults the memory in again every step) or save little (``malloc_trim`` between
phases: the holes open within the update). mimalloc (size-class pages: a freed block serves the next tensor of its
size) keeps the peak near the live tensors at glibc's step time; jemalloc was as lean but slower. Figures:
docs/experiments/performance.md, "The train step and the allocator"; BENCHMARKS.md, "rlvr vs TRL".

An allocator must be loaded before the process starts, so the ``rlvr`` command re-executes itself once with
mimalloc in ``LD_PRELOAD`` (the way PyTorch's own CPU launcher, ``torch.backends.xeon.run_cpu``, preloads jemalloc
or tcmalloc), then takes it out of the environment again so that the processes it starts (rlvr serve, vLLM, code
sandboxes) choose for themselves. ``RLVR_ALLOCATOR``: ``auto`` (the default: mimalloc where the ``cmeel-mimalloc``
wheel is installed - Linux x86-64 - and no NVIDIA GPU is visible, else the system's: a GPU run's tensors live in
CUDA's own caching allocator, so mimalloc would only change the host side under CUDA and NCCL, unmeasured),
``mimalloc`` (mimalloc wherever it is installed), ``system`` (never preload), or the path of an allocator's shared
library. Python programs that import rlvr (``GRPOTrainer``) run in a process rlvr did not start: preload it
there with ``env $(python -m rlvr.platform.allocator --env) python train.py``.

mimalloc's settings (``SETTINGS``, unless the environment sets them): freed pages are kept 10 s
(``MIMALLOC_PURGE_DELAY=10000``): a short delay (10 ms measured; mimalloc 3.4's default is 1 s) made every step
fault them in again and run slower; never purging let the resident set creep upwards. No transparent huge pages
(``MIMALLOC_ALLOW_THP=0``): mimalloc 3 asks for them on its arenas, and where the kernel compacts memory
synchronously for regions that ask (THP ``defrag`` ``madvise``, the common default) the faults after each purge
stalled sampling. Figures: docs/experiments/performance.md, "Settings nobody tuned"; BENCHMARKS.md.
"""

from __future__ import annotations

import glob
import importlib.metadata
import os
import sys
from pathlib import Path

VARIABLE = "RLVR_ALLOCATOR"
_PRELOADED = "_RLVR_PRELOADED"  # set across the re-execution only
_PREVIOUS = "_RLVR_PREVIOUS_LD_PRELOAD"
SETTINGS = {"MIMALLOC_PURGE_DELAY": "10000", "MIMALLOC_ALLOW_THP": "0"}  # mimalloc's, unless the environment sets them


def mimalloc_library() -> Path | None:
    """The shared library of the installed ``cmeel-mimalloc`` wheel, if any."""
    try:
        files = importlib.metadata.files("cmeel-mimalloc") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    found = sorted(f for f in files if f.name.startswith("libmimalloc.so"))
    return Path(found[0].locate()).resolve() if found else None


def nvidia_gpu_visible(environ: dict[str, str] | None = None) -> bool:
    """Whether this process can see an NVIDIA GPU (a device node, and CUDA_VISIBLE_DEVICES not hiding them all),
    decided without importing torch (the allocator is chosen before it loads)."""
    environ = os.environ if environ is None else environ
    if environ.get("CUDA_VISIBLE_DEVICES", "x").strip() in ("", "-1"):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def chosen_library(setting: str, platform: str = sys.platform, gpu: bool | None = None) -> Path | None:
    """The library ``RLVR_ALLOCATOR=setting`` asks for on ``platform`` (None: the system's allocator; ``gpu``: whether
    an NVIDIA GPU is visible, looked up when None); a path that is not a file is a ValueError saying what to set."""
    if setting == "system" or not platform.startswith("linux"):
        return None
    if setting in ("", "auto"):
        return None if (nvidia_gpu_visible() if gpu is None else gpu) else mimalloc_library()
    if setting == "mimalloc":
        return mimalloc_library()
    path = Path(setting)
    if not path.is_file():
        raise ValueError(f"{VARIABLE}={setting!r}: not a file; set it to auto, mimalloc, system or the path of an "
                         "allocator's shared library (e.g. /usr/lib/x86_64-linux-gnu/libjemalloc.so.2)")
    return path.resolve()


def preload_and_restart() -> None:
    """Called first by the ``rlvr`` command: re-execute this process with the chosen allocator preloaded (once);
    in the re-executed process, restore the environment its children inherit."""
    if os.environ.pop(_PRELOADED, None) is not None:
        previous = os.environ.pop(_PREVIOUS, "")
        if previous:
            os.environ["LD_PRELOAD"] = previous
        else:
            os.environ.pop("LD_PRELOAD", None)
        return
    library = chosen_library(os.environ.get(VARIABLE, "auto"))
    if library is None or str(library) in os.environ.get("LD_PRELOAD", ""):
        return
    env = {**os.environ, **preload_environment(dict(os.environ)), _PRELOADED: "1",
           _PREVIOUS: os.environ.get("LD_PRELOAD", "")}
    sys.stdout.flush(), sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def in_use() -> str:
    """The allocator this process runs on, for the run's log: the preloaded library's name, or the system's."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "the system's"
    for name in ("mimalloc", "jemalloc", "tcmalloc"):
        if f"lib{name}" in maps:
            return name
    return "the system's"


def preload_environment(environ: dict[str, str]) -> dict[str, str]:
    """What a process needs in its environment to start on the chosen allocator with rlvr's settings for it (empty:
    the system's allocator); variables ``environ`` already sets are left to it."""
    library = chosen_library(environ.get(VARIABLE, "auto"))
    if library is None:
        return {}
    preload = ":".join(filter(None, [str(library), environ.get("LD_PRELOAD", "")]))
    return {"LD_PRELOAD": preload, **{k: v for k, v in SETTINGS.items() if k not in environ}}


if __name__ == "__main__":  # env $(python -m rlvr.platform.allocator --env) python train.py
    if sys.argv[1:] == ["--env"]:
        print(" ".join(f"{k}={v}" for k, v in preload_environment(dict(os.environ)).items()))
    else:
        print(chosen_library(os.environ.get(VARIABLE, "auto")) or "")
