"""The model section of a ptx config: the architecture and how it runs, and the registry of model presets.

`ModelConfig` is `Config.model`; `EXECUTION_FIELDS` are the fields that say
how a model runs rather than what it computes (a checkpoint's config
replaces the others, `with_architecture`). Model families
(`ptx.models.llama`, `qwen`, `gemma`) register their presets into
`MODEL_PRESETS`. Like `ptx.config`, this module imports nothing from ptx.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Literal


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE frequency scaling for context extension (HF `rope_scaling`)."""

  # "none", "linear" (positions / factor), "llama3" (Llama 3.1 band scaling) or "yarn".
  kind: Literal["none", "linear", "llama3", "yarn"] = "none"
  # Context-extension factor (HF `factor`).
  factor: float = 1.0
  # Llama 3.1: wavelengths above original_max_positions / low_freq_factor are scaled.
  low_freq_factor: float = 1.0
  # Llama 3.1: wavelengths below original_max_positions / high_freq_factor are kept.
  high_freq_factor: float = 4.0
  # Llama 3.1, YaRN: the pre-training context length (HF `original_max_position_embeddings`).
  original_max_positions: int = 8192
  # YaRN: rotations per context above which dimensions are kept (HF `beta_fast`).
  beta_fast: float = 32.0
  # YaRN: rotations per context below which dimensions are divided by factor (HF `beta_slow`).
  beta_slow: float = 1.0
  # YaRN: scale of cos/sin (None: 0.1 ln(factor) + 1, or from mscale / mscale_all_dim).
  attention_factor: float | None = None
  # YaRN (DeepSeek): mscale of the inferred attention factor's numerator (0: unset).
  mscale: float = 0.0
  # YaRN (DeepSeek): mscale_all_dim of its denominator (0: unset).
  mscale_all_dim: float = 0.0
  # YaRN: round the ramp's bounds to whole dimensions (HF `truncate`).
  truncate: bool = True


@dataclasses.dataclass(frozen=True)
class MoeConfig:
  """Mixture-of-Experts MLPs (`ptx.models.moe`): a router sends each token to k of E experts."""

  # Routed experts per layer (0: every layer has the dense MLP of `mlp_dim`).
  n_experts: int = 0
  # Experts each token is routed to (HF `num_experts_per_tok`).
  experts_per_token: int = 2
  # Hidden width of each routed expert's gated MLP (HF `moe_intermediate_size`).
  expert_mlp_dim: int = 0
  # Hidden width of the gated MLP that every token also passes through (the shared experts, HF
  # `n_shared_experts x moe_intermediate_size`); 0: none.
  shared_mlp_dim: int = 0
  # Divide the k routed gate weights by their sum (HF `norm_topk_prob`; Mixtral and gpt-oss always do).
  norm_topk_prob: bool = True
  # A trained bias on the router's logits (gpt-oss).
  router_bias: bool = False
  # "softmax": the k most probable experts of a softmax (Qwen3-MoE, Mixtral, gpt-oss); "sigmoid": sigmoid scores,
  # experts chosen by score + a correction bias that the optimizer never changes (DeepSeek-V3, Kimi K2: their
  # auxiliary-loss-free balancing), gate weights the unbiased scores.
  router: Literal["softmax", "sigmoid"] = "softmax"
  # Biases on each routed expert's gate, up and down projections (gpt-oss).
  expert_bias: bool = False
  # Sigmoid routing, group-limited: the experts split into n_groups groups, each scored by its two best experts'
  # biased scores (HF `n_group`; 1: no groups).
  n_groups: int = 1
  # Sigmoid routing: tokens choose among the experts of this many best groups (HF `topk_group`).
  topk_groups: int = 1
  # Factor on the gate weights after any renormalisation (HF `routed_scaling_factor`).
  routed_scale: float = 1.0
  # Layers (0-based, ascending) whose MLP stays the dense one of `mlp_dim`: HF Qwen3-MoE's `mlp_only_layers`
  # and `decoder_sparse_step`, DeepSeek-V3's `first_k_dense_replace`. Their weights form a stack of their own.
  dense_layers: tuple[int, ...] = ()

  def __post_init__(self):
    if self.n_experts < 0:
      raise ValueError(f"model.moe.n_experts must be >= 0 (0: dense MLPs), got {self.n_experts}")
    if self.n_experts and not 1 <= self.experts_per_token <= self.n_experts:
      raise ValueError(f"model.moe.experts_per_token must be in [1, n_experts={self.n_experts}], "
                       f"got {self.experts_per_token}")
    if self.n_experts and self.expert_mlp_dim < 1:
      raise ValueError(f"model.moe.expert_mlp_dim must be >= 1 with n_experts={self.n_experts}, "
                       f"got {self.expert_mlp_dim}")
    if self.shared_mlp_dim < 0:
      raise ValueError(f"model.moe.shared_mlp_dim must be >= 0 (0: no shared experts), got {self.shared_mlp_dim}")
    if self.n_groups < 1 or self.n_experts % self.n_groups or not 1 <= self.topk_groups <= self.n_groups:
      raise ValueError(f"model.moe.n_groups={self.n_groups} must divide n_experts={self.n_experts}, and "
                       f"model.moe.topk_groups={self.topk_groups} be in [1, n_groups]")
    if self.n_groups > 1 and self.router != "sigmoid":
      raise ValueError(f"model.moe.n_groups={self.n_groups}: group-limited routing is the sigmoid router's "
                       f"(model.moe.router='sigmoid'), not {self.router!r}'s")
    if self.n_groups > 1 and self.topk_groups * self.n_experts // self.n_groups < self.experts_per_token:
      raise ValueError(f"model.moe.topk_groups={self.topk_groups} groups of {self.n_experts // self.n_groups} "
                       f"experts hold fewer than experts_per_token={self.experts_per_token}")

  @property
  def enabled(self) -> bool:
    """Whether the layers' MLPs are Mixtures of Experts."""
    return self.n_experts > 0


