"""The grain pipeline: sources, epochs, packing layout, exact resume, host shards."""

import dataclasses
import json
import os
import subprocess
import sys

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from ptx.data.batch import sft_example
from ptx.data.global_batch import to_global
from ptx.config import DataConfig
from ptx.data.pipeline import make_pipeline
from ptx.data.sources import ArrayRecordSource, JsonlSource, MemorySource, NoDataError, write_array_record
from ptx.data.tokenizer import ByteTokenizer
from ptx.sharding import batch_sharding

TOK = ByteTokenizer()


def _records(n=120, seed=0):
  rng = np.random.default_rng(seed)
  return [{"prompt": f"#{i} " + "q" * int(rng.integers(1, 40)), "completion": "a" * int(rng.integers(1, 30))}
          for i in range(n)]


def _sequences(batch):
  """Each packed sequence of a batch as (tokens, loss_mask) tuples, row by row."""
  out = []
  for r in range(batch["tokens"].shape[0]):
    for s in range(1, batch["segment_ids"][r].max() + 1):
      sel = batch["segment_ids"][r] == s
      out.append((tuple(batch["tokens"][r][sel]), tuple(batch["loss_mask"][r][sel])))
  return out


def _ids(batches):
  """The record number (#i) of every sequence in the batches."""
  return [int(TOK.decode(t).split()[0][1:]) for b in batches for t, _ in _sequences(b)]


def test_jsonl_source_indexes_lines_and_skips_blank_ones(tmp_path):
  path = tmp_path / "a.jsonl"
  path.write_text('{"x": 1}\n\n{"x": 2}\r\n \t\r\n{"x": 3}')
  src = JsonlSource([path, path])
  assert len(src) == 6
  assert [json.loads(src[i].payload) for i in range(3)] == [{"x": 1}, {"x": 2}, {"x": 3}]
  assert [src[i].where for i in (1, 5)] == [f"{path}:3", f"{path}:5"]


def test_jsonl_files_without_records_are_an_error_naming_them(tmp_path):
  empty, blank = tmp_path / "empty.jsonl", tmp_path / "blank.jsonl"
  empty.write_text("")
  blank.write_text("\n  \n\r\n\t\n")
  with pytest.raises(NoDataError, match=f"^{empty}, {blank}: no records \\(only empty or blank lines\\)$"):
    JsonlSource([empty, blank])
  good = tmp_path / "good.jsonl"
  good.write_text("{}\n")
  assert len(JsonlSource([empty, blank, good])) == 1  # empty files beside records are no error


def test_metrics_are_plain_counts_and_skip_reasons_survive_a_resume(tmp_path):
  path = tmp_path / "d.jsonl"
  too_long = json.dumps({"prompt": "p" * 200, "completion": "c"})
  lines = [json.dumps(r) for r in _records(20)] + ["not json"] * 6 + [too_long]
  path.write_text("\n".join(lines) + "\n")
  cfg = DataConfig(batch_size=2, seq_len=96, pack=False, shuffle=False, num_epochs=1, on_error="skip",
                   overlong="drop")
  it = iter(make_pipeline(JsonlSource(path), TOK, cfg))
  batches = list(it)
  metrics = it.metrics()
  assert {k: metrics[k] for k in ("read", "skipped", "truncated", "dropped", "sequences")} == {
      "read": 27, "skipped": 6, "truncated": 0, "dropped": 1, "sequences": 20}
  assert all(type(v) is int for k, v in metrics.items() if k != "packing_efficiency")
  assert len(batches) == 10 and isinstance(metrics["packing_efficiency"], float)
  reasons = it.skip_reasons()
  assert len(reasons) == 5 and all(r.startswith(f"{path}:") and "malformed JSON" in r for r in reasons)
  assert reasons[0] == f"{path}:21: malformed JSON: Expecting value at column 1"
  resumed = iter(make_pipeline(JsonlSource(path), TOK, cfg))
  resumed.set_state(json.loads(json.dumps(it.get_state())))
  assert resumed.skip_reasons() == reasons and resumed.metrics() == metrics


