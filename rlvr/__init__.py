"""rlvr: GRPO / DAPO / Dr. GRPO on verifiable rewards for Hugging Face causal LMs."""

# Importing rlvr changes nothing process-wide (no HF_HUB_OFFLINE): rlvr's own loading is offline where it loads
# (rlvr.models.policy: local directories, built-in aliases, the Hugging Face cache with local_files_only=True).

__version__ = "0.1.0"
__all__ = ["DistillationConfig", "DistillationTrainer", "GRPOConfig", "GRPOTrainer", "__version__"]

# the TRL-shaped Python API (rlvr/api.py), imported on first use
_API = ("DistillationConfig", "DistillationTrainer", "GRPOConfig", "GRPOTrainer", "TrainOutput")


def __getattr__(name: str):
    if name in _API:  # so `import rlvr` (and the CLI) stays light: torch and the trainer load only when asked for
        from rlvr import api

        return getattr(api, name)
    raise AttributeError(f"module 'rlvr' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
