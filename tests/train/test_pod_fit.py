"""The pod-fit check: the 8B SFT, 7B GRPO and 235B MoE SFT pod presets fit their pods' HBM; 8B on 2 v5e chips does not.

The pods' 16, 32 and 64 chips are more devices than this process fakes (8),
so those presets run `benchmarks/pod_fit.py` in a process of their own, which
fakes the pod's chip count; the too-small pod (2 chips) runs here on 2 of the
8 devices. `pytest -s` shows each preset's per-device GiB.
"""

import importlib.util
import json
import pathlib
import runpy
import subprocess
import sys

import pytest

import ptx
from ptx.models.params import count_params
from ptx.train import pod_fit

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "pod_fit.py"
# Loaded from its file: putting benchmarks/ on sys.path would let its scripts (data.py, train.py) shadow modules.
_spec = importlib.util.spec_from_file_location("pod_fit_benchmark", SCRIPT)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)
GiB = 2**30


@pytest.fixture(autouse=True)
def recipes_importable(monkeypatch):
  # `python recipes/x.py` puts recipes/ first on sys.path; so does this.
  monkeypatch.syspath_prepend(str(ROOT / "recipes"))


def _preset(recipe, preset):
  return runpy.run_path(str(ROOT / "recipes" / f"{recipe}.py"), run_name="pod_fit")["PRESETS"][preset]()


def _pod_fit(recipe, preset):
  """benchmarks/pod_fit.py's record of one pod preset, run in a process faking the pod's chips; printed for -s."""
  out = subprocess.run([sys.executable, str(SCRIPT), "--recipe", recipe, "--preset", preset], check=True,
                       stdout=subprocess.PIPE, text=True, timeout=540).stdout
  record = json.loads(out.splitlines()[-1])
  print(f"\n{recipe} --preset {preset} on {record['pod']} ({record['chips']} x {record['chip']}, mesh "
        f"{record['mesh']}): per device {record['total_gib']} GiB of {record['hbm_gib']} (state "
        f"{record['state_gib']}: params {record['params_gib']}, optimizer {record['opt_state_gib']}, reference "
        f"{record['reference_gib']}; programs {record['programs_gib']}; in flight {record['in_flight_gib']}), "
        f"fits: {record['fits']}, compiled in {record['compile_s']} s")
  assert record["chips"] == pod_fit.tpu_slice(record["pod"]).chips
  return record


def _params_gib(m, mesh):
  """GiB per device of model `m`'s bfloat16 parameters on a mesh of `fsdp` and `expert` axes (dividing their dims).

  Expert weights [L, E, D, F] split E over `expert` and D over `fsdp`; every other matrix splits D over (fsdp,
  expert): either way each device holds 1 / (fsdp x expert) of it. Qwen's q/k/v biases and Qwen3's q/k norms
  have no embed axis to shard and are replicated.
  """
  assert mesh["data"] == mesh["tensor"] == 1, mesh
  replicated = m.n_layers * (m.n_heads + 2 * m.n_kv_heads) * m.head_dim if m.qkv_bias else 0
  replicated += m.n_layers * 2 * m.head_dim if m.qk_norm else 0
  return ((count_params(m) - replicated) * 2 / (mesh["fsdp"] * mesh["expert"]) + replicated * 2) / GiB


def test_tpu_slice_names_count_tensorcores_on_v5p_and_chips_on_v5e():
  assert pod_fit.tpu_slice("v5p-64") == pod_fit.Pod("v5p", 32)
  assert pod_fit.tpu_slice("v5e-8") == pod_fit.Pod("v5e", 8)
  with pytest.raises(ValueError, match="'v5p-3'"):  # 3 TensorCores are no whole number of v5p chips
    pod_fit.tpu_slice("v5p-3")
  with pytest.raises(ValueError, match="Pod.chip"):
    pod_fit.Pod("v9", 4)


