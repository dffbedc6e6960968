"""SFT loss: target masking, segment boundaries, packing."""

import jax
import jax.numpy as jnp
import numpy as np

from ptx.algorithms import sft
from ptx.data.batch import pad_batch, sft_example
from ptx.data.tokenizer import ByteTokenizer
from ptx.models import forward, init_params
from ptx.models.decoder import token_log_probs


def test_targets_never_cross_segments_or_padding():
  batch = {
      "tokens": jnp.asarray([[5, 6, 7, 8, 9, 10, 0, 0]]),
      "loss_mask": jnp.asarray([[0, 1, 1, 0, 1, 1, 0, 0]]),
      "segment_ids": jnp.asarray([[1, 1, 1, 2, 2, 2, 0, 0]]),
      "positions": jnp.asarray([[0, 1, 2, 0, 1, 2, 0, 0]]),
  }
  targets, weights = sft.next_token_targets(batch)
  np.testing.assert_array_equal(targets, [[6, 7, 8, 9, 10, 0, 0]])
  # 7->8 crosses into segment 2 and 8 is not a target; 10->pad is padding.
  np.testing.assert_array_equal(weights, [[1, 1, 0, 1, 1, 0, 0]])


def test_token_log_probs_match_numpy():
  logits = jax.random.normal(jax.random.key(0), (2, 3, 5))
  targets = jnp.asarray([[0, 4, 2], [1, 1, 3]])
  logp = np.log(np.exp(logits) / np.exp(logits).sum(-1, keepdims=True))
  want = np.take_along_axis(logp, np.asarray(targets)[..., None], -1)[..., 0]
  # float32 log-softmax of 5 logits against float64: a few ulps of values ~1 (rtol 1e-6 is ~8 ulps).
  np.testing.assert_allclose(token_log_probs(logits, targets), want, rtol=1e-6)


def test_packed_batch_gives_the_unpacked_per_token_loss(tiny_config):
  tok = ByteTokenizer()
  cfg = tiny_config
  params = init_params(cfg, jax.random.key(0))
  examples = [sft_example(tok, "12+7=", "19"), sft_example(tok, "3*4=", "12"), sft_example(tok, "1-1=", "0")]
  unpacked = pad_batch(examples, 16, tok.pad_id)
  packed = {k: np.zeros((1, 32), np.int32) for k in unpacked}
  offset = 0
  for i, ex in enumerate(examples):
    n = len(ex["tokens"])
    packed["tokens"][0, offset:offset + n] = ex["tokens"]
    packed["loss_mask"][0, offset:offset + n] = ex["loss_mask"]
    packed["segment_ids"][0, offset:offset + n] = i + 1
    packed["positions"][0, offset:offset + n] = np.arange(n)
    offset += n

  def per_token(batch):
    logits = jax.jit(forward, static_argnums=2)(params, batch["tokens"], cfg, positions=batch["positions"],
                                                    segment_ids=batch["segment_ids"])[:, :-1]
    targets, weights = sft.next_token_targets(batch)
    nll = np.asarray(-token_log_probs(logits, targets))
    return nll[np.asarray(weights) > 0]

  # Packed and padded rows run attention over other key sets (masked keys add exact zeros) and the mean over another
  # token layout: float32 rounding of reordered sums, ~1e-6 relative (seen ~1% of these).
  np.testing.assert_allclose(per_token(packed), per_token(unpacked), rtol=1e-5, atol=1e-6)
  loss_packed, m_packed = sft.loss(params, packed, None, model=cfg)
  loss_unpacked, m_unpacked = sft.loss(params, unpacked, None, model=cfg)
  np.testing.assert_allclose(loss_packed, loss_unpacked, rtol=1e-5)
  assert m_packed["weight"] == m_unpacked["weight"] == 3 + 3 + 2


def test_pipeline_packing_reproduces_the_padded_per_token_losses(tiny_config):
  from ptx.config import DataConfig
  from ptx.data.pipeline import make_pipeline
  from ptx.data.sources import MemorySource

  records = [{"prompt": f"{i}*{i}=", "completion": str(i * i)} for i in range(12)]
  params = init_params(tiny_config, jax.random.key(0))
  logits_of = jax.jit(forward, static_argnums=2)

  def token_losses(pack):
    cfg = DataConfig(batch_size=12 if not pack else 2, seq_len=48, pack=pack, shuffle=False, num_epochs=1,
                     num_bins=2)
    losses = []
    for batch in make_pipeline(MemorySource(records), ByteTokenizer(), cfg):
      logits = logits_of(params, batch["tokens"], tiny_config, positions=batch["positions"],
                         segment_ids=batch["segment_ids"])[:, :-1]
      targets, weights = sft.next_token_targets(batch)
      losses.append(np.asarray(-token_log_probs(logits, targets))[np.asarray(weights) > 0])
    return np.sort(np.concatenate(losses))

  packed, padded = token_losses(True), token_losses(False)
  assert len(packed) == len(padded) == sum(len(str(i * i)) + 1 for i in range(12))
  # As above; sorted, so losses that rounding reorders are still compared within the tolerance.
  np.testing.assert_allclose(packed, padded, rtol=1e-5, atol=1e-6)
