"""Merging partial attention results through their log-sum-exp.

Attention over a key set split into disjoint parts equals a weighted sum of the
per-part outputs, weights exp(lse_i - lse) with lse = logaddexp over parts. The
ring (one part per ring step), split-cache decode (one part per cache split)
and sequence-sharded decode (one part per device) all merge with this function.

An empty part has lse = -inf and output 0; it gets weight 0, and a row whose
parts are all empty stays (out 0, lse -inf) with finite gradients.

Attention sinks (gpt-oss) are the same algebra with a part that has a logit
and no value: `with_sinks` adds one per query head to a finished result, after
every part is merged, so each row's denominator holds its sink exactly once.
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp


def merge_lse(
    outs: Sequence[jax.Array], lses: Sequence[jax.Array],
) -> tuple[jax.Array, jax.Array]:
  """Merges attention outputs computed over disjoint sets of keys.

  Args:
    outs: partial outputs, each [B, T, H, D], normalised over its own keys.
    lses: matching natural-log LSEs, each [B, H, T]; -inf marks a part where
      the row saw no key.

  Returns:
    (out [B, T, H, D] in float32, lse [B, H, T] float32) over all keys.
  """
  if len(outs) != len(lses) or not outs:
    raise ValueError(f"need matching non-empty parts, got {len(outs)} outs, "
                     f"{len(lses)} lses")
  lses = [x.astype(jnp.float32) for x in lses]
  for o, l in zip(outs, lses):
    if o.ndim != 4 or l.shape != (o.shape[0], o.shape[2], o.shape[1]):
      raise ValueError(f"out {o.shape} needs lse [B, H, T], got {l.shape}")
  m = lses[0]
  for l in lses[1:]:
    m = jnp.maximum(m, l)
  # The max is only for stability; keeping it out of autodiff avoids the
  # inf - inf of an all-empty row.
  m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
  weights = [jnp.exp(l - m) for l in lses]
  total = sum(weights[1:], weights[0])
  safe_total = jnp.where(total > 0, total, 1.0)
  lse = jnp.where(total > 0, m + jnp.log(safe_total), -jnp.inf)
  out = sum(
      (jnp.swapaxes(w / safe_total, 1, 2)[..., None] * o.astype(jnp.float32)
       for w, o in zip(weights, outs)),
      jnp.zeros(outs[0].shape, jnp.float32))
  return out, lse


def check_sinks(sinks: jax.Array, heads: int) -> None:
  """Raises ValueError unless `sinks` is a float [heads] array."""
  if sinks.shape != (heads,) or not jnp.issubdtype(sinks.dtype, jnp.floating):
    raise ValueError(f"sinks must be a float [H] = [{heads}] array, one logit per query head, "
                     f"got {sinks.dtype}{tuple(sinks.shape)}")


def with_sinks(out: jax.Array, lse: jax.Array, sinks: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Adds attention sinks to a finished attention result: one logit per query head, in the softmax, with no value.

  Equals softmax over the logits with the head's sink appended as one more
  column, that column dropped before the values (transformers' gpt_oss eager
  attention): the keys keep the share sigmoid(lse - sink) of the denominator
  exp(lse) + exp(sink). A row that saw no key (lse = -inf) keeps out 0 and gets
  lse = sink. Differentiable in out, lse and sinks, with finite gradients.

  Args:
    out: [B, T, H, Dv] attention output, normalised over its keys.
    lse: [B, H, T] natural-log log-sum-exp of its logits; -inf where the row
      saw no key.
    sinks: [H] one logit per query head (any float dtype; used in float32).

  Returns:
    (out [B, T, H, Dv] in out.dtype, lse [B, H, T] float32) with the sinks in
    the softmax.
  """
  if out.ndim != 4 or lse.shape != (out.shape[0], out.shape[2], out.shape[1]):
    raise ValueError(f"out {out.shape} needs lse [B, H, T], got {lse.shape}")
  check_sinks(sinks, out.shape[2])
  # Float32, as every softmax here: the sink joins the row's log-sum-exp.
  lse = lse.astype(jnp.float32)
  sinks_1H1 = sinks.astype(jnp.float32)[None, :, None]
  kept_BHT = jax.nn.sigmoid(lse - sinks_1H1)
  scaled = out.astype(jnp.float32) * jnp.swapaxes(kept_BHT, 1, 2)[..., None]
  return scaled.astype(out.dtype), jnp.logaddexp(lse, sinks_1H1)
