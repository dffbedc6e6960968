"""Document QA through search and read: tasks disjoint by document, replies within budget, and the hacks it refuses."""

import collections
import json
import re

import pytest

from ptx.data.tokenizer import ByteTokenizer
from ptx.envs.base import Outcome
from ptx.envs.docqa import DocQAEnv, DocQATasks

TOKENIZER = ByteTokenizer()
# Byte budgets: about four times the BPE defaults.
ENV = DocQAEnv(TOKENIZER, prompt_tokens=2400, reply_tokens=1600, line_tokens=120, prompt_passages=0)
TASKS = DocQATasks(seed=0)
# How a reader finds each attribute's value for the ship `{n}`, and the words it searches with.
READ = {
    "Under which registry code": ("registry code", [r"The {n} is entered in the registry under code (\S+)\.",
                                                    r"Registry code (\S+) belongs to the {n}\."]),
    "Who was given command": ("command captain", [r"Command of the {n} passed to captain (\w+ \w+)\.",
                                                  r"Captain (\w+ \w+) took the helm of the {n}\."]),
    "Out of which port": ("port sails", [r"The {n} sails out of the port of (\w+)\.",
                                         r"The home port of the {n} is (\w+)\."]),
    "How many tons": ("tons displaces", [r"The {n} displaces (\d+) tons\.", r"Surveyors put the {n} at (\d+) tons\."]),
}


def _call(name, **arguments):
  return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def _ship(question):
  return re.search(r"the ([A-Z]\w+ [A-Z]\w+)", question).group(1)


def _reader(question):
  """(the key words to search with, a function that finds the asked value in a text or returns None)."""
  words, patterns = next(v for k, v in READ.items() if question.startswith(k))
  ship = _ship(question)

  def read(text):
    found = [m.group(1) for p in patterns for m in re.finditer(p.format(n=ship), text)]
    return found[0] if found else None

  return f"{ship} {words}", read


def _within_budget(step):
  assert len(TOKENIZER.encode(step.observation)) <= ENV.reply_tokens
  return step


def test_tasks_are_reproducible_long_and_json_records():
  task = TASKS[3]
  assert task == DocQATasks(seed=0)[3] and task != DocQATasks(seed=1)[3]
  assert json.loads(json.dumps(task)) == task and set(task) == {"doc", "document", "question", "answer"}
  for i in range(20):
    passages = TASKS[i]["document"].split("\n\n")
    # Thousands of tokens: over 10,000 characters (about 2,500 BPE tokens) in 50 passages.
    assert len(passages) == 50 and sum(map(len, passages)) > 10_000
  with pytest.raises(ValueError, match="DocQATasks.split must be one of"):
    DocQATasks(split="test")


@pytest.fixture(scope="module")
def train():
  return [TASKS[i] for i in range(150)]


def test_train_and_held_out_never_share_a_document(train):
  held = [DocQATasks(seed=0, split="held_out")[i] for i in range(150)]
  assert not {t["doc"] for t in train} & {t["doc"] for t in held}
  assert not {t["document"] for t in train} & {t["document"] for t in held}
  # Another seed draws other tasks, on the same side: still none of the held-out documents.
  assert not {DocQATasks(seed=7)[i]["document"] for i in range(50)} & {t["document"] for t in held}


def test_answers_cannot_be_guessed_and_a_document_asks_many_questions(train):
  assert len({t["answer"] for t in train}) >= 148
  assert {next(k for k in READ if t["question"].startswith(k)) for t in train} == set(READ)
  asked = collections.defaultdict(set)
  for i in range(40):
    task = DocQATasks(seed=0, documents=8)[i]
    asked[task["doc"]].add(task["question"])
  assert max(map(len, asked.values())) >= 3


def test_no_sentence_gives_an_answer_away_without_its_ship(train):
  for task in train[:60]:
    sentences = re.split(r"(?<=\.) ", task["document"].replace("\n\n", " "))
    holding = [s for s in sentences if re.search(rf"\b{re.escape(task['answer'])}\b", s)]
    assert len(holding) == 1 and _ship(task["question"]) in holding[0]
    assert "answer" not in task["document"].lower()


