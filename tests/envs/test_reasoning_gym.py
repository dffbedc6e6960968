"""reasoning-gym families: the mixed stream, held out by generator seed, scoring by each family's own checker, and
the answers a policy would try (code for checkers that evaluate text, huge answers, checkers that raise)."""

import collections

import pytest

pytest.importorskip("reasoning_gym")  # the rl extra, installed by `make test`

import reasoning_gym as library  # noqa: E402 - after the skip
from reasoning_gym.factory import DATASETS  # noqa: E402

from ptx.envs import reasoning_gym, suites  # noqa: E402
from ptx.envs.base import Outcome  # noqa: E402

ENV = reasoning_gym.ReasoningGymEnv()


def test_held_out_problems_come_from_generator_seeds_training_never_draws():
  span = 1 << 30
  for seed in (0, 1, 977):
    train = reasoning_gym.ReasoningGymTasks(seed=seed, split="train")
    held = reasoning_gym.ReasoningGymTasks(seed=seed, split="held_out")
    for i in (0, 1, 10**6, 10**9, 10**12):
      assert 0 <= train.generator_seed(i) < span <= held.generator_seed(i) < 2 * span
  # The stream's problem j is reasoning-gym's own problem of seed j, for every default family.
  for family in reasoning_gym.DEFAULT_FAMILIES:
    for j in (3, span + 5):
      assert reasoning_gym.problem(family, j)["question"] == library.create_dataset(family, seed=j, size=1)[0][
          "question"], family
  _, tasks = suites.load("reasoning_gym", n=40)
  train = reasoning_gym.ReasoningGymTasks(split="train")
  assert {t["entry"]["question"] for t in tasks}.isdisjoint(train[i]["entry"]["question"] for i in range(400)) or \
      pytest.fail("a held-out question was generated in training: the families' problem spaces are too small")


def test_families_mix_by_weight_and_tasks_are_pure_functions_of_their_index():
  tasks = reasoning_gym.ReasoningGymTasks(("gcd", "lcm"), (3.0, 1.0), seed=4)
  counts = collections.Counter(tasks[i]["family"] for i in range(2000))
  # Binomial(2000, 0.75): a standard deviation of 19 draws; 6 of them is far beyond chance.
  assert abs(counts["gcd"] - 1500) < 6 * 19, counts
  assert tasks[123] == reasoning_gym.ReasoningGymTasks(("gcd", "lcm"), (3.0, 1.0), seed=4)[123]
  assert reasoning_gym.parse_families(["gcd:3", "lcm"]) == (("gcd", "lcm"), (3.0, 1.0))
  with pytest.raises(ValueError, match="positive weight"):
    reasoning_gym.parse_families(["gcd:0"])
  with pytest.raises(ValueError, match="no task family 'no_such'"):
    reasoning_gym.ReasoningGymTasks(("no_such",))


def test_each_default_family_scores_its_own_answer_one_and_others_less():
  tasks = reasoning_gym.ReasoningGymTasks(seed=1)
  seen = set()
  for i in range(300):
    task = tasks[i]
    if task["family"] in seen:
      continue
    seen.add(task["family"])
    right = ENV.reset(task).step(f"Thinking...\n<answer>{task['entry']['answer']}</answer>")
    assert (right.outcome, right.reward) == (Outcome.OK, 1.0), (task["family"], right.reason)
    wrong = ENV.reset(task).step("<answer>certainly not this</answer>")
    assert wrong.outcome == Outcome.WRONG and wrong.reward < 1.0, task["family"]
    assert ENV.reset(task).step(f"the answer is {task['entry']['answer']}").outcome == Outcome.NO_ANSWER
  assert seen == set(reasoning_gym.DEFAULT_FAMILIES)


def test_families_whose_checker_evaluates_text_are_refused_by_name():
  for family in ("string_insertion", "countdown", "puzzle24", "simple_integration", "n_queens"):
    with pytest.raises(ValueError, match=f"'{family}' is refused: its checker calls"):
      reasoning_gym.ReasoningGymTasks((family,))


