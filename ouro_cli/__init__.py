"""ouro: on-policy RL (GRPO) for Ouro looped language models."""

__version__ = "0.1.0"
