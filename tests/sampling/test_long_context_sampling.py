"""Long-context sampling: chunked prefill, decode phases and a seq-sharded KV cache change no token."""

import re

import jax
import numpy as np
import pytest
from engine_setup import GREEDY, argmax_reference, perturbed_params

from model_variants import gemma_like
from ptx.config import MeshConfig
from ptx.models.params import param_shardings
from ptx.sampling import generate
from ptx.sampling import generation as generation_lib
from ptx.sharding import make_mesh

# Ragged prompts up to 27 tokens: padded to 32 columns, prefilled in 4 chunks of 8.
PROMPTS = [list(range(3, 30)), [200, 3, 3, 41, 7, 90, 11], [12], list(range(100, 119))]
# Tokens exact, log-probs within 1e-5 (seen 1.9e-6 sharded vs single device): see test_generate.py.


# Programs compiled under the default phases must not be reused: the tests under small phases have a jit of their
# own, one for the module, so that they share each other's programs.
_SMALL_PHASES_JIT = jax.jit(generation_lib.generate_padded, static_argnames=generation_lib.STATIC_ARGNAMES)


@pytest.fixture
def small_phases(monkeypatch):
  """Decode phases of 4, 8, ... new tokens, so a short generation crosses several."""
  monkeypatch.setattr(generation_lib, "PHASE_TOKENS", 4)
  monkeypatch.setattr(generation_lib, "_generate_jit", _SMALL_PHASES_JIT)


def test_chunked_prefill_and_phases_equal_full_forward_argmax(tiny_config, small_phases):
  cfg = gemma_like(tiny_config)  # sliding windows of 3: chunks and phases cross them
  params = perturbed_params(cfg)
  n_new = 13  # phases of room 4, 8, then the full 12
  out = generate(params, PROMPTS, cfg=cfg, max_new_tokens=n_new, sampling=GREEDY, rng=jax.random.key(0),
                 prefill_chunk=8)
  np.testing.assert_array_equal(np.asarray(out.tokens), argmax_reference(params, cfg, PROMPTS, n_new))


@pytest.mark.parametrize("shape, group_size", [(dict(seq=8), 1), (dict(data=2, seq=4), 1), (dict(seq=8), 2)],
                         ids=["seq8", "data2_seq4", "seq8_shared_prefix"])
def test_seq_sharded_cache_equals_unsharded(tiny_config, small_phases, shape, group_size):
  cfg = tiny_config
  params = perturbed_params(cfg)
  mesh = make_mesh(MeshConfig(**{"data": 1, "fsdp": 1, "tensor": 1, "seq": 1, **shape}))
  # Groups share one copy of each prompt's K/V, seq-sharded like the rows' own slots.
  kwargs = dict(cfg=cfg, max_new_tokens=11, sampling=GREEDY, rng=jax.random.key(1), group_size=group_size,
                shared_prompts=group_size > 1)
  single = generate(params, PROMPTS, **kwargs)
  sharded = generate(jax.device_put(params, param_shardings(cfg, mesh)), PROMPTS, mesh=mesh, prefill_chunk=8,
                     **kwargs)
  np.testing.assert_array_equal(np.asarray(sharded.tokens), np.asarray(single.tokens))
  np.testing.assert_allclose(np.asarray(sharded.log_probs), np.asarray(single.log_probs), atol=1e-5)


def test_seq_sharded_cache_is_never_gathered(tiny_config):
  cfg = tiny_config
  mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1, seq=8))
  params = jax.device_put(perturbed_params(cfg), param_shardings(cfg, mesh))
  tokens, lengths = np.ones((4, 32), np.int32), np.full((4,), 32, np.int32)
  # A budget of 16: one decode phase (PHASE_TOKENS), whose cache is the whole one.
  with jax.set_mesh(mesh):
    text = generation_lib._generate_jit.lower(
        params, tokens, lengths, np.full((4, 1), -1, np.int32), jax.random.key(0), np.int32(16), cfg=cfg,
        sampling=GREEDY, budget=16, group_size=1, prefill_chunk=8).compile().as_text()
  slots = 32 + 16 - 1 + 1  # rounded up to a multiple of 8
  gathered = re.findall(r"= (\S+) all-gather(?:-start)?\(", text)
  assert gathered, "the per-device partials are merged across seq"
  assert not [shape for shape in gathered if f",{slots}," in shape], gathered  # nothing cache-sized
  assert f"[4,{cfg.n_kv_heads},{slots // 8},{cfg.head_dim}]" in text  # each device holds 1/8 of the slots