@dataclasses.dataclass(frozen=True)
class MlaConfig:
  """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): keys and values through a shared low-rank latent.

  Each head's query and key are a no-position part of `qk_nope_head_dim` and a rotary part of `model.head_dim`
  (HF `qk_rope_head_dim`; the key's rotary part is one per token, shared by all heads), its value `v_head_dim`
  wide. `ptx.models.params` lists the weights that replace q, k, v and o.
  """

  # Rank of the query's compression (HF `q_lora_rank`); 0: queries straight from the residual stream (HF None,
  # DeepSeek-V2-Lite).
  q_lora_rank: int = 0
  # Rank of the key/value latent (HF `kv_lora_rank`); 0: no MLA, the layers have ordinary q, k, v and o.
  kv_lora_rank: int = 0
  # Width of each head's query and key part without rotary positions (HF `qk_nope_head_dim`).
  qk_nope_head_dim: int = 0
  # Width of each head's value (HF `v_head_dim`).
  v_head_dim: int = 0

  def __post_init__(self):
    if self.q_lora_rank < 0 or self.kv_lora_rank < 0:
      raise ValueError(f"model.mla.q_lora_rank and model.mla.kv_lora_rank must be >= 0 (0: off), got "
                       f"{self.q_lora_rank} and {self.kv_lora_rank}")
    if self.kv_lora_rank and (self.qk_nope_head_dim < 1 or self.v_head_dim < 1):
      raise ValueError(f"model.mla.qk_nope_head_dim and model.mla.v_head_dim must be >= 1 with "
                       f"kv_lora_rank={self.kv_lora_rank}, got {self.qk_nope_head_dim} and {self.v_head_dim}")
    if not self.kv_lora_rank and (self.q_lora_rank or self.qk_nope_head_dim or self.v_head_dim):
      raise ValueError(f"model.mla.kv_lora_rank=0 turns MLA off; model.mla.q_lora_rank={self.q_lora_rank}, "
                       f"qk_nope_head_dim={self.qk_nope_head_dim} and v_head_dim={self.v_head_dim} must be 0 then")

  @property
  def enabled(self) -> bool:
    """Whether the layers' attention is multi-head latent attention."""
    return self.kv_lora_rank > 0


