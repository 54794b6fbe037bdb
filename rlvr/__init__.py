"""rlvr: GRPO / DAPO / Dr. GRPO on verifiable rewards for Hugging Face causal LMs."""

import os

# rlvr never downloads: models are local directories or built-in aliases. Make the hub client agree.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

__version__ = "0.1.0"
