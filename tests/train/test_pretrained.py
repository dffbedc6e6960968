"""`ptx.from_pretrained`: the Python start of a fine-tune from an HF checkpoint, and train_grpo from it."""

import dataclasses
import json

import jax
import numpy as np
import pytest

import ptx
from model_variants import HF_ARCH
from ptx import model_config
from ptx.models import load_hf

pytest.importorskip("tokenizers", reason="a checkpoint's tokenizer needs the hf extra (`make test` installs it)")


def _base():
  """The GRPO fine-tuning preset, with an execution setting the checkpoint must not override and a tiny shape."""
  cfg = ptx.FINETUNE["grpo"]()
  return dataclasses.replace(
      cfg, model=dataclasses.replace(cfg.model, remat="dots"), mesh=ptx.MeshConfig(data=2, fsdp=4),
      optim=dataclasses.replace(cfg.optim, lr=0.0, warmup_steps=0),
      train=dataclasses.replace(cfg.train, steps=2, checkpoint_every=100),
      data=dataclasses.replace(cfg.data, batch_size=8, seq_len=64),
      grpo=dataclasses.replace(cfg.grpo, group_size=2, max_response_tokens=4))


def _host(tree):
  return jax.tree.map(np.asarray, tree)


def test_the_start_has_the_checkpoints_architecture_weights_and_tokenizer(ptx_checkpoint):
  start = ptx.from_pretrained(ptx_checkpoint, _base())
  assert not model_config.architecture_differences(start.cfg.model, HF_ARCH)
  assert start.cfg.model.remat == "dots", "an execution setting of the given config was replaced"
  assert start.cfg.data.tokenizer == str(ptx_checkpoint) and start.tokenizer.vocab_size <= HF_ARCH.vocab_size
  assert start.cfg.grpo == _base().grpo and start.cfg.optim == _base().optim
  jax.tree.map(np.testing.assert_array_equal, _host(start.params), _host(load_hf(ptx_checkpoint).params))

  first = ptx.from_pretrained(ptx_checkpoint, _base(), n_layers=1)
  assert first.cfg.model.n_layers == 1
  np.testing.assert_array_equal(np.asarray(first.params["layers"]["down"]),
                                np.asarray(start.params["layers"]["down"])[:1])
  for n_layers in (0, HF_ARCH.n_layers + 1):
    with pytest.raises(ValueError, match=rf"n_layers={n_layers}: .*config.json has {HF_ARCH.n_layers} layers"):
      ptx.from_pretrained(ptx_checkpoint, _base(), n_layers=n_layers)


def test_train_grpo_fine_tunes_the_start_on_chat_prompts_and_refuses_weights_of_another_config(ptx_checkpoint,
                                                                                                tmp_path):
  start = ptx.from_pretrained(ptx_checkpoint, _base())
  tasks = [{"prompt": [{"role": "user", "content": f"{i}+1="}], "answer": str(i + 1)} for i in range(4)]
  seen = []

  def answered(prompts, completions, answer):
    seen.extend(prompts)
    return [float(c.strip().startswith(a)) for c, a in zip(completions, answer)]

  wrong = dataclasses.replace(start.cfg, model=dataclasses.replace(start.cfg.model, n_layers=1))
  with pytest.raises(ValueError, match=r"init_params.*n_layers=1.*ptx.from_pretrained"):
    ptx.train_grpo(wrong, tasks=tasks, rewards=answered, tokenizer=start.tokenizer, out=tmp_path / "wrong",
                   init_params=start.params, progress=False)
  # The SFT preset's record kind: train_grpo sets the rl kind itself, no `data.kind` error in command-line words.
  sft_records = dataclasses.replace(start.cfg, data=dataclasses.replace(start.cfg.data, kind="sft", pack=True))
  state, summary = ptx.train_grpo(sft_records, tasks=tasks, rewards=answered, tokenizer=start.tokenizer,
                                  out=tmp_path / "run", init_params=start.params, progress=False)
  assert summary["step"] == 2 and seen[0] == tasks[0]["prompt"]
  records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [1, 2] and all(np.isfinite(r["reward/mean"]) for r in records)
  # At lr 0 every update is 0, so the run trained the checkpoint's weights, all of its layers.
  jax.tree.map(np.testing.assert_array_equal, _host(state.params), _host(start.params))
