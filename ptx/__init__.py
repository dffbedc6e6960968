"""ptx: JAX/TPU-first post-training for LLMs (SFT, DPO, GRPO) in one SPMD program.

The names below are the promised API; everything else is importable but may
change. Internal modules never import this facade (a test enforces it).
"""

__version__ = "0.1.0"

from ptx import data, models
from ptx.algorithms import dpo, grpo, sft
from ptx.config import (Config, DataConfig, DPOConfig, GRPOConfig, LoRAConfig, MeshConfig, ModelConfig,
                        OptimizerConfig, RopeScaling, TrainConfig, apply_overrides)
from ptx.config import MODEL_PRESETS as presets
from ptx.data.tokenizer import ByteTokenizer, Tokenizer
from ptx.models import Decoder, attention, count_params, forward, init_params, load_hf, save_hf
from ptx.sampling import SamplingConfig, generate
from ptx.sharding import DEFAULT_RULES, Rules, make_mesh
from ptx.train.optimizer import make_optimizer
from ptx.train.state import TrainState, init_state, state_shardings
from ptx.train.step import make_train_step

__all__ = [
    "ByteTokenizer", "Config", "DEFAULT_RULES", "DPOConfig", "DataConfig", "Decoder", "GRPOConfig",
    "LoRAConfig", "MeshConfig", "ModelConfig", "OptimizerConfig", "RopeScaling", "Rules", "SamplingConfig",
    "Tokenizer", "TrainConfig", "TrainState", "apply_overrides", "attention", "count_params", "data", "dpo",
    "forward", "generate", "grpo", "init_params", "init_state", "load_hf", "make_mesh", "make_optimizer",
    "make_train_step", "models", "presets", "save_hf", "sft", "state_shardings",
]
