"""Every bad-input case gives its documented outcome under both policies."""

import json

import numpy as np
import pytest

from ptx.config import DataConfig
from ptx.data.pipeline import make_pipeline
from ptx.data.records import RecordError, decode, encode
from ptx.data.sources import JsonlSource, NoDataError, RawRecord
from ptx.data.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
GOOD = b'{"prompt": "1+1=", "completion": "2"}'

# (line bytes, error text); each is line 3 of a file between good records.
BAD = {
    "malformed_json": (b'{"prompt": "1+1=", "completion": ', "malformed JSON"),
    "not_an_object": (b'["1+1=", "2"]', "must be a JSON object"),
    "missing_field": (b'{"prompt": "1+1="}', "missing field 'completion'"),
    "wrong_type": (b'{"prompt": "1+1=", "completion": 2}', "'completion' must be a string, got int"),
    "empty_completion": (b'{"prompt": "1+1=", "completion": "  "}', "'completion' is empty"),
    "invalid_utf8": (b'{"prompt": "1+1=\xff", "completion": "2"}', "invalid UTF-8 at byte 16"),
    "lone_surrogate": (b'{"prompt": "\\ud800", "completion": "2"}', "not valid UTF-8"),
    "bad_messages": (b'{"messages": [{"role": "user", "content": "hi"}]}', "no non-empty assistant turn"),
}


def _file(tmp_path, bad_line):
  path = tmp_path / "data.jsonl"
  path.write_bytes(b"\n".join([GOOD, GOOD, bad_line, GOOD]) + b"\n")
  return path


def _run(path, **kw):
  cfg = DataConfig(batch_size=1, seq_len=64, pack=False, shuffle=False, num_epochs=1, **kw)
  it = iter(make_pipeline(JsonlSource(path), TOK, cfg))
  return list(it), it.metrics()


@pytest.mark.parametrize("case", sorted(BAD))
def test_raise_policy_names_file_and_line(tmp_path, case):
  line, reason = BAD[case]
  path = _file(tmp_path, line)
  with pytest.raises(RecordError, match=f"{path}:3: .*") as info:
    _run(path, on_error="raise")
  assert reason in info.value.reason and info.value.where == f"{path}:3"


@pytest.mark.parametrize("case", sorted(BAD))
def test_skip_policy_counts_and_keeps_the_good_records(tmp_path, case):
  batches, metrics = _run(_file(tmp_path, BAD[case][0]), on_error="skip")
  assert len(batches) == 3
  assert (metrics["read"], metrics["skipped"], metrics["sequences"]) == (4, 1, 3)


def _long_records():
  return [{"prompt": "p" * 10, "completion": "c" * 100}, {"prompt": "p" * 100, "completion": "c"},
          {"prompt": "ok", "completion": "fine"}]


def test_overlong_truncate_keeps_the_head_and_drops_records_left_without_targets():
  from ptx.data.sources import MemorySource

  cfg = DataConfig(batch_size=3, seq_len=32, pack=False, shuffle=False, num_epochs=1)
  it = iter(make_pipeline(MemorySource(_long_records()), TOK, cfg))
  (batch,) = list(it)
  assert it.metrics()["truncated"] == 1 and it.metrics()["dropped"] == 1
  want = encode("sft", TOK, _long_records()[0], "x")
  np.testing.assert_array_equal(batch["tokens"][0], want["tokens"][:32])
  assert batch["segment_ids"][2].sum() == 0  # the filler row of the short last batch


def test_overlong_drop_counts():
  from ptx.data.sources import MemorySource

  cfg = DataConfig(batch_size=1, seq_len=32, pack=False, shuffle=False, num_epochs=1, overlong="drop")
  it = iter(make_pipeline(MemorySource(_long_records()), TOK, cfg))
  assert len(list(it)) == 1 and it.metrics()["dropped"] == 2


