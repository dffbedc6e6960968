"""Multi-turn episodes with slow tools: the episode loop (tools overlap decoding) against lockstep turns.

Every method runs the same episodes through the same engine, model and seed:

  overlap   `ptx.episodes.loop.play`: an episode's reply goes back to the
            engine the moment its tool returns, and the engine decodes
            whichever episodes are not waiting on a tool
  lockstep  one turn-batch at a time, as a loop that decodes every live
            episode's turn and then runs all their tools (concurrently) does:
            every turn waits for the slowest tool of the batch
  play_lockstep  `play(..., lockstep=True)`, multi-turn training's default
            (`grpo.episode_lockstep`): tools run while the engine decodes,
            but replies join only when it can run nothing else, all at once,
            so log-probs do not depend on tool timing; slots refill as
            episodes end, where lockstep waves wait for the whole wave

The environment's tool calls sleep for a duration drawn from [--tool-min,
--tool-max] seconds, uniformly or log-uniformly (--tool-dist: most calls
quick, a long tail of slow ones), seeded by task, sample and turn, the same
for both methods; an episode takes --turns tool calls, its last one ending it.
--episodes = tasks x --samples in all, --concurrent at once: the engine's
slots, which the episode loop refills as episodes end, and the size of each
lockstep wave.
`tool_floor_s` is what each method would take if decoding cost nothing, from
the seeded tool durations alone: lockstep waits for the slowest tool of its
wave every turn (the sum over waves and turns of the wave's longest call);
the episode loop admits each task's --samples episodes, in order, as that
many slots come free, so its floor is that schedule played out with each
episode taking its tool time (`overlap`). Their ratio, `tool_bound`, is the
most overlap can gain over lockstep on this workload on any device. It is
below the ratio to a perfect spread of the episodes' tool time over the slots
(`overlap_ideal`: the larger of the total over --concurrent and the longest
episode; `tool_bound_ideal`) by the tail: the episodes admitted last run on
while other slots have nothing left to take, and no order chosen without
knowing the durations shortens it. The fewer episodes per slot, the more the
tail weighs: with 4 per slot (256 episodes, 64 at once) and log-uniform tools
it holds the loop to 1.91x of lockstep where the spread would allow 2.50x.
With uniform durations the spread's bound is about
E[max of --concurrent draws] / E[draw] (0.99 / 0.55 = 1.79 for 64 draws of
U(0.1, 1)).
`device_busy_frac` is the fraction of the wall time spent inside engine calls
(each call ends by fetching its tokens, so that is the device at work or the
host feeding it); `episodes_per_s` is episodes over wall seconds. Every method
runs the workload untimed until a run compiles nothing new (at most
--max-warmups + 1 times), then once timed; --rounds alternate
the methods; one JSON line per run, then a summary with the median over rounds
and the ratio overlap / lockstep.

    .venv/bin/python benchmarks/agent.py --episodes 1024 --concurrent 64 --tool-dist loguniform --rounds 3
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import heapq
import json
import os
import random
import statistics
import time

import jax

from ptx.model_config import ModelConfig
from ptx.data.tokenizer import ByteTokenizer
from ptx.models import init_params
from ptx.envs.base import Outcome, Step
from ptx.episodes.loop import play
from ptx.episodes.turn_format import TurnFormat
from ptx.sampling import SamplingConfig
from ptx.sampling.engine.engine import RolloutEngine
from ptx.sampling.engine.config import EngineConfig
from ptx.sampling.generation import STOP

import sampling as sampling_bench  # benchmarks/ is the script's folder, first on sys.path

# "toy" is for checking the script itself quickly (its test), not for figures.
MODELS = {"anchor": sampling_bench.CFG,
          "toy": ModelConfig(vocab_size=264, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64)}


@dataclasses.dataclass(frozen=True)
class ToolTimes:
  """How long the tools take: seconds in [low, high], "uniform" or "loguniform"."""

  low: float
  high: float
  dist: str = "uniform"

  def seconds(self, prompt: str, sample: int, call: int) -> float:
    """The seeded duration of a tool call (1-based `call`) of sample `sample` of the task `prompt`."""
    u = random.Random(f"{prompt}/{sample}/{call}").random()
    if self.dist == "uniform":
      return self.low + u * (self.high - self.low)
    return self.low * (self.high / self.low) ** u


def tool_times(args) -> ToolTimes:
  """The tools' durations of the command line."""
  return ToolTimes(args.tool_min, args.tool_max, args.tool_dist)