def test_a_host_whose_share_keeps_nothing_stops_and_the_others_go_on():
  # Record i is too long for every odd i: in source order host 1 of 2 reads only those.
  records = [{"prompt": f"#{i}", "completion": "c" * (80 if i % 2 else 3)} for i in range(8)]
  cfg = DataConfig(batch_size=2, seq_len=32, pack=False, shuffle=False, overlong="drop")
  first = iter(make_pipeline(MemorySource(records), TOK, cfg, process_index=0, process_count=2))
  assert [next(first)["tokens"].shape for _ in range(6)] == [(1, 32)] * 6
  with pytest.raises(NoDataError, match=r"none of the 4 records this host reads was kept \(4 dropped"):
    next(iter(make_pipeline(MemorySource(records), TOK, cfg, process_index=1, process_count=2)))
  # Shuffled, every host reads every record in time, so neither stops.
  shuffled = dataclasses.replace(cfg, shuffle=True)
  for p in range(2):
    it = iter(make_pipeline(MemorySource(records), TOK, shuffled, process_index=p, process_count=2))
    assert len([next(it) for _ in range(6)]) == 6


def test_jsonl_arrayrecord_and_memory_sources_give_the_same_batches(tmp_path):
  records = _records(40)
  (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  write_array_record(tmp_path / "d.array_record", records)
  cfg = DataConfig(batch_size=4, seq_len=96, num_bins=4, num_epochs=1)
  runs = [list(make_pipeline(src, TOK, cfg)) for src in (
      MemorySource(records), JsonlSource(tmp_path / "d.jsonl"), ArrayRecordSource(tmp_path / "d.array_record"))]
  for other in runs[1:]:
    assert len(other) == len(runs[0])
    for a, b in zip(runs[0], other):
      for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_each_epoch_is_a_new_permutation():
  cfg = DataConfig(batch_size=1, seq_len=96, pack=False, num_epochs=3, seed=7)
  ids = _ids(make_pipeline(MemorySource(_records(30)), TOK, cfg))
  epochs = [ids[i * 30:(i + 1) * 30] for i in range(3)]
  assert all(sorted(e) == list(range(30)) for e in epochs)
  assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != list(range(30))


def test_packed_batch_layout_reproduces_each_example():
  records = _records(60)
  cfg = DataConfig(batch_size=4, seq_len=128, num_bins=8, num_epochs=1)
  it = iter(make_pipeline(MemorySource(records), TOK, cfg))
  batches = list(it)
  seen = []
  for b in batches:
    assert set(b) == {"tokens", "loss_mask", "segment_ids", "positions"}
    assert all(v.dtype == np.int32 and v.shape == (4, 128) for v in b.values())
    pad = b["segment_ids"] == 0
    assert (b["tokens"][pad] == TOK.pad_id).all() and not b["loss_mask"][pad].any()
    for r in range(4):  # segments are contiguous, numbered 1.., positions restart at 0
      seg = b["segment_ids"][r]
      n = int((seg > 0).sum())
      assert (seg[n:] == 0).all() and (np.diff(seg[:n]) >= 0).all()
      for s in range(1, seg.max() + 1):
        np.testing.assert_array_equal(b["positions"][r][seg == s], np.arange((seg == s).sum()))
    seen += _sequences(b)
  want = [sft_example(TOK, r["prompt"], r["completion"]) for r in records]
  assert sorted(seen) == sorted((tuple(w["tokens"]), tuple(w["loss_mask"])) for w in want)
  m = it.metrics()
  assert m["sequences"] == 60 and m["tokens"] == sum(len(w["tokens"]) for w in want)
  assert 0.8 < m["packing_efficiency"] <= 1


def test_padding_mode_puts_one_sequence_per_row():
  cfg = DataConfig(batch_size=4, seq_len=96, pack=False, num_epochs=1)
  for b in make_pipeline(MemorySource(_records(12)), TOK, cfg):
    assert (b["segment_ids"].max(axis=1) == 1).all()


@pytest.mark.parametrize("pack", [True, False])
def test_resume_from_saved_state_matches_an_uninterrupted_run(pack):
  cfg = DataConfig(batch_size=2, seq_len=96, pack=pack, num_bins=6, num_epochs=2, num_threads=2, prefetch=16)
  ds = make_pipeline(MemorySource(_records(50)), TOK, cfg)
  full = list(ds)
  it = iter(ds)
  for _ in range(7):
    next(it)
  state = json.loads(json.dumps(it.get_state()))  # must survive JSON
  metrics = it.metrics()
  resumed = iter(ds)
  resumed.set_state(state)
  rest = list(resumed)
  assert len(rest) == len(full) - 7 and resumed.metrics()["read"] == 100
  for a, b in zip(full[7:], rest):
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])
  assert metrics["sequences"] < resumed.metrics()["sequences"]


