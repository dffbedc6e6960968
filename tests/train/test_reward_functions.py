"""GRPO from plain Python reward functions: their inputs, their errors, and a whole `train_grpo` run."""

import json

import numpy as np
import pytest

from ptx.config import Config, DataConfig, GRPOConfig, MeshConfig, OptimizerConfig, TrainConfig
from ptx.model_config import ModelConfig
from ptx.data.tokenizer import ByteTokenizer
from ptx.train.reward_functions import RewardFunctions, train_grpo

TOK = ByteTokenizer()


def _tokens(*texts):
  """Completions as the sampler returns them: token rows padded, each ended by eos, and their lengths."""
  rows = [TOK.encode(t) + [TOK.eos_id] for t in texts]
  width = max(map(len, rows))
  return np.asarray([r + [TOK.pad_id] * (width - len(r)) for r in rows]), np.asarray([len(r) for r in rows])


def test_a_function_sees_decoded_completions_its_prompts_and_the_fields_it_names():
  seen = {}

  def correct(prompts, completions, answer):
    seen.update(prompts=prompts, completions=completions, answer=answer)
    return [float(c == a) for c, a in zip(completions, answer)]

  reward = RewardFunctions((correct,), TOK, (TOK.eos_id,), group_size=2)
  tasks = [{"prompt": "1+1=", "answer": "2", "source": "x"}, {"prompt": "2+2=", "answer": "4", "source": "y"}]
  out = reward(*_tokens("2", "3", "4", "4"), tasks)
  np.testing.assert_array_equal(out, [1.0, 0.0, 1.0, 1.0])
  assert seen == {"prompts": ["1+1=", "1+1=", "2+2=", "2+2="], "completions": ["2", "3", "4", "4"],
                  "answer": ["2", "2", "4", "4"]}


def test_several_functions_are_named_components_and_none_is_unscored():
  def length(prompts, completions, **fields):
    assert set(fields) == {"answer"}
    return [len(c) for c in completions]

  def sometimes(prompts, completions):
    return [None, 1.0]

  out = RewardFunctions((length, sometimes), TOK, (TOK.eos_id,), group_size=1)(
      *_tokens("ab", "c"), [{"prompt": "p", "answer": "a"}, {"prompt": "q", "answer": "b"}])
  assert sorted(out) == ["length", "sometimes"]
  np.testing.assert_array_equal(out["length"], [2.0, 1.0])
  assert np.isnan(out["sometimes"][0]) and out["sometimes"][1] == 1.0


def test_bad_reward_functions_are_named():
  def short(prompts, completions):
    return [1.0]

  with pytest.raises(ValueError, match="reward function 'short' returned 1 values for 2 completions"):
    RewardFunctions((short,), TOK, (TOK.eos_id,), group_size=2)(*_tokens("a", "b"), [{"prompt": "p"}])
  with pytest.raises(ValueError, match="distinct names"):
    RewardFunctions((short, short), TOK, (TOK.eos_id,), group_size=2)


def test_train_grpo_trains_on_plain_python_rewards(tmp_path):
  cfg = Config(model=ModelConfig(vocab_size=264, d_model=64, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=32,
                                 mlp_dim=96),
               mesh=MeshConfig(data=2, fsdp=4), optim=OptimizerConfig(lr=1e-3, warmup_steps=0),
               train=TrainConfig(steps=2, log_every=1, checkpoint_every=100),
               data=DataConfig(kind="rl", batch_size=8, seq_len=8, pack=False),
               grpo=GRPOConfig(group_size=2, kl_placement="none", beta=0.0, max_response_tokens=4))

  def even_bytes(prompts, completions):
    return [sum(b % 2 == 0 for b in c.encode()) / max(len(c), 1) for c in completions]

  def echoes(prompts, completions, answer):
    return [float(c.startswith(a)) for c, a in zip(completions, answer)]

  tasks = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(5)]  # fewer than a batch: repeated
  state, summary = train_grpo(cfg, tasks=tasks, rewards=[even_bytes, echoes], tokenizer=TOK, out=tmp_path,
                              progress=False)
  assert int(state.step) == 2 and summary["step"] == 2
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert all({"reward/even_bytes/mean", "reward/echoes/mean", "rollout/staleness"} <= set(r) for r in records)
  assert records[0]["reward/even_bytes/mean"] > 0 and records[0]["actor/grad_norm"] > 0
  # The transcript of step 1 (the first step is always written): 8 of its 16 samples, decoded, as the functions saw
  # them, with each function's score of them (float32) and their sum.
  rows = [json.loads(line) for line in (tmp_path / "samples" / "step_1.jsonl").read_text().splitlines()]
  assert len(rows) == 8 and not (tmp_path / "samples" / "step_2.jsonl").exists()
  for row in rows:
    prompt, completion = row["prompt"], row["completion"]
    answer = str(int(prompt.split("+")[0]) + 1)
    want = {"even_bytes": even_bytes([prompt], [completion])[0], "echoes": echoes([prompt], [completion], [answer])[0]}
    assert row["rewards"] == pytest.approx(want, abs=1e-6) and row["reward"] == pytest.approx(sum(want.values()), 1e-6)
  assert len({row["completion"] for row in rows}) > 1