def tool_floors(tasks: list[dict], args) -> dict:
  """Each method's wall time if decoding cost nothing (see the module docstring), and their ratios."""
  per_wave = args.concurrent // args.samples
  times = tool_times(args)
  calls = {(t, s): [times.seconds(task["prompt"], s, c) for c in range(1, args.turns + 1)]
           for t, task in enumerate(tasks) for s in range(args.samples)}
  lockstep = sum(max(calls[(t, s)][c] for t in range(w, min(w + per_wave, len(tasks))) for s in range(args.samples))
                 for w in range(0, len(tasks), per_wave) for c in range(args.turns))
  episodes = [sum(c) for c in calls.values()]  # task-major, as the loop submits them
  overlap = admitted_in_order(episodes, args.concurrent, args.samples)
  ideal = max(sum(episodes) / args.concurrent, max(episodes))
  # Every episode takes --turns calls, so the episodes that drain together end together and free their slots as
  # a wave: play_lockstep's floor is lockstep's.
  return {"tool_floor_s": {"overlap": round(overlap, 3), "lockstep": round(lockstep, 3),
                           "play_lockstep": round(lockstep, 3), "overlap_ideal": round(ideal, 3)},
          "tool_bound": round(lockstep / overlap, 3), "tool_bound_ideal": round(lockstep / ideal, 3)}


def admitted_in_order(durations: list[float], slots: int, group: int) -> float:
  """When the last episode ends, if each group of `group` consecutive ones starts, in order, once that many of
  `slots` are free, and runs for its duration."""
  ends: list[float] = []  # a heap of the running episodes' end times
  now = 0.0
  for start in range(0, len(durations), group):
    while len(ends) > slots - group:
      now = heapq.heappop(ends)
    for duration in durations[start:start + group]:
      heapq.heappush(ends, now + duration)
  return max(ends)


class SleepyEpisode:
  """A tool call per turn that sleeps its seeded duration; done after `turns` calls."""

  def __init__(self, env: "SleepyEnv", task: dict, sample: int):
    self.env, self.task, self.sample, self.calls = env, task, sample, 0
    self.prompt = task["prompt"]

  def step(self, action: str) -> Step:
    self.calls += 1
    time.sleep(self.env.times.seconds(self.task["prompt"], self.sample, self.calls))
    if self.calls >= self.env.turns:
      return Step.final(Outcome.OK, "done", reward=float(len(action) % 2))
    return Step(observation=f"output {self.calls}")

  def close(self) -> None:
    pass


class SleepyEnv:
  """Episodes of `SleepyEpisode`; reset numbers a task's samples in order."""

  name, sandboxed = "sleepy", False

  def __init__(self, turns: int, times: ToolTimes):
    self.turns, self.max_turns, self.times = turns, turns, times
    self._samples: dict[str, int] = {}

  def reset(self, task: dict) -> SleepyEpisode:
    sample = self._samples.get(task["prompt"], 0)
    self._samples[task["prompt"]] = sample + 1
    return SleepyEpisode(self, task, sample)


def timed_engine(engine: RolloutEngine) -> list[float]:
  """Wraps `engine.step` to add each call's seconds to the returned list."""
  seconds, step = [], engine.step

  def wrapped(*args, **kwargs):
    start = time.perf_counter()
    out = step(*args, **kwargs)
    seconds.append(time.perf_counter() - start)
    return out

  engine.step = wrapped
  return seconds


def run_play(engine, params, env, tasks, fmt, args, *, lockstep: bool = False) -> dict:
  """The episode loop."""
  out = play(engine, params, env, tasks, fmt, samples=args.samples, max_turn_tokens=args.turn_tokens,
             tool_threads=args.concurrent, lockstep=lockstep)
  return {"episodes_done": len(out), "tool_calls": sum(t.turns for t in out)}


