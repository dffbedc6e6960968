"""GRPO's step kinds (fused, host-reward, engine, episodes) over one update, with their prompts and metrics."""
