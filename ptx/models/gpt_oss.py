"""gpt-oss: grouped-query attention with q/k/v/o biases and attention sinks, alternating sliding-window (128) and
full layers, YaRN rope, every layer's MLP a Mixture of Experts with biased router and experts and a clamped SwiGLU
(`model.activation="clamped_swiglu"`); presets and the HF name map.

HF checkpoints keep each layer's experts in one tensor, the gate and up projections interleaved in gate_up_proj
(`hf_layout.FUSED_EXPERTS`): the loader reads each half, the saver interleaves them back. The hub's MXFP4 expert
weights are dequantised by the loader into that bf16 layout; this map names the bf16 tensors only.
"""

from ptx.model_config import ModelConfig, MoeConfig, RopeScaling, register_preset
from ptx.models.gated_mlp import CLAMPED_SWIGLU_ALPHA
from ptx.models.hf_config import HFFamily, register
from ptx.models.hf_layout import FUSED_EXPERTS
from ptx.models.llama import HF_NAMES as _LLAMA_NAMES
from ptx.models.llama import MLP_PATHS

_ATTENTION = "model.layers.{i}.self_attn."
_EXPERTS = "model.layers.{i}.mlp.experts."

HF_GPT_OSS = register(HFFamily(
    model_type="gpt_oss", architecture="GptOssForCausalLM",
    names={**{path: name for path, name in _LLAMA_NAMES.items() if path not in MLP_PATHS},
           **{f"layers/{x}_bias": f"{_ATTENTION}{x}_proj.bias" for x in "qkvo"},
           "layers/sinks": _ATTENTION + "sinks",
           "layers/router": "model.layers.{i}.mlp.router.weight",
           "layers/router_bias": "model.layers.{i}.mlp.router.bias",
           # gate and up interleaved in one tensor (`FUSED_EXPERTS` says which columns are whose)
           **{f"layers/expert_{x}{bias}": f"{_EXPERTS}gate_up_proj{bias}"
              for x in ("gate", "up") for bias in ("", "_bias")},
           "layers/expert_down": _EXPERTS + "down_proj",
           "layers/expert_down_bias": _EXPERTS + "down_proj_bias"},
    features={"qkv_bias": True, "o_bias": True, "attention_sinks": True, "activation": "clamped_swiglu",
              "qk_norm": False, "norm_plus_one": False, "post_norms": False, "embed_scale": False},
    defaults={"rms_norm_eps": 1e-5, "hidden_act": "silu", "sliding_window": 128},
    # gpt-oss's experts are `intermediate_size` wide; it has no dense MLP.
    moe_keys={"n_experts": ("num_local_experts", "num_experts"), "experts_per_token": ("num_experts_per_tok",),
              "expert_mlp_dim": ("intermediate_size",)},
    # top-k of the logits, then a softmax over those k: ptx's softmax router renormalised (`ptx.models.moe`)
    moe_fixed={"norm_topk_prob": True, "router_bias": True, "expert_bias": True},
    keys={"swiglu_limit": "swiglu_limit"}, fixed={"attention_bias": True, "swiglu_alpha": CLAMPED_SWIGLU_ALPHA},
    layouts=FUSED_EXPERTS))


def _gpt_oss(n_layers: int, n_experts: int) -> ModelConfig:
  """The architecture both sizes share, with `n_layers` layers of `n_experts` experts (4 per token)."""
  return ModelConfig(
      vocab_size=201088, d_model=2880, n_layers=n_layers, n_heads=64, n_kv_heads=8, head_dim=64, mlp_dim=2880,
      activation="clamped_swiglu", swiglu_limit=7.0, norm_eps=1e-5, qkv_bias=True, o_bias=True,
      attention_sinks=True, rope_theta=150_000.0, sliding_window=128, sliding_window_pattern=2,
      rope_scaling=RopeScaling(kind="yarn", factor=32.0, original_max_positions=4096, beta_fast=32.0, beta_slow=1.0,
                               truncate=False),
      moe=MoeConfig(n_experts=n_experts, experts_per_token=4, expert_mlp_dim=2880, router_bias=True,
                    expert_bias=True),
      param_dtype="bfloat16", compute_dtype="bfloat16")


@register_preset("gpt_oss_20b")
def gpt_oss_20b() -> ModelConfig:
  """gpt-oss-20b: 20,914,757,184 parameters, 4,187,440,704 active (32 experts, 4 per token; the model card's 3.61B
  leaves out the embedding table)."""
  return _gpt_oss(n_layers=24, n_experts=32)


@register_preset("gpt_oss_120b")
def gpt_oss_120b() -> ModelConfig:
  """gpt-oss-120b: 116,829,156,672 parameters, 5,711,982,912 active (128 experts, 4 per token; the model card's
  5.13B leaves out the embedding table)."""
  return _gpt_oss(n_layers=36, n_experts=128)
