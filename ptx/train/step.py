"""The training step: one jitted `step(state, batch) -> (state, metrics)`.

The loss function is any `loss(params, batch, rng) -> (loss, metrics)` whose
`metrics["weight"]` is the denominator of its mean (target tokens for SFT,
pairs for DPO). Gradient accumulation splits the batch into micro-batches
in-graph and weights each micro-batch's gradient and metrics by its weight,
so the update equals the one from the whole batch at once.

Under LoRA (`lora=`), `state.params` are the adapters and `state.base` the
frozen model: the loss sees `lora.apply(base, adapters)`, gradients and
optimizer moments exist for the adapters only, and `prepare` gets the base,
which is the reference policy with the adapters switched off.

`SupervisedStep` is this step as a Job holds it (`ptx.train.job.sft_job`,
`dpo_job`): the bound loss and preparation, and their evaluator.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ptx.config import LoRAConfig
from ptx.models import lora as lora_lib
from ptx.train.optimizer import nonfinite_streak, skipped_steps
from ptx.train.state import TrainState

Batch = dict[str, jax.Array]
LossFn = Callable[[Any, Batch, jax.Array], tuple[jax.Array, dict[str, jax.Array]]]
StepFn = Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Bound:
  """`fn(*args, **options)`: a `functools.partial` that compares equal by its function and options.

  Jobs hold their losses bound this way, so two Jobs built from one config
  are equal (a partial compares by identity).
  """

  fn: Callable[..., Any]
  options: tuple[tuple[str, Any], ...]

  @classmethod
  def of(cls, fn: Callable[..., Any], **options: Any) -> "Bound":
    return cls(fn, tuple(sorted(options.items())))

  def __call__(self, *args: Any) -> Any:
    return self.fn(*args, **dict(self.options))


class JittedStep:
  """A jitted `step(state, batch)` as `fit` runs it: no work in flight between steps, so no pipeline to save."""

  def __init__(self, fn: StepFn):
    self._fn = fn

  def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
    return self._fn(state, batch)

  def compile(self, state: TrainState, batch: Batch,
              compiler_options: dict[str, Any] | None = None) -> dict[str, jax.stages.Compiled]:
    """The step's one program compiled for `state` and `batch` (arrays or ShapeDtypeStructs), not run."""
    return {"step": self._fn.lower(state, batch).compile(compiler_options)}

  def pipeline_state(self) -> None:
    """Nothing is sampled ahead."""
    return None

  def set_pipeline_state(self, saved: Any) -> None:
    """A checkpoint's batches sampled ahead (a host-reward run) are dropped: this step samples its own."""
    log.warning("the checkpoint holds batches sampled ahead that this run's step does not take; they are dropped")

  def take_samples(self, wait: bool = False) -> dict[int, bytes]:
    """Nothing is sampled to show (a GRPO step's transcripts: `ptx.train.grpo.samples`)."""
    return {}


def reference_params(state: TrainState) -> Any:
  """The frozen reference policy: under LoRA the base (adapters off, no copy), else `ref_params`."""
  return state.ref_params if state.base is None else state.base


def model_params(state: TrainState, lora: LoRAConfig | None) -> Any:
  """The parameter tree the model runs (for sampling, evaluation): adapters applied, no dropout."""
  return state.params if lora is None else lora_lib.apply(state.base, state.params, lora)


def trainable_loss(loss_fn: LossFn, base: Any, lora: LoRAConfig | None, *, dropout: bool = True) -> LossFn:
  """`loss_fn` as a function of the trained parameters: under LoRA, of the adapters over `base`.

  The adapters' dropout draws from the loss's rng; `dropout=False` turns it
  off (evaluation).
  """
  if lora is None:
    return loss_fn

  def loss(adapters, batch, rng):
    dropout_rng, rng = jax.random.split(rng)
    return loss_fn(lora_lib.apply(base, adapters, lora, dropout_rng if dropout else None), batch, rng)

  return loss


def accumulate_gradients(loss_fn: LossFn, params: Any, batch: Batch, rng: jax.Array,
                         n_micro: int) -> tuple[Any, dict[str, jax.Array]]:
  """Weighted mean of gradients and metrics over `n_micro` micro-batches.

  Micro-batch i takes rows i, i + n_micro, ... so each stays spread over the
  batch-sharded devices without any data movement.
  """
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  if n_micro == 1:  # static: no scan, no extra weighting
    (_, metrics), grads = grad_fn(params, batch, rng)
    return grads, metrics

  def split(x):
    if x.shape[0] % n_micro:
      raise ValueError(f"batch of {x.shape[0]} rows does not split into grad_accum={n_micro} micro-batches")
    return jnp.swapaxes(x.reshape(x.shape[0] // n_micro, n_micro, *x.shape[1:]), 0, 1)

  def body(carry, micro_and_index):
    grad_sum, metric_sum = carry
    micro, i = micro_and_index
    (_, metrics), grads = grad_fn(params, micro, jax.random.fold_in(rng, i))
    w = metrics["weight"]
    grad_sum = jax.tree.map(lambda acc, g: acc + w * g, grad_sum, grads)
    weighted = {k: v if k == "weight" else w * v for k, v in metrics.items()}
    metric_sum = jax.tree.map(jnp.add, metric_sum, weighted)
    return (grad_sum, metric_sum), None

  micro_batches = jax.tree.map(split, batch)
  zeros_like = lambda tree: jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), tree)
  abstract_metrics = jax.eval_shape(lambda: grad_fn(params, jax.tree.map(lambda x: x[0], micro_batches), rng)[0][1])
  init = (zeros_like(params), zeros_like(abstract_metrics))
  (grad_sum, metric_sum), _ = jax.lax.scan(body, init, (micro_batches, jnp.arange(n_micro)))
  weight = metric_sum["weight"]
  total = jnp.where(weight > 0, weight, 1.0)  # weights need not be counts (GRPO: fractions)
  grads = jax.tree.map(lambda g, p: (g / total).astype(p.dtype), grad_sum, params)
  metrics = {k: v if k == "weight" else v / total for k, v in metric_sum.items()}
  return grads, metrics


