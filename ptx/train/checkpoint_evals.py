"""Held-out suites evaluated at checkpoints, and regressions against the stage a run started from.

`build(cfg.eval, tokenizer)` turns a job's `eval` section
(`ptx.config.EvalConfig`) into `SuiteEvals`, once, before anything
compiles: each named suite's environment and task records
(`ptx.envs.suites`) and the sampler's settings. An unknown suite, a file
suite without its file or a file without its suite is a `ConfigError`
naming the field. `ptx eval` evaluates a model through the same object.
The likelihood suites (`choice`, `perplexity`: `ptx.episodes.likelihood`)
read their file too, and score the parameters as they are (whatever
`rollout.mode`) in windows of `SuiteEvals.max_length` positions.

`fit(..., evals=...)` runs it through `CheckpointEvals`:

- before the first step, on the parameters the run starts from: the
  baseline, OUT/evals/step_0 (a resumed run reads it back instead of
  evaluating again);
- every `eval.every` steps (default `train.checkpoint_every`) and after the
  last, into OUT/evals/step_<n>/<suite>/eval.json; not at a preemption
  stop, which must end quickly;
- each evaluation logs `eval/<suite>/pass@1`, `eval/<suite>/pass@k` (k =
  the report's k: `eval.k`, 1 for choice), `eval/<suite>/mean@k` (a
  perplexity suite: `eval/<suite>/bits_per_byte`, `.../byte_perplexity`,
  `.../token_perplexity`) and `eval/<suite>/regressed` (1.0 when pass@1 fell,
  or bits per byte rose, more than `eval.regression` from the baseline,
  `ptx.episodes.evaluation.regressed`); a regression is also a warning naming
  the suite, the step and both values, and an entry of `regressions`.

Evaluation reads the state's parameter arrays in place (`model_params`:
under LoRA the adapters over the base, neither copied) through a fresh
sampler per suite with `eval.seed`, so every evaluation draws the same
random numbers, from its own key, never the state's, and it reads no
training data: a run trains exactly as it would without it. Every process
samples (generation is one SPMD program) and scores; only process 0
writes reports and warns.

The sampler follows `rollout.mode` (`ptx.sampling.engine.mode`): standard
samples the parameters as they are; fast samples their int8 derivation
(made once per evaluation) on a speculative engine with n-gram drafts.

A single-turn suite is sampled by a `TextSampler` (`eval.max_new_tokens`
per completion) on the mode's engine: at most 32 completions decode at
once, so a suite of hundreds of long prompts (BFCL's function docs) takes
the memory of 32, and a finished completion frees its slot for the next
task. A multi-turn suite (`Environment.max_turns` > 1) is played by
`ptx.episodes.evaluation.evaluate_episodes` on the mode's engine over the same
arrays, on the same mesh, token in, token out as training plays episodes,
always through the chat template (the tokenizer's, else ChatML), whatever
`eval.chat`: a reply is a turn of the conversation. Its sizes:
`eval.max_new_tokens` per turn; an episode may add, after its first
prompt, each turn's budget and each reply's allowance (`episode_tokens`), and ends with outcome "limit"
beyond that.

Every suite gets a fresh engine of one shape (`SuiteEvals._extent`): the
context of the longest first prompt of any suite plus what its completion
or episode may add, whole groups of `eval.k`, at most 32 sequences at once
but at least one group on each device that holds pages, with pages for
every slot at its whole context (`episode_engine`). One shape compiles
one set of engine programs per evaluation, its own
(`ptx.sampling.engine.programs.Programs`), dropped when the evaluation
ends: an XLA:CPU executable of a 30-layer model maps over a thousand memory
regions, and an evaluation's programs kept beside training's crossed
Linux's limit of 65,530 per process (`vm.max_map_count`), where LLVM
aborts. Each evaluation compiles its programs again, or loads them from
the persistent compilation cache (`ptx.compile_cache`, on in the commands).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Any, Sequence

from jax.sharding import Mesh

from ptx import paths, sharding
from ptx.config import ConfigError, EvalConfig, LoRAConfig, RolloutConfig
from ptx.model_config import ModelConfig
from ptx.data.tokenizer import Tokenizer, check_fits
from ptx.models import paged_kv_cache
from ptx.episodes import evaluation, likelihood
from ptx.envs import suites
from ptx.envs.base import Environment
from ptx.episodes.turn_format import TurnFormat
from ptx.sampling.engine.config import EngineConfig
from ptx.sampling.engine.mode import RolloutMode
from ptx.sampling.engine.programs import Programs
from ptx.sampling.text import TextSampler, prompt_ids
from ptx.train.metrics import MetricsWriter
from ptx.train.run_dir import RunDirError
from ptx.train.state import TrainState
from ptx.train.step import model_params

log = logging.getLogger(__name__)

# Where a run's evaluations go, one directory per evaluated step: `EVALS/step_<n>/<suite>/eval.json`.
EVALS = "evals"
# Episodes of a multi-turn suite decoding at once (whole groups): its engine's slots, and with them its pages.
_EPISODES_AT_ONCE = 32
# An engine's context is rounded up to this, so suites with similar prompts share compiled programs.
_CONTEXT_STEP = 256
# Tokens an episode's context holds for each environment reply, at least: the shell shows 2000 characters of a
# command's output, some 500 tokens of a BPE tokenizer, error messages take tens.
_REPLY_TOKENS = 256


@dataclasses.dataclass(frozen=True, eq=False)
class SuiteEvals:
  """The suites of an `eval` section, loaded: what each evaluation samples and scores.

  Attributes:
    source: the section it was built from (`fit` refuses it for another).
    suites: (name, environment, task records) of each suite, in the
      section's order; a likelihood suite has no environment (None) and its
      records are `ptx.episodes.likelihood.SUITES`' (choice records, or texts).
    tokenizer: encodes prompts and decodes completions.
    mode: how suites are sampled (`rollout.mode`: standard or fast).
    max_length: positions a likelihood suite's scored sequence may span (the
      model's context; `ptx eval` reads the one the model declares).
  """

  source: EvalConfig
  suites: tuple[tuple[str, Environment | None, tuple[Any, ...]], ...]
  tokenizer: Tokenizer
  mode: RolloutMode = RolloutMode()
  max_length: int = likelihood.WINDOW

  def evaluate(self, params: Any, model: ModelConfig, *, mesh: Mesh | None = None,
               rules: sharding.Rules = sharding.DEFAULT_RULES) -> dict[str, dict[str, Any]]:
    """Evaluates `params` on every suite; returns the reports by suite name.

    Args:
      params: the model parameter tree (placed on `mesh` when given).
      model: its config.
      mesh: sample sharded on this mesh.
      rules: the sharding rules `params` were placed by.

    Returns:
      {suite: its report (`ptx.episodes.evaluation`'s, labelled by `ptx.envs.suites.label`)}.
    """
    section, reports = self.source, {}
    sampled = self.mode.params_fn(model, mesh, rules)(params)  # once per evaluation: the tree every suite samples
    context, size = self._extent
    shape = episode_engine(context, section.k, size, mesh, rules)  # every sampled suite's
    programs = Programs()  # the evaluation's own, released below: training never runs them
    engine = functools.partial(self._engine, model, shape, programs, mesh, rules)  # a fresh one per suite
    try:
      for name, env, tasks in self.suites:
        if env is None:  # a likelihood suite scores the parameters themselves
          scorer = likelihood.Scorer(params, model, self.tokenizer, max_length=self.max_length, mesh=mesh,
                                     rules=rules)
          reports[name] = {"suite": name, **likelihood.SUITES[name][1](scorer, tasks)}
          continue
        if env.max_turns > 1:
          check_fits(self.tokenizer, model.vocab_size, "the evaluation's episodes")
          report = evaluation.evaluate_episodes(engine(), sampled, env, list(tasks), TurnFormat.of(self.tokenizer),
                                                k=section.k, max_turn_tokens=section.max_new_tokens,
                                                max_episode_tokens=episode_tokens(env, section.max_new_tokens))
        else:
          # On an engine of bounded slots, not one batch of the whole suite: memory stays that of its slots however
          # many tasks there are, and a finished completion frees its slot for the next.
          sampler = TextSampler(sampled, model, self.tokenizer, max_new_tokens=section.max_new_tokens,
                                chat=section.chat, mesh=mesh, rules=rules, engine=engine())
          report = evaluation.evaluate(sampler, env, list(tasks), k=section.k)
        reports[name] = suites.label(name, env, list(tasks), report)
    finally:
      programs.release()
    return reports

  @functools.cached_property
  def _extent(self) -> tuple[int, int]:
    """(the longest context, the most tasks) of any sampled suite: the one engine shape they all share.

    One shape compiles one set of engine programs per evaluation, whatever the suites: a set per suite grew with
    every suite, and each XLA:CPU executable of a 30-layer model maps over a thousand memory regions, so six suites
    of SmolLM2-135M crossed Linux's 65,530 per process and aborted in LLVM. Measured once: the prompts do not change
    between evaluations.
    """
    section, contexts, sizes = self.source, [1], [1]  # a shape even with no sampled suite (none is built then)
    for _, env, tasks in self.suites:
      if env is None:
        continue
      if env.max_turns > 1:
        contexts.append(_longest_prompt(env, list(tasks), TurnFormat.of(self.tokenizer)) +
                        episode_tokens(env, section.max_new_tokens))
      else:
        contexts.append(max((len(prompt_ids(self.tokenizer, p, chat=section.chat)) for p in _prompts(env, tasks)),
                            default=0) + section.max_new_tokens)
      sizes.append(len(tasks))
    return max(contexts), max(sizes)

  def _engine(self, model: ModelConfig, shape: EngineConfig, programs: Programs, mesh: Mesh | None,
              rules: sharding.Rules):
    """A fresh engine of the mode over `shape`, seeded with `eval.seed`: every suite draws the same random numbers."""
    section = self.source
    return self.mode.engine(model, shape, sampling=section.sampling, seed=section.seed, mesh=mesh,
                            pad_id=self.tokenizer.pad_id, rules=rules, programs=programs)

  def start(self, out: str | os.PathLike, writer: MetricsWriter, *, model: ModelConfig, lora: LoRAConfig | None,
            mesh: Mesh, rules: sharding.Rules, checkpoint_every: int, primary: bool) -> CheckpointEvals:
    """The evaluations of one `fit` into run directory `out` (`checkpoint_every`: the default cadence)."""
    return CheckpointEvals(self, out, writer, model=model, lora=lora, mesh=mesh, rules=rules,
                           every=self.source.every or checkpoint_every, primary=primary)


def episode_engine(context: int, k: int, tasks: int, mesh: Mesh | None,
                   rules: sharding.Rules = sharding.DEFAULT_RULES) -> EngineConfig:
  """The rollout engine that plays a multi-turn suite: `tasks` groups of `k` episodes of up to `context` positions.

  Every device block of pages (`paged_kv_cache.page_blocks`) gets the same
  whole groups: as many as `_EPISODES_AT_ONCE` episodes allow over all
  blocks, at least one, never more than the suite has, with the pages of
  each of their episodes at `context` (rounded up to `_CONTEXT_STEP`) and
  its sink page, so an admitted episode never waits for pages.

  Args:
    context: positions one episode may fill, first prompt included.
    k: episodes per task (a group: its samples share a device block).
    tasks: tasks in the suite.
    mesh: the mesh the engine runs on (None: one device).
    rules: the sharding rules.

  Returns:
    The engine's shapes (the engine's defaults for its page size and calls).
  """
  # The mesh's size is a multiple of every product of its axes: the batch axes all divide it.
  blocks = paged_kv_cache.page_blocks(1 if mesh is None else mesh.devices.size, mesh, rules)
  groups = max(1, min(-(-tasks // blocks), _EPISODES_AT_ONCE // (k * blocks)))  # per block
  slots = groups * k
  context = -(-context // _CONTEXT_STEP) * _CONTEXT_STEP
  rows = blocks * min(slots, -(-8 // blocks))
  return EngineConfig.sized(blocks * slots, context, prefill_rows=rows).on_blocks(blocks)


def _prompts(env: Environment, tasks: Sequence[dict[str, Any]]) -> list[str]:
  """The first prompts of `tasks`, as text (each episode started to read it, then closed)."""
  prompts = []
  for index, task in enumerate(tasks):
    try:
      episode = env.reset(task)
    except ValueError as e:
      raise ValueError(f"task {index}: {e}") from None
    try:
      prompts.append(episode.prompt)
    finally:
      episode.close()
  return prompts


def _longest_prompt(env: Environment, tasks: list[dict[str, Any]], fmt: TurnFormat) -> int:
  """Tokens of the longest first prompt of `tasks` in `fmt`."""
  return max((len(fmt.prompt(prompt)) for prompt in _prompts(env, tasks)), default=0)


def episode_tokens(env: Environment, max_new_tokens: int) -> int:
  """Tokens an evaluated episode may add after its first prompt: its turns' and its replies' allowance.

  Each turn gets `max_new_tokens`; each reply (a tool's output or error) as
  much, at least _REPLY_TOKENS, or the bound an environment that counts its
  replies' tokens declares (`reply_tokens`, docqa's), whichever is most. The
  total bounds the episode, not each turn: a long reply can use what short
  turns left.
  """
  reply = max(max_new_tokens, _REPLY_TOKENS, getattr(env, "reply_tokens", 0))
  return env.max_turns * max_new_tokens + (env.max_turns - 1) * reply


def build(section: EvalConfig, tokenizer: Tokenizer, rollout: RolloutConfig = RolloutConfig()) -> SuiteEvals | None:
  """Loads the suites an `eval` section names; None when it names none.

  Args:
    section: the job's `cfg.eval`.
    tokenizer: the job's tokenizer.
    rollout: the job's `cfg.rollout`: how the suites are sampled.

  Returns:
    The SuiteEvals for `fit(..., evals=...)` or `ptx eval`, or None.

  Raises:
    ConfigError: naming `eval.suites` or `eval.files` for an unknown suite,
      a file suite without its file, a file without its suite, or a task
      file that cannot be read.
  """
  files = dict(entry.split("=") for entry in section.files)
  if len(files) != len(section.files):
    raise ConfigError(f"eval.files names a suite twice: {section.files}")
  known, file_suites = suites.NAMES + tuple(likelihood.SUITES), suites.FILE_SUITES + tuple(likelihood.SUITES)
  unknown = [name for name in section.suites if name not in known]
  if unknown:
    raise ConfigError(f"eval.suites: unknown suite(s) {unknown}; known: {', '.join(known)}")
  needs_file = [name for name in section.suites if name in file_suites and name not in files]
  if needs_file:
    entries = ", ".join(f"'{name}=PATH'" for name in needs_file)
    raise ConfigError(f"eval.suites: {needs_file} read their tasks from a JSONL file: add {entries} to eval.files")
  stray = [name for name in files if name not in section.suites or name not in file_suites]
  if stray:
    raise ConfigError(f"eval.files: {stray} are not file suites ({', '.join(file_suites)}) named in "
                      f"eval.suites {section.suites}")
  if not section.suites:
    return None
  loaded = []
  for name in section.suites:
    try:
      if name in likelihood.SUITES:
        loaded.append((name, None, tuple(likelihood.SUITES[name][0](files[name], section.n))))
        continue
      env, tasks = suites.load(name, n=section.n, seed=section.seed, path=files.get(name),
                              tokenizer=tokenizer, answer_match=section.answer_match,
                              chat=section.chat, families=section.families)
    except (OSError, ValueError) as e:  # a missing file or a bad record: named with the field that points at it
      raise ConfigError(f"eval.files {name}={files[name]}: {e}" if name in files else f"eval.suites {name}: {e}") from e
    loaded.append((name, env, tuple(tasks)))
  return SuiteEvals(source=section, suites=tuple(loaded), tokenizer=tokenizer, mode=RolloutMode.of(rollout))


class CheckpointEvals:
  """One run's evaluations: the baseline, each checkpoint's, and the regressions flagged against it."""

  def __init__(self, evals: SuiteEvals, out: str | os.PathLike, writer: MetricsWriter, *, model: ModelConfig,
               lora: LoRAConfig | None, mesh: Mesh, rules: sharding.Rules, every: int, primary: bool):
    self._evals, self._out, self._writer = evals, paths.path(out), writer
    self._model, self._lora, self._mesh, self._rules = model, lora, mesh, rules
    self.every, self._primary = every, primary
    self._baseline: dict[str, dict[str, Any]] = {}
    # Each flagged (suite, step) of this call of fit: {"suite", "step", "baseline", "pass@1"}.
    self.regressions: list[dict[str, Any]] = []

  def baseline(self, state: TrainState, resumed_from: int | None) -> None:
    """Evaluates the starting state as step 0, or on a resumed run reads step 0's reports back.

    Raises:
      RunDirError: a resumed run's directory lacks a suite's baseline report.
    """
    if resumed_from is None:
      self._baseline = self.evaluate(0, state)
      return
    where = self._out / EVALS / "step_0"
    try:
      saved = evaluation.read_suites(where)
    except (OSError, ValueError):
      saved = {}
    missing = [name for name, _, _ in self._evals.suites if name not in saved]
    if missing:
      raise RunDirError(f"--resume of {self._out}: {where} lacks the baseline report of {missing} (written before "
                        "the first step); start a new run (another --out) to evaluate them")
    self._baseline = saved

  def after(self, step: int, last_step: int) -> bool:
    """Whether step `step` of a run of `last_step` steps is evaluated."""
    return step % self.every == 0 or step == last_step

  def evaluate(self, step: int, state: TrainState) -> dict[str, dict[str, Any]]:
    """Evaluates the state after step `step`: writes the reports, logs them, flags regressions; returns them."""
    reports = self._evals.evaluate(model_params(state, self._lora), self._model, mesh=self._mesh, rules=self._rules)
    if self._primary:
      evaluation.write_suites(reports, self._out / EVALS / f"step_{step}")
    baseline = self._baseline or reports  # step 0 is its own baseline
    threshold = self._evals.source.regression
    record: dict[str, Any] = {"step": step}
    for name, report in reports.items():
      flagged = evaluation.regressed(baseline[name], report, threshold)
      metric, now, _ = evaluation.headline(report)
      before = evaluation.headline(baseline[name])[1]
      if metric == "pass@1":
        record.update({f"eval/{name}/pass@1": now, f"eval/{name}/pass@k": report["pass@k"][str(report["k"])],
                       f"eval/{name}/mean@k": report["mean@k"]})
      else:
        record.update({f"eval/{name}/{m}": report[m] for m in ("bits_per_byte", "byte_perplexity",
                                                               "token_perplexity")})
      record[f"eval/{name}/regressed"] = float(flagged)
      if flagged:
        self.regressions.append({"suite": name, "step": step, "baseline": before, metric: now})
        if self._primary:
          log.warning("eval: suite %s regressed at step %d: %s %.4f, baseline %.4f (a change of %+.4f beyond "
                      "eval.regression=%g)", name, step, metric, now, before, now - before, threshold)
    self._writer.write(record)
    return reports
