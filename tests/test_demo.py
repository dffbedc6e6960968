"""`ptx demo`: both stages train, and OUT holds metrics, readable plots, an HF export that transformers loads,
and a summary of held-out scores on problems no training stream holds."""

import json

import numpy as np
import problems
import pytest

from ptx import cli, demo
from ptx.data.tokenizer import ByteTokenizer
from ptx.train import streams

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# Both demo runs' flags: the run without GRPO steps has the module run's mesh and SFT shapes, so the compile cache
# serves it the programs that run compiled.
FLAGS = ("--no-progress", "--train.steps=20", "--train.log_every=10", "--data.batch_size=16", "--mesh.data=2",
         "--mesh.fsdp=4")
# Held-out problems the demo samples 8 times after each stage (it has 256, most of a stage's evaluation on CPU):
# the same sampler and scoring, and every score asserted below is still a fraction of them.
SAMPLED_TASKS = 32


def _demo(out, *flags: str) -> None:
  """`ptx demo --out OUT` with FLAGS and `flags`, sampling SAMPLED_TASKS held-out problems after each stage."""
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(demo, "SAMPLED_TASKS", SAMPLED_TASKS)
    cli.main(["demo", "--out", str(out), *FLAGS, *flags])


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("demo") / "out"
  _demo(out, "--rl-steps=4")
  return out


def test_demo_trains_both_stages_and_logs(demo_run, capsys):
  config = json.loads((demo_run / "sft" / "config.json").read_text())
  assert config["train"]["steps"] == 20 and config["mesh"]["data"] == 2
  records = [json.loads(line) for line in (demo_run / "sft" / "metrics.jsonl").read_text().splitlines()]
  train = [r for r in records if "loss" in r]
  assert [r["step"] for r in train] == [10, 20]
  assert train[-1]["loss"] < train[0]["loss"]
  assert {"loss", "accuracy", "grad_norm", "lr", "tokens_per_s"} <= set(train[0])
  assert [r["step"] for r in records if "eval/loss" in r] == [20]  # held-out loss at the end of SFT
  rl = [json.loads(line) for line in (demo_run / "grpo" / "metrics.jsonl").read_text().splitlines()]
  assert rl[-1]["step"] == 4 and {"reward/mean", "actor/pg_loss", "response_length/mean"} <= set(rl[-1])


def test_demo_summary_has_scores_before_and_after_and_no_shared_problem(demo_run):
  summary = json.loads((demo_run / "summary.json").read_text())
  for stage in ("init", "sft", "grpo"):
    assert set(summary[stage]) == {"greedy", "pass@1", "pass@8"}
    assert all(0.0 <= v <= 1.0 for v in summary[stage].values())
  held_out = summary["held_out"]
  assert held_out["shared_with"] == {"sft": 0, "grpo": 0} and held_out["problems"] > 100
  assert held_out["split_sizes"] == {"train": 7433, "held_out": 2567}  # 10,000 prompts "a+b=", a, b < 100


def test_the_full_demo_trains_on_no_held_out_problem():
  # At the demo's own sizes (38,400 SFT records, 51,200 GRPO prompts), over the prompts its GRPO stream reads.
  cfg = demo.default_config()
  rl_cfg = demo.grpo_config(cfg, 400)
  grpo_tasks = demo.ReadPrompts(demo.GRPO_TASKS)
  prompts = streams.grpo_prompts(rl_cfg, ByteTokenizer(), grpo_tasks, in_graph=True)
  for _ in range(rl_cfg.train.steps):
    next(prompts)
  sft = {r["prompt"] for r in demo.records(demo.SFT_TASKS, cfg.train.steps * cfg.data.batch_size)}
  assert len(sft) > 5000 and len(grpo_tasks.read) > 5000
  trained = {problems.arithmetic(p) for p in sft | grpo_tasks.read}  # 3+5 and 5+3 count as one problem
  held_out = {problems.arithmetic(r["prompt"]) for r in demo.records(demo.HELD_OUT_TASKS, demo.EVAL_SIZE)}
  assert len(held_out) > 100 and trained & held_out == set()


def test_demo_writes_readable_png_plots(demo_run):
  from PIL import Image

  names = sorted(p.name for p in (demo_run / "plots").iterdir())
  assert names == ["accuracy.png", "grpo_response_length.png", "grpo_reward.png", "sft_loss.png"]
  for name in names:
    path = demo_run / "plots" / name
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(path) as image:
      assert image.size[0] >= 600 and image.size[1] >= 400
      pixels = np.asarray(image.convert("L"))
    assert (pixels < 128).mean() > 0.005, f"{name} is blank"  # title, axes, labels and data drawn in ink


def test_demo_exports_an_hf_model_transformers_reproduces(demo_run):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from ptx.data.hf_tokenizer import load_tokenizer
  from ptx.models import load_hf

  hf = demo_run / "hf"
  tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
  ids = tokenizer("12+34=", add_special_tokens=False)["input_ids"]
  assert ids == load_tokenizer(hf).encode("12+34=")
  ids = [tokenizer.bos_token_id, *ids]
  model = transformers.AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32)
  with torch.no_grad():
    expected = model(torch.tensor([ids])).logits.numpy()
  ours = load_hf(hf)
  got = np.asarray(ours(np.asarray([ids], np.int32)))
  # HF parity: torch and XLA each sum in their own float32 order; 1e-4 on O(1) logits, as in tests/models/test_hf.py.
  np.testing.assert_allclose(got, expected, atol=1e-4)


def test_demo_without_rl_steps_plots_the_sft_stage_only(tmp_path):
  out = tmp_path / "out"
  _demo(out, "--rl-steps=0")
  assert sorted(p.name for p in (out / "plots").iterdir()) == ["accuracy.png", "sft_loss.png"]
