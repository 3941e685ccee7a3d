"""A Gemma4-style decoder in Flax NNX with the in-forward ("sunk") CP path.

Under context parallelism the model runs inside ``jax.shard_map``: it embeds
the FULL ``input_ids``, splices the vision encoder's soft tokens into image
positions, builds per-layer inputs and vision group ids on the full row, and
only then keeps this rank's tokens with :func:`cpjax.shard_sequence`. Every
attention layer calls :func:`cpjax.ring_attention` with the sharded document
ids, padding mask and vision groups. Without a :class:`CPContext` the same
model runs on one device with dense attention (:func:`cpjax.reference_attention`)
and no collective at all.

Shape letters: ``B`` batch, ``S`` full length, ``L`` local length, ``d``
model width, ``H``/``K`` query/KV heads, ``D`` head width, ``V`` vocabulary,
``N`` images, ``T`` soft tokens per image.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from cpjax.batch import DOCUMENT_IDS_KEY, vision_group_ids
from cpjax.masks import AttentionMask
from cpjax.models.gemma4.config import Gemma4Config
from cpjax.models.gemma4.cp_batch import IMAGE_OFFSET_KEY, image_token_offsets, shard_aux_only_cp_batch
from cpjax.reference import reference_attention
from cpjax.ring_attention import ring_attention
from cpjax.sharding import ContextParallelSharder, CPContext, shard_sequence

__all__ = ["Gemma4"]


class _Tokens(NamedTuple):
  """Per-token streams of the tokens this device computes ([B, L] each)."""

  positions: jax.Array
  segment_ids: jax.Array
  padding_mask: jax.Array
  vision_group_ids: jax.Array | None


def _normal(rngs: nnx.Rngs, shape, scale: float):
  return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32) * scale)


class RMSNorm(nnx.Module):
  """Gemma's RMSNorm: ``x / rms(x) * (1 + scale)``, scale initialised at 0."""

  def __init__(self, dim: int, eps: float):
    self.scale = nnx.Param(jnp.zeros((dim,), jnp.float32))
    self.eps = eps

  def __call__(self, x):
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return (y * (1.0 + self.scale[...])).astype(x.dtype)


class Dense(nnx.Module):
  """A bias-free projection ``x @ W`` (W: [in, *out])."""

  def __init__(self, rngs: nnx.Rngs, d_in: int, *d_out: int):
    self.w = _normal(rngs, (d_in, *d_out), d_in ** -0.5)

  def __call__(self, x):
    w = self.w[...].astype(x.dtype)
    return jnp.tensordot(x, w, axes=1)


def rope(x, positions, *, theta: float, rotary_dim: int):
  """Rotary embedding of the first ``rotary_dim`` features (half-split pairs).

  x: [B, L, H, D]; positions: int[B, L] global token positions.
  """
  half = rotary_dim // 2
  freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle = positions.astype(jnp.float32)[..., None, None] * freq       # [B, L, 1, half]
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  xf = x.astype(jnp.float32)
  x1, x2, rest = xf[..., :half], xf[..., half:rotary_dim], xf[..., rotary_dim:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)
  return out.astype(x.dtype)


