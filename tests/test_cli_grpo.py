"""`ptx grpo`: fused on built-in arithmetic, host-scored on rl records; a run cut short resumes exactly."""

import json
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from ptx import cli

STEPS = 4
# The entropy bonus and the KL term give gradients even while a random model earns no reward.
COMMON = ["--no-progress", "--model.n_layers=1", "--model.d_model=64", "--model.mlp_dim=128",
          f"--train.steps={STEPS}", "--train.log_every=1", "--train.checkpoint_every=2", "--data.batch_size=8",
          "--grpo.group_size=2", "--grpo.entropy_coef=0.05", "--grpo.beta=0.04",
          "--grpo.kl_placement=loss", "--mesh.data=2", "--mesh.fsdp=4"]


def _records(out):
  return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def _cut_after(full, cut, step):
  """A copy of a finished run as if it had been killed right after checkpoint `step` was published."""
  shutil.copytree(full, cut)
  for path in (cut / "checkpoints").iterdir():
    if path.name.isdigit() and int(path.name) > step:
      shutil.rmtree(path)
  lines = (cut / "metrics.jsonl").read_text().splitlines()
  (cut / "metrics.jsonl").write_text("".join(l + "\n" for l in lines if json.loads(l)["step"] <= step))


def _params(out):
  return ocp.StandardCheckpointer().restore((out / "checkpoints" / str(STEPS) / "state").absolute())["params"]


def _resumes_exactly(tmp_path, capsys, *args):
  full, cut = tmp_path / "full", tmp_path / "cut"
  cli.main(["grpo", "--out", str(full), *args])
  _cut_after(full, cut, 2)
  capsys.readouterr()
  cli.main(["grpo", "--out", str(cut), "--resume", *args])
  assert "resumed from checkpoint step 2" in capsys.readouterr().out
  want, got = _records(full), _records(cut)
  assert sorted(got) == list(range(1, STEPS + 1))
  for step in (3, 4):  # everything but the wall-clock rates
    wall_clock = ("steps_per_s", "samples_per_s", "tokens_per_s", "timing_s/", "perf/")
    drop = lambda r: {k: v for k, v in r.items() if not k.startswith(wall_clock)}
    assert drop(got[step]) == drop(want[step]), f"step {step} differs after resuming"
  jax.tree.map(np.testing.assert_array_equal, _params(cut), _params(full))
  assert want[1]["actor/grad_norm"] > 0
  return want


def test_grpo_on_builtin_arithmetic_resumes_exactly(tmp_path, capsys):
  records = _resumes_exactly(tmp_path, capsys, *COMMON)
  assert {"reward/mean", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "response_length/mean",
          "rollout/logp_diff_max"} <= set(records[STEPS])
  assert list((tmp_path / "full" / "tensorboard").iterdir()), "no TensorBoard event file"
  config = json.loads((tmp_path / "full" / "config.json").read_text())
  assert config["data"]["kind"] == "rl" and config["grpo"]["entropy_coef"] == 0.05


@pytest.mark.slow
@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_grpo_on_rl_records_scores_on_the_host_and_resumes_exactly(tmp_path, capsys, staleness):
  # With staleness 1 the checkpoint of step 2 holds batch 3, sampled by the parameters of step 1; the
  # resumed run must train on that batch, not sample batch 3 again with the parameters of step 2.
  rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(40)]
  data = tmp_path / "rl.jsonl"
  data.write_text("".join(json.dumps(r) + "\n" for r in rows))
  records = _resumes_exactly(tmp_path, capsys, *COMMON, f"--data.train_files=[\"{data}\"]",
                             f"--grpo.max_staleness={staleness}", "--grpo.max_response_tokens=6")
  assert {"timing_s/reward", "perf/device_wait_frac", "rollout/staleness"} <= set(records[STEPS])
  # Step k + 1 trains on a batch sampled min(k, s) updates earlier.
  assert [records[k + 1]["rollout/staleness"] for k in range(STEPS)] == [float(min(k, staleness)) for k in range(STEPS)]
  assert (tmp_path / "full" / "checkpoints" / "2" / "pipeline").exists() == (staleness > 0)


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
                        "field 'prompt' takes 83 tokens, more than prompt_len=64 (data.seq_len: set --data.seq_len=83 "
                        "or more)"),
    "episode_prompt_too_long": ("calculator", {"prompt": "3 boxes of 4? " * 20},
                                "its episode's first prompt takes 617 tokens, more than prompt_len=512"),
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


@pytest.mark.slow
def test_grpo_with_engine_rollouts_resumes_exactly(tmp_path, capsys):
  # The checkpoint of step 2 holds the engine mid-flight: batch 3's sequences part-decoded by the parameters of
  # step 2, their finished groups scored; the resumed run recomputes their cache and goes on as the full run did.
  rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(40)]
  data = tmp_path / "rl.jsonl"
  data.write_text("".join(json.dumps(r) + "\n" for r in rows))
  records = _resumes_exactly(tmp_path, capsys, *COMMON, f"--data.train_files=[\"{data}\"]", "--grpo.rollouts=engine",
                             "--grpo.max_staleness=1", "--grpo.max_response_tokens=6", "--rollout.decode_steps=2")
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

  env, builtin, fields = cli._episode_environment(name, ByteTokenizer())
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
  assert f"the longest of the first {STEPS * 8} tasks ({env}'s text in the chat template): set --data.seq_len=" in error


@pytest.mark.slow
def test_grpo_on_docqa_episodes_trains(tmp_path):
  # The built-in docqa tasks have no "prompt": each episode's first prompt is the environment's (1,075 tokens at most
  # in the byte tokenizer: DocQAEnv.prompt_tokens and the chat template).
  out = tmp_path / "run"
  cli.main(["grpo", "--out", str(out), *COMMON, "--train.steps=2", "--env", "docqa", "--grpo.max_staleness=0",
            "--grpo.turn_tokens=8", "--grpo.max_response_tokens=160", "--data.seq_len=1088", "--no-export"])
  records = _records(out)
  assert sorted(records) == [1, 2]
  for k in (1, 2):
    assert records[k]["episodes/turns_mean"] >= 1 and records[k]["episodes/tokens_environment_mean"] > 0
    assert records[k]["rollout/logp_diff_max"] < 1e-4  # the learner reads the tokens the engine sampled


@pytest.mark.slow
def test_grpo_on_chat_format_records_trains_and_checkpoints(tmp_path):
  # The data layer renders the messages (ChatML for the byte tokenizer) and exact_answer scores the completion; the
  # checkpoint of step 2 holds the batch sampled ahead (max_staleness 1), chat messages included.
  rows = [{"prompt": [{"role": "user", "content": f"{i}+{i}="}], "answer": str(2 * i)} for i in range(16)]
  data = tmp_path / "chat.jsonl"
  data.write_text("".join(json.dumps(r) + "\n" for r in rows))
  out = tmp_path / "run"
  cli.main(["grpo", "--out", str(out), *COMMON, "--train.steps=2", f"--data.train_files=[\"{data}\"]",
            "--data.seq_len=64", "--grpo.max_response_tokens=6", "--no-export"])
  records = _records(out)
  assert sorted(records) == [1, 2] and all("rewards/outcome/no_answer_frac" in records[k] for k in (1, 2))
  assert (out / "checkpoints" / "2" / "pipeline").exists()