def test_no_allowed_checker_runs_an_answer_as_code(tmp_path):
  """Every family reasoning-gym has and ptx allows, fed answers that are code: none runs (a canary file stays
  absent). A family whose checker evaluates text through a route the source scan misses fails here."""
  canary = tmp_path / "ran"
  code = f"__import__('pathlib').Path({str(canary)!r}).touch()"
  attacks = [code, f"[{code}]", f"({code}, 1)", f"{{'a': {code}}}", f"1 + {code}"]
  checked = 0
  for family in sorted(DATASETS):
    try:
      task = reasoning_gym.ReasoningGymTasks((family,), seed=2)[0]
    except Exception:  # noqa: BLE001 - refused (unsafe, or not drawable by seed), or its generator needs data
      continue
    for attack in attacks:
      ENV.reset(task).step(f"<answer>{attack}</answer>")
    checked += 1
    assert not canary.exists(), f"{family}'s checker ran the model's answer as code"
  assert checked >= 80, checked  # most of reasoning-gym's families are exercised


def test_answers_that_trip_a_checker_are_the_models_failure(monkeypatch):
  task = reasoning_gym.ReasoningGymTasks(("gcd",))[0]
  huge = ENV.reset(task).step("<answer>" + "9" * (reasoning_gym.MAX_ANSWER + 1) + "</answer>")
  assert huge.outcome == Outcome.WRONG and "more than" in huge.reason

  def broken(answer, entry):
    raise RecursionError("deep")

  monkeypatch.setattr(reasoning_gym, "_checker", lambda family: broken)
  tripped = ENV.reset(task).step("<answer>1</answer>")
  assert tripped.outcome == Outcome.WRONG and "raised RecursionError" in tripped.reason
  monkeypatch.setattr(reasoning_gym, "_checker", lambda family: lambda answer, entry: float("nan"))
  assert ENV.reset(task).step("<answer>1</answer>").reward == 0.0


def test_tagged_answer_is_the_last_and_linear_in_unclosed_tags():
  assert reasoning_gym.tagged_answer("<answer>1</answer> then <answer> 2 </answer>") == "2"
  assert reasoning_gym.tagged_answer("<answer>1") is None
  assert reasoning_gym.tagged_answer("<answer>" * 200_000 + "x</answer>") == "x"  # one pass: no regex back-tracking


def test_records_are_checked():
  task = reasoning_gym.ReasoningGymTasks(("gcd",))[0]
  with pytest.raises(ValueError, match="field 'entry' must be reasoning-gym's entry"):
    ENV.validate({**task, "entry": {"q": 1}})
  with pytest.raises(ValueError, match="field 'family'"):
    ENV.validate({**task, "family": "no_such"})


def test_the_suite_reports_accuracy_per_family():
  from ptx.episodes import evaluation

  env, tasks = suites.load("reasoning_gym", n=12, families=("gcd", "lcm:2"))
  answers = {t["prompt"]: f"<answer>{t['entry']['answer']}</answer>" if t["family"] == "gcd" else "<answer>0</answer>"
             for t in tasks}
  report = suites.label("reasoning_gym", env, tasks,
                        evaluation.evaluate(lambda prompts, k: [[answers[p]] * k for p in prompts], env, tasks, k=1))
  assert report["families"] == {"gcd": 1.0, "lcm": 0.0}


def test_a_demonstration_is_the_question_answered_in_tags_and_scores_one():
  tasks = reasoning_gym.ReasoningGymTasks(seed=2)
  for i in range(24):
    user, assistant = ENV.demonstration(tasks[i])
    assert user == {"role": "user", "content": tasks[i]["prompt"]}
    assert assistant["content"] == f"<answer>{tasks[i]['entry']['answer']}</answer>"
  wrong = {**tasks[0], "entry": {**tasks[0]["entry"], "answer": "<answer>"}}  # an answer its own tags would cut
  with pytest.raises(ValueError, match="its own answer scores wrong"):
    ENV.demonstration(wrong)
