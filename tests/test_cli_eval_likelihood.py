"""`ptx eval --task choice|perplexity`: log-likelihood reports end to end, compared as other suites' are."""

import json

import pytest

from ptx import cli
from ptx.episodes import evaluation


def test_choice_and_perplexity_write_reports_that_compare(ptx_checkpoint, tmp_path, capsys):
  choice, text = tmp_path / "choice.jsonl", tmp_path / "doc.txt"
  choice.write_text("".join(json.dumps({"context": c, "choices": [" yes", " no"], "answer": a}) + "\n"
                            for c, a in (("Is it?", 0), ("Is it not?", 1))))
  text.write_text("A short document, scored in rolling windows.")
  out = tmp_path / "eval"
  assert cli.main(["eval", "--model", str(ptx_checkpoint), "--task", "choice,perplexity", "--tasks-file",
                   f"choice={choice}", "--tasks-file", f"perplexity={text}", "--out", str(out)]) == 0
  lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
  assert [(line["suite"], line["tasks"]) for line in lines] == [("choice", 2), ("perplexity", 1)]
  assert lines[0]["pass@k"] == {"1": lines[0]["acc"]} and 0 <= lines[0]["acc_norm"] <= 1
  assert lines[1]["tokens"] == lines[1]["bytes"] == 44 and lines[1]["bits_per_byte"] > 0
  reports = evaluation.read_suites(out)
  assert cli.main(["eval", "--compare", str(out), str(out)]) == 0
  assert capsys.readouterr().out.splitlines()[-1] == (
      "no regression (no pass@1 fell, or bits_per_byte rose, by more than 0.05)")
  worse = tmp_path / "worse"
  reports["perplexity"]["bits_per_byte"] += 0.1  # a rise of bits per byte is the perplexity suite's regression
  evaluation.write_suites(reports, worse)
  assert cli.main(["eval", "--compare", str(out), str(worse)]) == 1
  table = capsys.readouterr().out.splitlines()
  assert "REGRESSED" in next(row for row in table if row.split()[:2] == ["perplexity", "bits_per_byte"])
  assert table[-1] == "REGRESSED (pass@1 fell, or bits_per_byte rose, by more than 0.05): perplexity"


def test_a_bad_choice_record_is_named(ptx_checkpoint, tmp_path, capsys):
  choice = tmp_path / "choice.jsonl"
  choice.write_text(json.dumps({"context": "c", "choices": ["a", "b"], "answer": 5}) + "\n")
  with pytest.raises(SystemExit) as info:
    cli.main(["eval", "--model", str(ptx_checkpoint), "--task", "choice", "--tasks-file", str(choice), "--out",
              str(tmp_path / "eval")])
  assert info.value.code == 2 and "choice.jsonl:1: field 'answer'" in capsys.readouterr().err