def test_preference_record_encodes_both_replies_with_the_same_prompt():
  ex = encode("preference", TOK, {"prompt": "q", "chosen": "yes", "rejected": "no"}, "x")
  assert TOK.decode(ex["chosen"]["tokens"][ex["chosen"]["loss_mask"] == 1]) == "yes"
  assert TOK.decode(ex["rejected"]["tokens"][ex["rejected"]["loss_mask"] == 1]) == "no"
  chat = encode("preference", TOK, {"prompt": [{"role": "user", "content": "q"}], "chosen": "yes",
                                    "rejected": "no"}, "x")
  assert TOK.decode(chat["chosen"]["tokens"][chat["chosen"]["loss_mask"] == 1]) == "yes<|im_end|>"
  with pytest.raises(RecordError, match="'rejected' is empty"):
    encode("preference", TOK, {"prompt": "q", "chosen": "yes", "rejected": ""}, "x")


def test_rl_record_keeps_task_fields_and_requires_them():
  ex = encode("rl", TOK, {"prompt": "2+2=", "answer": "4"}, "x", task_fields=("answer",))
  assert TOK.decode(ex["tokens"]) == "2+2=" and ex["task"] == {"answer": "4"} and not ex["loss_mask"].any()
  with pytest.raises(RecordError, match="x: missing field 'tests'"):
    encode("rl", TOK, {"prompt": "2+2="}, "x", task_fields=("tests",))
  chat = encode("rl", TOK, {"prompt": [{"role": "user", "content": "hi"}]}, "x")
  assert TOK.decode(chat["tokens"]).endswith("<|im_start|>assistant\n")


def test_decode_accepts_dicts_from_memory_and_json_bytes():
  assert decode(RawRecord({"a": 1}, "m[0]")) == {"a": 1}
  assert decode(RawRecord(json.dumps({"a": "é"}).encode(), "f:1")) == {"a": "é"}


def _jsonl(tmp_path, records):
  path = tmp_path / "data.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return path


# (records, config changes, what the error says after "first: "); each case keeps no record at seq_len 32.
NOTHING_KEPT = {
    "every_record_too_long": (
        [{"prompt": "p" * n, "completion": "c"} for n in (40, 50, 45)], dict(overlong="drop"),
        "{path}:1: 43 tokens, longer than data.seq_len=32 (data.overlong='drop'); {path}:2: 53 tokens",
        "The shortest record needs data.seq_len >= 43, the longest 53"),
    "preference_prompts_truncated_to_nothing": (
        [{"prompt": "q" * n, "chosen": "yes", "rejected": "no"} for n in (31, 40)], dict(kind="preference"),
        "{path}:1: 36 tokens, the first 32 before any target: truncation to data.seq_len=32 leaves no target token",
        "The shortest record needs data.seq_len >= 33, the longest 42"),
    "every_record_bad_and_skipped": (
        [{"prompt": "1+1="}] * 3, dict(on_error="skip"), "{path}:1: missing field 'completion'; {path}:2:", None),
}


@pytest.mark.parametrize("case", sorted(NOTHING_KEPT))
@pytest.mark.parametrize("num_epochs", [None, 1])
def test_a_stream_that_keeps_no_record_stops_saying_which_and_why(tmp_path, case, num_epochs):
  records, changes, first, needed = NOTHING_KEPT[case]
  path = _jsonl(tmp_path, records)
  cfg = DataConfig(batch_size=2, seq_len=32, pack=False, shuffle=False, num_epochs=num_epochs, num_threads=2,
                   **changes)
  # Repeating forever, the error comes after one pass (in reader threads' order); one epoch ends with it.
  with pytest.raises(NoDataError) as info:
    next(iter(make_pipeline(JsonlSource(path), TOK, cfg)))
  message = str(info.value)
  assert message.startswith(f"no example to train on: none of the {len(records)} records ")
  assert f"first: {first.format(path=path)}" in message
  assert (needed in message) if needed else "needs data.seq_len" not in message


def test_one_good_record_among_many_too_long_keeps_a_repeating_stream_going():
  from ptx.data.sources import MemorySource

  records = [{"prompt": "p" * 40, "completion": "c"}] * 30 + [{"prompt": "ok", "completion": "fine"}]
  cfg = DataConfig(batch_size=1, seq_len=32, pack=False, overlong="drop", seed=5)
  it = iter(make_pipeline(MemorySource(records), TOK, cfg))
  # Shuffled epochs put the good record anywhere, so up to 2 * 30 unkept records run between two kept ones.
  assert all(TOK.decode(next(it)["tokens"][0]).startswith("okfine") for _ in range(4))
