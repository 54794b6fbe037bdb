"""Models: loading (local, offline aliases), LoRA and the reference policy (policy.py), what rlvr reads off an
architecture, the offline GGUF aliases, the chat template and prompt tokenization."""