class Attention(nnx.Module):
  """GQA attention with q/k RMSNorm before RoPE and attention scale 1.0."""

  def __init__(self, cfg: Gemma4Config, layer: int, rngs: nnx.Rngs):
    self.full = cfg.is_full(layer)
    self.cfg = cfg
    self.kv_heads = cfg.full_num_kv_heads if self.full else cfg.num_kv_heads
    self.head_dim = cfg.full_head_dim if self.full else cfg.head_dim
    self.q_proj = Dense(rngs, cfg.d_model, cfg.num_heads, self.head_dim)
    self.k_proj = Dense(rngs, cfg.d_model, self.kv_heads, self.head_dim)
    self.v_proj = Dense(rngs, cfg.d_model, self.kv_heads, self.head_dim)
    self.o_proj = Dense(rngs, cfg.num_heads * self.head_dim, cfg.d_model)
    self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
    self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

  def __call__(self, x, tokens: _Tokens, cp: CPContext | None):
    cfg = self.cfg
    q = self.q_norm(self.q_proj(x))
    k = self.k_norm(self.k_proj(x))
    v = self.v_proj(x)
    if self.full:
      theta = cfg.rope_theta_full
      rotary = 2 * max(int(self.head_dim * cfg.partial_rotary_full) // 2, 1)
    else:
      theta, rotary = cfg.rope_theta_sliding, self.head_dim
    q = rope(q, tokens.positions, theta=theta, rotary_dim=rotary)
    k = rope(k, tokens.positions, theta=theta, rotary_dim=rotary)
    bidirectional = cfg.vision_bidirectional == "all" or (
        cfg.vision_bidirectional == "sliding" and not self.full)
    mask = AttentionMask.create(
        causal=True, sliding_window=None if self.full else cfg.sliding_window,
        segment_ids=tokens.segment_ids, padding_mask=tokens.padding_mask,
        vision_group_ids=tokens.vision_group_ids if bidirectional else None)
    if cp is None:
      out = reference_attention(q, k, v, mask=mask, scale=1.0)
    else:
      out = ring_attention(q, k, v, layout=cp.layout, axis_name=cp.axis_name, mask=mask,
                           scale=1.0)
    b, l = x.shape[:2]
    return self.o_proj(out.astype(x.dtype).reshape(b, l, -1))


class GatedMLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs, d: int, hidden: int):
    self.gate = Dense(rngs, d, hidden)
    self.up = Dense(rngs, d, hidden)
    self.down = Dense(rngs, hidden, d)

  def __call__(self, x):
    return self.down(jax.nn.gelu(self.gate(x), approximate=True) * self.up(x))


class MixtureOfExperts(nnx.Module):
  """Top-k routed gated experts (all experts computed densely: exact, small)."""

  def __init__(self, cfg: Gemma4Config, rngs: nnx.Rngs):
    d, h, e = cfg.d_model, cfg.expert_hidden, cfg.num_experts
    self.top_k = cfg.experts_top_k
    self.router = Dense(rngs, d, e)
    self.w_gate = _normal(rngs, (e, d, h), d ** -0.5)
    self.w_up = _normal(rngs, (e, d, h), d ** -0.5)
    self.w_down = _normal(rngs, (e, h, d), h ** -0.5)

  def __call__(self, x):
    logits = self.router(x).astype(jnp.float32)                    # [B, L, E]
    top, idx = jax.lax.top_k(logits, self.top_k)
    weights = jax.nn.softmax(top, axis=-1)
    gates = jnp.sum(jax.nn.one_hot(idx, logits.shape[-1]) * weights[..., None], axis=-2)
    dt = x.dtype
    hidden = (jax.nn.gelu(jnp.einsum("bld,edh->bleh", x, self.w_gate[...].astype(dt)),
                          approximate=True)
              * jnp.einsum("bld,edh->bleh", x, self.w_up[...].astype(dt)))
    out = jnp.einsum("bleh,ehd->bled", hidden, self.w_down[...].astype(dt))
    return jnp.einsum("bled,ble->bld", out, gates.astype(dt))


