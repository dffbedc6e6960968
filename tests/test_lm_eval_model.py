"""ptx.lm_eval_model: lm_eval's own command line runs local tasks on the model `ptx`, agreeing with `ptx eval`."""

import json

import numpy as np
import pytest

from ptx import cli
from ptx.data.tokenizer import ByteTokenizer

pytest.importorskip("lm_eval", reason="needs the lmeval extra (`make test` installs it)")

RECORDS = [{"context": "The sky is", "choices": [" blue", " made of green cheese"], "answer": 0},
           {"context": "2 + 2 =", "choices": [" 4", " 5", " fish"], "answer": 0},
           {"context": "Water is", "choices": [" wet", " dry"], "answer": 1}]
# Each task reads a local JSON file (dataset_path: json); the choices are scored exactly as written.
TASKS = {"ptx_choice": """task: ptx_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm
""", "ptx_generate": """task: ptx_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: {until}
  max_gen_toks: 6
metric_list:
  - metric: exact_match
"""}


def test_lm_eval_runs_local_tasks_on_ptx_and_agrees_with_ptx_eval(ptx_checkpoint, tmp_path, monkeypatch, capsys):
  # No hub: the tasks' data are local files and the datasets cache a temporary directory.
  for name, value in (("HF_DATASETS_OFFLINE", "1"), ("HF_HUB_OFFLINE", "1"), ("HF_HOME", str(tmp_path / "hf"))):
    monkeypatch.setenv(name, value)
  from ptx import lm_eval_model

  from ptx.models import load_hf
  from ptx.sampling.rules import SamplingConfig
  from ptx.sampling.text import TextSampler

  # ptx's greedy completions of the contexts; the generation task stops at a character of the first one.
  model = load_hf(ptx_checkpoint)
  sampler = TextSampler(model.params, model.cfg, ByteTokenizer(), max_new_tokens=6,
                        sampling=SamplingConfig(greedy=True))
  whole = [texts[0] for texts in sampler([r["context"] for r in RECORDS], 1)]
  stop = next(c for c in whole[0][1:] if c.isascii() and c.isalnum())
  data, tasks, out = tmp_path / "records.json", tmp_path / "tasks", tmp_path / "lm_eval"
  data.write_text(json.dumps(RECORDS))
  tasks.mkdir()
  for name, text in TASKS.items():
    (tasks / f"{name}.yaml").write_text(text.format(data=data, until=json.dumps([stop])))
  lm_eval_model.main(["run", "--model", "ptx", "--model_args", f"model={ptx_checkpoint}", "--batch_size", "4",
                      "--tasks", "ptx_choice,ptx_generate", "--include_path", str(tasks), "--output_path", str(out),
                      "--log_samples"])
  results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
  samples = {name: [json.loads(line) for line in next(out.rglob(f"samples_{name}_*.jsonl")).open()]
             for name in TASKS}

  jsonl = tmp_path / "choice.jsonl"
  jsonl.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
  capsys.readouterr()
  assert cli.main(["eval", "--model", str(ptx_checkpoint), "--task", "choice", "--tasks-file", str(jsonl), "--out",
                   str(tmp_path / "ptx")]) == 0
  report = json.loads((tmp_path / "ptx" / "eval.json").read_text())
  assert (results["ptx_choice"]["acc,none"], results["ptx_choice"]["acc_norm,none"]) == (report["acc"],
                                                                                       report["acc_norm"])
  by_doc = sorted(samples["ptx_choice"], key=lambda s: s["doc_id"])
  for sample, task in zip(by_doc, report["per_task"]):
    # The same float32 program, sharded over 8 devices against one: sums in another order, ~1e-6 relative.
    np.testing.assert_allclose([float(r[0][0]) for r in sample["resps"]], task["log_likelihoods"], rtol=1e-5)
  # generate_until: ptx's greedy completion of each context, cut before the stop string.
  want = [text.split(stop)[0] for text in whole]
  assert len(want[0]) < len(whole[0])
  assert [s["resps"][0][0] for s in sorted(samples["ptx_generate"], key=lambda s: s["doc_id"])] == want
