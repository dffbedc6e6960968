"""Bad inputs through the real `ptx` command line: each ends in one error naming the file, field or mismatch.

Every case fails while the run is prepared, before anything compiles, and
leaves an earlier run's results in --out byte for byte as they were: an
empty or blank-only JSONL file, records of which the pipeline keeps none
(every one too long for data.seq_len; DPO pairs whose prompt leaves no
target token), a cut safetensors shard, and a tokenizer larger than the
model's vocabulary. Training commands pass --overwrite: the earlier run is
replaced only once the new one starts training, so a new run that cannot
start loses nothing.
"""

import json
import shutil

import pytest

from model_variants import HF_ARCH
from ptx import cli
from ptx.model_config import MODEL_PRESETS

tokenizers = pytest.importorskip("tokenizers", reason="a checkpoint's tokenizer needs the hf extra (`make test`)")

TOY = ["--no-progress", "--model=tiny", "--model.n_layers=1", "--train.steps=2", "--data.batch_size=8",
       "--data.seq_len=32", "--data.shuffle=false", "--mesh.data=2", "--mesh.fsdp=4"]
BIG_VOCAB = 1012
CUT_SHORT = "(an interrupted download or copy?)"


@pytest.fixture(scope="module")
def big_tokenizer(tmp_path_factory, ptx_checkpoint):
  """The checkpoint's directory with a tokenizer of BIG_VOCAB tokens (the byte ones and added ones)."""
  path = tmp_path_factory.mktemp("big_vocab")
  shutil.copytree(ptx_checkpoint, path, dirs_exist_ok=True)
  tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
  tok.add_tokens([f"<extra_{i}>" for i in range(BIG_VOCAB - tok.get_vocab_size(with_added_tokens=True))])
  tok.save(str(path / "tokenizer.json"))
  return path


@pytest.fixture
def earlier(tmp_path):
  """An out directory holding an earlier run's results."""
  out = tmp_path / "out"
  (out / "hf").mkdir(parents=True)
  results = {"config.json": '{"train": {"steps": 2}}\n', "metrics.jsonl": '{"step": 2, "loss": 1.5}\n',
             "eval.json": '{"pass@k": {"1": 0.5}}\n', "samples.jsonl": '{"task": 0, "sample": 0}\n',
             "hf/model.safetensors": "earlier weights"}
  for name, text in results.items():
    (out / name).write_text(text)
  return out


def _files(out):
  return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def _refused(argv, out, capsys) -> str:
  """Runs `ptx ARGV`, which must exit 2 and leave `out` as it was; returns its error line."""
  before = _files(out)
  with pytest.raises(SystemExit) as info:
    cli.main(argv)
  assert info.value.code == 2
  assert _files(out) == before, "the failed command wrote into the earlier run"
  return capsys.readouterr().err.strip().splitlines()[-1]


