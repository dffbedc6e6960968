"""AdamW with linear warmup, cosine decay and global-norm clipping."""

from __future__ import annotations

from typing import Any

import jax
import optax

from ptx.config import OptimizerConfig


def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
  """Linear warmup from 0 to `cfg.lr`, then cosine decay to `lr * min_lr_ratio`."""
  warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.lr, warmup_steps=warmup, decay_steps=max(total_steps, warmup + 1),
      end_value=cfg.lr * cfg.min_lr_ratio)


def make_optimizer(cfg: OptimizerConfig, total_steps: int, decay_mask: Any = None,
                   trainable_mask: Any = None) -> optax.GradientTransformation:
  """Builds the optimizer once, before jit; steps with non-finite gradients are skipped.

  Args:
    cfg: optimizer hyper-parameters.
    total_steps: length of the schedule in optimizer steps.
    decay_mask: pytree of bools (True: apply weight decay), e.g.
      `ptx.models.params.weight_decay_mask(model_cfg)`; None decays everything.
    trainable_mask: pytree of bools (False: the parameter never changes: its gradient is zeroed before
      clipping and Adam, and `decay_mask` must leave it undecayed), e.g.
      `ptx.models.params.trainable_mask(model_cfg)`; None trains everything.
  """
  adamw = optax.adamw(learning_rate_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                      weight_decay=cfg.weight_decay, mask=decay_mask)
  inner = adamw if cfg.clip_norm <= 0 else optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw)
  if trainable_mask is not None:
    # Zeroed gradients keep Adam's moments at 0 and its update at exactly 0; the moments' state keeps the layout
    # of the parameters, which the checkpoint and sharding code maps over.
    frozen = jax.tree.map(lambda trainable: not trainable, trainable_mask)
    inner = optax.chain(optax.masked(optax.set_to_zero(), frozen), inner)
  # A step whose gradients are not finite leaves parameters and moments untouched
  # and is counted in the state (`skipped_steps`); it is never applied.
  return optax.apply_if_finite(inner, max_consecutive_errors=_NEVER)


def skipped_steps(opt_state: Any) -> Any:
  """The number of steps skipped for non-finite gradients so far (an int32 scalar)."""
  return optax.tree_utils.tree_get(opt_state, "total_notfinite")


def nonfinite_streak(opt_state: Any) -> Any:
  """How many of the latest steps in a row were skipped for non-finite gradients (an int32 scalar)."""
  return optax.tree_utils.tree_get(opt_state, "notfinite_count")


_NEVER = 2**31 - 1
