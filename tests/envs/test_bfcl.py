"""BFCL: the records load, ptx's scorer agrees with BFCL's own AST checker, the splits are disjoint, the env scores."""

import importlib.util
import random
import sys
import types

import pytest

from ptx.envs.base import Outcome
from ptx.envs.tools import FORMATS, Call, render_calls
from ptx.episodes.scoring import score

if importlib.util.find_spec("bfcl_eval") is None:
  pytest.skip("BFCL's data comes from bfcl-eval (`make test` installs it with --no-deps)", allow_module_level=True)

from ptx.envs import bfcl  # noqa: E402 - after the skip


@pytest.fixture(scope="module")
def reference():
  """BFCL's own `ast_checker(functions, output, answer, language, category, model)`, and its Language enum.

  The checker module imports the model registry only to learn whether a model's API rewrote dots in function names
  to underscores, and that registry imports every vendor's client (not installed). A stand-in registry answers "no"
  for every model (ptx's forms keep dots), so the checker's own code runs unchanged.
  """
  registry = types.ModuleType("bfcl_eval.constants.model_config")

  class _NoRewrite(dict):
    def __missing__(self, name):
      return types.SimpleNamespace(underscore_to_dot=False)

  registry.MODEL_CONFIG_MAPPING = _NoRewrite()
  with pytest.MonkeyPatch.context() as patch:
    patch.setitem(sys.modules, "bfcl_eval.constants.model_config", registry)
    from bfcl_eval.constants.enums import Language
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker
  return ast_checker, Language.PYTHON


def test_the_categories_load_with_their_expected_calls():
  counts = {c: (len(records := bfcl.load(c)), sum(len(r["answer"]) for r in records)) for c in bfcl.CATEGORIES}
  assert counts == {"simple_python": (400, 400), "multiple": (200, 200), "parallel": (200, 540),
                    "parallel_multiple": (200, 607)}
  record = bfcl.load("parallel")[0]
  assert record["id"] == "parallel_0" and record["prompt"].startswith("Play songs from the artists Taylor Swift")
  assert bfcl.ground_truth(record) == [Call("spotify.play", {"artist": "Taylor Swift", "duration": 20}),
                                       Call("spotify.play", {"artist": "Maroon 5", "duration": 15})]
  with pytest.raises(ValueError, match="category must be one of"):
    bfcl.load("multi_turn_base")


def _variants(record, rng):
  """Model-like outputs for a record: its expected calls, and each edited as a policy's mistakes and attempts edit."""
  truth = bfcl.ground_truth(record)
  out = [truth, list(reversed(truth)), truth + truth[:1], truth[:-1], truth[:-1] + truth[:1]]

  def edit(fn):
    i = rng.randrange(len(truth))
    arguments = dict(truth[i].arguments)
    fn(truth[i].name, arguments, record["answer"][i][truth[i].name])
    out.append(truth[:i] + [Call(truth[i].name, arguments)] + truth[i + 1:])

  def per_argument(change):
    def fn(name, arguments, accepted):
      for key, values in accepted.items():
        if values and change(arguments, key, values):
          return
    return fn

  def set_last(arguments, key, values):  # another accepted value, or leave out one that may be left out
    if values[-1] == "":
      arguments.pop(key, None)
    else:
      arguments[key] = values[-1]
    return False

  def restyle(arguments, key, values):
    if isinstance(arguments.get(key), str):
      arguments[key] = f" {arguments[key].upper().replace(' ', '-')}."
      return True
    return False

  def quote(arguments, key, values):
    if type(arguments.get(key)) in (int, float):
      arguments[key] = str(arguments[key])
      return True
    return False

  def swap_number(arguments, key, values):
    value = arguments.get(key)
    if type(value) is int:
      arguments[key] = float(value)
      return True
    if type(value) is float and value.is_integer():
      arguments[key] = int(value)
      return True
    return False

  def wrong(arguments, key, values):
    value = arguments.get(key)
    if type(value) is bool:
      arguments[key] = not value
    elif type(value) in (int, float):
      arguments[key] = value + 1
    elif type(value) is str:
      arguments[key] = value + " extra"
    elif type(value) is list:
      arguments[key] = list(reversed(value)) if len(value) > 1 else value + value
    else:
      return False
    return True

  def drop(arguments, key, values):
    return arguments.pop(key, None) is not None

  edit(per_argument(set_last))
  for change in (restyle, quote, swap_number, wrong, drop):
    edit(per_argument(change))
  edit(lambda name, arguments, accepted: arguments.update(unit="meters"))
  edit(lambda name, arguments, accepted: arguments.update(
      {k: v[-1] for k, v in accepted.items() if v and v[-1] != ""}))  # every argument, optional ones too
  other = next((f["name"] for f in record["functions"] if f["name"] != truth[0].name), truth[0].name + "_v2")
  out.append([Call(other, truth[0].arguments)] + truth[1:])
  return out


