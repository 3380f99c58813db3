"""Models trained in EDGC experiments."""

from edgc.models.gpt2 import GPT, PRESETS, GPTConfig, build_model

__all__ = ["GPT", "GPTConfig", "PRESETS", "build_model"]
