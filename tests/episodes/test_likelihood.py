"""ptx.episodes.likelihood: continuation and rolling log-likelihoods against the logits, choice, perplexity."""

import json
import math

import jax
import numpy as np
import pytest

from ptx.data.records import RecordError
from ptx.data.tokenizer import ByteTokenizer
from ptx.episodes import likelihood
from ptx.models import decoder, load_hf

# Sums of 1..40 float32 log-probs of about log(272) = 5.6 each, from the same math in another order (padded,
# batched rows against one unpadded row): float32 rounding, ~1e-7 relative per operation over a few layers.
RTOL = 1e-5


@pytest.fixture(scope="module")
def model(ptx_checkpoint):
  return load_hf(ptx_checkpoint)


def _direct(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
  """log p(continuation | context) and whether it is greedy, from the full logits of one unpadded row."""
  tokens = np.array([context + continuation], np.int32)
  logp = jax.nn.log_softmax(np.asarray(decoder.forward(model.params, tokens, model.cfg), np.float64), axis=-1)[0]
  rows = range(len(context) - 1, len(tokens[0]) - 1)  # position t predicts token t + 1
  return (float(sum(logp[t, tokens[0, t + 1]] for t in rows)),
          all(int(np.argmax(logp[t])) == tokens[0, t + 1] for t in rows))


def test_scores_equal_a_direct_computation_from_the_logits(model):
  scorer = likelihood.Scorer(model.params, model.cfg, ByteTokenizer(), batch_size=4)
  pairs = [("The capital of France is", " Paris"), ("", "hello"), ("2 + 2 = ", "4"), ("a" * 20, "b" * 19),
           ("x", "yz"), ("Once upon a time", " there was a tiny model that scored text")]
  got = scorer.loglikelihood(pairs)
  for (context, continuation), (logp, greedy) in zip(pairs, got):
    ids = scorer.encode_pair(context, continuation)
    assert ids[0][0] == 1 and "".join(map(chr, [i - 3 for i in ids[1]])).strip() == continuation.strip()
    want, want_greedy = _direct(model, *ids)
    assert logp == pytest.approx(want, rel=RTOL) and greedy == want_greedy
  # The context's trailing space is scored with the continuation, as lm-evaluation-harness splits a pair.
  assert scorer.encode_pair("2 + 2 = ", "4")[1] == ByteTokenizer().encode(" 4")
  # A greedy continuation is found: the model's own argmax tokens.
  context = [1] + ByteTokenizer().encode("abc")
  argmax = []
  for _ in range(3):
    logits = decoder.forward(model.params, np.array([context + argmax], np.int32), model.cfg)
    argmax.append(int(np.argmax(logits[0, -1])))
  assert scorer.score_tokens([(context, argmax)])[0][1]


def test_rolling_windows_score_every_token_once_and_equal_the_direct_sums(model):
  tokenizer = ByteTokenizer()
  text = "The quick brown fox jumps over the lazy dog."  # 44 tokens
  windows = likelihood.rolling_windows(tokenizer.encode(text), 1, 16)
  assert [t for _, c in windows for t in c] == tokenizer.encode(text)
  assert all(len(a) + len(b) <= 16 for a, b in windows) and len(windows[-1][0]) + len(windows[-1][1]) == 16
  short = likelihood.Scorer(model.params, model.cfg, tokenizer, max_length=16)
  whole = likelihood.Scorer(model.params, model.cfg, tokenizer, max_length=64)
  got_short, got_whole = short.rolling([text])[0], whole.rolling([text])[0]
  assert got_short == pytest.approx(sum(_direct(model, *w)[0] for w in windows), rel=RTOL)
  assert got_whole == pytest.approx(_direct(model, [1], tokenizer.encode(text))[0], rel=RTOL)


def test_acc_and_acc_norm_differ_when_a_longer_choice_has_the_better_mean(model, tmp_path):
  scorer = likelihood.Scorer(model.params, model.cfg, ByteTokenizer())
  context = "Pick: "
  short, long = "q", "the same letter again and again"
  (s, _), (l, _) = scorer.loglikelihood([(context, short), (context, long)])
  assert s > l and s / len(short) < l / len(long)  # a short choice wins the sum, the long one the mean
  path = tmp_path / "choice.jsonl"
  path.write_text("".join(json.dumps({"context": context, "choices": [short, long], "answer": a}) + "\n"
                          for a in (0, 1)))
  report = likelihood.choice_report(scorer, likelihood.read_choices(path, 10))
  assert (report["acc"], report["acc_norm"], report["pass@k"], report["tasks"]) == (0.5, 0.5, {"1": 0.5}, 2)
  assert [(t["pick_acc"], t["pick_acc_norm"]) for t in report["per_task"]] == [(0, 1), (0, 1)]
  assert report["per_task"][0]["log_likelihoods"] == pytest.approx([s, l])


def test_perplexity_is_the_rolling_likelihood_per_token_and_byte(model, tmp_path):
  scorer = likelihood.Scorer(model.params, model.cfg, ByteTokenizer(), max_length=32)
  texts = ["héllo wörld", "a longer document than one window holds, scored in windows"]
  (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
  report = likelihood.perplexity_report(scorer, likelihood.read_texts(tmp_path / "docs.jsonl", 10))
  total = sum(scorer.rolling(texts))
  n_bytes = sum(len(t.encode()) for t in texts)
  assert report["tokens"] == report["bytes"] == n_bytes  # the byte tokenizer: one token per byte
  assert report["token_perplexity"] == pytest.approx(math.exp(-total / n_bytes))
  assert report["bits_per_byte"] == pytest.approx(-total / n_bytes / math.log(2))
  (tmp_path / "doc.txt").write_text(texts[1])
  assert likelihood.read_texts(tmp_path / "doc.txt", 10) == [texts[1]]


@pytest.mark.parametrize("record,field", [
    ({"choices": ["a", "b"], "answer": 0}, "field 'context'"),
    ({"context": "c", "choices": ["a"], "answer": 0}, "field 'choices'"),
    ({"context": "c", "choices": ["a", "b"], "answer": 2}, "field 'answer'"),
    ({"context": "c", "choices": ["a", "b"], "answer": True}, "field 'answer'"),
])
def test_bad_choice_records_name_the_file_line_and_field(record, field, tmp_path):
  path = tmp_path / "bad.jsonl"
  path.write_text(json.dumps({"context": "c", "choices": ["a", "b"], "answer": 1}) + "\n" + json.dumps(record) + "\n")
  with pytest.raises(RecordError, match=f"bad.jsonl:2: {field}"):
    likelihood.read_choices(path, 10)
