"""ptx.train.checkpoint_evals: held-out suites at checkpoints, regressions against the baseline, `--compare`."""

import dataclasses
import json
import logging
import shutil

import jax
import numpy as np
import pytest

from ptx import cli, config_io
from ptx.config import Config, ConfigError, DataConfig, EvalConfig, MeshConfig, SamplingConfig, TrainConfig
from ptx.model_config import MODEL_PRESETS
from ptx.data.arithmetic import ArithmeticTask
from ptx.data.pipeline import make_pipeline
from ptx.data.sources import MemorySource
from ptx.data.tokenizer import ByteTokenizer
from ptx.episodes import evaluation
from ptx.sampling.engine.engine import RolloutEngine
from ptx.sharding import make_mesh
from ptx.train import checkpoint_evals
from ptx.train.job import sft_job
from ptx.train.loop import fit
from ptx.train.run_dir import RunDirError

TOK = ByteTokenizer()
SUITES = ("arithmetic", "countdown")
# Two suites of 2 tasks x 2 samples of 4 tokens: cheap, and pass@1 moves in steps of 1/4.
EVAL = EvalConfig(suites=SUITES, n=2, k=2, max_new_tokens=4)
BASE = Config(model=dataclasses.replace(MODEL_PRESETS["tiny"](), n_layers=1, d_model=64, mlp_dim=128),
              mesh=MeshConfig(data=2, fsdp=4),
              train=TrainConfig(steps=4, log_every=2, checkpoint_every=2, keep_checkpoints=5),
              data=DataConfig(batch_size=8, seq_len=32, num_bins=4), eval=EVAL)


def _fit(cfg, out, resume=False):
  task = ArithmeticTask(0, 2)
  records = [{"prompt": task[i]["prompt"], "completion": task[i]["answer"]} for i in range(200)]
  return fit(cfg, sft_job(cfg, TOK), train_data=make_pipeline(MemorySource(records), TOK, cfg.data), out=out,
             resume=resume, evals=checkpoint_evals.build(cfg.eval, TOK), progress=False)


