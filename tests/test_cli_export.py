"""`ptx dpo` end to end: precomputed references, LoRA, a resumed run, and OUT/hf (+ OUT/adapter under LoRA) at the end
(`--no-export`, which writes neither: tests/test_cli.py)."""

import json

import numpy as np

from cli_runs import by_step, cut_after, files_flag, metrics, without_timing, write_jsonl
from ptx import cli
from ptx.data.hf_tokenizer import load_tokenizer
from ptx.models import load_hf
from ptx.models.hf_generation import GenerationInfo, read_generation

COMMON = ["--no-progress", "--model=tiny", "--model.n_layers=1", "--train.steps=4", "--train.log_every=2",
          "--data.batch_size=8", "--data.seq_len=32", "--mesh.data=2", "--mesh.fsdp=4"]


def test_dpo_with_precomputed_reference_and_lora_exports_merged_weights_and_adapter_and_resumes(tmp_path, capsys):
  pairs = write_jsonl(tmp_path / "pref.jsonl", [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": "no"}
                                                for i in range(24)])
  out = tmp_path / "dpo"
  args = [files_flag("train_files", pairs), files_flag("eval_files", pairs), "--train.eval_every=4",
          "--train.checkpoint_every=2", "--dpo.reference=precomputed", "--lora.rank=4", *COMMON]
  cli.main(["dpo", "--out", str(out), *args])
  table = np.load(out / "reference_logps" / "train.npy")
  assert table.shape == (24, 2) and np.isfinite(table).all()
  assert (out / "reference_logps" / "eval.npy").exists()
  records = metrics(out)
  assert records[-1]["step"] == 4 and any("eval/rewards/accuracies" in r for r in records)
  # Under LoRA a checkpoint holds the adapters only: a resumed run takes the frozen base again, and its reference
  # table, and goes on as the uninterrupted run did.
  cut = cut_after(out, tmp_path / "cut", 2)
  capsys.readouterr()
  cli.main(["dpo", "--out", str(cut), "--resume", "--no-export", *args])
  assert "resumed from checkpoint step 2" in capsys.readouterr().out
  resumed = by_step(cut)
  assert sorted(resumed) == [2, 4] and without_timing(resumed[4]) == without_timing(by_step(out)[4])
  assert any("eval/rewards/accuracies" in r for r in metrics(cut) if r["step"] == 4)
  assert json.loads((out / "adapter" / "adapter_config.json").read_text())["r"] == 4
  assert (out / "adapter" / "adapter_model.safetensors").exists() and (out / "base" / "config.json").exists()
  model = load_hf(out / "hf")
  assert load_tokenizer(out / "hf").encode("7+1=") == [b + 3 for b in b"7+1="]
  # A fresh model declares its tokenizer's ids, in the merged export and the base alike.
  for exported in (out / "hf", out / "base"):
    assert read_generation(exported) == GenerationInfo(bos_token_id=1, eos_token_ids=(2,), pad_token_id=0)
  for file in [*(out / "hf").iterdir(), *(out / "adapter").iterdir()]:
    assert file.stat().st_mode & 0o044 == 0o044, f"{file} is not readable by group and others"
  assert model(np.asarray([[1, 58, 46, 52, 64]], np.int32)).shape == (1, 5, model.cfg.vocab_size)