def test_a_scripted_reader_searches_with_the_key_words_and_answers_right():
  solved = 0
  for i in range(12):
    task = TASKS[i]
    episode = ENV.reset(task)
    assert len(TOKENIZER.encode(episode.prompt)) <= ENV.prompt_tokens and task["question"] in episode.prompt
    assert task["answer"] not in episode.prompt  # prompt_passages=0: the document is only reached through tools
    query, read = _reader(task["question"])
    step = _within_budget(episode.step(_call("search", query=query)))
    assert not step.done and (step.tool_calls, step.tool_errors) == (1, 0)
    assert step.observation.startswith(f'search("{query}"): passages ')
    found = read(step.observation)
    if found is None:  # not among the best three for the key words: then by the ship's name alone
      found = read(_within_budget(episode.step(_call("search", query=_ship(task["question"])))).observation)
    final = episode.step(f"Answer: {found or 'unknown'}")
    assert final.done and final.reward == (1.0 if found else 0.0) and (found is None or found == task["answer"])
    solved += final.reward == 1.0
  assert solved >= 9  # 11 of 12 on this seed, 10 with the key words alone


def test_answers_are_matched_after_normalisation_and_wrong_ones_score_nothing():
  task = TASKS[0]
  for spelling in (task["answer"], f"  **{task['answer'].upper()}**.", f'"{task["answer"].lower()}"'):
    step = ENV.reset(task).step(f"The registry says so.\nAnswer: {spelling}")
    assert step.outcome == Outcome.OK and step.reward == 1.0
  wrong = ENV.reset(task).step("Answer: Ada Norton")
  assert wrong.done and wrong.outcome == Outcome.WRONG and wrong.reward == 0.0
  nothing = ENV.reset(task).step("Let me think about where to look.")
  assert not nothing.done and "no `Answer: <answer>` line" in nothing.observation


def test_replies_show_new_passages_once_and_summarise_earlier_calls():
  task = TASKS[1]
  episode = ENV.reset(task)
  query = _reader(task["question"])[0]
  first = episode.step(_call("search", query=query))
  listed = re.match(r'search\(".*"\): passages (\d+), (\d+), (\d+)', first.observation).groups()
  assert all(f"\n\n[{n}] " in first.observation for n in listed)
  again = episode.step(_call("search", query=query) + _call("read", passage=int(listed[0])))
  # Seen whole already: marked, not repeated, unless read; the first turn's call is now history.
  assert f'passages {", ".join(n + " (seen)" for n in listed)}' in again.observation
  assert again.observation.count("\n\n[") == 1 and f"\n\n[{listed[0]}] " in again.observation
  assert again.observation.endswith(f"Earlier in this episode:\n- {first.observation.splitlines()[0]}")


def test_a_reply_stays_within_budget_whatever_the_turn_asks():
  task = TASKS[2]
  episode = ENV.reset(task)
  greedy = "".join(_call("search", query=q) for q in ("registry code", "captain command", "port sails", "tons"))
  step = _within_budget(episode.step(greedy))
  assert re.search(r"\[\d+ more passages? left out\]", step.observation) and step.tool_calls == 4
  flood = _within_budget(episode.step(_call("x" * 5000) * 3 + _call("search", query="q" * 150 + " captain") * 20))
  assert (flood.tool_calls, flood.tool_errors) == (23, 22)
  assert "error: 19 more tool calls not answered (at most 4 a turn)" in flood.observation


@pytest.mark.parametrize("call, problem", [
    (_call("search"), "error: search needs argument 'query'"),
    (_call("search", query=5), "error: argument 'query' of search must be string, got int"),
    (_call("search", query="the is of"), "error: search failed: ValueError: the query has no words to search for"),
    (_call("search", query="x " * 150), "error: search failed: ValueError: the query is longer than 200 characters"),
    (_call("search", query="port", k=10), "error: search has no argument 'k'; it takes ['query']"),
    (_call("read", passage=0), "error: read failed: ValueError: passage must be between 1 and 50, got 0"),
    (_call("read", passage="3"), "error: argument 'passage' of read must be integer, got str"),
    (_call("read", passage=True), "error: argument 'passage' of read must be integer, got bool"),
    (_call("answer", text="KX-1234"), "error: no tool named 'answer'; the tools are ['read', 'search']"),
    ('<tool_call>{"name": "search", </tool_call>', "error: the tool call is not valid JSON"),
], ids=["no query", "query a number", "stop words only", "query too long", "unknown argument", "passage 0",
        "passage a string", "passage a bool", "unknown tool", "bad JSON"])