def _records(out):
  return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _evals(out):
  return {r["step"]: r for r in _records(out) if any(k.startswith("eval/") for k in r)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The same 4-step SFT run with the two suites evaluated every 2 steps and without evaluation."""
  with_evals, without = tmp_path_factory.mktemp("with_evals"), tmp_path_factory.mktemp("without")
  state, summary = _fit(BASE, with_evals)
  plain_state, _ = _fit(dataclasses.replace(BASE, eval=EvalConfig()), without)
  return {"out": with_evals, "state": state, "summary": summary, "plain_out": without, "plain_state": plain_state}


def test_the_suites_are_evaluated_before_the_first_step_and_at_every_checkpoint(runs):
  out = runs["out"]
  records = _evals(out)
  assert sorted(records) == [0, 2, 4]
  for step, record in records.items():
    for name in SUITES:
      report = evaluation.read_report(out / "evals" / f"step_{step}" / name / "eval.json")
      assert report["suite"] == name and report["tasks"] == 2 and report["k"] == 2
      assert (out / "evals" / f"step_{step}" / name / "samples.jsonl").is_file()
      assert record[f"eval/{name}/pass@1"] == report["pass@k"]["1"]
      assert record[f"eval/{name}/pass@k"] == report["pass@k"]["2"]
      assert record[f"eval/{name}/mean@k"] == report["mean@k"]
      baseline = evaluation.read_report(out / "evals" / "step_0" / name / "eval.json")
      assert record[f"eval/{name}/regressed"] == float(evaluation.regressed(baseline, report, EVAL.regression))
  flagged = [{"suite": n, "step": s} for s, r in records.items() for n in SUITES if r[f"eval/{n}/regressed"]]
  assert [{"suite": r["suite"], "step": r["step"]} for r in runs["summary"]["eval/regressions"]] == flagged
  assert json.loads((out / "config.json").read_text())["eval"]["suites"] == list(SUITES)


def test_evaluation_does_not_change_training(runs):
  # Bitwise: evaluation draws from its own key and reads no training data, so the same steps run.
  same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), runs["state"].params,
                      runs["plain_state"].params)
  assert all(jax.tree.leaves(same))
  losses = [[r["loss"] for r in _records(runs[out]) if "loss" in r] for out in ("out", "plain_out")]
  assert losses[0] == losses[1] and len(losses[0]) == 2
  assert not (runs["plain_out"] / "evals").exists()
  assert "eval" not in json.loads((runs["plain_out"] / "config.json").read_text())


def test_a_resumed_run_flags_a_drop_below_the_baseline_in_its_directory(runs, tmp_path, caplog, capsys):
  out = tmp_path / "run"
  shutil.copytree(runs["out"], out)
  baseline = out / "evals" / "step_0"
  # pass@1 here is a multiple of 1/4 in [0, 1]. From 1.0 only a perfect score (all 4 samples of 3-digit
  # arithmetic right, from a tiny model after 6 steps of 2-digit addition) would not be a drop beyond 0.05;
  # from 0.04 no score can drop by more than 0.04.
  for name, value in (("arithmetic", 1.0), ("countdown", 0.04)):
    report = json.loads((baseline / name / "eval.json").read_text())
    report["pass@k"]["1"] = value
    (baseline / name / "eval.json").write_text(json.dumps(report))
  before = {p: p.read_bytes() for p in baseline.rglob("*") if p.is_file()}
  with caplog.at_level(logging.WARNING):
    _, summary = _fit(dataclasses.replace(BASE, train=dataclasses.replace(BASE.train, steps=6)), out, resume=True)
  assert summary["resumed_from"] == 4
  assert {p: p.read_bytes() for p in baseline.rglob("*") if p.is_file()} == before, "the baseline was evaluated again"
  records = _evals(out)
  assert sorted(records) == [0, 2, 4, 6]
  now = records[6]["eval/arithmetic/pass@1"]
  assert records[6]["eval/arithmetic/regressed"] == 1.0 and records[6]["eval/countdown/regressed"] == 0.0
  assert summary["eval/regressions"] == [{"suite": "arithmetic", "step": 6, "baseline": 1.0, "pass@1": now}]
  assert f"suite arithmetic regressed at step 6: pass@1 {now:.4f}, baseline 1.0000" in caplog.text
  assert "countdown regressed" not in caplog.text

  capsys.readouterr()
  assert cli.main(["eval", "--compare", str(baseline), str(out / "evals" / "step_6")]) == 1
  table = capsys.readouterr().out
  rows = table.splitlines()
  assert next(row for row in rows if row.startswith("arithmetic") and "pass@1 " in row).endswith("REGRESSED")
  assert not any("REGRESSED" in row for row in rows if row.startswith("countdown"))
  assert table.splitlines()[-1] == "REGRESSED (pass@1 fell by more than 0.05): arithmetic"
  # A threshold above the drop passes; two report files get the full table and the same verdict.
  assert cli.main(["eval", "--compare", str(baseline), str(out / "evals" / "step_6"), "--threshold=1"]) == 0
  reports = [str(d / "arithmetic" / "eval.json") for d in (baseline, out / "evals" / "step_6")]
  capsys.readouterr()
  assert cli.main(["eval", "--compare", *reports]) == 1
  table = capsys.readouterr().out
  assert table.startswith("A: exact_answer, 2 tasks x 2") and table.splitlines()[-1].startswith("REGRESSED")


def test_a_multi_turn_suite_gets_an_engine_of_whole_groups_on_every_block():
  # A multi-turn suite's episodes are played by `ptx eval` (tests/test_cli_eval.py) and at checkpoints through the
  # same SuiteEvals.evaluate; here, the engine it sizes on the training mesh (compiling nothing).
  mesh = make_mesh(BASE.mesh)  # 8 devices, each holding a block of pages
  config = checkpoint_evals.episode_engine(1000, 2, 3, mesh)
  # One group of 2 per block (32 episodes at once would be 2 groups per block, but 3 tasks need no more), the
  # context rounded up to whole steps of 256 positions, pages for every slot at its whole context and a sink.
  assert (config.max_seqs, config.max_seq_len, config.pages, config.prefill_rows) == (16, 1024, 8 * (2 * 64 + 1), 8)
  # A group reserving the whole context fits one device's slots and pages (a rounding of the slots over all devices,
  # 4 -> 8, would leave one a device); more samples than its slots do not.
  engine = RolloutEngine(BASE.model, config, mesh=mesh)
  engine.submit(list(range(1, 100)), max_new_tokens=4, samples=2, keep=True, reserve=config.max_seq_len)
  with pytest.raises(ValueError, match="3 samples share pages on one device, which has 2 slots"):
    engine.submit([1], max_new_tokens=4, samples=3)
  assert checkpoint_evals.episode_engine(1000, 4, 100, None).max_seqs == 32  # 8 groups of 4 at once
  assert checkpoint_evals.episode_engine(1000, 64, 2, None).max_seqs == 64  # at least one group


def test_a_single_turn_suite_larger_than_the_engines_slots_samples_what_one_static_batch_would(monkeypatch):
  # A suite is sampled on an engine of at most 32 slots, not in one batch of all its prompts (BFCL's 252 requests
  # with their function docs took 31 GB as one batch): 40 greedy completions through 32 slots are the completions
  # one static `generate` batch of all 40 gives.
  from ptx.models import init_params
  from ptx.sampling.text import TextSampler

  section = EvalConfig(suites=("arithmetic",), n=40, k=1, max_new_tokens=4, sampling=SamplingConfig(greedy=True))
  evals = checkpoint_evals.build(section, TOK)
  params = init_params(BASE.model, jax.random.key(0))
  built = []
  original = checkpoint_evals.SuiteEvals._engine
  monkeypatch.setattr(checkpoint_evals.SuiteEvals, "_engine",
                      lambda self, *a: built.append(original(self, *a)) or built[-1])
  report = evals.evaluate(params, BASE.model)["arithmetic"]
  assert [engine.config.max_seqs for engine in built] == [32]
  _, env, tasks = evals.suites[0]
  static = TextSampler(params, BASE.model, TOK, max_new_tokens=4, sampling=section.sampling)
  prompts = [env.reset(task).prompt for task in tasks]
  assert [[s["completion"]] for s in report["samples"]] == static(prompts, 1)
  # A second evaluation (the next checkpoint) reuses the measured shape: the prompts are not scanned again.
  monkeypatch.setattr(checkpoint_evals, "_prompts", lambda *a: pytest.fail("the prompts were scanned again"))
  assert evals.evaluate(params, BASE.model)["arithmetic"] == report and built[1].config == built[0].config


def test_every_suite_of_an_evaluation_samples_on_engines_of_one_shape(monkeypatch):
  # A shape per suite compiled a set of engine programs per suite, and XLA:CPU maps thousands of memory regions per
  # executable of a 30-layer model: six suites of SmolLM2-135M crossed Linux's 65,530 and aborted in LLVM. One shape
  # (the longest context of any suite: here the calculator's episodes) compiles one set for every suite.
  from ptx.models import init_params

  section = EvalConfig(suites=("arithmetic", "calculator"), n=2, k=1, max_new_tokens=4,
                       sampling=SamplingConfig(greedy=True))
  evals = checkpoint_evals.build(section, TOK)
  built = []
  original = checkpoint_evals.SuiteEvals._engine
  monkeypatch.setattr(checkpoint_evals.SuiteEvals, "_engine",
                      lambda self, *a: built.append(original(self, *a)) or built[-1])
  reports = evals.evaluate(init_params(BASE.model, jax.random.key(0)), BASE.model)
  assert set(reports) == {"arithmetic", "calculator"} and reports["calculator"]["tasks"] == 2
  assert len(built) == 2 and built[0].config == built[1].config
  _, calculator, tasks = evals.suites[1]
  longest = checkpoint_evals._longest_prompt(calculator, list(tasks), checkpoint_evals.TurnFormat.of(TOK))
  assert built[0].config.max_seq_len >= longest + checkpoint_evals.episode_tokens(calculator, 4) > 256


def test_an_evaluation_drops_the_programs_it_compiled_when_it_ends(monkeypatch):
  # The GRPO run of SmolLM2-135M with six suites aborted in LLVM while compiling its training step after the step-0
  # evaluation: the evaluation's executables, kept, and training's crossed vm.max_map_count (65,530). An evaluation
  # compiles into its own programs and frees them (and their maps) when it ends; the shared set gains nothing.
  from ptx.models import init_params
  from ptx.sampling.engine import map_budget, programs

  model = dataclasses.replace(BASE.model, n_layers=2)  # enough kernels that a kept set stands out of the noise
  params = init_params(model, jax.random.key(0))
  section = EvalConfig(suites=("arithmetic",), n=2, k=1, max_new_tokens=4, sampling=SamplingConfig(greedy=True))
  checkpoint_evals.build(section, TOK).evaluate(params, model)  # the first evaluation's threads and buffers
  evals = checkpoint_evals.build(dataclasses.replace(section, max_new_tokens=300), TOK)  # another engine shape
  held, release = [], programs.Programs.release
  monkeypatch.setattr(programs.Programs, "release",
                      lambda self: held.append((self.compiled, map_budget.held())) or release(self))
  shared, before = programs.SHARED.compiled, map_budget.held()
  evals.evaluate(params, model)
  after = map_budget.held()
  [(compiled, during)] = held
  assert compiled >= 2 and programs.SHARED.compiled == shared  # a prefill and a decode, none in the shared set
  # Half of what the compiled set added: the rest of an evaluation (arrays, threads) maps a few regions at most.
  assert after - before < (during - before) / 2, (before, during, after)


def test_a_resume_without_the_baseline_is_refused(runs, tmp_path):
  out = tmp_path / "run"
  shutil.copytree(runs["out"], out)
  shutil.rmtree(out / "evals" / "step_0" / "countdown")
  with pytest.raises(RunDirError, match=r"lacks the baseline report of \['countdown'\]"):
    _fit(dataclasses.replace(BASE, train=dataclasses.replace(BASE.train, steps=6)), out, resume=True)


def test_the_eval_section_comes_from_overrides_and_bad_values_are_named():
  cfg = config_io.apply_overrides(Config(), ['--eval.suites=["arithmetic", "math"]', '--eval.files=["math=m.jsonl"]',
                                             "--eval.k=3", "--eval.sampling.temperature=0.7", "--eval.every=50"])
  assert cfg.eval.suites == ("arithmetic", "math") and cfg.eval.files == ("math=m.jsonl",)
  assert (cfg.eval.k, cfg.eval.sampling.temperature, cfg.eval.every) == (3, 0.7, 50)
  for override, message in (("--eval.k=0", "eval.k must be >= 1"), ("--eval.every=0", "eval.every must be >= 1"),
                            ("--eval.regression=2", r"eval.regression must be in \[0, 1\]"),
                            ('--eval.suites=["needle", "needle"]', "eval.suites must be distinct"),
                            ('--eval.files=["math"]', "eval.files entries are 'suite=path'")):
    with pytest.raises(ConfigError, match=f"--{override[2:].split('=')[0]}: {message}"):
      config_io.apply_overrides(Config(), [override])


def test_build_names_the_field_of_a_bad_suite_or_file(tmp_path):
  assert checkpoint_evals.build(EvalConfig(), TOK) is None
  for section, message in ((EvalConfig(suites=("nope",)), "eval.suites: unknown suite"),
                           (EvalConfig(suites=("math",)), "add 'math=PATH' to eval.files"),
                           (EvalConfig(files=("math=m.jsonl",)), r"eval.files: \['math'\] are not file suites"),
                           (EvalConfig(suites=("arithmetic",), files=("arithmetic=a.jsonl",)), "are not file suites"),
                           (EvalConfig(suites=("math",), files=("math=a.jsonl", "math=b.jsonl")), "a suite twice"),
                           (EvalConfig(suites=("math",), files=(f"math={tmp_path}/missing.jsonl",)),
                            f"eval.files math={tmp_path}/missing.jsonl: ")):
    with pytest.raises(ConfigError, match=message):
      checkpoint_evals.build(section, TOK)
  (tmp_path / "m.jsonl").write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n")
  evals = checkpoint_evals.build(EvalConfig(suites=("math", "arithmetic"), files=(f"math={tmp_path}/m.jsonl",), n=3),
                                 TOK)
  assert [(name, len(tasks)) for name, _, tasks in evals.suites] == [("math", 1), ("arithmetic", 3)]


def test_fit_refuses_suites_it_was_not_given_or_given_for_another_section(tmp_path):
  job = sft_job(BASE, TOK)
  with pytest.raises(ValueError, match=r"cfg.eval names suites \['arithmetic', 'countdown'\] but evals holds None"):
    fit(BASE, job, train_data=[], out=tmp_path, evals=None)
  other = checkpoint_evals.build(dataclasses.replace(EVAL, n=3), TOK)
  with pytest.raises(ValueError, match="of another eval section"):
    fit(BASE, job, train_data=[], out=tmp_path, evals=other)
