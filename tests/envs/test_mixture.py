"""Mixtures of environments (`ptx.envs.mixture`): records dispatched by name, a seeded weighted stream, held-out
splits that stay held out, and `ptx grpo --env A:W,B`'s flag."""

import collections

import pytest

from ptx import cli, env_flags
from ptx.envs.base import Outcome, first_prompt
from ptx.envs.calculator import CalculatorEnv, CalculatorTasks
from ptx.envs.exact_answer import ExactAnswerEnv
from ptx.envs.mixture import MixedTasks, MixtureEnv, weighted_names


class _Numbered:
  """A task source whose record i says where it came from."""

  def __init__(self, tag):
    self.tag = tag

  def __getitem__(self, i):
    return {"prompt": f"{self.tag} {i}", "answer": str(i)}


def test_the_stream_is_a_seeded_pure_function_of_the_index_and_follows_the_weights():
  tasks = MixedTasks(("a", "b"), (_Numbered("a"), _Numbered("b")), (3.0, 1.0), seed=5)
  records = [tasks[i] for i in range(4000)]
  assert records[:50] == [MixedTasks(("a", "b"), (_Numbered("a"), _Numbered("b")), (3.0, 1.0), seed=5)[i]
                          for i in range(50)]  # a resumed run reads the same records
  assert [tasks[i] for i in range(50)] != [MixedTasks(tasks.names, tasks.sources, tasks.weights, seed=6)[i]
                                           for i in range(50)]
  for i, record in enumerate(records):  # record i is its source's own record i
    assert record["task"] == {"prompt": f"{record['env']} {i}", "answer": str(i)}
  share = collections.Counter(r["env"] for r in records)["a"] / len(records)
  # 3:1 is a share of 0.75; over 4,000 draws its standard deviation is 0.007, so 0.03 is over 4 of them.
  assert abs(share - 0.75) < 0.03


@pytest.mark.parametrize("names, sources, weights, message", [
    ((), (), (), "one source and one weight per name"),
    (("a", "b"), (_Numbered("a"),), (), "one source and one weight per name"),
    (("a",), (_Numbered("a"),), (1.0, 2.0), "one source and one weight per name"),
    (("a", "b"), (_Numbered("a"), _Numbered("b")), (1.0, 0.0), "weights must be positive"),
])
def test_a_malformed_stream_is_refused(names, sources, weights, message):
  with pytest.raises(ValueError, match=message):
    MixedTasks(names, sources, weights)


def test_records_are_validated_posed_and_scored_by_the_environment_they_name():
  env = MixtureEnv(("calculator", "exact"), (CalculatorEnv(), ExactAnswerEnv()))
  assert env.max_turns == CalculatorEnv().max_turns and not env.sandboxed
  calc = CalculatorTasks(0)[0]
  record = {"env": "calculator", "task": calc}
  env.validate(record)
  assert env.label(record) == "calculator"
  assert first_prompt(env, record) == first_prompt(CalculatorEnv(), calc)
  exact = {"env": "exact", "task": {"prompt": "What is 2 + 2?", "answer": "4"}}
  episode = env.reset(exact)
  assert episode.prompt == "What is 2 + 2?"
  assert episode.step("The answer is 4.").outcome == Outcome.OK
  assert env.reset(exact).step("The answer is 5.").outcome == Outcome.WRONG
  for bad, message in [({"task": calc}, "field 'env'"),
                       ({"env": "terminal", "task": calc}, r"field 'env' must be one of \('calculator', 'exact'\)"),
                       ({"env": "calculator"}, "field 'task'"),
                       ({"env": "exact", "task": {"prompt": "What is 2 + 2?"}}, "'answer'")]:
    with pytest.raises(ValueError, match=message):
      env.validate(bad)


