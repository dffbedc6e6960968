"""Config overrides, presets, errors and round trips."""

import dataclasses
import json

import pytest

import ptx.models  # noqa: F401  (registers the presets)
from ptx import config as config_lib
from ptx import config_io
from ptx.config import Config, ConfigError, OptimizerConfig
from ptx.model_config import ModelConfig, MoeConfig, RopeScaling
from ptx.config_io import apply_overrides


def test_overrides_parse_into_declared_types():
  cfg = apply_overrides(Config(), [
      "--model.d_model=256", "--optim.lr=1e-5", "--model.qk_norm=true", "--model.activation=gelu_tanh",
      "--model.sliding_window=128", "--model.final_logit_softcap=30", "--model.rope_scaling.kind=llama3",
      "--mesh.fsdp=-1",
  ])
  assert cfg.model.d_model == 256 and cfg.optim.lr == 1e-5 and cfg.model.qk_norm is True
  assert cfg.model.activation == "gelu_tanh" and cfg.model.sliding_window == 128
  assert cfg.model.final_logit_softcap == 30.0 and isinstance(cfg.model.final_logit_softcap, float)
  assert cfg.model.rope_scaling == RopeScaling(kind="llama3")
  assert apply_overrides(cfg, ["--model.sliding_window=none"]).model.sliding_window is None


def test_rollout_sampling_is_part_of_the_grpo_config():
  cfg = apply_overrides(Config(), ["--grpo=dapo", "--grpo.sampling.temperature=0.7", "--grpo.sampling.top_p=0.95"])
  assert (cfg.grpo.sampling.temperature, cfg.grpo.sampling.top_p, cfg.grpo.epsilon_high) == (0.7, 0.95, 0.28)
  assert config_io.from_dict(Config, config_io.to_dict(cfg)) == cfg
  assert config_io.from_dict(Config, {"grpo": {"beta": 0.1}}).grpo.sampling == config_lib.SamplingConfig()


def test_none_is_a_string_where_a_literal_field_offers_it():
  cfg = apply_overrides(Config(), ["--grpo.kl_placement=none", "--grpo.filter_groups=none", "--model.remat=none",
                                   "--model.rope_scaling.kind=none", "--model.sliding_window=none"])
  assert (cfg.grpo.kl_placement, cfg.grpo.filter_groups, cfg.model.remat) == ("none", "none", "none")
  assert cfg.model.rope_scaling.kind == "none" and cfg.model.sliding_window is None


def test_a_preset_then_field_overrides():
  cfg = apply_overrides(Config(), ["--model=gemma2_2b", "--model.n_layers=2"])
  assert cfg.model.n_layers == 2 and cfg.model.d_model == 2304 and cfg.model.attn_logit_softcap == 50.0


@pytest.mark.parametrize("arg, message", [
    ("--model.d_modle=3", "unknown field 'd_modle'"),
    ("--modle.d_model=3", "unknown field 'modle'"),
    ("--model.d_model=3.5", "model.d_model: expected int"),
    ("--model.d_model=true", "expected int"),
    ("--model.activation=relu", "is not one of"),
    ("--model.d_model.x=1", "has no sub-fields"),
    ("--model=gpt5", "unknown model preset 'gpt5'"),
    ("model.d_model=3", "not of the form"),
    ("--train.steps", "not of the form"),
    ("--grpo.sampling.greedy=true", "grpo.sampling.greedy: GRPO needs sampled rollouts"),
    ("--grpo.sampling.temperature=0", "grpo.sampling.temperature: sampling.temperature must be > 0"),
    ("--grpo.sampling.top_p=1.5", "top_p must be in"),
    ("--model.n_layers=0", "model.n_layers must be >= 1, got 0"),
    ("--optim.lr=-1e-3", r"optim.lr must be finite and >= 0, got -0.001"),
    ("--optim.b2=1", r"optim.b1 and optim.b2 must be in \[0, 1\)"),
    ("--optim.clip_norm=-1", "optim.clip_norm must be finite and >= 0"),
])
def test_bad_overrides_name_the_field(arg, message):
  with pytest.raises(ConfigError, match=message):
    apply_overrides(Config(), [arg])


def test_a_python_caller_gets_the_same_range_checks():
  with pytest.raises(ValueError, match="optim.lr must be finite and >= 0, got nan"):
    OptimizerConfig(lr=float("nan"))
  with pytest.raises(ValueError, match="model.n_layers must be >= 1, got 0"):
    ModelConfig(n_layers=0)


