"""Config variants shared by model and sampler tests (importable: conftest modules are not)."""

import dataclasses


def gemma_like(cfg):
  """The tiny config with every Gemma 2/3 feature switched on."""
  return dataclasses.replace(
      cfg, activation="gelu_tanh", norm_plus_one=True, post_norms=True, qk_norm=True, embed_scale=True,
      tie_embeddings=True, sliding_window=3, sliding_window_pattern=2, attn_logit_softcap=5.0,
      final_logit_softcap=3.0, query_pre_attn_scalar=20.0, rope_local_theta=100.0)