def test_resume_through_an_orbax_checkpoint(tmp_path):
  cfg = DataConfig(batch_size=2, seq_len=96, num_bins=6, seed=3)
  ds = make_pipeline(MemorySource(_records(50)), TOK, cfg)
  it = iter(ds)
  for _ in range(5):
    next(it)
  mngr = ocp.CheckpointManager(tmp_path / "ckpt", item_names=("data",))
  mngr.save(5, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
  mngr.wait_until_finished()
  want = [next(it) for _ in range(4)]
  restored = mngr.restore(5, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(iter(ds))))["data"]
  for a in want:
    b = next(restored)
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])
  mngr.close()


def test_two_processes_read_disjoint_shards_that_make_up_the_whole_stream():
  records = _records(80)
  single = _ids(make_pipeline(MemorySource(records), TOK, DataConfig(
      batch_size=4, seq_len=96, pack=False, num_epochs=1)))
  cfg = DataConfig(batch_size=4, seq_len=96, num_bins=4, num_epochs=1)
  shards = [_ids(make_pipeline(MemorySource(records), TOK, cfg, process_index=p, process_count=2))
            for p in range(2)]
  assert not set(shards[0]) & set(shards[1])
  assert sorted(shards[0] + shards[1]) == sorted(single) == list(range(80))
  # Before packing, host p's stream is every second element of the single stream from p.
  unpacked = [_ids(make_pipeline(MemorySource(records), TOK, DataConfig(
      batch_size=2, seq_len=96, pack=False, num_epochs=1), process_index=p, process_count=2)) for p in range(2)]
  assert unpacked[0] == single[0::2] and unpacked[1] == single[1::2]


def test_preference_and_rl_batches():
  pref = [{"prompt": "q", "chosen": "good", "rejected": "bad answer"}] * 3
  cfg = DataConfig(kind="preference", batch_size=2, seq_len=32, pack=False, num_epochs=1, shuffle=False)
  first = next(iter(make_pipeline(MemorySource(pref), TOK, cfg)))
  assert set(first) == {"chosen", "rejected", "record_index"} and first["chosen"]["tokens"].shape == (2, 32)
  shuffled = dataclasses.replace(cfg, shuffle=True, batch_size=3, num_epochs=2)
  epochs = iter(make_pipeline(MemorySource(pref), TOK, shuffled))
  assert [sorted(next(epochs)["record_index"]) for _ in range(2)] == [[0, 1, 2], [0, 1, 2]]
  rl = [{"prompt": "2+2=", "answer": "4"}, {"prompt": "3+3=", "answer": "6"}]
  cfg = DataConfig(kind="rl", batch_size=2, seq_len=16, pack=False, num_epochs=1, shuffle=False,
                       task_fields=("answer",))
  batch = next(iter(make_pipeline(MemorySource(rl), TOK, cfg)))
  assert batch["task"] == [{"answer": "4"}, {"answer": "6"}] and not batch["loss_mask"].any()
  with pytest.raises(ValueError, match="packing is for sft"):
    DataConfig(kind="rl")


def test_to_global_makes_data_sharded_arrays(mesh):
  cfg = DataConfig(batch_size=8, seq_len=64, num_bins=8)
  host = next(iter(make_pipeline(MemorySource(_records(40)), TOK, cfg)))
  out = to_global({**host, "nested": {"x": host["tokens"]}, "task": ["kept"]}, mesh)
  assert out["tokens"].shape == (8, 64) and out["tokens"].sharding == batch_sharding(mesh)
  np.testing.assert_array_equal(np.asarray(out["nested"]["x"]), host["tokens"])
  assert out["task"] == ["kept"] and isinstance(out["segment_ids"], jax.Array)


def test_core_imports_neither_seqio_nor_tensorflow_and_exports_the_pipeline():
  code = ("import sys, ptx.data as d; light = 'grain' not in sys.modules; d.make_pipeline; "
          "import ptx.data.pipeline, ptx.data.global_batch; "
          "assert light and not {'seqio', 'tensorflow'} & set(sys.modules), sorted(sys.modules)")
  subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_chat_records_train_only_on_assistant_turns_after_packing():
  chat = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"},
                        {"role": "user", "content": "more"}, {"role": "assistant", "content": "done"}]}
          for i in range(6)]
  cfg = DataConfig(batch_size=2, seq_len=256, num_bins=2, num_epochs=1, shuffle=False)
  batches = list(make_pipeline(MemorySource(chat), TOK, cfg))
  targets = [TOK.decode(np.asarray(t)[np.asarray(m) == 1]) for b in batches for t, m in _sequences(b)]
  assert sorted(targets) == sorted(f"a{i}<|im_end|>done<|im_end|>" for i in range(6))
