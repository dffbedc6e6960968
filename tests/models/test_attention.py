"""The model runs the same under every attention implementation, and its program runs the one the config names.

The Pallas kernels run through the Pallas interpreter (`interpret_pallas`); the GPU kernel needs head_dim a power
of two >= 16, so its tests widen the tiny config's heads to 16.
"""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_variants import gemma_like
from tolerances import assert_close_to_scale
from ptx.config import MeshConfig
from ptx.model_config import ModelConfig
from ptx.models import attention, forward, init_params
from ptx import sharding
from ptx.models.attention import interpret_pallas, resolve
from ptx.sharding import make_mesh

fwd = jax.jit(forward, static_argnames=("cfg",))
# The kernels tile the softmax and sum it in another order than the XLA reference: float32 rounding, ~1e-6 relative
# on O(1) logits (seen <= 12% of rtol = atol = 1e-5). Their gradients of the summed logits differ by <= 9e-7 of each
# leaf's largest entry, but entries that are cancellations come within 36% of rtol = atol = 1e-4, so the gradients are
# compared to each leaf's scale.
LOGITS_TOL, GRADS_REL = 1e-5, 1e-5


def _inputs(cfg):
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
  segments = jnp.asarray([[1] * 9 + [2] * 5 + [0] * 2, [1] * 16])
  positions = jnp.asarray([list(range(9)) + list(range(5)) + [0, 0], list(range(16))])
  return tokens, positions, segments


def _runs(impl):
  """The context an implementation runs in on CPU: the Pallas interpreter for "pallas"."""
  return interpret_pallas() if impl == "pallas" else contextlib.nullcontext()


# The interpreted Pallas kernel compiles slowly: once, on the variant with windows and soft-caps.
@pytest.mark.parametrize("impl, variant", [("blockwise", "llama"), ("blockwise", "gemma"), ("pallas", "gemma")])
def test_kernels_match_the_reference_in_the_model(tiny_config, impl, variant):
  cfg = gemma_like(tiny_config) if variant == "gemma" else tiny_config
  if impl == "pallas":
    cfg = dataclasses.replace(cfg, head_dim=16)
  params = init_params(cfg, jax.random.key(0))
  tokens, positions, segments = _inputs(cfg)
  real = np.asarray(segments) > 0

  def loss(p, impl):
    c = dataclasses.replace(cfg, attention_impl=impl)
    logits = forward(p, tokens, c, positions=positions, segment_ids=segments)
    return (logits * real[..., None]).sum(), logits

  (_, want), g_want = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)(params, "xla")
  with _runs(impl):
    (_, got), g_got = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)(params, impl)
  np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=LOGITS_TOL, rtol=LOGITS_TOL)
  jax.tree.map(lambda a, b: assert_close_to_scale(a, b, GRADS_REL), g_got, g_want)


# Programs of a 1-layer model forward: the config's attention_impl, over the `seq` mesh, inside interpret_pallas.
# "auto" (the default) is xla on CPU at this length, ring over the seq mesh, and the Pallas kernel where there is one.
PROGRAMS = {"xla": ("xla", False, False), "blockwise": ("blockwise", False, False), "pallas": ("pallas", False, True),
            "ring": ("ring", True, False), "ring+pallas": ("ring", True, True), "auto": ("auto", False, False),
            "auto/seq": ("auto", True, False), "auto/pallas": ("auto", False, True)}
# What each implementation leaves in a compiled program, and the programs that hold it (no other may).
MARKERS = {
    "ptx_dense_attention": ["xla", "auto"],  # dense_attention's named scope
    "ptx_blockwise_fwd": ["blockwise", "ring", "auto/seq"],  # the blockwise kernel's scope; on CPU ring hops run it
    "ptx_flash_fwd": ["pallas", "ring+pallas", "auto/pallas"],  # the GPU Pallas kernel; ring hops run the platform's
    "collective-permute": ["ring", "ring+pallas", "auto/seq"],  # the ring's K/V rotation
}


@pytest.fixture(scope="module")
def compiled_forwards():
  """The compiled HLO text of each program in PROGRAMS."""
  cfg = ModelConfig(vocab_size=264, d_model=40, n_layers=1, n_heads=8, n_kv_heads=2, head_dim=16, mlp_dim=96,
                    rope_theta=10_000.0)
  params = init_params(cfg, jax.random.key(0))
  tokens = jnp.zeros((2, 32), jnp.int32)
  texts = {}
  for name, (impl, over_seq, interpreted) in PROGRAMS.items():
    c = dataclasses.replace(cfg, attention_impl=impl)
    with contextlib.ExitStack() as stack:
      if over_seq:
        stack.enter_context(jax.set_mesh(make_mesh(MeshConfig(data=1, fsdp=1, tensor=1, seq=8))))
      if interpreted:
        stack.enter_context(interpret_pallas())
      texts[name] = jax.jit(lambda p, t, c=c: forward(p, t, c)).lower(params, tokens).compile().as_text()
  return texts