def run_lockstep(engine, params, env, tasks, fmt, args) -> dict:
  """Waves of --concurrent episodes, each in turn-batches: decode every live episode's turn, then wait for all tools."""
  per_wave, calls = args.concurrent // args.samples, 0
  for start in range(0, len(tasks), per_wave):
    calls += _lockstep_wave(engine, params, env, tasks[start:start + per_wave], fmt, args)
  return {"episodes_done": len(tasks) * args.samples, "tool_calls": calls}


def _lockstep_wave(engine, params, env, tasks, fmt, args) -> int:
  """One wave of lockstep turns; returns its tool calls."""
  episodes, messages, turns = {}, {}, 0
  for task in tasks:
    group = [env.reset(task) for _ in range(args.samples)]
    ids = engine.submit(fmt.prompt(task["prompt"]), max_new_tokens=args.turn_tokens, stop_ids=fmt.stop_ids,
                        samples=args.samples, keep=True, reserve=engine.config.max_seq_len)
    for seq_id, episode in zip(ids, group):
      episodes[seq_id], messages[seq_id] = episode, [{"role": "user", "content": task["prompt"]}]
  with concurrent.futures.ThreadPoolExecutor(args.concurrent) as pool:
    while episodes:
      finished = {}
      while engine.busy:
        finished.update((c.seq_id, c) for c in engine.step(params))
      actions = {i: fmt.action(c.tokens) for i, c in finished.items()}
      results = dict(zip(actions, pool.map(lambda i: episodes[i].step(actions[i]), actions)))
      turns += len(results)
      for seq_id, step in results.items():
        messages[seq_id].append({"role": "assistant", "content": actions[seq_id]})
        if step.done:
          engine.release(seq_id)
          del episodes[seq_id]
          continue
        c = finished[seq_id]
        closed = c.finish_reason == STOP and int(c.tokens[-1]) in fmt.stop_ids
        reply = fmt.reply(messages[seq_id], step.observation, closed=closed)
        messages[seq_id].append({"role": fmt.reply_role, "content": step.observation})
        engine.extend(seq_id, reply, max_new_tokens=args.turn_tokens)
  return turns


_COMPILES = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, seconds, **_: _COMPILES.append(seconds)
    if name == "/jax/core/compile/backend_compile_duration" else None)


