"""Idefics3 and SmolVLM: a Llama text model (ptx's decoder) after a SigLIP tower and a pixel-shuffle connector
(`model.vision`, `ptx.models.vision`); their HF name maps.

Both transformers classes (`Idefics3ForConditionalGeneration`, `SmolVLMForConditionalGeneration`) store the same
tensors: the text model under `model.text_model.` (read as Llama's `model.`), the tower under `model.vision_model.`,
the connector's projection as `model.connector.modality_projection.proj.weight`. The patch embedding is a Conv2d
kernel [Dv, C, P, P], which ptx reads flattened (`hf_layout.CONV_KERNELS`). config.json nests the text model's
config under `text_config` and the tower's under `vision_config`, so `save_hf` (which writes flat configs) does not
write these families yet.
"""

from ptx.models.hf_config import HFFamily, register
from ptx.models.llama import HF_LLAMA

_TOWER = "model.vision_model."
_LAYER = _TOWER + "encoder.layers.{i}."
# ptx vision leaf -> the HF module of each encoder layer that holds it (weight and bias).
_LAYER_MODULES = {"attn_norm": "layer_norm1", "q": "self_attn.q_proj", "k": "self_attn.k_proj",
                  "v": "self_attn.v_proj", "o": "self_attn.out_proj", "mlp_norm": "layer_norm2", "up": "mlp.fc1",
                  "down": "mlp.fc2"}
_MODULES = {"patch": _TOWER + "embeddings.patch_embedding", "post_norm": _TOWER + "post_layernorm",
            **{leaf: _LAYER + module for leaf, module in _LAYER_MODULES.items()}}

HF_NAMES = {
    **HF_LLAMA.names,
    **{f"vision/{leaf}": f"{module}.weight" for leaf, module in _MODULES.items()},
    **{f"vision/{leaf}_bias": f"{module}.bias" for leaf, module in _MODULES.items()},
    "vision/pos": _TOWER + "embeddings.position_embedding.weight",
    "connector/proj": "model.connector.modality_projection.proj.weight",
}

# transformers' defaults (Idefics3Config and SmolVLMConfig agree), for keys a config.json may omit.
_VISION_DEFAULTS = {
    "scale_factor": 2, "image_token_id": 128257,
    "vision_config": {"hidden_size": 1152, "intermediate_size": 3072, "num_hidden_layers": 12,
                      "num_attention_heads": 16, "num_channels": 3, "image_size": 224, "patch_size": 32,
                      "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6},
}


def _family(model_type: str, architecture: str) -> HFFamily:
  """The family of one of the two transformers classes, which differ only in their names."""
  return register(HFFamily(
      model_type=model_type, architecture=architecture, names=HF_NAMES, features=HF_LLAMA.features,
      defaults=HF_LLAMA.defaults, nested="text_config", aliases=(("model.text_model.", "model."),),
      vision=_VISION_DEFAULTS))


HF_IDEFICS3 = _family("idefics3", "Idefics3ForConditionalGeneration")
HF_SMOLVLM = _family("smolvlm", "SmolVLMForConditionalGeneration")
