"""Flax NNX decoder for the Llama 3, Qwen2/2.5/3, Qwen3-MoE, Mixtral, DeepSeek-V3, gpt-oss, Gemma 2/3, Idefics3 and
SmolVLM families."""

# Imported to register their presets and HF families.
from ptx.models import deepseek, gemma, gpt_oss, idefics3, llama, mixtral, qwen  # noqa: F401
from ptx.models.attention import attention
from ptx.models.decoder import Decoder, forward
from ptx.models.hf_load import load_hf
from ptx.models.hf_save import save_hf
from ptx.models.params import (abstract_params, count_params, init_params, param_shardings, param_specs)

__all__ = ["Decoder", "abstract_params", "attention", "count_params", "forward", "init_params",
           "load_hf", "param_shardings", "param_specs", "save_hf"]
