"""The attention dispatch table: which kernel each platform and feature set gets, and why; refusals by name.

No device is needed: the table is a function of a call's static facts (`attention_choice.Need`), and the plumbing
of a row layout from the data config to the kernel is checked by watching `resolve`'s arguments.
"""

import dataclasses
import importlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import ptx_kernels
import pytest

from ptx.config import ConfigError, DataConfig
from ptx.models import attention_choice, decoder, forward, init_params
from ptx.models.attention_choice import Need, choose, refusal
from ptx.train.job import check_attention_kernel

attention_lib = importlib.import_module("ptx.models.attention")  # `ptx.models.attention` is also the function

# A bf16 GQA call of right-padded rows of 4K tokens, head width 128: what cuDNN computes.
PLAIN = dict(rows="padded_right", half_precision=True, pairs=4096 * 4096, head_dim=128, v_head_dim=128)
# (platform, what differs from PLAIN) -> the kernel the table gives.
CASES = [
    ("gpu", {}, "cudnn"),
    ("gpu", dict(window="static"), "cudnn"),
    ("gpu", dict(head_dim=80, v_head_dim=80), "cudnn"),  # a multiple of 8: cuDNN's, though not Triton's
    ("gpu", dict(rows="packed"), "pallas"),
    ("gpu", dict(softcap=True), "pallas"),
    ("gpu", dict(sinks=True), "pallas"),
    ("gpu", dict(window="traced"), "pallas"),
    ("gpu", dict(self_attention=False), "pallas"),
    ("gpu", dict(half_precision=False), "pallas"),
    ("gpu", dict(head_dim=192, v_head_dim=128), "pallas"),  # MLA's widths, taken by the Pallas kernel's rule here
    ("gpu", dict(head_dim=80, v_head_dim=80, half_precision=False, pallas_takes_heads=False), "xla"),
    ("gpu", dict(ring=True), "ring"),
    ("tpu", {}, "splash"),
    ("tpu", dict(rows="packed", softcap=True, window="static", half_precision=False), "splash"),
    ("tpu", dict(sinks=True), "pallas"),
    ("tpu", dict(window="traced"), "pallas"),
    ("tpu", dict(self_attention=False), "pallas"),
    ("tpu", dict(head_dim=192, v_head_dim=128), "splash"),  # splash carries the value width apart
    ("tpu", dict(ring=True), "ring"),
    ("cpu", dict(pairs=1024 * 1024), "xla"),
    ("cpu", {}, "blockwise"),
    ("cpu", dict(ring=True), "ring"),
    ("gpu", dict(interpreted=True, platform="cpu"), "pallas"),
    ("gpu", dict(interpreted=True, pallas_takes_heads=False), "xla"),
]


def _need(platform, change):
  return Need(**{"platform": platform, **PLAIN, **change})


@pytest.mark.parametrize("platform, change, impl", CASES)
def test_the_table_gives_each_platform_and_feature_set_its_kernel(platform, change, impl):
  row = choose(_need(platform, change))
  assert row.impl == impl and row.reason


def test_every_row_of_the_table_is_reached():
  reached = {choose(_need(platform, change)) for platform, change, _ in CASES}
  assert [row.reason for row in attention_choice.TABLE if row not in reached] == []


def test_a_vendor_kernel_named_outright_is_refused_with_the_tables_reason():
  assert refusal("cudnn", _need("gpu", {})) is None
  assert refusal("splash", _need("tpu", dict(rows="packed"))) is None
  assert refusal("splash", _need("tpu", dict(interpreted=True))) is None  # the TPU interpreter runs splash
  assert "GPU only" in refusal("cudnn", _need("cpu", {}))
  assert "GPU only" in refusal("cudnn", _need("gpu", dict(interpreted=True)))
  assert "TPU only" in refusal("splash", _need("gpu", {}))
  assert "packed segments" in refusal("cudnn", _need("gpu", dict(rows="packed")))
  assert "soft-cap" in refusal("cudnn", _need("gpu", dict(softcap=True)))
  assert "bf16 and fp16" in refusal("cudnn", _need("gpu", dict(half_precision=False)))
  assert "sinks" in refusal("splash", _need("tpu", dict(sinks=True)))
  assert "traced" in refusal("splash", _need("tpu", dict(window="traced")))
  for impl in ("xla", "blockwise", "pallas", "ring"):  # checked where they run
    assert refusal(impl, _need("cpu", {})) is None
  with pytest.raises(ValueError, match="impl 'cudnn' cannot run this call: cudnn runs on a GPU only"):
    attention_lib.resolve("cudnn", q_len=8, kv_len=8, head_dim=16)