@pytest.mark.parametrize("marker", MARKERS)
def test_the_compiled_program_runs_the_named_implementation(compiled_forwards, marker):
  assert [name for name, text in compiled_forwards.items() if marker in text] == MARKERS[marker]


def test_auto_resolves_by_mesh_backend_length_and_head_width():
  short = dict(q_len=1024, kv_len=1024, head_dim=64)
  assert resolve("auto", **short) == "xla"  # CPU: the dense logits while one block is <= 1K x 1K
  assert resolve("auto", q_len=1024, kv_len=1025, head_dim=64) == "blockwise"
  with interpret_pallas():  # a platform with a Pallas kernel: it runs, but the GPU kernel takes no 80-wide heads
    assert resolve("auto", **short) == "pallas"
    assert resolve("auto", q_len=1024, kv_len=1024, head_dim=80) == "xla"
  with interpret_pallas("pallas_tpu"):
    assert resolve("auto", q_len=1024, kv_len=1024, head_dim=80) == "pallas"
  with jax.set_mesh(make_mesh(MeshConfig(data=1, fsdp=1, tensor=1, seq=8))):
    assert resolve("auto", **short) == "ring"
    assert resolve("auto", q_len=24, kv_len=24, head_dim=64) == "xla"  # not a multiple of 2 x 8 ring blocks
    assert resolve("auto", q_len=1024, kv_len=2048, head_dim=64) == "blockwise"  # not self-attention
    whole = sharding.Rules(params=sharding.DEFAULT_RULES.params, activations={})
    assert resolve("auto", **short, rules=whole) == "xla"  # the rules keep the sequence whole
    for impl in ("xla", "blockwise", "pallas", "ring"):
      assert resolve(impl, **short) == impl
  with pytest.raises(ValueError, match="'flash' is not one of"):
    resolve("flash", **short)


def test_ring_attention_in_the_model_over_the_seq_axis(tiny_config):
  cfg = dataclasses.replace(tiny_config, n_layers=1)
  params = init_params(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(2), (2, 32), 0, cfg.vocab_size)
  want = fwd(params, tokens, cfg)
  mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1, seq=8))
  with jax.set_mesh(mesh):
    got = fwd(params, tokens, dataclasses.replace(cfg, attention_impl="ring"))
  np.testing.assert_allclose(got, want, atol=LOGITS_TOL, rtol=LOGITS_TOL)  # ring blocks: another order, as above


@pytest.mark.parametrize("impl", ["blockwise"])
def test_per_device_kernels_under_batch_sharding_with_left_padding(tiny_config, impl):
  # Ragged left-padded rows on data x fsdp once deadlocked blockwise: GSPMD put
  # collectives inside its row-dependent tile loops. Now it runs per device.
  cfg = dataclasses.replace(tiny_config, n_layers=2)
  params = init_params(cfg, jax.random.key(0))
  b, t = 8, 24
  pad = np.arange(b) * 3 % t  # every row a different amount of left padding
  segments = jnp.asarray((np.arange(t)[None] >= pad[:, None]).astype(np.int32))
  positions = jnp.maximum(jnp.arange(t)[None] - jnp.asarray(pad)[:, None], 0)
  tokens = jax.random.randint(jax.random.key(3), (b, t), 0, cfg.vocab_size)
  real = np.asarray(segments) > 0

  def loss(p, impl):
    c = dataclasses.replace(cfg, attention_impl=impl)
    logits = forward(p, tokens, c, positions=positions, segment_ids=segments)
    return (logits * real[..., None]).sum(), logits

  step = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
  (_, want), g_want = step(params, "xla")
  with jax.set_mesh(make_mesh(MeshConfig(data=2, fsdp=4, tensor=1, seq=1))):
    (_, got), g_got = step(params, impl)
    hlo = step.lower(params, impl).compile().as_text()
  assert "all-gather" not in hlo and "all-reduce" in hlo  # batch-sharded, gradients reduced
  np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=LOGITS_TOL, rtol=LOGITS_TOL)
  jax.tree.map(lambda a, b: assert_close_to_scale(a, b, GRADS_REL), g_got, g_want)


def test_unknown_and_unavailable_implementations_are_clear_errors():
  q = jnp.zeros((1, 4, 2, 8))
  ids = jnp.ones((1, 4), jnp.int32)
  with pytest.raises(ValueError, match="is not one of"):
    attention(q, q, q, segment_ids=ids, positions=ids, impl="flash")
  with pytest.raises(ValueError, match="needs a GPU or TPU"):
    attention(q, q, q, segment_ids=ids, positions=ids, impl="pallas")
  with pytest.raises(ValueError, match="no.*set|none is set"):
    attention(q, q, q, segment_ids=ids, positions=ids, impl="ring")