class DecoderLayer(nnx.Module):
  """Sandwich-normed attention and FFN, then the per-layer input."""

  def __init__(self, cfg: Gemma4Config, layer: int, rngs: nnx.Rngs):
    eps = cfg.rms_norm_eps
    self.attn = Attention(cfg, layer, rngs)
    self.pre_attn_norm, self.post_attn_norm = RMSNorm(cfg.d_model, eps), RMSNorm(cfg.d_model, eps)
    self.pre_ffw_norm, self.post_ffw_norm = RMSNorm(cfg.d_model, eps), RMSNorm(cfg.d_model, eps)
    self.mlp = GatedMLP(rngs, cfg.d_model, cfg.mlp_hidden)
    self.moe = MixtureOfExperts(cfg, rngs) if cfg.num_experts else None
    if cfg.per_layer_dim:
      self.pl_gate = Dense(rngs, cfg.d_model, cfg.per_layer_dim)
      self.pl_up = Dense(rngs, cfg.per_layer_dim, cfg.d_model)
      self.pl_norm = RMSNorm(cfg.d_model, eps)

  def __call__(self, x, tokens: _Tokens, per_layer, cp: CPContext | None):
    x = x + self.post_attn_norm(self.attn(self.pre_attn_norm(x), tokens, cp))
    h = self.pre_ffw_norm(x)
    ffw = self.mlp(h)
    if self.moe is not None:
      ffw = ffw + self.moe(h)
    x = x + self.post_ffw_norm(ffw)
    if per_layer is not None:
      gated = jax.nn.gelu(self.pl_gate(x), approximate=True) * per_layer
      x = x + self.pl_norm(self.pl_up(gated))
    return x