@dataclasses.dataclass(frozen=True)
class VisionConfig:
  """An image encoder before the decoder (`ptx.models.vision`): a SigLIP ViT and the Idefics3 / SmolVLM connector.

  The tower cuts each image (one tile, `image_size` square) into patches, embeds them by a matmul over the flattened
  patch plus a learned position embedding, and runs `depth` pre-LayerNorm bidirectional layers (GELU-tanh MLPs) and
  a final LayerNorm. The connector folds each `scale_factor` x `scale_factor` block of patches into one vector (the
  pixel shuffle) and projects it to `model.d_model`: `tokens_per_image` features, which replace the embeddings of
  the `image_token_id` positions of the text.
  """

  # Encoder layers (HF vision_config `num_hidden_layers`); 0: a text-only model, no tower.
  depth: int = 0
  # Side of the square image the tower sees, in pixels (HF `image_size`).
  image_size: int = 224
  # Side of a square patch in pixels (HF `patch_size`).
  patch_size: int = 16
  # Colour channels of a pixel (HF `num_channels`).
  channels: int = 3
  # Width of the tower's residual stream (HF vision_config `hidden_size`).
  width: int = 768
  # Attention heads of each encoder layer; each is width / n_heads wide (HF `num_attention_heads`).
  n_heads: int = 12
  # Hidden width of each encoder layer's GELU-tanh MLP (HF vision_config `intermediate_size`).
  mlp_dim: int = 3072
  # LayerNorm epsilon of the tower (HF `layer_norm_eps`).
  norm_eps: float = 1e-6
  # Pixel shuffle: each scale_factor x scale_factor block of patches becomes one feature (HF `scale_factor`).
  scale_factor: int = 2
  # The token id whose positions take the image features (HF `image_token_id`, `<image>`).
  image_token_id: int = 0
  # Train the tower (patch and position embeddings, layers, final norm); False: frozen, no optimizer state.
  train_tower: bool = False
  # Train the connector's projection; False: frozen, no optimizer state.
  train_connector: bool = False

  def __post_init__(self):
    if self.depth < 0:
      raise ValueError(f"model.vision.depth must be >= 0 (0: no vision tower), got {self.depth}")
    if not self.depth:
      return
    for name in ("image_size", "patch_size", "channels", "width", "n_heads", "mlp_dim", "scale_factor"):
      if getattr(self, name) < 1:
        raise ValueError(f"model.vision.{name} must be >= 1, got {getattr(self, name)}")
    if self.image_size % self.patch_size:
      raise ValueError(f"model.vision.image_size={self.image_size} must be a multiple of model.vision.patch_size="
                       f"{self.patch_size}")
    if self.patches_per_side % self.scale_factor:
      raise ValueError(f"model.vision.scale_factor={self.scale_factor} must divide the {self.patches_per_side} "
                       f"patches per side (model.vision.image_size / patch_size)")
    if self.width % self.n_heads:
      raise ValueError(f"model.vision.width={self.width} must be a multiple of model.vision.n_heads={self.n_heads}")
    if self.image_token_id < 0:
      raise ValueError(f"model.vision.image_token_id must be >= 0, got {self.image_token_id}")

  @property
  def enabled(self) -> bool:
    """Whether the model has a vision tower."""
    return self.depth > 0

  @property
  def patches_per_side(self) -> int:
    """Patches along each side of an image."""
    return self.image_size // self.patch_size

  @property
  def n_patches(self) -> int:
    """Patches of an image: the tower's sequence length and the rows of its position embedding."""
    return self.patches_per_side ** 2

  @property
  def patch_dim(self) -> int:
    """Values of a flattened patch: channels x patch_size x patch_size."""
    return self.channels * self.patch_size ** 2

  @property
  def tokens_per_image(self) -> int:
    """Features the connector makes of one image: the image tokens it fills in the text."""
    return self.n_patches // self.scale_factor ** 2


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only transformer covering Llama 3, Qwen2/2.5/3, Gemma 2/3 and Mixture-of-Experts MLPs."""

  # Vocabulary size (rows of the embedding table).
  vocab_size: int = 512
  # Width of the residual stream.
  d_model: int = 128
  # Number of decoder layers (stacked and scanned).
  n_layers: int = 2
  # Query heads.
  n_heads: int = 4
  # Key/value heads (grouped-query attention when fewer than n_heads).
  n_kv_heads: int = 4
  # Width of each attention head; with MLA, the width of its rotary part (HF `qk_rope_head_dim`).
  head_dim: int = 32
  # Hidden width of the gated MLP.
  mlp_dim: int = 384
  # MLP gate activation: "silu" (SwiGLU: Llama, Qwen), "gelu_tanh" (GeGLU: Gemma) or "clamped_swiglu" (gpt-oss:
  # gate and up clamped at swiglu_limit, `ptx.models.gated_mlp`).
  activation: Literal["silu", "gelu_tanh", "clamped_swiglu"] = "silu"
  # activation "clamped_swiglu": the gate is clamped above at this, the up projection to +-this (HF `swiglu_limit`).
  swiglu_limit: float = 7.0
  # RMSNorm epsilon.
  norm_eps: float = 1e-5
  # Gemma-style RMSNorm that scales by (1 + w) with w initialised at 0.
  norm_plus_one: bool = False
  # Gemma 2/3: extra RMSNorms on the outputs of attention and MLP.
  post_norms: bool = False
  # Qwen2/2.5: biases on the q, k and v projections.
  qkv_bias: bool = False
  # gpt-oss: a bias on the attention's output projection.
  o_bias: bool = False
  # gpt-oss: a learned logit per head and layer that joins each query's softmax denominator (`sinks` [L, H]).
  attention_sinks: bool = False
  # Qwen3/Gemma 3: RMSNorm over head_dim on queries and keys.
  qk_norm: bool = False
  # Gemma: multiply embeddings by sqrt(d_model).
  embed_scale: bool = False
  # Share the embedding table with the output projection.
  tie_embeddings: bool = False
  # RoPE base frequency (of global layers where local and global differ).
  rope_theta: float = 10_000.0
  # RoPE scaling for the global layers.
  rope_scaling: RopeScaling = RopeScaling()
  # Mixture-of-Experts MLPs in every layer (n_experts 0: dense MLPs).
  moe: MoeConfig = MoeConfig()
  # Multi-head latent attention in every layer (mla.kv_lora_rank 0: ordinary grouped-query attention).
  mla: MlaConfig = MlaConfig()
  # An image encoder whose features replace the image tokens' embeddings (vision.depth 0: a text-only model).
  vision: VisionConfig = VisionConfig()
  # Gemma 3: RoPE base of the sliding-window layers (None: same as rope_theta).
  rope_local_theta: float | None = None
  # Sliding-window size of local layers in tokens (None: every layer is global).
  sliding_window: int | None = None
  # Layer i is global when (i + 1) % pattern == 0, else local (Gemma 2: 2, Gemma 3: 6);
  # 1 with a window makes every layer local.
  sliding_window_pattern: int = 1
  # Gemma 2: tanh soft-cap on attention logits (None: off).
  attn_logit_softcap: float | None = None
  # Gemma 2: tanh soft-cap on output logits (None: off).
  final_logit_softcap: float | None = None
  # Attention scale is query_pre_attn_scalar ** -0.5 (None: head_dim).
  query_pre_attn_scalar: float | None = None
  # Standard deviation of the normal initialiser of weight matrices.
  init_std: float = 0.02
  # Storage dtype of the parameters.
  param_dtype: str = "float32"
  # Dtype of activations and matmuls; logits, softmax and losses stay float32.
  compute_dtype: str = "float32"
  # Rematerialisation of each layer: "none", "full", "dots" or "dots_no_batch".
  remat: Literal["none", "full", "dots", "dots_no_batch"] = "none"
  # Run the stacked layers under one lax.scan (compile time flat in depth) or unrolled, one copy of
  # the layer per layer. Unrolled is faster for shallow models: a scan stacks every layer's residuals
  # into [L, ...] buffers and slices them back in the backward. With remat, keep the scan: unrolled
  # layers' compiled backward held every layer's activations anyway (XLA:CPU, benchmarks/RESULTS.md).
  scan_layers: bool = True
  # How a decode step (one token against a KV cache: `generate` and the rollout engine) runs the layers: "unroll"
  # (one copy of each layer in the program, weights sliced out of the stack once before the loop: XLA:CPU copies a
  # layer's weights out of a stack on every token otherwise), "scan" (one lax.scan over the stacked layers and a
  # stacked cache: a few kernels per layer, so an accelerator's decode is not bound by kernel launches), "auto"
  # (unroll on CPU, scan on GPU and TPU). Equal tokens and log-probs either way.
  decode_loop: Literal["auto", "scan", "unroll"] = "auto"
  # Attention: "auto", "xla", "blockwise", "pallas", "cudnn", "splash" or "ring" (`ptx.models.attention`). "auto"
  # is the row of `ptx.models.attention_choice.TABLE` for each call, printed at the start of a run: ring where the
  # mesh splits the sequence, cuDNN on GPU and splash on TPU where they compute the call exactly, else ptx's Pallas
  # kernel; on CPU xla for short sequences, blockwise for long. A name outright runs that one or is refused.
  attention_impl: Literal["auto", "xla", "blockwise", "pallas", "cudnn", "splash", "ring"] = "auto"
  # Ring attention: query heads per ring pass (None: one kv head's group); fewer heads per pass
  # keep smaller float32 accumulators and send each kv head around the ring more often.
  ring_heads_per_pass: int | None = None
  # Ring attention: token order over the `seq` axis; "zigzag" balances causal work (losses reorder
  # their batch once, positions stay global), "contiguous" keeps the natural order.
  seq_layout: Literal["zigzag", "contiguous"] = "zigzag"
  # How an MoE layer runs its experts (`ptx.models.moe`), equal up to rounding: "dense" (every expert on every
  # token, weighted: the reference, and fastest on CPU, where grouped matmuls compute densely anyway), "ragged"
  # (token copies sorted by expert, grouped matmuls), "expert_parallel" (experts split over the `expert` mesh axis,
  # token copies sent to them and back by two all-to-alls, at most moe_capacity_factor's capacity per expert:
  # `ptx.models.expert_parallel`), "auto" (expert_parallel on a mesh whose `expert` axis is over 1, else dense in
  # CPU programs, ragged elsewhere).
  moe_impl: Literal["auto", "dense", "ragged", "expert_parallel"] = "auto"
  # moe_impl "expert_parallel": each device sends each expert at most ceil(factor x its tokens x k / E) token
  # copies and drops the rest (counted: the statistic `tokens_dropped`; the predictions of their positions leave
  # the SFT and GRPO losses; DPO refuses it; samplers never drop). None: as many as the device has tokens, the
  # most one expert can receive (a token's k experts are distinct), so no copy is ever dropped.
  moe_capacity_factor: float | None = None
  # Weight of the MoE layers' mean load-balancing loss in the training losses (SFT, DPO, GRPO); 0: off, the
  # default (in RL a load-balancing loss fights the policy objective: NeMo-RL measured it degrading accuracy).
  moe_balance_coef: float = 0.0
  # Weight of the MoE layers' mean router z-loss in the training losses; 0: off, the default.
  moe_z_coef: float = 0.0
  # Losses and log-prob passes (SFT, DPO, GRPO and their references) project to the vocabulary this many
  # tokens per device at a time, so float32 logits take chunk x V per device, never [B, T, V]
  # (0: every token at once). 1024 keeps a 152K vocabulary's logits chunk at 0.6 GB.
  logits_chunk: int = 1024

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_dim"):
      if getattr(self, name) < 1:
        raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
    if self.moe_balance_coef < 0 or self.moe_z_coef < 0:
      raise ValueError(f"model.moe_balance_coef and model.moe_z_coef must be >= 0, got {self.moe_balance_coef} and "
                       f"{self.moe_z_coef}")
    if self.moe_capacity_factor is not None and not self.moe_capacity_factor > 0:
      raise ValueError(f"model.moe_capacity_factor must be > 0 (None: no copy dropped), got {self.moe_capacity_factor}")
    if not self.swiglu_limit > 0:
      raise ValueError(f"model.swiglu_limit must be > 0, got {self.swiglu_limit}")
    if self.logits_chunk < 0:
      raise ValueError(f"model.logits_chunk must be >= 0 (0: every token at once), got {self.logits_chunk}")
    dense = self.moe.dense_layers
    if dense and (not self.moe.enabled or list(dense) != sorted(set(dense)) or dense[0] < 0
                  or dense[-1] >= self.n_layers or len(dense) == self.n_layers):
      raise ValueError(f"model.moe.dense_layers={list(dense)} must be distinct ascending layer indices below "
                       f"n_layers={self.n_layers}, not all of them, in a model with experts (model.moe.n_experts="
                       f"{self.moe.n_experts})")

    if self.mla.enabled:
      _check_mla(self)
    if self.vision.enabled and not 0 <= self.vision.image_token_id < self.vocab_size:
      raise ValueError(f"model.vision.image_token_id={self.vision.image_token_id} must be a token below "
                       f"model.vocab_size={self.vocab_size}")

  @property
  def qk_head_dim(self) -> int:
    """Width of each head's queries and keys: head_dim, plus the part without positions under MLA."""
    return self.head_dim + self.mla.qk_nope_head_dim

  @property
  def v_head_dim(self) -> int:
    """Width of each head's values: head_dim, or MLA's own."""
    return self.mla.v_head_dim if self.mla.enabled else self.head_dim

  @property
  def cache_kv_heads(self) -> int:
    """Heads a KV cache holds per slot: n_kv_heads, or MLA's one latent that every head reads."""
    return 1 if self.mla.enabled else self.n_kv_heads

  @property
  def cache_head_dim(self) -> int:
    """Width of a cached key: head_dim, or MLA's latent and rotary key (kv_lora_rank + head_dim).

    An MLA cache holds no values: they are the first kv_lora_rank columns of its keys (`ptx.models.mla`).
    """
    return self.mla.kv_lora_rank + self.head_dim if self.mla.enabled else self.head_dim

  @property
  def cache_values(self) -> bool:
    """Whether a KV cache holds values beside its keys (not MLA's, whose values are its latent keys' columns)."""
    return not self.mla.enabled

  @property
  def n_moe_layers(self) -> int:
    """The layers whose MLP is a Mixture of Experts: the L of recorded routes [B, T, L, k] (0 for a dense model)."""
    return self.n_layers - len(self.moe.dense_layers) if self.moe.enabled else 0

  def stack_layers(self, stack: str) -> tuple[int, ...]:
    """The layers, in order, whose weights parameter stack `stack` holds (`ptx.models.params`).

    "layers" holds every layer of a dense model and the MoE layers of a Mixture of Experts; "dense_layers" the
    layers of `moe.dense_layers`; "vision" the vision tower's encoder layers (its stacked leaves).
    """
    if stack == "dense_layers":
      return self.moe.dense_layers
    if stack == "vision":
      return tuple(range(self.vision.depth))
    if stack != "layers":
      raise ValueError(f"no parameter stack {stack!r}: 'layers', 'dense_layers' or 'vision'")
    return tuple(i for i in range(self.n_layers) if i not in self.moe.dense_layers)