def test_config_round_trips_through_json(tmp_path):
  cfg = apply_overrides(Config(), ["--model=gemma3_1b", "--train.steps=7"])
  config_io.save(cfg, tmp_path / "config.json")
  again = config_io.from_dict(Config, json.loads((tmp_path / "config.json").read_text()))
  assert again == cfg


def test_from_dict_names_the_bad_key():
  with pytest.raises(ConfigError, match="model.rope_scaling.kindd"):
    config_io.from_dict(Config, {"model": {"rope_scaling": {"kindd": "linear"}}})


def test_every_field_has_a_comment():
  import dataclasses
  import inspect

  for cls in (ModelConfig, config_lib.MeshConfig, config_lib.OptimizerConfig,
              config_lib.TrainConfig, config_lib.Config, RopeScaling, config_lib.GRPOConfig,
              config_lib.SamplingConfig, MoeConfig):
    source = inspect.getsource(cls).splitlines()
    for field in dataclasses.fields(cls):
      line = next(i for i, l in enumerate(source) if l.strip().startswith(f"{field.name}:"))
      assert source[line - 1].strip().startswith("#"), f"{cls.__name__}.{field.name} has no comment"


def test_the_startup_summary_lists_only_the_fields_set_beside_the_defaults():
  cfg = apply_overrides(Config(), ["--train.steps=7", "--grpo.sampling.temperature=0.5", "--lora.rank=4"])
  assert config_io.fields(cfg, changed_only=True) == ["train.steps=7", "grpo.sampling.temperature=0.5", "lora.rank=4"]
  assert config_io.fields(cfg, ("train", "model"), changed_only=True) == ["train.steps=7"]
  assert config_io.fields(Config(), changed_only=True) == []


@pytest.mark.parametrize("preset", [f"{kind}_{command}" for kind in ("toy", "finetune") for command in
                                    ("sft", "dpo", "grpo")] + ["dapo_gemma"])
def test_every_field_as_an_override_line_rebuilds_the_config(preset):
  from ptx.config import GRPO_PRESETS
  from ptx.model_config import MODEL_PRESETS
  from ptx.train import presets

  if preset == "dapo_gemma":  # a model preset and a GRPO preset with their tuples, None and literal "none"s
    cfg = dataclasses.replace(Config(), model=MODEL_PRESETS["gemma2_2b"](), grpo=GRPO_PRESETS["dapo"])
    cfg = apply_overrides(cfg, ['--data.train_files=["a b.jsonl"]', "--grpo.kl_placement=none", "--lora.rank=4"])
  else:
    kind, command = preset.split("_")
    cfg = {"toy": presets.TOY, "finetune": presets.FINETUNE}[kind][command]()
  lines = config_io.fields(cfg)
  assert len(lines) > 100 and len({line.split("=")[0] for line in lines}) == len(lines)
  assert apply_overrides(Config(), [f"--{line}" for line in lines]) == cfg
  # The lines of some sections rebuild just those.
  sections = ("train", "grpo")
  rebuilt = apply_overrides(Config(), [f"--{line}" for line in config_io.fields(cfg, sections)])
  assert all(getattr(rebuilt, s) == getattr(cfg, s) for s in sections)
  assert all(line.startswith(sections) for line in config_io.fields(cfg, sections))


def test_field_overrides_apply_together_whatever_their_order():
  # A config class checks its fields once, all set: rl records need pack=False, given before or after the kind.
  want = apply_overrides(Config(), ["--data.pack=false", "--data.kind=rl"])
  assert want.data.kind == "rl" and not want.data.pack
  assert apply_overrides(Config(), ["--data.kind=rl", "--train.steps=3", "--data.pack=false"]).data == want.data
  # A rule still broken with every override set names the section's overrides.
  with pytest.raises(ConfigError, match=r"--data.kind, --data.seq_len: DataConfig: packing is for sft records"):
    apply_overrides(Config(), ["--data.kind=rl", "--train.steps=3", "--data.seq_len=64"])
  # A preset replaces its section where it stands: the fields before it are gone, those after it stay.
  cfg = apply_overrides(Config(), ["--model.n_layers=3", "--model=gemma2_2b", "--model.mlp_dim=64"])
  from ptx.model_config import MODEL_PRESETS

  assert cfg.model.n_layers == MODEL_PRESETS["gemma2_2b"]().n_layers != 3 and cfg.model.mlp_dim == 64
  # The last value of a field given twice.
  assert apply_overrides(Config(), ["--train.steps=3", "--train.steps=5"]).train.steps == 5
