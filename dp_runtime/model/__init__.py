"""The reference Qwen3-MoE model: its config and presets, and its weights."""
