"""Gemma 4's vision tower and its embedder into the text model.

Images arrive as the processor makes them: ``pixel_values`` [N, P, 3 p^2]
(patches in row-major order over the patch grid, padded with zero pixels)
and ``image_position_ids`` int[N, P, 2] holding each patch's (x, y) on the
grid, (-1, -1) for padding. The tower runs on whole images (before any
sequence sharding): patch embedding plus 2-D position tables, an encoder
with axial 2-D RoPE and bidirectional attention over real patches, k x k
average pooling by position, and ``embed_vision``'s RMS0 + projection.

Shape letters: ``N`` images, ``P`` patches per image, ``M = P / k^2`` pooled
bins, ``E`` vision width, ``D`` text width.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import ArrayLike

from cpjax.models.gemma4.layers import (
  Buffer,
  ClippableLinear,
  Linear,
  RMSNorm,
  apply_rope,
  gelu,
  rope_angles,
)
from cpjax.models.gemma4.vision_config import Gemma4VisionConfig
from cpjax.parallel import gathered

__all__ = ["VisionTower", "MultimodalEmbedder", "soft_token_counts"]


def soft_token_counts(image_position_ids: ArrayLike, pooling_kernel_size: int) -> np.ndarray:
  """Count the soft tokens each image yields (host-side, to validate a batch).

  Mirrors :class:`VisionTower`'s pooling: patch (x, y) falls in bin
  ``x // k + (W // k) * (y // k)`` (``W`` = the image's patch columns) and
  every bin that receives a real patch yields one soft token. Padding
  patches (position -1) yield none, so an image slot that is all padding
  (a packed row's unused slot) yields no soft token.

  Args:
    image_position_ids: int[N, P, 2] patch positions (-1 = padding).
    pooling_kernel_size: ``k``.

  Returns:
    int[N]: soft tokens each image yields.

  >>> pos = np.array([[[x, y] for y in range(3) for x in range(6)] + [[-1, -1]] * 9,
  ...                 [[-1, -1]] * 27])
  >>> soft_token_counts(pos, 3).tolist()
  [2, 0]
  """
  raw = np.asarray(image_position_ids)
  real = ~np.all(raw == -1, axis=-1)
  pos = np.maximum(raw, 0)
  k = pooling_kernel_size
  bins = pos.shape[1] // (k * k)
  width = pos[..., 0].max(axis=-1, keepdims=True) + 1
  bin_of = pos[..., 0] // k + (width // k) * (pos[..., 1] // k)
  return np.asarray([np.unique(b[(b < bins) & r]).size for b, r in zip(bin_of, real)], np.int64)


class VisionAttention(nnx.Module):
  def __init__(self, cfg: Gemma4VisionConfig, *, rngs):
    e, h, kv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    lin = lambda i, o: ClippableLinear(i, o, clipped=cfg.use_clipped_linears, rngs=rngs)
    self.q_proj, self.k_proj, self.v_proj = lin(e, h * d), lin(e, kv * d), lin(e, kv * d)
    self.o_proj = lin(h * d, e)
    self.q_norm = RMSNorm(d, eps=cfg.rms_norm_eps)
    self.k_norm = RMSNorm(d, eps=cfg.rms_norm_eps)
    self.v_norm = RMSNorm(d, eps=cfg.rms_norm_eps, with_scale=False)
    self.heads, self.kv_heads, self.head_dim = h, kv, d

  def __call__(self, x, rope, real):
    """x: [N, P, E]; rope: 2 x (cos, sin) [N, P, D/2]; real: bool[N, P]."""
    n, p, _ = x.shape
    d = self.head_dim
    q = self.q_norm(self.q_proj(x).reshape(n, p, self.heads, d))
    k = self.k_norm(self.k_proj(x).reshape(n, p, self.kv_heads, d))
    v = self.v_norm(self.v_proj(x).reshape(n, p, self.kv_heads, d))
    q, k = _axial_rope(q, rope), _axial_rope(k, rope)
    k = jnp.repeat(k, self.heads // self.kv_heads, axis=2)
    v = jnp.repeat(v, self.heads // self.kv_heads, axis=2)
    logits = jnp.einsum("nqhd,nkhd->nhqk", q, k, preferred_element_type=jnp.float32)
    # Scale 1.0 (q/k are RMS-normalised); padding patches are masked as keys.
    # Every image holds a real patch, so no row is empty.
    logits = jnp.where(real[:, None, None, :], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(x.dtype)
    out = jnp.einsum("nhqk,nkhd->nqhd", probs, v)
    return self.o_proj(out.reshape(n, p, -1))


def _axial_rope(x, rope):
  """First half of the head rotated by x positions, second half by y."""
  half = x.shape[-1] // 2
  (cos_x, sin_x), (cos_y, sin_y) = rope
  return jnp.concatenate(
    [apply_rope(x[..., :half], cos_x, sin_x), apply_rope(x[..., half:], cos_y, sin_y)], axis=-1
  )


class VisionMLP(nnx.Module):
  def __init__(self, cfg: Gemma4VisionConfig, *, rngs):
    lin = lambda i, o: ClippableLinear(i, o, clipped=cfg.use_clipped_linears, rngs=rngs)
    self.gate_proj = lin(cfg.hidden_size, cfg.intermediate_size)
    self.up_proj = lin(cfg.hidden_size, cfg.intermediate_size)
    self.down_proj = lin(cfg.intermediate_size, cfg.hidden_size)

  def __call__(self, x):
    return self.down_proj(gelu(self.gate_proj(x)) * self.up_proj(x))


class VisionEncoderLayer(nnx.Module):
  def __init__(self, cfg: Gemma4VisionConfig, *, rngs):
    eps = cfg.rms_norm_eps
    self.self_attn = VisionAttention(cfg, rngs=rngs)
    self.mlp = VisionMLP(cfg, rngs=rngs)
    self.input_layernorm = RMSNorm(cfg.hidden_size, eps=eps)
    self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=eps)
    self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps=eps)
    self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps=eps)

  def __call__(self, x, rope, real):
    x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, real))
    return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class VisionEncoder(nnx.Module):
  def __init__(self, cfg: Gemma4VisionConfig, *, rngs):
    self.layers = nnx.List(
      [VisionEncoderLayer(cfg, rngs=rngs) for _ in range(cfg.num_hidden_layers)]
    )


class PatchEmbedder(nnx.Module):
  def __init__(self, cfg: Gemma4VisionConfig, *, rngs):
    self.input_proj = Linear(cfg.patch_features, cfg.hidden_size, rngs=rngs)
    table = (
      jax.random.normal(rngs.params(), (2, cfg.position_embedding_size, cfg.hidden_size)) * 0.02
      if rngs is not None
      else jnp.zeros((2, cfg.position_embedding_size, cfg.hidden_size))
    )
    self.position_embedding_table = nnx.Param(table.astype(jnp.float32))


class VisionTower(nnx.Module):
  """Patches -> pooled vision features: ([N, P, 3p^2], int[N, P, 2]) ->
  (float32[N, M, E], bool[N, M] bins that hold a real patch)."""

  def __init__(self, cfg: Gemma4VisionConfig, *, rngs: nnx.Rngs | None):
    self.cfg = cfg
    self.patch_embedder = PatchEmbedder(cfg, rngs=rngs)
    self.encoder = VisionEncoder(cfg, rngs=rngs)
    if cfg.standardize:
      self.std_bias = Buffer(jnp.zeros((cfg.hidden_size,), jnp.float32))
      self.std_scale = Buffer(jnp.ones((cfg.hidden_size,), jnp.float32))

  def __call__(self, pixel_values, image_position_ids, dtype):
    cfg = self.cfg
    n, p, _ = pixel_values.shape
    k = cfg.pooling_kernel_size
    bins = p // (k * k)
    pos = jnp.asarray(image_position_ids).astype(jnp.int32)
    padding = jnp.all(pos == -1, axis=-1)  # [N, P]
    # 1. Patch embedding: pixels rescaled to [-1, 1], plus x and y tables.
    x = self.patch_embedder.input_proj((2.0 * (pixel_values - 0.5)).astype(dtype))
    table = gathered(self.patch_embedder.position_embedding_table[...])
    clamped = jnp.maximum(pos, 0)
    pe = table[0][clamped[..., 0]] + table[1][clamped[..., 1]]
    x = x + jnp.where(padding[..., None], 0.0, pe).astype(dtype)
    # 2. Encoder. RoPE uses the raw ids: padding rows are junk nobody reads.
    inv_freq = 1.0 / (
      cfg.rope_theta
      ** (np.arange(0, cfg.head_dim // 2, 2, dtype=np.float32) / np.float32(cfg.head_dim // 2))
    )
    rope = (rope_angles(pos[..., 0], inv_freq, dtype), rope_angles(pos[..., 1], inv_freq, dtype))
    real = ~padding
    for layer in self.encoder.layers:
      x = layer(x, rope, real)
    # 3. Pool k x k squares of patches by position, in float32.
    x = jnp.where(padding[..., None], 0.0, x).astype(jnp.float32)
    max_x = jnp.max(clamped[..., 0], axis=-1, keepdims=True) + 1
    cell = clamped // k
    bin_of = cell[..., 0] + (max_x // k) * cell[..., 1]  # [N, P]
    weights = jax.nn.one_hot(bin_of, bins, dtype=jnp.float32) / (k * k)  # [N, P, M]
    pooled = jnp.einsum("npm,npe->nme", weights, x, precision=jax.lax.Precision.HIGHEST)
    # A bin is a soft token when a real patch falls in it (padding patches
    # add zeros to bin 0, which a real image's corner patch fills anyway; an
    # all-padding image slot then yields no soft token).
    valid = jnp.any((weights != 0) & real[..., None], axis=1)  # [N, M]
    pooled = pooled.astype(dtype).astype(jnp.float32) * math.sqrt(cfg.hidden_size)
    if cfg.standardize:
      pooled = (pooled - self.std_bias[...]) * self.std_scale[...]
    return pooled.astype(dtype), valid


class MultimodalEmbedder(nnx.Module):
  """``embed_vision``: ``RMS0(v) @ W.T`` into the text width."""

  def __init__(self, d_in: int, d_out: int, *, eps: float, rngs: nnx.Rngs | None):
    self.embedding_projection = Linear(d_in, d_out, rngs=rngs)
    self.embedding_pre_projection_norm = RMSNorm(d_in, eps=eps, with_scale=False)

  def __call__(self, x):
    return self.embedding_projection(self.embedding_pre_projection_norm(x))