class VisionEncoder(nnx.Module):
  """Patches -> soft tokens: [N, C, H, W] -> [N, T, d]."""

  def __init__(self, cfg: Gemma4Config, rngs: nnx.Rngs):
    self.cfg = cfg
    self.patch_proj = Dense(rngs, cfg.patch_features, cfg.d_model)
    self.norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
    self.mlp = GatedMLP(rngs, cfg.d_model, cfg.d_model)

  def __call__(self, pixels):
    n, c, hgt, wid = pixels.shape
    p = self.cfg.patch_size
    patches = pixels.reshape(n, c, hgt // p, p, wid // p, p).transpose(0, 2, 4, 1, 3, 5)
    patches = patches.reshape(n, (hgt // p) * (wid // p), c * p * p)
    x = self.norm(self.patch_proj(patches))
    return x + self.mlp(x)


class Gemma4(nnx.Module):
  """Gemma4-style decoder: ``logits = model(batch, cp=...)``.

  Example:
    >>> import numpy as np
    >>> from flax import nnx
    >>> from cpjax.models.gemma4 import Gemma4, Gemma4Config, prepare_batch
    >>> model = Gemma4(Gemma4Config(num_layers=2), rngs=nnx.Rngs(0))
    >>> batch = prepare_batch({"input_ids": np.ones((1, 8), np.int32),
    ...                        "labels": np.ones((1, 8), np.int32)})
    >>> model(batch).shape
    (1, 8, 256)
  """

  def __init__(self, cfg: Gemma4Config, *, rngs: nnx.Rngs, dtype=jnp.float32):
    self.cfg = cfg
    self.dtype = dtype
    # Unit-scale inputs after the sqrt(d_model) multiplier; tied logits start O(1).
    self.embed = _normal(rngs, (cfg.vocab_size, cfg.d_model), cfg.d_model ** -0.5)
    self.vision = VisionEncoder(cfg, rngs)
    self.layers = nnx.List([DecoderLayer(cfg, i, rngs) for i in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
    if cfg.per_layer_dim:
      width = cfg.num_layers * cfg.per_layer_dim
      self.pl_embed = _normal(rngs, (cfg.vocab_size, width), cfg.per_layer_dim ** -0.5)
      self.pl_proj = Dense(rngs, cfg.d_model, width)
      self.pl_proj_norm = RMSNorm(cfg.per_layer_dim, cfg.rms_norm_eps)

  # -------------------------------------------------------- full-row inputs
  def embed_full_row(self, batch: Mapping[str, Any]):
    """Embeddings [B, S, d], per-layer inputs [B, S, layers, P] and vision
    group ids [B, S], all built on the FULL row (before any slicing)."""
    cfg = self.cfg
    ids = jnp.asarray(batch["input_ids"])
    x = jnp.take(self.embed[...], ids, axis=0) * math.sqrt(cfg.d_model)
    types = batch.get("mm_token_type_ids")
    groups = None
    if types is not None:
      types = jnp.asarray(types)
      groups = vision_group_ids(types)
      if batch.get("pixel_values") is not None:
        x = self._splice_images(x, types, jnp.asarray(batch["pixel_values"]),
                                batch.get(IMAGE_OFFSET_KEY))
    per_layer = None
    if cfg.per_layer_dim:
      b, s = ids.shape
      table = jnp.take(self.pl_embed[...], ids, axis=0) * math.sqrt(cfg.per_layer_dim)
      proj = self.pl_proj(x) * cfg.d_model ** -0.5
      shape = (b, s, cfg.num_layers, cfg.per_layer_dim)
      per_layer = (self.pl_proj_norm(proj.reshape(shape)) + table.reshape(shape)) * 2 ** -0.5
    return x.astype(self.dtype), per_layer, groups

  def _splice_images(self, x, types, pixels, row_offset=None):
    """Put image n's T soft tokens at the n-th run of T image positions.

    Image tokens are numbered row-major over the *global* batch. A
    data-parallel shard holds only some rows, so it needs ``row_offset``
    int[B]: the image tokens in the global rows before each of its rows
    (:func:`image_token_offsets`); without it the rows here are the batch.
    """
    soft = self.vision(pixels).reshape(-1, self.cfg.d_model)       # [N*T, d]
    is_image = types == 1
    if row_offset is None:
      row_offset = image_token_offsets(types)
    slot = jnp.asarray(row_offset)[:, None] + jnp.cumsum(is_image, axis=1) - 1
    slot = jnp.clip(slot, 0, soft.shape[0] - 1)
    return jnp.where(is_image[..., None], soft[slot], x)

  # ---------------------------------------------------------------- forward
  def __call__(self, batch: Mapping[str, Any], *, cp: CPContext | None = None):
    """Logits [B, L, V] of this device's tokens (all S tokens without ``cp``).

    ``batch`` holds the full-length primary streams (``input_ids``,
    ``mm_token_type_ids``, ``pixel_values``) and the per-token streams of the
    tokens computed here (``position_ids``, ``padding_mask``,
    ``_packed_seq_ids``): local parts under CP, as the aux-only sharder
    produces them.
    """
    x, per_layer, groups = self.embed_full_row(batch)
    if cp is not None:
      cut = functools.partial(shard_sequence, layout=cp.layout, axis_name=cp.axis_name)
      x = cut(x)
      per_layer = None if per_layer is None else cut(per_layer)
      groups = None if groups is None else cut(groups, pad_value=-1)
    tokens = _Tokens(jnp.asarray(batch["position_ids"]), jnp.asarray(batch[DOCUMENT_IDS_KEY]),
                     jnp.asarray(batch["padding_mask"]), groups)
    for i, layer in enumerate(self.layers):
      pl = None if per_layer is None else per_layer[:, :, i].astype(x.dtype)
      x = layer(x, tokens, pl, cp)
    x = self.final_norm(x)
    logits = jnp.einsum("bld,vd->blv", x, self.embed[...].astype(x.dtype),
                        preferred_element_type=jnp.float32)
    cap = self.cfg.final_logit_soft_cap
    return logits if cap is None else cap * jnp.tanh(logits / cap)

  def prepare_model_inputs_for_cp(self, batch: Mapping[str, Any] | None = None, *,
                                  layout: str = "contiguous") -> dict:
    """``{"cp_sharder": ContextParallelSharder}`` whose ``shard_batch`` is the
    aux-only sharder (``layout`` ``"contiguous"`` as the original, or
    ``"load_balanced"``): the CP dispatch calls it instead of a generic one."""
    del batch  # the sharder is the same for every batch of this model
    return {"cp_sharder": ContextParallelSharder(
        shard_batch=functools.partial(_sharder_call, shard_aux_only_cp_batch, layout))}


def _sharder_call(fn, layout, batch, mesh, **kw):
  """``shard_batch(batch, mesh, **kw)`` argument order for the Gemma4 sharder."""
  return fn(mesh, batch, layout=layout, **kw)
