"""DeepSeek-V3 and Kimi K2: multi-head latent attention (`ptx.models.mla`) and sigmoid-routed Mixtures of Experts
with a shared expert, the first layers dense; presets and the HF name map.

HF checkpoints store the rotary rows of q_b (or q) and kv_a interleaved (`rope_interleave`): the loader reads
them in ptx's halves order and the saver writes them back interleaved (`hf_config.interleaved_rope_rows`). The
multi-token prediction layer (`num_nextn_predict_layers`) is skipped on load, as transformers skips it.
"""

import dataclasses

from ptx.model_config import MlaConfig, ModelConfig, MoeConfig, RopeScaling, register_preset
from ptx.models.hf_config import HFFamily, register
from ptx.models.llama import HF_NAMES as _LLAMA_NAMES
from ptx.models.llama import MLP_NAMES

_ATTENTION = "model.layers.{i}.self_attn."
_SHARED = {"embed", "final_norm", "lm_head", "layers/attn_norm", "layers/mlp_norm"}
_NAMES = {path: name for path, name in _LLAMA_NAMES.items() if path in _SHARED}
_NAMES.update({
    "layers/q": _ATTENTION + "q_proj.weight",
    "layers/q_a": _ATTENTION + "q_a_proj.weight",
    "layers/q_a_norm": _ATTENTION + "q_a_layernorm.weight",
    "layers/q_b": _ATTENTION + "q_b_proj.weight",
    "layers/kv_a": _ATTENTION + "kv_a_proj_with_mqa.weight",
    "layers/kv_a_norm": _ATTENTION + "kv_a_layernorm.weight",
    "layers/kv_b": _ATTENTION + "kv_b_proj.weight",
    "layers/o": _ATTENTION + "o_proj.weight",
    "layers/router": "model.layers.{i}.mlp.gate.weight",
    "layers/router_correction": "model.layers.{i}.mlp.gate.e_score_correction_bias",
    **{f"layers/expert_{x}": f"model.layers.{{i}}.mlp.experts.{{e}}.{x}_proj.weight" for x in MLP_NAMES},
    **{f"layers/{x}": f"model.layers.{{i}}.mlp.shared_experts.{x}_proj.weight" for x in MLP_NAMES},
})
# The first_k_dense_replace dense layers: the whole layer is a stack of its own, with a dense MLP.
_NAMES.update({f"dense_{path}": name for path, name in list(_NAMES.items())
               if path.startswith("layers/") and "expert" not in name and "mlp.gate." not in name})
_NAMES.update({f"dense_layers/{x}": f"model.layers.{{i}}.mlp.{x}_proj.weight" for x in MLP_NAMES})

HF_DEEPSEEK_V3 = register(HFFamily(
    model_type="deepseek_v3", architecture="DeepseekV3ForCausalLM", names=_NAMES,
    features={"qkv_bias": False, "qk_norm": False, "norm_plus_one": False, "post_norms": False,
              "embed_scale": False},
    defaults={"rms_norm_eps": 1e-6, "hidden_act": "silu", "rope_interleave": True, "norm_topk_prob": True,
              "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "n_shared_experts": 0},
    moe_keys={"n_experts": ("n_routed_experts",), "experts_per_token": ("num_experts_per_tok",),
              "expert_mlp_dim": ("moe_intermediate_size",), "shared_mlp_dim": ("n_shared_experts",),
              "norm_topk_prob": ("norm_topk_prob",), "n_groups": ("n_group",), "topk_groups": ("topk_group",),
              "routed_scale": ("routed_scaling_factor",)},
    moe_fixed={"router": "sigmoid"}, dense_layers="first_k_dense_replace", mla=True,
    extra_layers_key="num_nextn_predict_layers"))

# Kimi K2 ships DeepSeek-V3's architecture under its own model_type (custom code): read, and written on request.
HF_KIMI_K2 = register(dataclasses.replace(HF_DEEPSEEK_V3, model_type="kimi_k2"))

# YaRN of both: 4K pre-training context, mscale = mscale_all_dim = 1 (cos/sin unscaled, the logits' scale x mscale^2).
_MLA = MlaConfig(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, v_head_dim=128)


@register_preset("deepseek_v3_671b")
def deepseek_v3_671b() -> ModelConfig:
  """DeepSeek-V3 (and V3.1, R1): 671B parameters without the multi-token prediction layer, 37B active."""
  return ModelConfig(
      vocab_size=129280, d_model=7168, n_layers=61, n_heads=128, n_kv_heads=128, head_dim=64, mlp_dim=18432,
      norm_eps=1e-6, rope_theta=10_000.0, mla=_MLA,
      rope_scaling=RopeScaling(kind="yarn", factor=40.0, original_max_positions=4096, mscale=1.0, mscale_all_dim=1.0),
      moe=MoeConfig(n_experts=256, experts_per_token=8, expert_mlp_dim=2048, shared_mlp_dim=2048, router="sigmoid",
                    n_groups=8, topk_groups=4, routed_scale=2.5, dense_layers=(0, 1, 2)),
      param_dtype="bfloat16", compute_dtype="bfloat16")


@register_preset("kimi_k2")
def kimi_k2() -> ModelConfig:
  """Kimi K2 (Instruct, Base): 1.03T parameters (the model card's "1T"), 32B active (384 experts, 8 per token)."""
  return ModelConfig(
      vocab_size=163840, d_model=7168, n_layers=61, n_heads=64, n_kv_heads=64, head_dim=64, mlp_dim=18432,
      norm_eps=1e-6, rope_theta=50_000.0, mla=_MLA,
      rope_scaling=RopeScaling(kind="yarn", factor=32.0, original_max_positions=4096, mscale=1.0, mscale_all_dim=1.0),
      moe=MoeConfig(n_experts=384, experts_per_token=8, expert_mlp_dim=2048, shared_mlp_dim=2048, router="sigmoid",
                    routed_scale=2.827, dense_layers=(0,)),
      param_dtype="bfloat16", compute_dtype="bfloat16")
