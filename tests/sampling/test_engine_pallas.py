"""The rollout engine with `attention_impl="pallas"`: the Pallas paged kernel (interpreted here) reads the pages.

Its tokens equal the pure-JAX path's, greedy and sampled, with sliding windows and soft-caps; its log-probs
match within float32 reordering; configurations the kernel cannot read are refused by field name.
"""

import contextlib
import dataclasses
import functools

import jax
import numpy as np
import pytest
from engine_setup import BUDGETS, GREEDY, PROMPTS, SAMPLED, perturbed_params

from model_variants import gemma_like
from ptx.models import paged_kv_cache
from ptx.models.attention import interpret_pallas
from ptx.sampling.engine.config import EngineConfig
from ptx.sampling.engine.engine import RolloutEngine

# The GPU kernel tiles a page as it tiles a head: both powers of two >= 16. Few slots, so requests queue; prompts of
# up to 40 tokens take several prefill chunks of 16 and pages of 16; the pages split over a mesh's 2 data devices.
CONFIG = EngineConfig(max_seqs=4, pages=34, page_size=16, max_seq_len=64, decode_steps=5, prefill_chunk=16,
                      prefill_rows=2)
# The kernel folds one page at a time into its online softmax, the pure-JAX path blocks of pages: the same float32
# math in another order, a few ulps of the log-probs (seen below 1e-6).
KERNEL_VS_XLA_ATOL = 1e-5


def _config(tiny_config, impl):
  """The Gemma-like tiny config with heads of 16 (the kernel's tile) and the given attention_impl."""
  return dataclasses.replace(gemma_like(tiny_config), head_dim=16, attention_impl=impl)


def _run(cfg, params, sampling, samples):
  """Every PROMPTS request with `samples` samples through one engine on CONFIG: the completions in request order."""
  engine = RolloutEngine(cfg, CONFIG, sampling=sampling, seed=4)
  ids = {row: engine.submit(PROMPTS[row], max_new_tokens=BUDGETS[row], samples=samples) for row in range(len(PROMPTS))}
  done = engine.run(params)
  assert engine.allocator.in_use == 0
  return [done[i] for row in range(len(PROMPTS)) for i in ids[row]]


@functools.cache  # the pure-JAX path's completions, for each test that compares the kernel's with them (read only)
def _pure_jax(tiny_config, sampling, samples):
  """`_run` without the kernel: (params, completions)."""
  cfg = _config(tiny_config, "auto")
  params = perturbed_params(cfg)
  return params, _run(cfg, params, sampling, samples)


@pytest.mark.parametrize("sampling, samples", [(GREEDY, 1), (SAMPLED, 2)], ids=["greedy", "sampled"])
def test_the_pallas_paged_kernel_gives_the_pure_jax_paths_tokens(tiny_config, sampling, samples):
  params, expected = _pure_jax(tiny_config, sampling, samples)
  with interpret_pallas("pallas_gpu"):
    cfg = _config(tiny_config, "pallas")
    assert paged_kv_cache.kernel_for(cfg, CONFIG.page_size).name == "pallas_gpu"
    got = _run(cfg, params, sampling, samples)
  for want, have in zip(expected, got, strict=True):
    np.testing.assert_array_equal(have.tokens, want.tokens, err_msg=f"sequence {want.seq_id}")
    np.testing.assert_allclose(have.log_probs, want.log_probs, atol=KERNEL_VS_XLA_ATOL, rtol=0)
  assert len({tuple(c.tokens) for c in got}) > len(PROMPTS) // 2  # varied: a kernel reading nothing would not be


def test_auto_and_the_other_impls_keep_the_pure_jax_path(tiny_config):
  for impl in ("auto", "xla", "blockwise"):
    assert paged_kv_cache.kernel_for(_config(tiny_config, impl), 16) is None


@pytest.mark.parametrize("page_size, int8, interpreted, message", [
    (16, False, False, "attention_impl='pallas': the paged attention has no Pallas kernel on 'cpu'"),
    (16, True, True, "EngineConfig.kv_dtype='int8' pages are read by the pure-JAX path"),
    (8, False, True, "pallas_gpu needs EngineConfig.page_size a power of two >= 16, got 8"),
])
def test_pages_the_kernel_cannot_read_are_refused_naming_the_field(tiny_config, page_size, int8, interpreted,
                                                                     message):
  config = dataclasses.replace(CONFIG, page_size=page_size, pages=65, kv_dtype="int8" if int8 else "auto")
  with interpret_pallas("pallas_gpu") if interpreted else contextlib.nullcontext():
    with pytest.raises(ValueError, match=message):
      RolloutEngine(_config(tiny_config, "pallas"), config)



def test_the_pallas_paged_kernel_reads_each_devices_pages_on_a_mesh(tiny_config, mesh):
  """data=2 x tensor=4: each device's kernel reads its own block of pages and its KV heads."""
  from ptx.models.params import param_shardings

  params, expected = _pure_jax(tiny_config, GREEDY, 1)
  with interpret_pallas("pallas_gpu"):
    cfg = _config(tiny_config, "pallas")
    engine = RolloutEngine(cfg, CONFIG, sampling=GREEDY, seed=4, mesh=mesh)
    assert engine.allocator.blocks == 2
    ids = [engine.submit(PROMPTS[row], max_new_tokens=BUDGETS[row])[0] for row in range(len(PROMPTS))]
    done = engine.run(jax.device_put(params, param_shardings(cfg, mesh)))
  for want, seq_id in zip(expected, ids, strict=True):
    np.testing.assert_array_equal(done[seq_id].tokens, want.tokens, err_msg=f"sequence {seq_id}")
