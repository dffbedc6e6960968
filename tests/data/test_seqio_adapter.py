"""The seqio adapter makes ptx batches and resumes exactly (needs `ptx[seqio]`)."""

import numpy as np
import pytest

seqio = pytest.importorskip("seqio")
tf = pytest.importorskip("tensorflow")

from ptx.config import DataConfig  # noqa: E402
from ptx.data.seqio_adapter import SeqioBatches  # noqa: E402

PROBLEMS = [(f"{a}+{b}=", str(a + b)) for a in range(12) for b in range(5)]


@pytest.fixture(scope="module")
def task():
  vocab = seqio.ByteVocabulary()

  def source(split, shuffle_files, seed=None):
    del split, shuffle_files, seed
    return tf.data.Dataset.from_tensor_slices(
        {"inputs": [p for p, _ in PROBLEMS], "targets": [a for _, a in PROBLEMS]})

  name = "ptx_test_sums"
  seqio.TaskRegistry.add(
      name, source=seqio.FunctionDataSource(source, splits=["train"]),
      preprocessors=[seqio.preprocessors.tokenize, seqio.preprocessors.append_eos_after_trim],
      output_features={"inputs": seqio.Feature(vocab), "targets": seqio.Feature(vocab)})
  yield seqio.get_mixture_or_task(name)
  seqio.TaskRegistry.remove(name)


def _sequences(batches):
  out = []
  for b in batches:
    for r in range(b["tokens"].shape[0]):
      for s in range(1, b["segment_ids"][r].max() + 1):
        sel = b["segment_ids"][r] == s
        out.append((tuple(b["tokens"][r][sel]), tuple(b["loss_mask"][r][sel])))
  return out


def _expected():
  vocab = seqio.ByteVocabulary()
  out = []
  for p, a in PROBLEMS:
    # append_eos_after_trim ends both features with eos.
    ins, tgt = vocab.encode(p) + [vocab.eos_id], vocab.encode(a) + [vocab.eos_id]
    out.append((tuple([0] + ins + tgt), tuple([0] * (1 + len(ins)) + [1] * len(tgt))))
  return out


def test_packed_batches_hold_every_example_with_targets_masked(task):
  cfg = DataConfig(batch_size=4, seq_len=32, num_bins=8, num_epochs=1, seed=1)
  it = iter(SeqioBatches(task, cfg))
  batches = list(it)
  assert set(batches[0]) == {"tokens", "loss_mask", "segment_ids", "positions"}
  assert batches[0]["tokens"].shape == (4, 32)
  assert sorted(_sequences(batches)) == sorted(_expected())
  assert it.metrics()["sequences"] == len(PROBLEMS)


def test_resume_matches_an_uninterrupted_run(task):
  cfg = DataConfig(batch_size=2, seq_len=32, num_bins=4, num_epochs=2, seed=1)
  ds = SeqioBatches(task, cfg)
  full = list(ds)
  it = iter(ds)
  for _ in range(5):
    next(it)
  resumed = iter(ds)
  resumed.set_state(it.get_state())
  rest = list(resumed)
  assert len(rest) == len(full) - 5
  for a, b in zip(full[5:], rest):
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])


def test_two_hosts_read_disjoint_shards_of_the_whole(task):
  cfg = DataConfig(batch_size=4, seq_len=32, num_bins=4, num_epochs=1, shuffle=False)
  shards = [_sequences(SeqioBatches(task, cfg, process_index=p, process_count=2)) for p in range(2)]
  assert not set(shards[0]) & set(shards[1])
  assert sorted(shards[0] + shards[1]) == sorted(_expected())
