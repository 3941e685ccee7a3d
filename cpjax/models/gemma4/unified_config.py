"""Gemma 4 12B's encoder-free embedders (transformers' ``gemma4_unified``).

The unified model has no vision or audio tower: each 48-pixel image patch
(``patch_size`` x ``pooling_kernel_size`` pixels a side) and each 40 ms of
16 kHz audio (640 samples) is one soft token, embedded on its own by a few
norms and projections (:mod:`cpjax.models.gemma4.embedders`).

>>> v = Gemma4UnifiedVisionConfig()
>>> v.model_patch_size, v.patch_features
(48, 6912)
>>> unified_audio_from_hf({"audio_embed_dim": 640, "hidden_size": 640}).samples_per_token
640
"""

from __future__ import annotations

import dataclasses

from cpjax.models.gemma4.hf_config import check_keys
from cpjax.models.gemma4.text_config import require_positive

__all__ = [
  "Gemma4UnifiedAudioConfig",
  "Gemma4UnifiedVisionConfig",
  "UNIFIED_TEXT_DEFAULTS",
  "unified_audio_from_hf",
  "unified_vision_from_hf",
]

# transformers' Gemma4UnifiedTextConfig defaults where they differ from
# Gemma4TextConfig's (a text_config that leaves a key out means these); the
# unified decoder has no per-layer inputs and no MoE.
UNIFIED_TEXT_DEFAULTS = {
  "sliding_window": 1024,
  "use_bidirectional_attention": "vision",
  "max_position_embeddings": 262144,
  "hidden_size_per_layer_input": 0,
  "enable_moe_block": False,
}
# The embedders' LayerNorms: torch's default epsilon (not the config's).
LAYER_NORM_EPS = 1e-5


@dataclasses.dataclass(frozen=True)
class Gemma4UnifiedVisionConfig:
  """The image embedder (transformers' ``Gemma4UnifiedVisionConfig``).

  Attributes:
    patch_size: pixels a side of the processor's small patches.
    pooling_kernel_size: small patches a side of one soft token's patch.
    mm_embed_dim: the embedder's width ``E``.
    mm_posemb_size: positions of each axis of the 2-D position table.
    output_proj_dims: the width ``embed_vision`` projects from (``E``).
    rms_norm_eps: epsilon of the RMS norm before the projection.
  """

  patch_size: int = 16
  pooling_kernel_size: int = 3
  mm_embed_dim: int = 3840
  mm_posemb_size: int = 1120
  output_proj_dims: int = 3840
  rms_norm_eps: float = 1e-6

  def __post_init__(self):
    require_positive(
      self,
      ("patch_size", "pooling_kernel_size", "mm_embed_dim", "mm_posemb_size", "output_proj_dims"),
    )
    if self.output_proj_dims != self.mm_embed_dim:
      raise ValueError(
        f"output_proj_dims ({self.output_proj_dims}) must equal mm_embed_dim "
        f"({self.mm_embed_dim}): embed_vision projects the embedder's output"
      )

  @property
  def model_patch_size(self) -> int:
    """Pixels a side of one soft token's patch: ``patch_size * pooling_kernel_size``."""
    return self.patch_size * self.pooling_kernel_size

  @property
  def patch_features(self) -> int:
    """3 * model_patch_size**2: the last dim of ``pixel_values``."""
    return 3 * self.model_patch_size**2


@dataclasses.dataclass(frozen=True)
class Gemma4UnifiedAudioConfig:
  """The audio embedder (transformers' ``Gemma4UnifiedAudioConfig``): frames of
  ``audio_embed_dim`` waveform samples, one soft token each."""

  audio_embed_dim: int = 640
  rms_norm_eps: float = 1e-6

  def __post_init__(self):
    require_positive(self, ("audio_embed_dim",))

  @property
  def samples_per_token(self) -> int:
    """Waveform samples in one soft token (640 at 16 kHz: 40 ms)."""
    return self.audio_embed_dim


def _same(raw: dict, where: str, keys: tuple[str, ...], value: int) -> None:
  """The published files spell one width several ways: they must agree."""
  for key in keys:
    if key in raw and raw[key] != value:
      raise ValueError(f"{where}.{key} ({raw[key]}) must equal {value} (the same width)")


def unified_vision_from_hf(raw: dict) -> Gemma4UnifiedVisionConfig:
  """Read a unified model's ``vision_config`` dict.

  ``num_soft_tokens`` (the processor's budget per image) is the processor's
  to read; ``model_patch_size`` must be ``patch_size * pooling_kernel_size``.
  """
  fields = {f.name for f in dataclasses.fields(Gemma4UnifiedVisionConfig)}
  check_keys(raw, "vision_config", fields | {"model_patch_size", "num_soft_tokens"})
  cfg = Gemma4UnifiedVisionConfig(**{k: v for k, v in raw.items() if k in fields})
  _same(raw, "vision_config", ("model_patch_size",), cfg.model_patch_size)
  return cfg


def unified_audio_from_hf(raw: dict) -> Gemma4UnifiedAudioConfig:
  """Read a unified model's ``audio_config`` dict (its widths all ``audio_embed_dim``)."""
  fields = {f.name for f in dataclasses.fields(Gemma4UnifiedAudioConfig)}
  aliases = ("hidden_size", "output_proj_dims", "audio_samples_per_token")
  check_keys(raw, "audio_config", fields | set(aliases))
  cfg = Gemma4UnifiedAudioConfig(**{k: v for k, v in raw.items() if k in fields})
  _same(raw, "audio_config", aliases, cfg.audio_embed_dim)
  return cfg