def test_the_scorer_agrees_with_bfcls_own_checker_on_a_fixed_sample_of_outputs(reference):
  ast_checker, python = reference
  rng = random.Random(0)
  records = [r for c in (*bfcl.CATEGORIES, "live_simple", "live_parallel", "live_parallel_multiple")
             for r in rng.sample(bfcl.load(c), min(60, len(bfcl.load(c))))]
  verdicts, disagreements = [], []
  for record in records:
    for calls in _variants(record, rng):
      ours = bfcl.check(record, calls)
      theirs = ast_checker(record["functions"], [{c.name: c.arguments} for c in calls], record["answer"], python,
                           record["category"], "ptx")
      verdicts.append(not ours)
      if (not ours) != theirs["valid"]:
        disagreements.append((record["id"], calls, ours, theirs["error"]))
  assert not disagreements, f"{len(disagreements)} of {len(verdicts)} disagree, e.g. {disagreements[0]}"
  # Both verdicts are well represented, so agreement is not that of a scorer that always says one thing.
  assert len(verdicts) == 4760 and 1900 < sum(verdicts) < 2400


def test_held_out_and_training_records_are_disjoint_by_construction():
  train, held = bfcl.BFCLTasks(seed=3), bfcl.BFCLTasks(seed=3, split="held_out")
  assert (len(train), len(held)) == (748, 252)
  train_records = [train[i] for i in range(2 * len(train))]  # two passes: the stream cycles, reshuffled
  held_records = [held[i] for i in range(len(held))]
  assert [r["id"] for r in train_records[:len(train)]] != [r["id"] for r in train_records[len(train):]]
  assert {r["id"] for r in train_records[:len(train)]} == {r["id"] for r in train_records}
  every = {r["id"] for c in bfcl.CATEGORIES for r in bfcl.load(c)}
  assert {r["id"] for r in train_records} | {r["id"] for r in held_records} == every
  # The split is by the request's text: no request is on both sides, even where two categories share it.
  assert not {r["prompt"] for r in train_records} & {r["prompt"] for r in held_records}
  assert held[0] == bfcl.BFCLTasks(seed=3, split="held_out")[0] != bfcl.BFCLTasks(seed=4, split="held_out")[0]
  with pytest.raises(IndexError, match="has 252 records"):
    held[252]
  with pytest.raises(ValueError, match="split must be one of"):
    bfcl.BFCLTasks(split="test")
  with pytest.raises(ValueError, match="categories must be some of"):
    bfcl.BFCLTasks(categories=("exec_simple",))


