"""Losses as pure functions: SFT, the DPO family, the GRPO family, advantages and dynamic sampling."""
