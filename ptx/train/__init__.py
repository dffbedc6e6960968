"""Training: jobs and the host loop, state, steps and optimizer, checkpoints, export, and GRPO's step kinds (grpo/)."""