def test_bad_tool_calls_get_an_error_naming_the_problem(call, problem):
  step = _within_budget(ENV.reset(TASKS[0]).step(call))
  assert not step.done and (step.tool_calls, step.tool_errors) == (1, 1) and step.observation.startswith(problem)


def _naive_judge(task, action):
  """Rewards an action that mentions the answer anywhere: what each hack below would beat."""
  return task["answer"].lower() in action.lower()


def test_the_hacks_a_policy_would_try_score_nothing():
  task = TASKS[4]
  right, query = task["answer"], _reader(task["question"])[0]
  dump = " ".join(ENV.reset(task).step(_call("search", query=query)).observation.split())
  others = [DocQATasks(seed=0)[i]["answer"] for i in range(5, 8)]
  hacks = {
      # Right first and last: whichever one a lax judge took, it would pay.
      "several answers in one turn": "\n".join(f"Answer: {a}" for a in [right, *others, right]),
      "every candidate on one line": f"Answer: {' or '.join([*others, right])}",
      "the retrieved passages as the answer": f"Answer: {dump}",
      "the question as the answer": f"Answer: {task['question']}",
      "an empty answer": "Answer:",
  }
  assert right in dump
  for name, action in hacks.items():
    step = ENV.reset(task).step(action)
    assert step.done and step.reward == 0.0 and step.outcome == Outcome.WRONG, name
    assert _naive_judge(task, action) == (name not in ("the question as the answer", "an empty answer")), name
  # An answer in a turn that calls a tool is not an answer: the turn only gets the tool's results.
  hidden = ENV.reset(task).step(_call("search", query="captain") + f"\nAnswer: {right}")
  assert not hidden.done and hidden.tool_calls == 1 and hidden.observation.startswith('search("captain")')
  # Searching for the answer itself: the document never says "answer", and stop words are ignored.
  for probe in ("answer", "the answer is", "what is the answer"):
    step = ENV.reset(task).step(_call("search", query=probe))
    assert step.observation == f'search("{probe}"): no passage matches' and right not in step.observation


def test_other_call_formats_reach_the_same_tools():
  task = TASKS[0]
  llama = DocQAEnv(TOKENIZER, tool_format="llama3", reply_tokens=1600, line_tokens=120).reset(task)
  step = llama.step(json.dumps({"name": "read", "parameters": {"passage": 7}}))
  assert step.tool_calls == 1 and step.observation.startswith("read(7): passage 7\n\n[7] ")
  gemma = DocQAEnv(TOKENIZER, tool_format="gemma", reply_tokens=1600, line_tokens=120).reset(task)
  step = gemma.step("```tool_code\nsearch(query='port')\n```")
  assert step.tool_calls == 1 and step.observation.startswith('search("port"): passages ')


def test_settings_and_records_are_checked_by_name():
  with pytest.raises(ValueError, match=r"DocQAEnv.reply_tokens must be >= \(max_calls \+ 1\) \* \(line_tokens \+ 1\)"):
    DocQAEnv(TOKENIZER, reply_tokens=300)
  with pytest.raises(ValueError, match="DocQAEnv.tool_format must be one of"):
    DocQAEnv(TOKENIZER, tool_format="xml")
  with pytest.raises(ValueError, match="do not fit DocQAEnv.prompt_tokens: .*fixed is"):
    DocQAEnv(TOKENIZER, prompt_tokens=300).reset(TASKS[0])
  with pytest.raises(ValueError, match="docqa task record needs field 'answer'"):
    ENV.reset({"document": "a", "question": "b"})
  with pytest.raises(ValueError, match="docqa task field 'document' has no passages"):
    ENV.reset({"document": "\n\n", "question": "b", "answer": "c"})
