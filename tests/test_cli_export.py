"""`ptx dpo` / `ptx sft` end to end: precomputed references, and OUT/hf (+ OUT/adapter under LoRA) at the end."""

import json

import numpy as np

from ptx import cli
from ptx.data.hf_tokenizer import load_tokenizer
from ptx.models import load_hf
from ptx.models.hf_generation import GenerationInfo, read_generation

COMMON = ["--no-progress", "--model=tiny", "--model.n_layers=1", "--train.steps=4", "--train.log_every=2",
          "--data.batch_size=8", "--data.seq_len=32", "--mesh.data=2", "--mesh.fsdp=4"]


def _jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def test_dpo_with_precomputed_reference_and_lora_exports_merged_weights_and_adapter(tmp_path):
  pairs = _jsonl(tmp_path / "pref.jsonl", [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": "no"}
                                           for i in range(24)])
  out = tmp_path / "dpo"
  cli.main(["dpo", "--out", str(out), f"--data.train_files=[\"{pairs}\"]", f"--data.eval_files=[\"{pairs}\"]",
            "--train.eval_every=4", "--dpo.reference=precomputed", "--lora.rank=4", *COMMON])
  table = np.load(out / "reference_logps" / "train.npy")
  assert table.shape == (24, 2) and np.isfinite(table).all()
  assert (out / "reference_logps" / "eval.npy").exists()
  records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  assert records[-1]["step"] == 4 and any("eval/rewards/accuracies" in r for r in records)
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


def test_no_export_writes_no_model(tmp_path):
  rows = _jsonl(tmp_path / "sft.jsonl", [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(16)])
  cli.main(["sft", "--out", str(tmp_path / "sft"), f"--data.train_files=[\"{rows}\"]", "--no-export", *COMMON])
  assert (tmp_path / "sft" / "metrics.jsonl").exists() and not (tmp_path / "sft" / "hf").exists()
