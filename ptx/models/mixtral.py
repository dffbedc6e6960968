"""Mixtral: Llama's attention, every layer's MLP a Mixture of Experts (`ptx.models.moe`); preset and HF name map."""

from ptx.model_config import ModelConfig, MoeConfig, register_preset
from ptx.models.hf_config import HFFamily, register
from ptx.models.llama import HF_NAMES as _LLAMA_NAMES
from ptx.models.llama import MLP_PATHS

# HF Mixtral's experts: w1 the gate, w3 the up and w2 the down projection.
_EXPERTS = {"gate": "w1", "up": "w3", "down": "w2"}

HF_MIXTRAL = register(HFFamily(
    model_type="mixtral", architecture="MixtralForCausalLM",
    names={**{path: name for path, name in _LLAMA_NAMES.items() if path not in MLP_PATHS},
           "layers/router": "model.layers.{i}.block_sparse_moe.gate.weight",
           **{f"layers/expert_{x}": f"model.layers.{{i}}.block_sparse_moe.experts.{{e}}.{w}.weight"
              for x, w in _EXPERTS.items()}},
    features={"qkv_bias": False, "qk_norm": False, "norm_plus_one": False, "post_norms": False,
              "embed_scale": False},
    defaults={"rms_norm_eps": 1e-5, "hidden_act": "silu"},
    # Mixtral's experts are `intermediate_size` wide; it has no dense MLP.
    moe_keys={"n_experts": ("num_local_experts",), "experts_per_token": ("num_experts_per_tok",),
              "expert_mlp_dim": ("intermediate_size",)},
    moe_fixed={"norm_topk_prob": True}))


@register_preset("mixtral_8x7b")
def mixtral_8x7b() -> ModelConfig:
  """Mixtral-8x7B-v0.1: 46,702,792,704 parameters (8 experts, 2 per token)."""
  return ModelConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                     mlp_dim=14336, rope_theta=1_000_000.0, norm_eps=1e-5,
                     moe=MoeConfig(n_experts=8, experts_per_token=2, expert_mlp_dim=14336),
                     param_dtype="bfloat16", compute_dtype="bfloat16")
