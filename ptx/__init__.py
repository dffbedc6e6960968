"""ptx: JAX/TPU-first post-training for LLMs (SFT, DPO, GRPO) in one SPMD program.

The names below are the promised API; everything else is importable but may
change. Internal modules never import this facade (a test enforces it).

  configs     Config and its sections, presets (model architectures), TOY and
              FINETUNE (hyperparameters of fresh toy runs and of fine-tuning)
  models      load_hf / save_hf, convert_gguf, Decoder, forward, init_params, merge_lora
  data        tokenizers, make_pipeline, record sources, supervised_data and
              grpo_prompts (a job's data as the CLI builds it), ArithmeticTask
  starts      from_pretrained (a config with an HF checkpoint's architecture,
              its weights and tokenizer)
  jobs        sft_job, dpo_job, grpo_job, grpo_host_job, grpo_episode_job
              (multi-turn episodes in an environment) -> Job; fit runs one;
              export_hf / save_peft write the result; train_grpo trains from
              plain Python reward functions
  sampling    generate (in-graph), TextSampler (text in, text out)
  RL pieces   grpo (the loss family, GRPO_PRESETS), advantages, environments
              (ExactAnswerEnv, PythonTestsEnv), EnvReward, evaluate (pass@k)
"""

__version__ = "0.1.0"

from ptx import data, models
from ptx.algorithms import advantages, dpo, grpo, sft
from ptx.config import (GRPO_PRESETS, Config, DataConfig, DPOConfig, EvalConfig, GRPOConfig, LoRAConfig, MeshConfig,
                        OptimizerConfig, TrainConfig)
from ptx.config_io import apply_overrides
from ptx.model_config import MODEL_PRESETS as presets
from ptx.model_config import MlaConfig, ModelConfig, MoeConfig, RopeScaling
from ptx.data import JsonlSource, MemorySource, load_tokenizer
from ptx.data.arithmetic import ArithmeticTask
from ptx.data.tokenizer import ByteTokenizer, Tokenizer
from ptx.models import Decoder, attention, count_params, forward, init_params, load_hf, save_hf
from ptx.models.gguf import convert_gguf
from ptx.models.lora import merge as merge_lora
from ptx.models.peft_export import save_peft
from ptx.envs.exact_answer import ExactAnswerEnv
from ptx.envs.python_tests import PythonTestsEnv
from ptx.episodes.evaluation import evaluate
from ptx.sampling import SamplingConfig, generate
from ptx.sampling.text import TextSampler
from ptx.sharding import DEFAULT_RULES, Rules, make_mesh
from ptx.train.export import export_hf
from ptx.train.optimizer import make_optimizer
from ptx.train.presets import FINETUNE, TOY
from ptx.train.state import TrainState, init_state, initial_params, state_shardings
from ptx.train.step import make_train_step

# Names whose modules import the grain data stack load on first use, so that `import ptx` (and
# `from ptx.data import ByteTokenizer`) stays light.
_LAZY = {
    "make_pipeline": ("ptx.data.pipeline", "make_pipeline"),
    "Job": ("ptx.train.job", "Job"), "sft_job": ("ptx.train.job", "sft_job"), "dpo_job": ("ptx.train.job", "dpo_job"),
    "grpo_job": ("ptx.train.job", "grpo_job"), "grpo_host_job": ("ptx.train.job", "grpo_host_job"),
    "grpo_episode_job": ("ptx.train.job", "grpo_episode_job"),
    "fit": ("ptx.train.loop", "fit"), "train_grpo": ("ptx.train.reward_functions", "train_grpo"),
    "EnvReward": ("ptx.episodes.scoring", "EnvReward"), "grpo_prompts": ("ptx.train.streams", "grpo_prompts"),
    "supervised_data": ("ptx.train.streams", "supervised"),
    "from_pretrained": ("ptx.train.pretrained", "from_pretrained"),
}

__all__ = [
    "ArithmeticTask", "ByteTokenizer", "Config", "DEFAULT_RULES", "DPOConfig", "DataConfig", "Decoder", "EnvReward",
    "EvalConfig", "ExactAnswerEnv", "FINETUNE", "GRPOConfig", "GRPO_PRESETS", "Job", "JsonlSource", "LoRAConfig",
    "MemorySource", "MeshConfig", "MlaConfig", "ModelConfig", "MoeConfig", "OptimizerConfig", "PythonTestsEnv",
    "RopeScaling", "Rules", "SamplingConfig", "TOY", "TextSampler", "Tokenizer", "TrainConfig", "TrainState",
    "advantages", "apply_overrides", "attention", "convert_gguf", "count_params", "data", "dpo", "dpo_job", "evaluate",
    "export_hf", "fit", "forward", "from_pretrained", "generate", "grpo", "grpo_episode_job", "grpo_host_job",
    "grpo_job", "grpo_prompts", "init_params", "init_state", "initial_params", "load_hf", "load_tokenizer", "make_mesh",
    "make_optimizer", "make_pipeline", "make_train_step", "merge_lora", "models", "presets", "save_hf", "save_peft",
    "sft", "sft_job", "state_shardings", "supervised_data", "train_grpo",
]


def __getattr__(name: str):
  if name in _LAZY:
    import importlib

    module, attr = _LAZY[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # resolved once
    return value
  raise AttributeError(f"module 'ptx' has no attribute {name!r}")