def test_a_job_naming_a_kernel_its_rows_or_model_cannot_use_is_refused_naming_the_field(tiny_config):
  cudnn = dataclasses.replace(tiny_config, attention_impl="cudnn", compute_dtype="bfloat16", head_dim=16)
  check_attention_kernel(cudnn, "gpu", "padded_right", 64)
  with pytest.raises(ConfigError, match="model.attention_impl='cudnn' cannot run this job: cuDNN masks by"):
    check_attention_kernel(cudnn, "gpu", "packed", 64)
  with pytest.raises(ConfigError, match="runs on a GPU only, not on 'cpu'"):
    check_attention_kernel(cudnn, "cpu", "padded_right", 64)
  with pytest.raises(ConfigError, match="computes bf16 and fp16 only"):
    check_attention_kernel(dataclasses.replace(cudnn, compute_dtype="float32"), "gpu", "padded_right", 64)
  splash = dataclasses.replace(cudnn, attention_impl="splash")
  check_attention_kernel(splash, "tpu", "packed", 64)
  with pytest.raises(ConfigError, match="splash.*sinks"):
    check_attention_kernel(dataclasses.replace(splash, attention_sinks=True), "tpu", "packed", 64)
  windowed = dataclasses.replace(splash, sliding_window=4)
  with pytest.raises(ConfigError, match="traced"):  # scanned layers trace their windows
    check_attention_kernel(windowed, "tpu", "packed", 64)
  check_attention_kernel(dataclasses.replace(windowed, scan_layers=False), "tpu", "packed", 64)


def test_row_layouts_follow_the_data():
  assert DataConfig(kind="sft").rows == "packed"
  assert DataConfig(kind="sft", pack=False).rows == "padded_right"
  assert DataConfig(kind="preference", pack=False).rows == "padded_right"
  assert DataConfig(kind="rl", pack=False).rows == "packed"  # a left-padded prompt, then its completion


def test_the_declared_row_layout_reaches_every_layers_attention(tiny_config, monkeypatch):
  from ptx.algorithms import dpo, sft
  seen = []
  real = attention_lib.resolve

  def watch(impl, **facts):
    seen.append(facts["rows"])
    return real(impl, **facts)

  monkeypatch.setattr(attention_lib, "resolve", watch)
  cfg = dataclasses.replace(tiny_config, scan_layers=False)  # each layer traces its own call
  params = init_params(cfg, jax.random.key(0))
  ones = jnp.ones((2, 8), jnp.int32)
  batch = dict(tokens=ones, loss_mask=ones, segment_ids=ones, positions=jnp.broadcast_to(jnp.arange(8), (2, 8)))
  for rows in ("padded_right", "packed"):
    seen.clear()
    jax.eval_shape(functools.partial(sft.loss, model=cfg, rows=rows), params, batch, jax.random.key(0))
    assert seen == [rows] * cfg.n_layers
  seen.clear()
  jax.eval_shape(functools.partial(dpo.sequence_logps, model=cfg, rules=attention_lib.sharding.DEFAULT_RULES),
                 params, batch)
  assert seen == ["padded_right"] * cfg.n_layers


