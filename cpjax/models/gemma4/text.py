"""Gemma 4's text decoder layers: attention with K/V sharing, MLP, MoE, PLE.

Attention itself is not computed here: a layer hands its queries, keys and
values to an ``attend(q, k, v, layer)`` callable from the model, which
applies the layer's mask either densely on one device or as a ring over the
``cp`` axis. What a layer computes per token (projections, norms, RoPE,
MLP, MoE, per-layer inputs) does not depend on where its tokens live.

Shape letters: ``B`` batch, ``S`` tokens here (all, or this rank's), ``D``
model width, ``H``/``K`` query/KV heads, ``d`` head width, ``E`` experts,
``P`` per-layer input width.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import qwix
from flax import nnx
from jax.typing import DTypeLike

from cpjax.models.gemma4.experts import ExpertStats, grouped_matmul, routed_experts
from cpjax.models.gemma4.layers import (
  Buffer,
  Linear,
  RMSNorm,
  apply_rope,
  gelu,
  rms_normalize,
  scaled,
)
from cpjax.models.gemma4.remat import remat_tiles
from cpjax.models.gemma4.text_config import Gemma4TextConfig
from cpjax.parallel import gather_safe

__all__ = ["DecoderLayer"]


class TextAttention(nnx.Module):
  """q/k RMSNorm before RoPE, weightless v norm, scale 1.0, GQA.

  A ``reuse`` layer (K/V sharing) has only ``q_proj``/``q_norm``/``o_proj``:
  it attends to the keys and values of its type's ``store`` layer. With
  ``attention_k_eq_v`` a full layer has no ``v_proj``: ``v = RMS0(k_raw)``.
  """

  def __init__(self, cfg: Gemma4TextConfig, layer: int, *, rngs):
    self.layer = layer
    assert cfg.layer_types is not None  # __post_init__ fills it
    self.kind = cfg.layer_types[layer]
    self.mode = cfg.kv_sharing_modes[layer]
    self.heads, self.kv_heads = cfg.num_attention_heads, cfg.kv_heads(layer)
    self.head_dim = d = cfg.layer_head_dim(layer)
    eps = cfg.rms_norm_eps
    self.q_proj = Linear(cfg.hidden_size, self.heads * d, rngs=rngs)
    self.q_norm = RMSNorm(d, eps=eps)
    self.o_proj = Linear(self.heads * d, cfg.hidden_size, rngs=rngs)
    self.k_eq_v = cfg.attention_k_eq_v and cfg.is_full(layer)
    self.eps = eps
    if self.mode != "reuse":
      self.k_proj = Linear(cfg.hidden_size, self.kv_heads * d, rngs=rngs)
      self.k_norm = RMSNorm(d, eps=eps)
      if not self.k_eq_v:
        self.v_proj = Linear(cfg.hidden_size, self.kv_heads * d, rngs=rngs)

  def __call__(self, h, rope, attend, shared_kv: dict):
    """h: [B, S, D] normed input; rope: (cos, sin) [B, S, d]."""
    b, s, _ = h.shape
    d = self.head_dim
    q = apply_rope(self.q_norm(self.q_proj(h).reshape(b, s, self.heads, d)), *rope)
    if self.mode == "reuse":
      k, v = shared_kv[self.kind]
    else:
      k_raw = self.k_proj(h).reshape(b, s, self.kv_heads, d)
      v_raw = k_raw if self.k_eq_v else self.v_proj(h).reshape(b, s, self.kv_heads, d)
      k = apply_rope(self.k_norm(k_raw), *rope)
      v = rms_normalize(v_raw, self.eps).astype(v_raw.dtype)
    out = attend(q, k, v, self.layer)
    return self.o_proj(out.astype(h.dtype).reshape(b, s, -1)), (k, v)


# Values of one [B, T, I] intermediate per tile of a long row's MLP, at most
# (32 MiB in float32; E2B's 6144 hidden units: tiles of 1024 tokens). Smaller
# tiles add up the weights' gradients more often for little less memory.
MLP_TILE_VALUES = 1 << 23


class TextMLP(nnx.Module):
  """Gemma's gated MLP, ``down(gelu(gate(x)) * up(x))``: x [B, S, D] -> [B, S, D],
  through ``I`` hidden units; a long row goes ``T`` tokens at a time.

  A long row's largest activations are this MLP's [B, S, I] intermediates and
  their gradients (E2B at S = 16384 tokens per rank: 384 MiB each in float32,
  eight alive at once in a layer's backward). Past ``MLP_TILE_VALUES`` values
  per intermediate the row goes through a loop over tiles of ``T`` tokens
  (DeepSpeed ALST's tiled MLP, :func:`~cpjax.models.gemma4.remat.remat_tiles`):
  the backward recomputes one tile's intermediates at a time, writes the
  tile's input gradient in place and adds up the weights' gradients over the
  tiles. Each token's output is the same computation.

  >>> mlp = TextMLP(4, 8, rngs=nnx.Rngs(0))
  >>> mlp(jnp.ones((1, 3, 4))).shape
  (1, 3, 4)
  """

  def __init__(self, d: int, hidden: int, *, rngs):
    self.gate_proj = Linear(d, hidden, rngs=rngs)
    self.up_proj = Linear(d, hidden, rngs=rngs)
    self.down_proj = Linear(hidden, d, rngs=rngs)

  def __call__(self, x):
    b, s, d = x.shape
    hidden = self.gate_proj.weight.shape[0]
    # A power of two, so that a power-of-two row needs no padding.
    tile = 1 << max(0, (MLP_TILE_VALUES // (b * hidden)).bit_length() - 1)
    if s <= tile:
      return self._mlp(x)
    # Tiles of the sequence, not of B * S: the rows keep their split.
    pad = -s % tile
    tiles = jnp.pad(x, ((0, 0), (0, pad), (0, 0))).reshape(b, -1, tile, d).swapaxes(0, 1)
    # The tile's MLP runs on a copy of this module made inside the loop, so
    # what runs in it may set attributes there (qwix's LoRA does).
    graphdef, state = nnx.split(self)
    out = remat_tiles(lambda state, x: nnx.merge(graphdef, state)._mlp(x), state, tiles)
    return out.swapaxes(0, 1).reshape(b, -1, d)[:, :s]

  def _mlp(self, x):
    return self.down_proj(gelu(self.gate_proj(x)) * self.up_proj(x))


class Router(nnx.Module):
  """Top-k routing on the RAW residual (transformers; Google's library
  routes on the pre-FFW-normed one): ``softmax(RMS0(r) * scale / sqrt(D) @
  W.T)`` in float32, top-k, renormalised, times ``per_expert_scale``."""

  def __init__(self, cfg: Gemma4TextConfig, *, rngs):
    # Built only with enable_moe_block, which requires both (Gemma4TextConfig).
    assert cfg.num_experts is not None and cfg.top_k_experts is not None
    self.proj = Linear(cfg.hidden_size, cfg.num_experts, rngs=rngs)
    self.scale = nnx.Param(jnp.ones((cfg.hidden_size,), jnp.float32))
    self.per_expert_scale = nnx.Param(jnp.ones((cfg.num_experts,), jnp.float32))
    self.top_k, self.eps = cfg.top_k_experts, cfg.rms_norm_eps
    self.root = cfg.hidden_size**-0.5

  def __call__(self, r):
    """r: [T, D] -> (weights float32[T, k], expert ids int32[T, k])."""
    z = rms_normalize(r, self.eps).astype(r.dtype)
    z = scaled(z * self.scale[...].astype(r.dtype), self.root)  # (a Python number in torch)
    probs = jax.nn.softmax(self.proj(z).astype(jnp.float32), axis=-1)
    top, idx = jax.lax.top_k(probs, self.top_k)
    top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top * self.per_expert_scale[...].astype(jnp.float32)[idx], idx


class Experts(nnx.Module):
  """E gated experts as raw [E, out, in] tensors (``gate_up_proj`` stacks
  gate then up). Tokens are grouped by expert and run through
  :func:`cpjax.models.gemma4.experts.grouped_matmul`: each token costs its k experts, not
  all E (on TPU; elsewhere each of the G experts here computes every row,
  masked, as JAX's own lowering of ``ragged_dot`` does).

  LoRA (PEFT's ``target_parameters``, made by
  :func:`cpjax.training.lora.apply_lora`): a tensor named in
  ``lora_parameters`` gains per-expert factors ``<name>_lora_a`` [E, in, r]
  and ``<name>_lora_b`` [E, r, out] (float32) and the module a
  ``lora_scale``; expert ``e`` then computes ``x W_e.T + scale * x A_e
  B_e`` with its own rows, on every path the experts run (one device,
  expert parallelism with or without a capacity factor, TPU's grouped
  matmul), and the factors travel with their experts over ``ep``. As
  PEFT's ``ParamWrapper`` computes it: the factors in the weights' compute
  dtype, each product accumulated in float32, the sum formed in float32.
  """

  # The tensors that can carry LoRA factors, in the order the Hugging Face
  # module defines them (PEFT nests its wrappers in that order).
  lora_parameters = ("gate_up_proj", "down_proj")

  def __init__(self, cfg: Gemma4TextConfig, *, rngs):
    e, d, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    # Built only with enable_moe_block, which requires both (Gemma4TextConfig).
    assert e is not None and i is not None
    normal = lambda shape, fan_in: (
      jax.random.normal(rngs.params(), shape) * fan_in**-0.5
      if rngs is not None
      else jnp.zeros(shape)
    )
    self.gate_up_proj = nnx.Param(normal((e, 2 * i, d), d).astype(jnp.float32))
    self.down_proj = nnx.Param(normal((e, d, i), i).astype(jnp.float32))
    self.num_experts, self.hidden = e, i

  def _adapters(self) -> dict:
    """{tensor name: (A [E, in, r], B [E, r, out])} of the adapted tensors."""
    return {
      name: (getattr(self, name + "_lora_a")[...], getattr(self, name + "_lora_b")[...])
      for name in self.lora_parameters
      if hasattr(self, name + "_lora_a")
    }

  def __call__(
    self,
    x,
    weights,
    idx,
    *,
    expert_axes: tuple[str, ...] = (),
    capacity_factor: float | None = None,
  ) -> tuple[jax.Array, ExpertStats]:
    """x: [T, D]; weights float32[T, k]; idx int32[T, k] -> ([T, D], stats).

    With ``expert_axes`` the experts are split over those mesh axes and
    tokens travel to them (:func:`cpjax.models.gemma4.experts.routed_experts`)."""
    hidden = self.hidden
    scale = getattr(self, "lora_scale", None)

    def project(rows, weight, sizes, adapter):
      """rows [R, in] by each row's expert's weight [E, out, in] (and adapter)."""
      dt = rows.dtype
      # A quantized base (QLoRA) stores qwix's QArray: the experts run on q *
      # scale. It is frozen (a quantized base is LoRA's only): no gradient.
      if isinstance(weight, qwix.QArray):
        dense = qwix.dequantize(jax.lax.stop_gradient(weight))
      else:
        dense = weight
      y = grouped_matmul(rows, jnp.swapaxes(dense, 1, 2).astype(dt), sizes)
      if adapter is None:
        return y
      a, b = adapter
      assert scale is not None  # apply_lora sets it beside the factors
      low = grouped_matmul(rows, a.astype(dt), sizes)  # [R, r]
      term = grouped_matmul(low, b.astype(dt), sizes).astype(jnp.float32)
      return (y.astype(jnp.float32) + scale * term).astype(dt)

    def run(rows, sizes, params):
      gate_up, down, adapters = params  # [E, 2I, D], [E, D, I] (those here)
      gu = project(rows, gate_up, sizes, adapters.get("gate_up_proj"))
      return project(gelu(gu[:, :hidden]) * gu[:, hidden:], down, sizes, adapters.get("down_proj"))

    return routed_experts(
      x,
      weights,
      idx,
      (self.gate_up_proj[...], self.down_proj[...], self._adapters()),
      run,
      num_experts=self.num_experts,
      expert_axes=expert_axes,
      capacity_factor=capacity_factor,
    )


class DecoderLayer(nnx.Module):
  """One Gemma 4 layer: sandwich-normed attention, dense MLP (plus MoE),
  the per-layer input, and ``layer_scalar`` on the whole residual."""

  def __init__(self, cfg: Gemma4TextConfig, layer: int, *, rngs):
    eps, d = cfg.rms_norm_eps, cfg.hidden_size
    self.self_attn = TextAttention(cfg, layer, rngs=rngs)
    self.mlp = TextMLP(d, cfg.mlp_size(layer), rngs=rngs)
    self.input_layernorm = RMSNorm(d, eps=eps)
    self.post_attention_layernorm = RMSNorm(d, eps=eps)
    self.pre_feedforward_layernorm = RMSNorm(d, eps=eps)
    self.post_feedforward_layernorm = RMSNorm(d, eps=eps)
    self.layer_scalar = Buffer(jnp.ones((1,), jnp.float32))
    self.moe = cfg.enable_moe_block
    if self.moe:
      self.router = Router(cfg, rngs=rngs)
      self.experts = Experts(cfg, rngs=rngs)
      self.post_feedforward_layernorm_1 = RMSNorm(d, eps=eps)
      self.post_feedforward_layernorm_2 = RMSNorm(d, eps=eps)
      self.pre_feedforward_layernorm_2 = RMSNorm(d, eps=eps)
    self.ple = cfg.hidden_size_per_layer_input
    if self.ple:
      self.per_layer_input_gate = Linear(d, self.ple, rngs=rngs)
      self.per_layer_projection = Linear(self.ple, d, rngs=rngs)
      self.post_per_layer_input_norm = RMSNorm(d, eps=eps)

  def __call__(
    self,
    x,
    per_layer_input,
    rope,
    attend,
    shared_kv: dict,
    *,
    expert_axes: tuple[str, ...] = (),
    capacity_factor: float | None = None,
  ):
    """x: [B, S, D]; per_layer_input: [B, S, P] or None. Returns (x, (k, v),
    :class:`~cpjax.models.gemma4.experts.ExpertStats` or None); ``expert_axes`` and
    ``capacity_factor`` as :func:`cpjax.models.gemma4.experts.routed_experts`."""
    attn, kv = self.self_attn(self.input_layernorm(x), rope, attend, shared_kv)
    x = x + self.post_attention_layernorm(attn)
    residual = x
    ffw = self.mlp(self.pre_feedforward_layernorm(x))
    stats = None
    if self.moe:
      # Expert parallelism dispatches inside its own shard_map (manual over
      # every axis), where the SPMD partitioner's check gather_safe avoids
      # cannot fail; and rows must stay split there.
      flat = residual.reshape(-1, residual.shape[-1])
      flat = flat if expert_axes else gather_safe(flat)
      weights, idx = self.router(flat)
      b = residual.shape[0]
      experts, stats = self.experts(
        self.pre_feedforward_layernorm_2(flat).reshape(b, -1, flat.shape[-1]),
        weights.reshape(b, -1, weights.shape[-1]),
        idx.reshape(b, -1, idx.shape[-1]),
        expert_axes=expert_axes,
        capacity_factor=capacity_factor,
      )
      ffw = self.post_feedforward_layernorm_1(ffw) + self.post_feedforward_layernorm_2(
        experts.reshape(residual.shape)
      )
    x = residual + self.post_feedforward_layernorm(ffw)
    if self.ple:
      gated = gelu(self.per_layer_input_gate(x)) * per_layer_input
      x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
    return x * self.layer_scalar[...].astype(x.dtype), kv, stats


def embed_scale(width: int, dtype: DTypeLike) -> jax.Array:
  """Return ``sqrt(width)`` rounded to ``dtype`` first (bf16: sqrt(1536) -> 39.25).

  Args:
    width: the embedding width.
    dtype: the activation dtype.

  Returns:
    ``sqrt(width)`` as a ``dtype`` scalar.
  """
  return jnp.asarray(math.sqrt(width), dtype)