def _check_mla(cfg: ModelConfig) -> None:
  """Refuses, naming the fields, the options that MLA layers do not have."""
  if cfg.n_kv_heads != cfg.n_heads:
    raise ValueError(f"model.mla: every head has its own key and value from the latent, so model.n_kv_heads must "
                     f"equal model.n_heads={cfg.n_heads}, got {cfg.n_kv_heads}")
  if cfg.head_dim % 2:
    raise ValueError(f"model.mla: model.head_dim (the rotary width) must be even, got {cfg.head_dim}")
  for name in ("qkv_bias", "qk_norm", "query_pre_attn_scalar"):
    if getattr(cfg, name):
      raise ValueError(f"model.mla: MLA layers have no model.{name} (got {getattr(cfg, name)!r})")


# ModelConfig fields that say how the model runs, not what it computes: loading a checkpoint replaces every other
# field by the checkpoint's and keeps these as the preset or the command line chose them (`with_architecture`).
EXECUTION_FIELDS = ("param_dtype", "compute_dtype", "remat", "scan_layers", "decode_loop", "attention_impl",
                    "ring_heads_per_pass", "seq_layout", "moe_impl", "moe_capacity_factor", "moe_balance_coef",
                    "moe_z_coef", "logits_chunk")


def with_architecture(execution: ModelConfig, architecture: ModelConfig) -> ModelConfig:
  """`architecture`'s model (a checkpoint's config) run with `execution`'s settings (`EXECUTION_FIELDS`)."""
  return dataclasses.replace(architecture, **{name: getattr(execution, name) for name in EXECUTION_FIELDS})


def architecture_differences(a: ModelConfig, b: ModelConfig) -> list[str]:
  """The architecture fields (all but `EXECUTION_FIELDS`) whose values differ between `a` and `b`."""
  return [f.name for f in dataclasses.fields(ModelConfig)
          if f.name not in EXECUTION_FIELDS and getattr(a, f.name) != getattr(b, f.name)]


# Registered model presets, filled in by the family modules (ptx.models.*).
MODEL_PRESETS: dict[str, Callable[[], ModelConfig]] = {}


def register_preset(name: str) -> Callable[[Callable[[], ModelConfig]], Callable[[], ModelConfig]]:
  """Registers a zero-argument function returning a ModelConfig under `name`."""

  def wrap(fn: Callable[[], ModelConfig]) -> Callable[[], ModelConfig]:
    if name in MODEL_PRESETS:
      raise ValueError(f"model preset {name!r} is registered twice")
    MODEL_PRESETS[name] = fn
    return fn

  return wrap