@pytest.fixture(scope="module")
def parallel():
  """A parallel request of two different calls: spotify.play for Taylor Swift (20 min) and Maroon 5 (15 min)."""
  return bfcl.load("parallel")[0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_env_rewards_the_expected_calls_in_its_form_through_the_scoring_harness(parallel, fmt):
  env = bfcl.BFCLEnv(tool_format=fmt)
  truth = bfcl.ground_truth(parallel)
  prompt = env.reset(parallel).prompt
  assert prompt.startswith(parallel["prompt"]) and '"name": "spotify.play"' in prompt
  assert render_calls(fmt, [Call("spotify.play", {"artist": "...", "duration": "..."})] * 2) in prompt
  right = f"I'll play both.\n{render_calls(fmt, truth)}" if fmt != "llama3" else render_calls(fmt, truth)
  steps = score(env, [parallel] * 3, [right, render_calls(fmt, truth[::-1]), "Taylor Swift for 20, Maroon 5 for 15."])
  assert [(s.outcome, s.reward) for s in steps] == [(Outcome.OK, 1.0), (Outcome.OK, 1.0), (Outcome.NO_ANSWER, 0.0)]
  assert steps[0].tool_calls == 2


ATTACKS = {
    "an-extra-call": lambda t: t + [Call("spotify.play", {"artist": "Adele", "duration": 5})],
    "a-duplicated-call-in-place-of-the-other": lambda t: [t[0], t[0]],
    "one-call-for-two": lambda t: t[:1],
    "an-extra-argument": lambda t: [Call(t[0].name, {**t[0].arguments, "shuffle": True}), t[1]],
    "a-number-as-a-string": lambda t: [Call(t[0].name, {**t[0].arguments, "duration": "20"}), t[1]],
    "a-float-for-an-integer": lambda t: [Call(t[0].name, {**t[0].arguments, "duration": 20.0}), t[1]],
    "a-missing-argument": lambda t: [Call(t[0].name, {"artist": "Taylor Swift"}), t[1]],
    "a-wrong-value": lambda t: [Call(t[0].name, {**t[0].arguments, "duration": 21}), t[1]],
    "a-wrong-function": lambda t: [Call("spotify_play", t[0].arguments), t[1]],
}


@pytest.mark.parametrize("attack", ATTACKS.values(), ids=ATTACKS)
def test_what_a_policy_might_try_scores_nothing(parallel, attack):
  env = bfcl.BFCLEnv(tool_format="hermes")
  (step,) = score(env, [parallel], [render_calls("hermes", attack(bfcl.ground_truth(parallel)))])
  assert step.outcome == Outcome.WRONG and step.reward == 0.0, step.reason


def test_calls_outside_the_form_or_unreadable_ones_score_nothing(parallel):
  truth = bfcl.ground_truth(parallel)
  cases = [("hermes", "\n".join(f'{{"name": "{c.name}", "arguments": {c.arguments}}}' for c in truth),
            Outcome.NO_ANSWER),  # the calls in prose, no tags
           ("gemma", "spotify.play(artist='Taylor Swift', duration=20)\nspotify.play(artist='Maroon 5', duration=15)",
            Outcome.NO_ANSWER),  # no tool_code fence
           ("llama3", "Here you go: " + render_calls("llama3", truth), Outcome.NO_ANSWER),  # not the whole turn
           ("hermes", render_calls("smollm2", truth), Outcome.WRONG),  # another family's form
           ("gemma", render_calls("gemma", truth).replace("duration=15", "duration=__import__('os')"), Outcome.WRONG)]
  for fmt, text, outcome in cases:
    (step,) = score(bfcl.BFCLEnv(tool_format=fmt), [parallel], [text])
    assert step.outcome == outcome and step.reward == 0.0, (fmt, text, step.reason)


def test_a_record_with_a_bad_field_is_refused_by_name(parallel):
  env = bfcl.BFCLEnv()
  env.validate(parallel)
  with pytest.raises(ValueError, match="needs field 'answer'"):
    env.validate({k: v for k, v in parallel.items() if k != "answer"})
  with pytest.raises(ValueError, match="field 'category' must be one of"):
    env.validate({**parallel, "category": "exec_parallel"})
  with pytest.raises(ValueError, match="which no function doc names"):
    env.reset({**parallel, "answer": [{"youtube.play": {}}]})
  with pytest.raises(ValueError, match="BFCLEnv.tool_format must be one of"):
    bfcl.BFCLEnv(tool_format="xml")


def test_every_records_ground_truth_scores_one_in_every_form():
  """`ground_truth` is an accepted answer of every record: required arguments at a value, optional ones at their
  default, nested dicts at their first accepted values (the suite's test replies rely on it)."""
  for fmt in FORMATS:
    env = bfcl.BFCLEnv(tool_format=fmt)
    tasks = [s[i] for s in (bfcl.BFCLTasks(split="train"), bfcl.BFCLTasks(split="held_out")) for i in range(len(s))]
    assert len({t["id"] for t in tasks}) == 1000  # the train stream cycles: one pass, then every held-out record
    wrong = [(t["id"], step.reason) for t in tasks
             if (step := env.reset(t).step(render_calls(fmt, bfcl.ground_truth(t)))).reward != 1.0]
    assert wrong == [], (fmt, wrong[:3])


def test_a_demonstration_is_the_request_answered_by_its_expected_calls_in_the_envs_form():
  for fmt in ("smollm2", "gemma"):
    env = bfcl.BFCLEnv(tool_format=fmt)
    task = bfcl.BFCLTasks(seed=2)[5]
    user, assistant = env.demonstration(task)
    assert user == {"role": "user", "content": env.first_prompt(task)}
    assert assistant == {"role": "assistant", "content": render_calls(fmt, bfcl.ground_truth(task))}
    assert env.reset(task).step(assistant["content"]).outcome == Outcome.OK
  with pytest.raises(ValueError, match="bfcl task record needs field 'functions'"):
    bfcl.BFCLEnv().demonstration({k: v for k, v in task.items() if k != "functions"})


def test_a_demonstration_the_env_would_not_score_one_is_refused(monkeypatch):
  """`demonstration` plays its answer through the environment: expected calls it does not accept are an error, never
  a wrong demonstration (here `ground_truth` made to drop the request's calls)."""
  monkeypatch.setattr(bfcl, "ground_truth", lambda task: [])
  with pytest.raises(ValueError, match="its expected calls score no_answer"):
    bfcl.BFCLEnv().demonstration(bfcl.BFCLTasks()[0])


def test_the_suite_reports_accuracy_per_category():
  from ptx.data.tokenizer import ByteTokenizer
  from ptx.envs import suites
  from ptx.episodes import evaluation

  env, tasks = suites.load("bfcl", n=40, tokenizer=ByteTokenizer())
  # The expected calls for the simple requests, none for the others.
  answers = {env.first_prompt(t): render_calls(env.tool_format, bfcl.ground_truth(t)) if t["category"] ==
             "simple_python" else "no call" for t in tasks}
  report = suites.label("bfcl", env, tasks, evaluation.evaluate(lambda prompts, k: [[answers[p]] * k for p in prompts],
                                                                env, tasks, k=1))
  categories = {t["category"] for t in tasks}
  assert len(categories) == 4 and report["categories"] == {c: float(c == "simple_python") for c in sorted(categories)}
