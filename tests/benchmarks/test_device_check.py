"""benchmarks/device_check.sh, the one-shot GPU check, keeps running where no GPU is: its smoke mode on the CPU.

The smoke run goes through every section as the GPU run does (the wrapper, one process per section, the same
benchmark functions) with tiny shapes, so an API change that would break the device run fails here first; the two
1B sections whose code another section's smoke run covers are checked by their wiring, stops and moe by tests of
their own. It runs without grain and tensorboardX, as the GPU image does (a module-level import of grain cost the
H200 run of 12-04 its memory section). The wrapper's own failure paths (a section past its time limit, a crash, no
JAX) run on stand-in interpreters, and the tile_runs section's per-case limit on stand-in children.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "device_check.sh"
DEFAULT = ("env", "attention", "sft", "sft_1b", "grpo", "grpo_1b", "decode", "tile_runs")  # the wrapper's default run
# Sections a call names in DEVICE_CHECK_SECTIONS, the default run leaving them out.
OPT_IN = ("decode_1b", "kernels", "memory", "rollout", "fast", "agent", "stops", "moe")
# The 1B shape's sections run their SmolLM2 section's function on another Shape; in smoke mode both shapes are
# 1-layer cuts, so sft_1b's smoke run covers the 1B cut (the cheapest), and the other two are checked by their wiring
# alone.
AT_1B = {"sft_1b": "sft", "grpo_1b": "grpo", "decode_1b": "decode"}
# The sections of the smoke run below; stops and moe, slower, have tests of their own.
SMOKE = tuple(name for name in DEFAULT + OPT_IN if name not in ("grpo_1b", "decode_1b", "stops", "moe"))
# ptx dependencies the GPU image lacks; the smoke run makes them unimportable.
NOT_ON_THE_GPU_IMAGE = ("grain", "tensorboardX")
CONTEXT = ("section", "device", "backend", "jax", "load")
# The smoke runs see one CPU device, as the device run sees one GPU (the suite's 8 fake devices would only add SPMD
# partitioning to each compile), with the suite's LLVM level (-O0) and without LLVM's expensive passes (the figures
# only show that the code runs; the kernel checks and the greedy speculation's exact tokens still hold): a fifth less
# CPU than at 8 devices and -O1 (52 s against 63 for the default sections, 12-06). XLA takes a flag's last value.
SMOKE_XLA_FLAGS = (f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=1 "
                   "--xla_llvm_disable_expensive_passes=true").strip()


def _run(tmp_path, python, *args, **env):
  """Runs the wrapper with OUT=tmp_path/out; returns (completed process, the JSON lines of its stdout)."""
  out = tmp_path / "out"
  done = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=540,
                        env={**os.environ, "PYTHON": python, "OUT": str(out), **env})
  assert done.returncode == 0, done.stderr
  lines = [json.loads(line) for line in done.stdout.splitlines()]
  assert (out / "device_check.jsonl").read_text().splitlines() == done.stdout.splitlines()
  return done, lines


def _stand_in(tmp_path, body: str) -> str:
  """An executable shell script that the wrapper runs as its PYTHON ($3 is the section's name)."""
  path = tmp_path / "python"
  path.write_text("#!/bin/sh\n" + body)
  path.chmod(0o755)
  return str(path)


def _without(tmp_path, *packages: str) -> str:
  """A folder for PYTHONPATH in which importing each of `packages` raises ImportError."""
  for name in packages:
    (tmp_path / "absent" / name).mkdir(parents=True)
    (tmp_path / "absent" / name / "__init__.py").write_text(f"raise ImportError('{name} is not on this image')\n")
  return str(tmp_path / "absent")


@pytest.fixture(scope="module")
def smoke_lines(tmp_path_factory):
  """The JSON lines of one smoke run of the SMOKE sections (~90 s of CPU, 12-08), as on the GPU image's packages."""
  tmp_path = tmp_path_factory.mktemp("smoke")
  return _run(tmp_path, sys.executable, "--smoke", PYTHONPATH=_without(tmp_path, *NOT_ON_THE_GPU_IMAGE),
              XLA_FLAGS=SMOKE_XLA_FLAGS, DEVICE_CHECK_SECTIONS=" ".join(f"{name}:300" for name in SMOKE),
              DEVICE_CHECK_TOTAL_S=str(300 * len(SMOKE)))[1]


def test_the_default_run_is_issue_58s_sections_within_one_device_call():
  [line] = [line for line in SCRIPT.read_text().splitlines() if line.startswith("SECTIONS=")]
  entries = line.split(":-", 1)[1].rstrip("}").split()
  assert tuple(entry.split(":")[0] for entry in entries) == DEFAULT
  # Within the wrapper's DEVICE_CHECK_TOTAL_S (570 s, one device call of at most 600 s), or a section is skipped.
  assert sum(int(entry.split(":")[1]) for entry in entries) <= 570


def test_the_1b_sections_measure_as_the_smollm2_ones_do_at_a_model_of_over_a_billion_parameters(import_benchmark):
  from ptx.model_config import MODEL_PRESETS
  from ptx.models import count_params
  device_check = import_benchmark("device_check")
  assert set(device_check.SECTIONS) == set(DEFAULT + OPT_IN)
  for name, twin in AT_1B.items():
    section = device_check.SECTIONS[name]
    assert section.func is device_check.SECTIONS[twin] and section.keywords == {"shape": device_check.LLAMA_1B}
  assert count_params(MODEL_PRESETS[device_check.LLAMA_1B.preset]()) >= 10**9


@pytest.mark.slow
def test_every_section_prints_its_figures_without_an_error(smoke_lines):
  assert {line["section"] for line in smoke_lines} == set(SMOKE)
  for line in smoke_lines:
    assert not [key for key in line if "error" in key], line
    assert all(key in line for key in CONTEXT), line
    assert line["backend"] == "cpu" and line["elapsed_s"] >= 0


@pytest.mark.slow
def test_the_smoke_run_checks_each_kernel_case_and_measures_each_step(smoke_lines):
  by = {name: [line for line in smoke_lines if line["section"] == name] for name in SMOKE}
  [env] = by["env"]
  assert env["devices"] == 1 and env["imports"] == dict.fromkeys(DEFAULT[1:] + OPT_IN, "ok")
  assert all(env["versions"][name] is None for name in NOT_ON_THE_GPU_IMAGE), env["versions"]
  paged = [line for line in by["kernels"] if line["bench"] == "paged_attention_check"]
  assert {line["case"] for line in paged} == {"gqa", "mqa_window_softcap"}
  flash = [line for line in by["kernels"] if line["bench"] == "attention_gpu_check"]
  assert [line["case"] for line in flash] == ["gqa_causal"]
  assert len(paged) + len(flash) == len(by["kernels"]) and all(line["ok"] for line in by["kernels"])
  [attention] = by["attention"]
  # On the CPU "auto" is the materialised logits up to 1K x 1K for either row layout (ptx.models.attention_choice);
  # no cuDNN to face.
  for rows in ("packed", "padded_right"):
    assert attention[f"default_{rows}_impl"] == "xla" and attention[f"default_{rows}_fwd_bwd_s"] > 0, attention
    assert f"default_{rows}_fwd_vs_cudnn" not in attention
  assert attention["cudnn"] == "skipped: no GPU"
  for name, model in (("sft", "smollm2_135m"), ("sft_1b", "llama3_2_1b"), ("grpo", "smollm2_135m")):
    [line] = by[name]
    assert line["model"] == model and line["attention_impl"] == "auto" and line["attention_resolved"] == "xla"
    assert line["tokens_per_s"] > 0 and line["mfu"] >= 0, line
  # The 1B's cut keeps its preset's bfloat16 parameters; SmolLM2's preset stores float32.
  assert by["sft_1b"][0]["param_dtype"] == "bfloat16" and by["sft"][0]["param_dtype"] == "float32"
  lines = by["decode"]
  assert [(line["decode_loop"], line["rows"]) for line in lines] == [("unroll", 2), ("scan", 2)]
  for line in lines:
    # 8 new tokens a row in calls of 4 steps; one decode and one prefill program compiled, none while timed.
    assert line["decode_tokens"] == 2 * 8 and line["decode_calls"] == 2 and line["step_s"] > 0, line
    assert line["programs_compiled"] == 2 and line["compiled_in_timed_run"] == 0, line
    # A step reads the bfloat16 weights and the K/V of 1 layer x 2 KV heads x 32 wide per position; the CPU has no
    # bandwidth in the table, so no roofline.
    assert line["kv_bytes_per_position"] == 2 * 1 * 2 * 32 * 2 and line["hbm_bytes_per_s"] is None, line
    assert line["step_bytes"] == line["weight_bytes"] + line["kv_bytes_per_position"] * 2 * (24 + 3.5)
  *checks, timing = by["tile_runs"]
  assert [(line["case"], line["dtype"]) for line in checks] == [
      ("gqa_causal", "float32"), ("gqa_packed", "float32"), ("mqa_window_softcap", "float32")]
  assert all(line["impl"] == "tile_runs" and line["ok"] for line in checks), checks
  assert timing["tile_runs_fwd_vs_pallas_gpu"] > 0 and timing["tile_runs_fwd_bwd_vs_pallas_gpu"] > 0
  [memory] = by["memory"]
  # The floor counts only what a training step cannot avoid holding, so the compiled step is at least that.
  assert memory["per_device_mib"] >= memory["floor_mib"]["total"] > 0
  *runs, summary = by["rollout"]
  assert [line["method"] for line in runs] == ["static", "engine"] and summary["summary"] is True
  # 4 prompts x 4 samples x 64 tokens, all useful: no stop id, every budget 64.
  assert all(line["workload"] == "uniform" and line["useful_tokens"] == 1024 for line in runs), runs
  assert summary["engine_over_static"] > 0
  modes = [line for line in by["fast"] if line["workload"] == "code_edit"]
  assert [line["mode"] for line in modes] == ["standard", "ngram_always", "int8_ngram"]
  assert all(line["tokens"] == 2 * 8 and line["tokens_per_s"] > 0 for line in modes), modes
  # Greedy n-gram speculation keeps the standard engine's tokens exactly in float32 (the int8 tree may not).
  assert modes[1]["same_as_standard"] == 1.0 and modes[2]["params"] == "int8"
  assert by["fast"][-1]["workload"] == "calibrate" and by["fast"][-1]["verify_cost"] > 0
  *runs, summary = by["agent"]
  assert sorted(line["method"] for line in runs) == ["overlap", "play_lockstep"]
  assert all(line["episodes_done"] == 8 for line in runs), runs
  assert summary["summary"]["tool_bound"] >= 1 and summary["summary"]["overlap_over_play_lockstep"] > 0


def test_a_section_past_its_limit_or_crashing_gets_an_error_line_and_the_next_still_runs(tmp_path):
  # kernels outlives its 5 s limit; attention dies with a traceback full of characters JSON must escape. The 30 s
  # kept for attention leave kernels its 5 s, and a loaded machine's second or two past them no "skipped" line.
  python = _stand_in(tmp_path, 'case "$3" in kernels) exec sleep 60 ;; esac\n'
                               "printf 'Traceback \"q\" \\\\ back\\n\\tboom\\n' >&2; exit 1\n")
  _, lines = _run(tmp_path, python, DEVICE_CHECK_SECTIONS="kernels:5 attention:30", DEVICE_CHECK_TOTAL_S="35")
  assert [line["section"] for line in lines] == ["kernels", "attention"]
  assert lines[0]["error"].startswith("timed out after 5 s")
  assert lines[1]["error"].startswith("exit code 1") and "boom" in lines[1]["error"]
  assert "== attention (exit 1)" in (tmp_path / "out" / "device_check.stderr").read_text()


def test_a_check_case_that_hangs_or_crashes_gets_an_error_row_and_the_cases_after_it_still_run(import_benchmark):
  # The tile_runs section's children: each prints a row per case it is given, in order.
  device_check = import_benchmark("device_check")
  child = ("import json, sys, time\n"
           "for name in sys.argv[1:]:\n"
           "  time.sleep(60) if name == 'hang' else sys.exit(5) if name == 'crash' else None\n"
           "  print(json.dumps({'case': name}), flush=True)\n")
  started = []

  def argv(pending):
    started.append(list(pending))
    return [sys.executable, "-c", child, *pending]

  rows = list(device_check._each_within(argv, ["a", "hang", "b", "crash", "c"], 2, dict(os.environ)))
  assert [name for name, _ in rows] == ["a", "hang", "b", "crash", "c"]
  assert [row for _, row in rows[::2]] == [{"case": "a"}, {"case": "b"}, {"case": "c"}]
  assert rows[1][1]["error"].startswith("no result within 2 s: killed")
  assert "exit code 5" in rows[3][1]["error"]
  # A new child after each, for the cases still to run.
  assert started == [["a", "hang", "b", "crash", "c"], ["b", "crash", "c"], ["c"]]


def test_without_jax_one_line_says_so_and_nothing_else_runs(tmp_path):
  fake = tmp_path / "nojax" / "jax"
  fake.mkdir(parents=True)
  (fake / "__init__.py").write_text("raise ImportError('no jax on this machine')\n")
  _, lines = _run(tmp_path, sys.executable, PYTHONPATH=str(fake.parent))
  [line] = lines
  assert line["section"] == "env" and line["missing"] == ["jax"] and "no jax on this machine" in line["error"]


@pytest.mark.slow
def test_the_opt_in_stops_section_compares_static_and_the_engine_on_stop_ended_requests(tmp_path):
  _, lines = _run(tmp_path, sys.executable, "--smoke", DEVICE_CHECK_SECTIONS="stops:300", DEVICE_CHECK_TOTAL_S="300",
                  XLA_FLAGS=SMOKE_XLA_FLAGS)
  *runs, summary = lines
  assert not [line for line in lines if "error" in line], lines
  assert [(line["section"], line["method"]) for line in runs] == [("stops", "static"), ("stops", "engine_on_demand")]
  assert all(line["workload"] == "stops" and 0 < line["useful_tokens"] <= 8 * 64 for line in runs), runs
  assert summary["summary"] is True and summary["engine_on_demand_over_static_per_round"][0] > 0


@pytest.mark.slow
def test_the_opt_in_moe_section_times_dense_and_its_mixture_of_experts_twin(tmp_path):
  _, lines = _run(tmp_path, sys.executable, "--smoke", DEVICE_CHECK_SECTIONS="moe:300", DEVICE_CHECK_TOTAL_S="300",
                  XLA_FLAGS=SMOKE_XLA_FLAGS)
  assert not [line for line in lines if "error" in line], lines
  assert [(line["workload"], line["model"]) for line in lines] == [
      ("sft", "dense"), ("sft", "moe_ragged"), ("grpo", "dense"), ("grpo", "moe_ragged")]
  dense, twin = lines[0], lines[1]
  assert twin["params"] > dense["params"] and twin["active_params"] - dense["active_params"] < 0.01 * dense["params"]
  assert all(line["step_s_median"] > 0 and line["over_dense"] > 0 for line in lines)
