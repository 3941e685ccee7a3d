"""E2B and E4B's audio tower configuration (transformers' ``Gemma4AudioConfig``).

A conformer over log-mel frames (the USM design): two stride-2 convolutions
subsample time by 4, then ``num_hidden_layers`` conformer layers (a
half-step feed-forward, chunked local self-attention with a relative
position bias, a causal depthwise convolution, a second feed-forward), and
``output_proj_dims`` soft-token features that ``embed_audio`` projects into
the text width.

>>> cfg = audio_from_hf({"hidden_size": 1024, "output_proj_dims": 1536})
>>> cfg.context_size, cfg.mel_bins, cfg.soft_tokens(3000)
(24, 128, 750)
"""

from __future__ import annotations

import dataclasses

from cpjax.models.gemma4.hf_config import check_keys
from cpjax.models.gemma4.text_config import require_positive

__all__ = ["Gemma4AudioConfig", "audio_from_hf"]


@dataclasses.dataclass(frozen=True)
class Gemma4AudioConfig:
  """The audio tower (transformers' ``Gemma4AudioConfig``; its defaults are E2B's).

  Attributes:
    hidden_size: the conformer's width ``H``.
    num_hidden_layers: conformer layers.
    num_attention_heads: heads of the chunked attention (``H`` split evenly).
    subsampling_conv_channels: output channels of the two stride-2 convolutions.
    conv_kernel_size: taps of the causal depthwise convolution.
    residual_weight: scale of each feed-forward's output before its residual.
    attention_chunk_size: query frames a block attends as one.
    attention_context_left: one more than the frames a query sees back with
      itself (13: itself and 11 back).
    attention_context_right: one more than the frames a query sees ahead
      (0 or 1: none).
    attention_logit_cap: tanh soft cap of the attention logits.
    attention_invalid_logits_value: the logit a masked key gets (after the cap).
    use_clipped_linears: whether projections clamp their inputs and outputs to
      bounds the checkpoint stores (buffers).
    rms_norm_eps: epsilon of the convolutions' LayerNorms, the light
      convolution's RMS norms and ``embed_audio``'s.
    gradient_clipping: the clamp applied to the residual stream's branches.
    output_proj_dims: width of the tower's output (``embed_audio``'s input).
  """

  hidden_size: int = 1024
  num_hidden_layers: int = 12
  num_attention_heads: int = 8
  subsampling_conv_channels: tuple[int, int] = (128, 32)
  conv_kernel_size: int = 5
  residual_weight: float = 0.5
  attention_chunk_size: int = 12
  attention_context_left: int = 13
  attention_context_right: int = 0
  attention_logit_cap: float = 50.0
  attention_invalid_logits_value: float = -1.0e9
  use_clipped_linears: bool = True
  rms_norm_eps: float = 1e-6
  gradient_clipping: float = 1e10
  output_proj_dims: int = 1536

  def __post_init__(self):
    object.__setattr__(self, "subsampling_conv_channels", tuple(self.subsampling_conv_channels))
    require_positive(
      self,
      (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "conv_kernel_size",
        "attention_chunk_size",
        "attention_context_left",
        "output_proj_dims",
      ),
    )
    if not self.attention_logit_cap > 0:
      raise ValueError(f"attention_logit_cap must be > 0, got {self.attention_logit_cap}")
    if len(self.subsampling_conv_channels) != 2 or min(self.subsampling_conv_channels) < 1:
      raise ValueError(
        "subsampling_conv_channels must be two positive channel counts, got "
        f"{list(self.subsampling_conv_channels)}"
      )
    if self.hidden_size % self.num_attention_heads:
      raise ValueError(
        f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
        f"({self.num_attention_heads})"
      )
    if self.attention_context_right < 0:
      raise ValueError(f"attention_context_right must be >= 0, got {self.attention_context_right}")

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_attention_heads

  @property
  def context_size(self) -> int:
    """Key frames each block of ``attention_chunk_size`` queries reads."""
    return (
      self.attention_chunk_size + self.attention_context_left - 1 + self.attention_context_right
    )

  @property
  def mel_bins(self) -> int:
    """The width of ``input_features`` the tower takes. transformers sizes the
    projection after the convolutions as ``(channels[0] // 4) * channels[1]``:
    four-fold subsampled mel bins times the channels, so the bins are
    ``channels[0]`` (128, the feature extractor's)."""
    return self.subsampling_conv_channels[0]

  def soft_tokens(self, frames: int) -> int:
    """Soft tokens of a clip of ``frames`` real feature frames: each stride-2
    convolution keeps every other frame (``mask[:, ::2]``, twice)."""
    after_first = (frames + 1) // 2
    return (after_first + 1) // 2


_READ = {f.name for f in dataclasses.fields(Gemma4AudioConfig)} | {"hidden_act"}


def audio_from_hf(raw: dict) -> Gemma4AudioConfig:
  """Read an E2B / E4B ``audio_config`` dict (``hidden_act`` must be silu)."""
  check_keys(raw, "audio_config", _READ)
  if raw.get("hidden_act", "silu") != "silu":
    raise ValueError(
      f"audio_config.hidden_act must be 'silu' (the only value cpjax implements), "
      f"got {raw['hidden_act']!r}"
    )
  fields = {f.name for f in dataclasses.fields(Gemma4AudioConfig)}
  return Gemma4AudioConfig(**{k: v for k, v in raw.items() if k in fields})
