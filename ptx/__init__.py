"""ptx: JAX/TPU-first post-training for LLMs (SFT, DPO, GRPO) in one SPMD program."""

__version__ = "0.1.0"