def test_a_demonstration_is_the_named_environments_and_one_without_them_is_refused():
  env = MixtureEnv(("calculator", "exact"), (CalculatorEnv(), ExactAnswerEnv()))
  calc = CalculatorTasks(0)[3]
  assert env.demonstration({"env": "calculator", "task": calc}) == CalculatorEnv().demonstration(calc)
  with pytest.raises(ValueError, match="mixture: environment 'exact' has no demonstrations"):
    env.demonstration({"env": "exact", "task": {"prompt": "What is 2 + 2?", "answer": "4"}})


def test_an_environment_named_twice_is_refused():
  with pytest.raises(ValueError, match="distinct names"):
    MixtureEnv(("a", "a"), (ExactAnswerEnv(), ExactAnswerEnv()))


@pytest.mark.parametrize("entries, message", [
    (["a:x"], "NAME or NAME:WEIGHT with a positive weight, got 'a:x'"),
    (["a:-1"], "positive weight"),
    (["a:inf"], "positive weight"),
    ([":2"], "positive weight"),
    (["a", "a:2"], "must be distinct"),
])
def test_weighted_names_refuse_bad_entries(entries, message):
  assert weighted_names(["a:2.5", "b"], "things") == (("a", "b"), (2.5, 1.0))
  with pytest.raises(ValueError, match=message):
    weighted_names(entries, "things")


def test_a_mixture_of_the_built_in_training_tasks_never_draws_a_held_out_task():
  # reasoning-gym holds out generator seeds [2^30, 2^31) and BFCL the requests `ptx.data.splits` puts in held_out;
  # the mixture reads each one's train split, so none of its records is a held-out suite's.
  pytest.importorskip("reasoning_gym")
  pytest.importorskip("bfcl_eval")
  from ptx.data.tokenizer import ByteTokenizer
  from ptx.envs import bfcl, reasoning_gym

  args = cli._parser().parse_args(["grpo", "--env", "reasoning_gym:2,bfcl", "--families", "gcd,lcm"])
  env, builtin, fields = env_flags.mixture(args, ByteTokenizer())
  assert fields == ("env", "task") and env.names == ("reasoning_gym", "bfcl")
  tasks = builtin(0)
  records = [tasks[i] for i in range(300)]
  held_out = {r["prompt"] for r in bfcl.BFCLTasks(split="held_out")}
  drawn = collections.Counter(r["env"] for r in records)
  assert drawn["bfcl"] > 50 and drawn["reasoning_gym"] > 150  # 1:2 of 300, each well inside its binomial spread
  train_seeds = range(0, 2 ** 30)
  for i, record in enumerate(records):
    env.validate(record)
    if record["env"] == "bfcl":
      assert record["task"]["prompt"] not in held_out
    else:
      assert record["task"]["family"] in ("gcd", "lcm")
      assert tasks.sources[0].generator_seed(i) in train_seeds
      assert record["task"] == reasoning_gym.ReasoningGymTasks(("gcd", "lcm"), (1.0, 1.0), seed=0)[i]


@pytest.mark.parametrize("flag, message", [
    ("exact_answer,bfcl", "several of"),  # exact_answer has no built-in training tasks
    ("bfcl,bfcl", "must be distinct"),
    ("bfcl:0,calculator", "positive weight"),
    ("bfcl:2", "several of"),  # a mixture of one
    ("nope", "several of"),
])
def test_the_env_flag_refuses_what_cannot_be_mixed(flag, message, capsys):
  with pytest.raises(SystemExit):
    cli._parser().parse_args(["grpo", "--env", flag])
  assert message in capsys.readouterr().err


def test_options_of_one_environment_are_refused_for_a_mixture_without_it(tmp_path, capsys):
  with pytest.raises(SystemExit) as exit_:
    cli.main(["grpo", "--out", str(tmp_path / "run"), "--env", "calculator,docqa", "--families", "gcd"])
  assert exit_.value.code == 2
  assert "--families chooses --env reasoning_gym's task families" in capsys.readouterr().err
