"""Int8 KV pages in the rollout engine: a quarter of float32's bytes plus scales, near float's tokens and log-probs,
the same on a mesh as on one device, shared prompt pages (copy-on-write of int8 pages and scales) == copied ones."""

import dataclasses

import jax
import numpy as np
from engine_setup import PROMPTS, SAMPLED, SMALL, grouped_equals_copied, perturbed_params, run_requests

from ptx.models.params import param_shardings
from ptx.sampling.engine.engine import RolloutEngine

INT8 = dataclasses.replace(SMALL, kv_dtype="int8")
# Int8 K/V round each element by up to half a step (absmax / 254 of its slot and head): on this model the log-probs
# of the same tokens moved by at most 0.02 nats; 0.1 bounds it with room while a wrong scale (say, a missing
# dequantisation) moves them by whole nats.
LOGPROB_ATOL = 0.1


def test_int8_pages_cost_a_quarter_and_sample_near_float(tiny_config):
  cfg, params = tiny_config, perturbed_params(tiny_config)
  stops = [[]] * len(PROMPTS)
  exact = RolloutEngine(cfg, SMALL, sampling=SAMPLED, seed=3)
  int8 = RolloutEngine(cfg, INT8, sampling=SAMPLED, seed=3)
  slots = SMALL.pages * cfg.n_kv_heads * SMALL.page_size * 2 * cfg.n_layers  # K and V, every layer
  assert exact.pool_bytes == slots * cfg.head_dim * 4
  assert int8.pool_bytes == slots * (cfg.head_dim + 4)  # int8 values and a float32 scale per slot and head
  a, b = (run_requests(engine, params, range(len(PROMPTS)), stops) for engine in (exact, int8))
  same = compared = 0
  for row in range(len(PROMPTS)):
    (x,), (y,) = a[row], b[row]
    # The same uniforms draw the same token until the distributions part: compare the log-probs up to there.
    n = next((i for i, (s, t) in enumerate(zip(x.tokens, y.tokens)) if s != t), len(x.tokens))
    np.testing.assert_allclose(y.log_probs[:n], x.log_probs[:n], atol=LOGPROB_ATOL, rtol=0, err_msg=f"row {row}")
    same, compared = same + n, compared + len(x.tokens)
  assert same >= 0.8 * compared, (same, compared)


def test_int8_pages_on_a_mesh_and_shared_between_samples(tiny_config, mesh):
  """data=2 x tensor=4 == one device; a group's shared prompt pages == each sample prefilling its own copy."""
  cfg, params = tiny_config, perturbed_params(tiny_config)
  stops = [[]] * len(PROMPTS)
  placed = jax.device_put(params, param_shardings(cfg, mesh))
  sharded = run_requests(RolloutEngine(cfg, INT8, sampling=SAMPLED, seed=5, mesh=mesh), placed, range(4), stops, 2)
  single = run_requests(RolloutEngine(cfg, INT8, sampling=SAMPLED, seed=5), params, range(4), stops, 2)
  for row in range(4):
    for a, b in zip(sharded[row], single[row]):
      np.testing.assert_array_equal(a.tokens, b.tokens)
  grouped_equals_copied(cfg, INT8, params, G=3)  # 9 full prompt pages shared, the 10th copied per sample
