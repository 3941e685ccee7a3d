"""Gemma4Config: the size and attention layout of the Gemma4-style decoder."""

from __future__ import annotations

import dataclasses

__all__ = ["Gemma4Config"]

_VISION_MODES = ("sliding", "all", "none")


@dataclasses.dataclass(frozen=True)
class Gemma4Config:
  """A small but faithful Gemma4-style decoder (defaults train in seconds on CPU).

  Attributes:
    vocab_size: tokens in the (tied) embedding.
    d_model: residual width; embeddings are scaled by ``sqrt(d_model)``.
    num_layers: decoder layers; layer i is *full* (global) attention iff
      ``(i + 1) % full_every == 0`` or it is the last layer, else *sliding*.
    full_every: the sliding : full pattern period (6 gives Gemma's 5 : 1).
    num_heads: query heads on every layer.
    num_kv_heads: KV heads on sliding layers (GQA).
    head_dim: head width on sliding layers.
    full_num_kv_heads: KV heads on full layers (Gemma4 uses fewer there).
    full_head_dim: head width on full layers (Gemma4 uses a larger one).
    sliding_window: tokens a sliding layer sees, the query included.
    rope_theta_sliding / rope_theta_full: RoPE base per layer kind.
    partial_rotary_full: fraction of ``full_head_dim`` rotated on full layers.
    mlp_hidden: width of the gated (GELU) MLP.
    num_experts: 0 for none, else a top-k mixture of experts added beside the
      dense MLP on every layer.
    experts_top_k: experts each token is routed to.
    expert_hidden: width of each expert's gated MLP.
    per_layer_dim: width ``P`` of the per-layer token inputs (0 disables):
      a [vocab, num_layers * P] embedding plus a projection of the main
      embedding, fed to every layer after its FFN through a gated projection.
    image_size / patch_size / num_channels: the tiny vision encoder's input;
      each image becomes ``(image_size // patch_size) ** 2`` soft tokens,
      spliced into the positions whose ``mm_token_type_ids`` is 1.
    vision_bidirectional: which layers let the tokens of one image attend to
      each other in both directions: ``"sliding"`` (the original), ``"all"``
      (Hugging Face), or ``"none"``.
    final_logit_soft_cap: ``c * tanh(logits / c)`` on the output logits, or None.
    rms_norm_eps: RMSNorm epsilon.

  Example:
    >>> cfg = Gemma4Config()
    >>> [cfg.is_full(i) for i in range(cfg.num_layers)], cfg.tokens_per_image
    ([False, False, False, False, False, True], 4)
  """

  vocab_size: int = 256
  d_model: int = 64
  num_layers: int = 6
  full_every: int = 6
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 16
  full_num_kv_heads: int = 1
  full_head_dim: int = 32
  sliding_window: int = 64
  rope_theta_sliding: float = 1e4
  rope_theta_full: float = 1e6
  partial_rotary_full: float = 0.25
  mlp_hidden: int = 128
  num_experts: int = 0
  experts_top_k: int = 2
  expert_hidden: int = 32
  per_layer_dim: int = 8
  image_size: int = 8
  patch_size: int = 4
  num_channels: int = 3
  vision_bidirectional: str = "sliding"
  final_logit_soft_cap: float | None = 30.0
  rms_norm_eps: float = 1e-6

  def __post_init__(self):
    positive = ("vocab_size", "d_model", "num_layers", "full_every", "num_heads",
                "num_kv_heads", "head_dim", "full_num_kv_heads", "full_head_dim",
                "sliding_window", "mlp_hidden", "image_size", "patch_size", "num_channels")
    for name in positive:
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    for heads in ("num_kv_heads", "full_num_kv_heads"):
      if self.num_heads % getattr(self, heads):
        raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of {heads} "
                         f"({getattr(self, heads)})")
    if self.head_dim % 2 or self.full_head_dim % 2:
      raise ValueError(f"head dims must be even for RoPE, got {self.head_dim} and "
                       f"{self.full_head_dim}")
    if not 0 < self.partial_rotary_full <= 1:
      raise ValueError(f"partial_rotary_full must be in (0, 1], got {self.partial_rotary_full}")
    if self.num_experts < 0 or (self.num_experts and not 1 <= self.experts_top_k <= self.num_experts):
      raise ValueError(f"need 0 <= experts_top_k <= num_experts, got top_k={self.experts_top_k}, "
                       f"num_experts={self.num_experts}")
    if self.per_layer_dim < 0:
      raise ValueError(f"per_layer_dim must be >= 0, got {self.per_layer_dim}")
    if self.image_size % self.patch_size:
      raise ValueError(f"image_size ({self.image_size}) must be a multiple of patch_size "
                       f"({self.patch_size})")
    if self.vision_bidirectional not in _VISION_MODES:
      raise ValueError(f"vision_bidirectional must be one of {_VISION_MODES}, got "
                       f"{self.vision_bidirectional!r}")

  def is_full(self, layer: int) -> bool:
    """Whether ``layer`` uses full (global) attention."""
    return (layer + 1) % self.full_every == 0 or layer == self.num_layers - 1

  @property
  def tokens_per_image(self) -> int:
    return (self.image_size // self.patch_size) ** 2

  @property
  def patch_features(self) -> int:
    return self.patch_size * self.patch_size * self.num_channels