def _jsonl(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return path


@pytest.mark.parametrize("command", ["sft", "dpo", "grpo"])
@pytest.mark.parametrize("content", ["", "\n  \n\r\n"], ids=["empty", "blank_only"])
def test_a_data_file_without_records(command, content, tmp_path, earlier, capsys):
  data = tmp_path / "empty.jsonl"
  data.write_text(content)
  line = _refused([command, "--out", str(earlier), "--overwrite", f'--data.train_files=["{data}"]', *TOY], earlier,
                  capsys)
  assert line == f"ptx: error: {data}: no records (only empty or blank lines)"


def test_every_record_too_long_for_seq_len(tmp_path, earlier, capsys):
  data = _jsonl(tmp_path / "long.jsonl", [{"prompt": "p" * n, "completion": "c"} for n in (40, 50, 45)])
  line = _refused(["sft", "--out", str(earlier), "--overwrite", f'--data.train_files=["{data}"]',
                   "--data.overlong=drop", *TOY], earlier, capsys)
  too_long = lambda n: f"{n} tokens, longer than data.seq_len=32 (data.overlong='drop')"
  assert line == ("ptx: error: no example to train on: none of the 3 records this host reads was kept (3 dropped, "
                  f"0 skipped as bad records); first: {data}:1: {too_long(43)}; {data}:2: {too_long(53)}; "
                  f"{data}:3: {too_long(48)}. The shortest record needs data.seq_len >= 43, the longest 53")


def test_dpo_pairs_whose_prompt_leaves_no_target_token(tmp_path, earlier, capsys):
  data = _jsonl(tmp_path / "pairs.jsonl", [{"prompt": "q" * n, "chosen": "yes", "rejected": "no"} for n in (40, 35)])
  line = _refused(["dpo", "--out", str(earlier), "--overwrite", f'--data.train_files=["{data}"]', *TOY], earlier,
                  capsys)
  cut = lambda n, before: (f"{n} tokens, the first {before} before any target: truncation to data.seq_len=32 leaves "
                           "no target token")
  assert line == ("ptx: error: no example to train on: none of the 2 records this host reads was kept (2 dropped, "
                  f"0 skipped as bad records); first: {data}:1: {cut(45, 41)}; {data}:2: {cut(40, 36)}. The shortest "
                  "record needs data.seq_len >= 37, the longest 42")


def _cut_copy(checkpoint, tmp_path, keep):
  """A copy of the checkpoint whose shard keeps the bytes `keep(bytes)` returns; (directory, shard, original bytes)."""
  path = tmp_path / "cut"
  shutil.copytree(checkpoint, path)
  shard = path / "model.safetensors"
  data = shard.read_bytes()
  shard.write_bytes(keep(data))
  return path, shard, data


def test_a_shard_cut_inside_its_header_via_eval(ptx_checkpoint, tmp_path, earlier, capsys):
  path, shard, data = _cut_copy(ptx_checkpoint, tmp_path, lambda data: data[:300])
  line = _refused(["eval", "--model", str(path), "--task", "arithmetic", "--n", "2", "--k", "1", "--out",
                   str(earlier)], earlier, capsys)
  header = int.from_bytes(data[:8], "little")
  assert line == (f"ptx: error: {shard}: 300 bytes, too short for the {header}-byte safetensors header it "
                  f"announces: the file is cut short {CUT_SHORT} or not a safetensors file")


def test_a_shard_cut_inside_its_data_via_model_dir(ptx_checkpoint, tmp_path, earlier, capsys):
  path, shard, data = _cut_copy(ptx_checkpoint, tmp_path, lambda data: data[:-500])
  sft = _jsonl(tmp_path / "sft.jsonl", [{"prompt": "1+1=", "completion": "2"}] * 8)
  line = _refused(["sft", "--model-dir", str(path), "--out", str(earlier), "--overwrite",
                   f'--data.train_files=["{sft}"]',
                   "--no-progress", "--mesh.data=2", "--mesh.fsdp=4"], earlier, capsys)
  assert line == (f"ptx: error: {shard}: {len(data) - 500} bytes, but its safetensors header describes {len(data)}: "
                  f"the tensor data is cut short {CUT_SHORT}")


def _too_large(where):
  return (f"ptx: error: {where}: tokenizer vocab {BIG_VOCAB} > model vocab_size {{m}}: ids {{m}}..{BIG_VOCAB - 1} "
          "have no embedding; use the model's own tokenizer or a model with a vocabulary at least as large")


def test_a_tokenizer_larger_than_the_model_via_eval(big_tokenizer, earlier, capsys):
  line = _refused(["eval", "--model", str(big_tokenizer), "--task", "arithmetic", "--n", "2", "--k", "1", "--out",
                   str(earlier)], earlier, capsys)
  assert line == _too_large("TextSampler").format(m=HF_ARCH.vocab_size)


def test_a_tokenizer_larger_than_the_model_via_model_dir_and_the_toy_path(big_tokenizer, tmp_path, earlier, capsys):
  sft = _jsonl(tmp_path / "sft.jsonl", [{"prompt": "1+1=", "completion": "2"}] * 8)
  data = [f'--data.train_files=["{sft}"]', "--no-progress", "--mesh.data=2", "--mesh.fsdp=4"]
  line = _refused(["sft", "--model-dir", str(big_tokenizer), "--out", str(earlier), "--overwrite", *data], earlier,
                  capsys)
  where = f"the tokenizer of {big_tokenizer} with {big_tokenizer / 'config.json'}"
  assert line == _too_large(where).format(m=HF_ARCH.vocab_size)
  line = _refused(["sft", "--out", str(earlier), "--overwrite", f"--data.tokenizer={big_tokenizer}", *data, *TOY],
                  earlier, capsys)
  assert line == _too_large("model.vocab_size").format(m=MODEL_PRESETS["tiny"]().vocab_size)