def make_train_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    *,
    mesh: Mesh,
    state_shardings: TrainState,
    grad_accum: int = 1,
    prepare: Callable[[Any, Batch], Batch] | None = None,
    lora: LoRAConfig | None = None,
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
  """Jits the training step once, with explicit shardings and a donated state.

  Args:
    loss_fn: `loss(params, batch, rng) -> (loss, metrics)` with static
      configuration already bound (functools.partial).
    optimizer: the optax transformation the state was initialised with.
    mesh: the device mesh.
    state_shardings: from `ptx.train.state.state_shardings`.
    grad_accum: micro-batches per step.
    prepare: `prepare(ref_params, batch) -> batch`, the algorithm's batch
      preparation from the frozen reference (e.g. DPO's reference
      log-probs); runs in the same program, without gradients.
    lora: the LoRA config when `state.params` are adapters over `state.base`
      (the state from `init_state(..., lora=)`).

  Returns:
    `step(state, batch) -> (state, metrics)`; metrics are scalars: the loss
    function's metrics plus `grad_norm`, `skipped_steps` (steps so far
    whose non-finite gradients were not applied) and `nonfinite_streak`
    (how many of the latest steps in a row were).
  """

  def step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
    rng = jax.random.fold_in(state.rng, state.step)
    # The model's activation constraints resolve against this mesh.
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      if prepare is not None:
        batch = jax.lax.stop_gradient(prepare(reference_params(state), batch))
      grads, metrics = accumulate_gradients(trainable_loss(loss_fn, state.base, lora), state.params, batch, rng,
                                            grad_accum)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {**metrics, "grad_norm": optax.tree.norm(grads), "skipped_steps": skipped_steps(opt_state),
               "nonfinite_streak": nonfinite_streak(opt_state)}
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

  replicated = NamedSharding(mesh, PartitionSpec())
  # Batch arrays come with their shardings: `ptx.data.global_batch.to_global` places each [batch, ...] array by
  # its rank ([B] reference log-probs, [B, T] tokens), which one in_shardings entry for the batch could not.
  return jax.jit(step, in_shardings=(state_shardings, None), out_shardings=(state_shardings, replicated),
                 donate_argnums=0)


def make_evaluator(loss_fn: LossFn, prepare: Callable[[Any, Batch], Batch] | None, lora: LoRAConfig | None, *,
                   mesh: Mesh, state_shardings: TrainState,
                   batches: Sequence[Batch]) -> Callable[[TrainState], dict[str, float]]:
  """Returns `evaluate(state) -> {"eval/...": mean}` over global `batches`, weighted like the training loss."""

  @functools.partial(jax.jit, in_shardings=(state_shardings, None))
  def metrics(state, batch):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      if prepare is not None:
        batch = prepare(reference_params(state), batch)
      return trainable_loss(loss_fn, state.base, lora, dropout=False)(state.params, batch, state.rng)[1]

  def evaluate(state):
    totals: dict[str, float] = {}
    for batch in batches:
      m = jax.device_get(metrics(state, batch))
      w = float(m["weight"])
      for key, value in m.items():
        totals[key] = totals.get(key, 0.0) + (w if key == "weight" else w * float(value))
    weight = totals.get("weight", 0.0) or 1.0
    return {f"eval/{k}": (v if k == "weight" else v / weight) for k, v in totals.items()}

  return evaluate


@dataclasses.dataclass(frozen=True)
class SupervisedStep:
  """The step of a supervised Job (SFT, DPO): a loss over host batches and its optional reference preparation.

  Attributes:
    loss: `loss(params, batch, rng) -> (loss, metrics)`.
    prepare: `prepare(ref_params, batch) -> batch` from the frozen reference
      (DPO's reference log-probs), or None.
    grad_accum: micro-batches per step.
    lora: the adapters' config when the job trains LoRA, else None.
  """

  loss: Bound
  prepare: Bound | None = None
  grad_accum: int = 1
  lora: LoRAConfig | None = None

  def optimizer_stage(self) -> None:
    """No stage: the optimizer is the plain one."""
    return None

  def stream(self, data: Iterator[Batch]) -> Iterator[Batch]:
    """The training iterator as `fit` reads it: unchanged."""
    return data

  def build(self, optimizer: optax.GradientTransformation, mesh: Mesh, state_shardings: TrainState,
            data: Iterator[Batch]) -> JittedStep:
    """The jitted step for `fit` (it reads no data of its own)."""
    return JittedStep(make_train_step(self.loss, optimizer, mesh=mesh, state_shardings=state_shardings,
                                      grad_accum=self.grad_accum, prepare=self.prepare, lora=self.lora))

  def evaluator(self, state_shardings: TrainState, mesh: Mesh,
                batches: Sequence[Batch]) -> Callable[[TrainState], dict[str, float]]:
    """The held-out evaluation of this step's loss over global `batches`."""
    return make_evaluator(self.loss, self.prepare, self.lora, mesh=mesh, state_shardings=state_shardings,
                          batches=batches)
