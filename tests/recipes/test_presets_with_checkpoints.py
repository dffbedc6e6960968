"""Every preset made for real weights keeps its execution settings when --model-dir brings the architecture.

For each recipe preset but the fresh-model `tiny` ones, a tiny checkpoint of
the preset's own family (its flags: biases, tied embeddings, RoPE scaling,
norms; small dimensions) is written with `save_hf`, and the recipe's
`launch.configure` loads it: the architecture must be the checkpoint's, and
every execution setting (dtypes, remat, attention, logits chunk, scan) the
preset's.
"""

import dataclasses
import pathlib
import runpy
import sys

import jax
import pytest

from ptx import model_config
from ptx.models import Decoder, init_params, save_hf

RECIPES = pathlib.Path(__file__).resolve().parents[2] / "recipes"
# The presets are read at collection: the recipes import `launch` from their folder, as `python recipes/x.py` does.
if str(RECIPES) not in sys.path:
  sys.path.insert(0, str(RECIPES))
NAMES = ("sft_chat", "dpo", "grpo_math", "grpo_code", "grpo_smollm2", "long_context_sft")
# Small dimensions every family can take (GQA 4:2; head_dim even for RoPE); each preset keeps its own flags.
TINY_DIMS = dict(vocab_size=272, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=12, mlp_dim=80)


def _presets():
  for name in NAMES:
    presets = runpy.run_path(str(RECIPES / f"{name}.py"), run_name="presets")["PRESETS"]
    for preset in sorted(presets):
      if preset != "tiny":
        yield name, preset


@pytest.mark.parametrize("name, preset", list(_presets()))
def test_preset_execution_settings_survive_a_checkpoint(name, preset, tmp_path):
  import launch

  recipe = runpy.run_path(str(RECIPES / f"{name}.py"), run_name="presets")
  base = recipe["PRESETS"][preset]()
  dims = dict(TINY_DIMS)
  if base.model.mla.enabled:  # every head its own key and value from the latent
    dims["n_kv_heads"] = dims["n_heads"]
  if base.model.moe.enabled:  # hundreds of experts, each small
    dims["moe"] = dataclasses.replace(base.model.moe, expert_mlp_dim=16, shared_mlp_dim=16 * bool(
        base.model.moe.shared_mlp_dim))
  architecture = dataclasses.replace(base.model, **dims, param_dtype="float32", compute_dtype="float32")
  checkpoint = tmp_path / "ckpt"
  save_hf(Decoder(architecture, params=init_params(architecture, jax.random.key(0))), checkpoint)
  # The byte tokenizer's files stand in for the model's tokenizer.
  pytest.importorskip("tokenizers", reason="needs the hf extra (`make test` installs it)")
  from ptx.data.tokenizer import ByteTokenizer

  ByteTokenizer().save_hf(checkpoint)
  args, overrides = launch.parse(recipe["__doc__"], recipe["PRESETS"],
                                 ["--preset", preset, "--out", str(tmp_path / "run"), "--model-dir", str(checkpoint),
                                  # 8 CPU devices instead of the pod's chips, the preset's seq axis kept.
                                  "--mesh.data=1", "--mesh.fsdp=-1", "--mesh.expert=1", "--mesh.tensor=1",
                                  f"--mesh.seq={base.mesh.seq}"])
  cfg, params, _ = launch.configure(args, base, overrides)
  for field in model_config.EXECUTION_FIELDS:
    assert getattr(cfg.model, field) == getattr(base.model, field), f"{name} --preset {preset}: model.{field} lost"
  assert not model_config.architecture_differences(cfg.model, dataclasses.replace(architecture, **{
      f: getattr(base.model, f) for f in model_config.EXECUTION_FIELDS})), "the architecture is not the checkpoint's"
  assert params["layers"]["o"].shape[0] == len(cfg.model.stack_layers("layers"))
  assert cfg.data.tokenizer == str(checkpoint)