def test_the_cudnn_branch_equals_the_reference_on_right_padded_rows(tiny_config, monkeypatch):
  # cuDNN's own arguments computed by JAX's "xla" (no GPU here): the model's call of it, lengths read from the
  # segment ids, under the per-device shard_map of a data x fsdp mesh.
  monkeypatch.setattr(ptx_kernels, "cudnn_attention", functools.partial(ptx_kernels.cudnn_attention,
                                                                        implementation="xla"))
  # A window and a scale of their own, which the call must map; unrolled layers keep the window a static int.
  cfg = dataclasses.replace(tiny_config, n_layers=1, sliding_window=5, sliding_window_pattern=1,
                            query_pre_attn_scalar=3.0, scan_layers=False)
  params = init_params(cfg, jax.random.key(0))
  lengths = np.array([16, 11, 5, 16, 9, 16, 1, 14])
  segments = jnp.asarray((np.arange(16)[None] < lengths[:, None]).astype(np.int32))
  positions = jnp.broadcast_to(jnp.arange(16), (8, 16))
  tokens = jax.random.randint(jax.random.key(1), (8, 16), 0, cfg.vocab_size)
  run = jax.jit(lambda c: forward(params, tokens, c, positions=positions, segment_ids=segments,
                                  rows="padded_right"), static_argnums=0)
  want = run(dataclasses.replace(cfg, attention_impl="xla"))
  monkeypatch.setattr(attention_lib, "resolve", lambda impl, **facts: "cudnn")
  from ptx.config import MeshConfig
  from ptx.sharding import make_mesh
  with jax.set_mesh(make_mesh(MeshConfig(data=2, fsdp=4, tensor=1, seq=1))):
    got = run(dataclasses.replace(cfg, attention_impl="auto"))
  real = np.asarray(segments) > 0
  # float32 both sides, the softmax summed in another order: ~1e-6 of O(1) logits.
  np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=1e-5, rtol=1e-5)


def test_a_run_prints_the_attention_row_of_its_training_rows(tiny_config):
  impl, reason = decoder.attention_row(tiny_config, 64, "packed", attention_lib.sharding.DEFAULT_RULES)
  assert (impl, reason) == (choose(Need("cpu", pairs=64 * 64)).impl, choose(Need("cpu", pairs=64 * 64)).reason)
  named = dataclasses.replace(tiny_config, attention_impl="blockwise")
  assert decoder.attention_row(named, 64, "packed", attention_lib.sharding.DEFAULT_RULES)[0] == "blockwise"


def test_the_splash_branch_in_the_model_equals_the_reference(tiny_config):
  # Splash in the Pallas interpreter, named outright: packed rows with left padding, a window and a soft-cap of
  # their own, per device under a data x fsdp mesh.
  cfg = dataclasses.replace(tiny_config, n_layers=1, sliding_window=5, sliding_window_pattern=1,
                            attn_logit_softcap=3.0, scan_layers=False)
  params = init_params(cfg, jax.random.key(0))
  segments = np.tile([[0, 0, 0] + [1] * 7 + [2] * 6, [1] * 9 + [2] * 7], (4, 1)).astype(np.int32)
  positions = np.zeros_like(segments)
  for row in range(len(segments)):
    for s in (1, 2):
      positions[row, segments[row] == s] = np.arange((segments[row] == s).sum())
  tokens = jax.random.randint(jax.random.key(1), segments.shape, 0, cfg.vocab_size)
  run = jax.jit(lambda c: forward(params, tokens, c, positions=jnp.asarray(positions),
                                  segment_ids=jnp.asarray(segments)), static_argnums=0)
  want = run(dataclasses.replace(cfg, attention_impl="xla"))
  from ptx.config import MeshConfig
  from ptx.sharding import make_mesh
  with attention_lib.interpret_pallas("pallas_tpu"), jax.set_mesh(make_mesh(MeshConfig(data=2, fsdp=4))):
    got = run(dataclasses.replace(cfg, attention_impl="splash"))
  real = segments > 0
  # float32 both sides, the softmax summed in another order: ~1e-6 of O(1) logits.
  np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=1e-5, rtol=1e-5)
