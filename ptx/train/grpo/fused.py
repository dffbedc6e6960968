"""GRPO's fused mode: sample -> in-graph reward -> advantages -> updates in one jitted program per RL step.

`make_grpo_step` jits `sample`, an in-graph reward and `learn`
(`ptx.train.grpo.update`), with DAPO's refill of zero-variance groups when
`filter_groups="refill"` (`ptx.algorithms.dynamic_sampling`, as the
host-reward mode does), as one executable per RL step; `FusedGRPOStep` is
that step as a Job holds it (`ptx.train.job.grpo_job`). With transcripts on
(`grpo.samples_every`), the program also returns the step's first
`grpo.samples_rows` rows, which `FusedStep` fetches only for the steps it
writes (`ptx.train.grpo.samples`), one step late.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ptx.algorithms import advantages as adv_lib
from ptx.algorithms import dynamic_sampling
from ptx.data.tokenizer import Tokenizer
from ptx.sampling.generation import Generation
from ptx.train.grpo.samples import SampleLog, rows_of
from ptx.train.grpo.update import GRPOStepKind, RLSpec, learn, rollout_batch, sample, step_keys
from ptx.train.state import TrainState
from ptx.train.step import JittedStep, model_params

# reward(generation, task) -> float32 [R] or named components {name: [R]}; task arrays are already repeated to
# R = B * G rows.
RewardFn = Callable[[Generation, dict[str, jax.Array]], adv_lib.Rewards]


def sample_kept_groups(params: Any, batch: dict[str, Any], key: jax.Array, spec: RLSpec,
                       reward_fn: RewardFn) -> tuple[dict[str, jax.Array], Generation, jax.Array, dict]:
  """DAPO dynamic sampling in-graph: rounds of B prompts until B groups with signal are kept.

  `batch["prompts"]` holds B * (1 + max_refill_rounds) prompts; round r
  samples and scores prompts r * B .. (r + 1) * B - 1, and its groups whose
  un-shaped reward is not constant fill the next free slots. Rounds stop
  once B groups are kept; slots still free after the last round keep a
  round-0 group with `keep` = 0 (trained on what is available, never a
  crash). Without refill, one round of B prompts.

  Returns:
    (rollout batch with `keep` [R], generation, raw rewards [R] or their
    components, metrics).
  """
  G, rounds = spec.grpo.group_size, spec.grpo.refill_rounds
  if batch["prompts"].shape[0] % rounds:
    raise ValueError(f"{batch['prompts'].shape[0]} prompts do not split into {rounds} refill rounds")
  B = batch["prompts"].shape[0] // rounds
  take = lambda x, r: jax.lax.dynamic_slice_in_dim(x, r * B, B)

  def sample_round(r):
    prompts, lengths = take(batch["prompts"], r), take(batch["prompt_lengths"], r)
    task = jax.tree.map(lambda x: jnp.repeat(take(x, r), G, axis=0), batch["task"])
    gen = sample(params, prompts, lengths, jax.random.fold_in(key, r) if rounds > 1 else key, spec)
    rewards = reward_fn(gen, task)
    by_group = lambda x: x.reshape(B, G, *x.shape[1:])
    rows = {"batch": jax.tree.map(by_group, rollout_batch(prompts, lengths, gen, G)),
            "gen": jax.tree.map(by_group, dataclasses.replace(gen, routes=None)),  # the batch holds them
            "rewards": jax.tree.map(by_group, rewards)}
    return rows, adv_lib.groups_with_signal(adv_lib.total_reward(rewards, spec.grpo.reward_weights), G)

  first, signal = sample_round(0)
  if rounds == 1:
    flat = jax.tree.map(lambda x: x.reshape(B * G, *x.shape[2:]), first)
    return flat["batch"], flat["gen"], flat["rewards"], {}

  def body(loop):
    r, kept, sampled, with_signal = loop
    rows, signal = sample_round(r)
    return r + 1, dynamic_sampling.place(kept, rows, signal), sampled + B, with_signal + signal.sum()

  start = (jnp.int32(1), dynamic_sampling.place(dynamic_sampling.start(first), first, signal), jnp.int32(B),
           signal.sum())
  r, kept, sampled, with_signal = jax.lax.while_loop(lambda l: (l[0] < rounds) & (l[1].count < B), body, start)
  flat, keep = dynamic_sampling.flat(kept)
  flat["batch"]["keep"] = keep
  return flat["batch"], flat["gen"], flat["rewards"], dynamic_sampling.metrics(kept, sampled=sampled,
                                                                               with_signal=with_signal, rounds=r)


def make_grpo_step(spec: RLSpec, reward_fn: RewardFn, *, optimizer: optax.GradientTransformation, mesh: Mesh,
                   state_shardings: TrainState, sample_rows: int = 0) -> Callable[..., tuple[Any, ...]]:
  """Jits one fused RL step with explicit shardings and a donated state.

  Args:
    spec: the static step description (model, GRPO config, budget, stop ids, LoRA, rules).
    reward_fn: the in-graph reward.
    optimizer: the optax transformation of the state.
    mesh: the device mesh.
    state_shardings: from `state_shardings(..., with_reference=spec.grpo.uses_reference, lora=spec.lora)`.
    sample_rows: > 0: the step also returns its first this many rows (`ptx.train.grpo.samples.rows_of`).

  Returns:
    `step(state, batch) -> (state, metrics)`, or `(state, metrics, rows)` with `sample_rows`, with
    batch = {"prompts" [B', P] left-padded, "prompt_lengths" [B'], "task": reward_fn's arrays [B', ...]}
    (`ptx.train.grpo.prompts.PromptBatches`), B' = B prompts, or B * (1 +
    max_refill_rounds) with `filter_groups="refill"`.
  """

  def step(state: TrainState, batch: dict[str, Any]):
    sample_key, update_key = step_keys(state)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      rollouts, gen, rewards, filter_metrics = sample_kept_groups(model_params(state, spec.lora), batch, sample_key,
                                                                  spec, reward_fn)
      rows = rows_of(rollouts, gen, rewards, sample_rows) if sample_rows else None
      state, metrics = learn(state, rollouts, gen, rewards, update_key, spec, optimizer)
    return (state, {**metrics, **filter_metrics}) + ((rows,) if sample_rows else ())

  # Prompts and task fields are small: they arrive as they are and the sampler's
  # constraints shard the rows; the state keeps its layout and is donated.
  # Replicated metrics and rows: every process can read them.
  replicated = NamedSharding(mesh, PartitionSpec())
  return jax.jit(step, in_shardings=(state_shardings, None),
                 out_shardings=(state_shardings, replicated) + ((replicated,) if sample_rows else ()),
                 donate_argnums=0)


class FusedStep(JittedStep):
  """The fused step as `fit` runs it: the jitted step, keeping the rows of the steps `samples` writes.

  Args:
    fn: `make_grpo_step(..., sample_rows=samples.rows)`.
    samples: which steps keep their rows.
    group_size: G.
  """

  def __init__(self, fn: Callable[..., tuple[Any, ...]], samples: SampleLog, group_size: int):
    super().__init__(fn)
    self._samples, self._group_size = samples, group_size
    self._next: int | None = None  # the 1-based number of the next step, counted here: reading state.step waits

  def __call__(self, state: TrainState, batch: dict[str, Any]) -> tuple[TrainState, dict[str, jax.Array]]:
    if not self._samples.rows:
      return self._fn(state, batch)
    if self._next is None:  # the first step's state is ready: a fresh or restored one
      self._next = int(state.step) + 1
    step, self._next = self._next, self._next + 1
    state, metrics, rows = self._fn(state, batch)
    if self._samples.due(step):
      self._samples.keep(step, rows, self._group_size)
    return state, metrics

  def take_samples(self, wait: bool = False) -> dict[int, bytes]:
    """The transcripts of the steps that kept rows (`SampleLog.take`), by step."""
    return self._samples.take(wait)


@dataclasses.dataclass(frozen=True)
class FusedGRPOStep(GRPOStepKind):
  """The fused GRPO step of a Job: `spec`, an in-graph `reward_fn`, jitted by `build`; the transcripts' tokenizer."""

  reward_fn: RewardFn
  tokenizer: Tokenizer | None = dataclasses.field(default=None, compare=False)

  def stream(self, data: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """The prompt iterator as `fit` reads it: unchanged."""
    return data

  def build(self, optimizer: optax.GradientTransformation, mesh: Mesh, state_shardings: TrainState,
            data: Iterator[dict[str, Any]]) -> FusedStep:
    """The jitted step for `fit` (it reads no data of its own)."""
    samples = SampleLog(self.spec.grpo, self.tokenizer)
    return FusedStep(make_grpo_step(self.spec, self.reward_fn, optimizer=optimizer, mesh=mesh,
                                    state_shardings=state_shardings, sample_rows=samples.rows), samples,
                     self.spec.grpo.group_size)