def workload(args, episodes: int | None = None) -> list[dict]:
  """The tasks: `episodes` (default --episodes) / --samples of them, the first ones of the whole workload."""
  return [{"prompt": f"task {i}: run the tools"} for i in range((episodes or args.episodes) // args.samples)]


def measure(method: str, params, cfg, args) -> dict:
  """One timed run of `method` on a fresh engine, after untimed ones until a run compiles nothing new.

  Which shape buckets a run's engine calls take depends on when tools
  return, so one warm-up run may not meet them all; `compiles` counts the
  programs compiled during the timed run anyway (0 when it ran warm). With
  --warmup-episodes the untimed runs play only that many episodes (the
  workload's first ones), all of them warm-ups, and one timed run of the
  whole workload follows.
  """
  config = EngineConfig(max_seqs=args.concurrent, pages=args.concurrent * (args.context // args.page_size) + 1,
                        page_size=args.page_size, max_seq_len=args.context, decode_steps=args.decode_steps,
                        prefill_chunk=64, prefill_rows=16)
  fmt = TurnFormat(ByteTokenizer())
  run = {"overlap": run_play, "lockstep": run_lockstep,
         "play_lockstep": lambda *a: run_play(*a, lockstep=True)}[method]

  def once(tasks: list[dict]) -> dict:
    engine = RolloutEngine(cfg, config, sampling=SamplingConfig(temperature=1.0), seed=args.seed)
    seconds = timed_engine(engine)
    env = SleepyEnv(args.turns, tool_times(args))
    compiled = len(_COMPILES)
    start, cpu = time.perf_counter(), time.process_time()
    record = run(engine, params, env, tasks, fmt, args)
    wall = time.perf_counter() - start
    return dict(record, wall_s=round(wall, 3), cpu_s=round(time.process_time() - cpu, 3),
                engine_s=round(sum(seconds), 3), engine_calls=len(seconds), compiles=len(_COMPILES) - compiled)

  tasks, warmups = workload(args), 0
  warm = workload(args, args.warmup_episodes) if args.warmup_episodes else tasks
  while True:
    record = once(warm)
    if warmups >= 1 and (record["compiles"] == 0 or warmups > args.max_warmups):
      break
    warmups += 1
  if args.warmup_episodes:
    warmups, record = warmups + 1, once(tasks)
  record.update(warmup_runs=warmups, load_avg_1m=round(os.getloadavg()[0], 2))
  record.update(episodes_per_s=round(record["episodes_done"] / record["wall_s"], 3),
                device_busy_frac=round(record["engine_s"] / record["wall_s"], 3))
  return record


def parser() -> argparse.ArgumentParser:
  """The script's options; `device_check` parses its own list with them."""
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", default="anchor", choices=sorted(MODELS), help="anchor: the Tunix harness's config")
  p.add_argument("--episodes", type=int, default=256, help="episodes in all, --samples per task")
  p.add_argument("--concurrent", type=int, default=64, help="episodes the engine holds at once (its slots)")
  p.add_argument("--samples", type=int, default=4, help="episodes per task (a GRPO group)")
  p.add_argument("--turns", type=int, default=3, help="tool calls per episode")
  p.add_argument("--tool-min", type=float, default=0.1)
  p.add_argument("--tool-dist", default="uniform", choices=("uniform", "loguniform"))
  p.add_argument("--tool-max", type=float, default=1.0)
  p.add_argument("--turn-tokens", type=int, default=32)
  p.add_argument("--context", type=int, default=512)
  p.add_argument("--page-size", type=int, default=16)
  p.add_argument("--decode-steps", type=int, default=8)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--methods", default="overlap,lockstep")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--max-warmups", type=int, default=4, help="untimed runs at most before the timed one")
  p.add_argument("--warmup-episodes", type=int, default=0,
                 help="episodes of each untimed run (a multiple of --samples); default: the whole workload")
  return p


def rows(args):
  """Yields one row per run (the methods alternating over --rounds), then the summary row."""
  if args.episodes % args.samples or args.concurrent % args.samples or args.warmup_episodes % args.samples:
    raise SystemExit(f"--episodes {args.episodes}, --concurrent {args.concurrent} and --warmup-episodes "
                     f"{args.warmup_episodes} must be multiples of --samples {args.samples}")
  cfg = MODELS[args.model]
  params = init_params(cfg, jax.random.key(args.seed))
  context = {"backend": jax.default_backend(),
             **{k: v for k, v in vars(args).items() if k not in ("methods", "rounds", "max_warmups")}}
  methods = args.methods.split(",")
  runs: dict[str, list[dict]] = {m: [] for m in methods}
  for r in range(args.rounds):
    for method in methods if r % 2 == 0 else methods[::-1]:
      record = measure(method, params, cfg, args)
      runs[method].append(record)
      yield {"method": method, "round": r, **record, **context}
  summary = {m: {"episodes_per_s_median": statistics.median(x["episodes_per_s"] for x in rs),
                 "device_busy_frac_median": statistics.median(x["device_busy_frac"] for x in rs),
                 "runs": [x["episodes_per_s"] for x in rs], "cpu_s": [x["cpu_s"] for x in rs]}
             for m, rs in runs.items() if rs}  # --rounds 0: the tool floors alone
  for other in ("lockstep", "play_lockstep"):
    if {"overlap", other} <= set(summary):
      summary[f"overlap_over_{other}"] = round(summary["overlap"]["episodes_per_s_median"]
                                               / summary[other]["episodes_per_s_median"], 2)
  summary.update(tool_floors(workload(args), args))
  yield {"summary": summary, "load_avg_1m_end": round(os.getloadavg()[0], 2)}


def main() -> None:
  """Alternates the methods over rounds; one JSON line per run, then the summary."""
  for row in rows(parser().parse_args()):
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
  main()
