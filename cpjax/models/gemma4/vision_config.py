"""Gemma 4's vision tower configuration (transformers' ``Gemma4VisionConfig``)."""

from __future__ import annotations

import dataclasses

from cpjax.models.gemma4.text_config import require_positive

__all__ = ["Gemma4VisionConfig"]


@dataclasses.dataclass(frozen=True)
class Gemma4VisionConfig:
  """The vision tower (transformers' ``Gemma4VisionConfig``).

  >>> Gemma4VisionConfig().hidden_size
  768
  """

  hidden_size: int = 768
  intermediate_size: int = 3072
  num_hidden_layers: int = 16
  num_attention_heads: int = 12
  num_key_value_heads: int = 12
  head_dim: int = 64
  patch_size: int = 16
  pooling_kernel_size: int = 3
  position_embedding_size: int = 10240
  rope_theta: float = 100.0
  use_clipped_linears: bool = False
  standardize: bool = False
  rms_norm_eps: float = 1e-6

  def __post_init__(self):
    require_positive(
      self,
      (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "patch_size",
        "pooling_kernel_size",
        "position_embedding_size",
      ),
    )
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(
        f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
        f"num_key_value_heads ({self.num_key_value_heads})"
      )
    if self.head_dim % 4:
      raise ValueError(f"head_dim must be a multiple of 4 (2-D RoPE), got {self.head_dim}")

  @property
  def patch_features(self) -> int:
    """3 * patch_size**2: the last dim of ``pixel_values``."""
    return 3 * self.patch_size**2