def test_each_pod_preset_is_the_slice_its_recipe_header_launches_it_on():
  for (recipe, preset), (slice_name, *_) in bench.PODS.items():
    doc = runpy.run_path(str(ROOT / "recipes" / f"{recipe}.py"), run_name="header")["__doc__"]
    assert f"TPU {slice_name}" in doc, f"{recipe}.py's header does not launch --preset {preset} on a TPU {slice_name}"


@pytest.mark.slow  # each compiles a full-size model for 16 or 32 fake devices: about 20 s and 25 s on 2 cores
# grpo_math's qwen7b: host-reward GRPO with a frozen reference and 512 rollouts sharing their prompts, which held
# 258 GiB per chip while its update ran the shared-prompt cache path unrolled and built full-vocabulary logits.
@pytest.mark.parametrize("recipe, preset", [("sft_chat", "llama3_8b"), ("grpo_math", "qwen7b")])
def test_the_8b_sft_and_7b_grpo_pod_presets_fit_their_chips(recipe, preset):
  record = _pod_fit(recipe, preset)
  assert record["fits"] and record["total_gib"] <= record["hbm_gib"], record
  # bfloat16 parameters over the fsdp chips; the record rounds to 1e-3 GiB, hence half of that.
  cfg = _preset(recipe, preset)
  exact = _params_gib(cfg.model, record["mesh"])
  assert record["mesh"]["fsdp"] == record["chips"]
  assert abs(record["params_gib"] - exact) <= 5e-4, (exact, record)
  # Adam's two moments, laid out like the bfloat16 parameters, plus a few scalars (bytes); rounding as above.
  assert abs(record["opt_state_gib"] - 2 * exact) <= 5e-4, (exact, record)
  if recipe.startswith("grpo") and cfg.grpo.uses_reference:  # a frozen copy laid out like the parameters
    assert abs(record["reference_gib"] - exact) <= 5e-4, (exact, record)


@pytest.mark.slow  # compiles Qwen3-235B-A22B's SFT step for 64 fake devices: about 15 s on 2 cores
def test_the_235b_moe_sft_pod_preset_fits_its_chips_with_its_experts_split_over_the_expert_axis():
  record = _pod_fit("sft_chat", "qwen3_235b_a22b")
  assert record["fits"] and record["total_gib"] <= record["hbm_gib"], record
  # 8 devices of the expert axis hold 16 of the 128 experts each; each expert's d_model splits over the 8 of fsdp.
  assert {axis: n for axis, n in record["mesh"].items() if n > 1} == {"fsdp": 8, "expert": 8}
  cfg = _preset("sft_chat", "qwen3_235b_a22b")
  exact = _params_gib(cfg.model, record["mesh"])
  assert abs(record["params_gib"] - exact) <= 5e-4, (exact, record)  # the record's rounding to 1e-3 GiB
  assert abs(record["opt_state_gib"] - 2 * exact) <= 5e-4, (exact, record)  # Adam's moments, as the parameters
  assert record["reference_gib"] == 0 and abs(record["state_gib"] - 3 * exact) <= 1e-3, record


def test_the_8b_sft_preset_on_two_v5e_chips_does_not_fit():
  cfg = _preset("sft_chat", "llama3_8b")
  fit = pod_fit.check(cfg, ptx.sft_job(cfg, ptx.ByteTokenizer()), pod_fit.Pod("v5e", 2))
  print(f"\nsft_chat --preset llama3_8b on 2 v5e chips: {fit.record()}")
  assert fit.mesh["fsdp"] == 2 and not fit.fits and fit.headroom_gib < 0
  # Exact, from the shardings: bfloat16 parameters and two Adam moments over 2 chips (scalars: step, rng, count).
  n = count_params(cfg.model)
  assert 0 <= fit.state - 3 * 2 * n // 2 < 1024, fit.state
  assert fit.state > 16 * GiB  # the state alone overflows a v5e's 16 GiB, whatever the compiler's scratch
  # The step's only other input is the batch: 4 int32 arrays of 32 rows of 4096 tokens per chip.
  assert fit.programs["step"].inputs == 4 * (cfg.data.batch_size // 2) * cfg.data.seq_len * 4
