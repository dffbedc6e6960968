"""The rollout engine: continuous batching over a paged KV cache, admission, speculative decoding, the fast mode."""
