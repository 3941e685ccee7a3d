"""Gemma 4's building blocks, numerically as transformers computes them.

Parameters keep Hugging Face's names and layouts (``Linear.weight`` is
[out, in]), so a module's path in the NNX state IS its checkpoint key.
Buffers (transformers' ``nn.Buffer``: ``layer_scalar``, clip bounds,
``std_bias``/``std_scale``) are :class:`Buffer` variables: loaded and saved
like parameters, never trained.

Shape letters: ``B`` batch, ``S`` tokens, ``H`` heads, ``D`` head width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike, DTypeLike

__all__ = [
  "Buffer",
  "ClippableLinear",
  "LayerNorm",
  "Linear",
  "RMSNorm",
  "apply_rope",
  "gelu",
  "rope_angles",
  "scaled",
]


class Buffer(nnx.Variable):
  """A checkpoint tensor that is not trained (transformers' ``nn.Buffer``)."""


def gelu(x: jax.Array) -> jax.Array:
  """Apply GELU, tanh approximation (``gelu_pytorch_tanh``).

  Args:
    x: the input.

  Returns:
    ``gelu(x)``.
  """
  return jax.nn.gelu(x, approximate=True)


def _init(rngs: nnx.Rngs | None, shape, scale: float, value: float | None = None):
  if value is not None or rngs is None:
    return jnp.full(shape, 1.0 if value is None else value, jnp.float32)
  return jax.random.normal(rngs.params(), shape, jnp.float32) * scale


class Linear(nnx.Module):
  """``y = x @ W.T`` with ``W`` [out, in], computed in ``x``'s dtype; bias-free
  unless ``bias`` (the unified model's image embedder)."""

  def __init__(self, d_in: int, d_out: int, *, bias: bool = False, rngs: nnx.Rngs | None):
    self.weight = nnx.Param(_init(rngs, (d_out, d_in), d_in**-0.5))
    if bias:
      self.bias = nnx.Param(jnp.zeros((d_out,), jnp.float32))

  def __call__(self, x):
    weight = self.weight[...]
    if isinstance(weight, jax.Array):  # (a quantized base's weight is qwix's to compute with)
      weight = weight.astype(x.dtype)
    y = jnp.einsum("...i,oi->...o", x, weight)
    if hasattr(self, "bias"):
      y = y + self.bias[...].astype(y.dtype)
    return y


class ClippableLinear(nnx.Module):
  """The vision and audio towers' linear: with ``clipped``, the input and output
  are clamped to bounds stored in the checkpoint (``input_min`` ... as buffers)."""

  def __init__(self, d_in: int, d_out: int, *, clipped: bool, rngs: nnx.Rngs | None):
    self.linear = Linear(d_in, d_out, rngs=rngs)
    self.clipped = clipped
    if clipped:
      self.input_min = Buffer(jnp.asarray(-jnp.inf, jnp.float32))
      self.input_max = Buffer(jnp.asarray(jnp.inf, jnp.float32))
      self.output_min = Buffer(jnp.asarray(-jnp.inf, jnp.float32))
      self.output_max = Buffer(jnp.asarray(jnp.inf, jnp.float32))

  def __call__(self, x):
    if self.clipped:
      x = jnp.clip(x, self.input_min[...].astype(x.dtype), self.input_max[...].astype(x.dtype))
    y = self.linear(x)
    if self.clipped:
      y = jnp.clip(y, self.output_min[...].astype(y.dtype), self.output_max[...].astype(y.dtype))
    return y


def scaled(x: jax.Array, c: float) -> jax.Array:
  """Return ``x * c`` as torch multiplies a tensor by a Python number: in
  float32 with ``c`` unrounded, the product rounded once to ``x``'s dtype.

  Rounding ``c`` to bfloat16 first moves 1/sqrt(2816) (26B-A4B's router) by
  0.24% and 2**-0.5 by 0.01%: bfloat16 results then differ from
  transformers' in up to half of their last bits.

  Args:
    x: the input, any float dtype.
    c: the Python number.

  Returns:
    ``x * c`` in ``x``'s dtype.

  Example:
    >>> x = jnp.asarray([3.0, 5.0], jnp.bfloat16)
    >>> scaled(x, 2816**-0.5).tolist()                         # torch's x * 2816**-0.5
    [0.056640625, 0.09423828125]
    >>> (x * jnp.asarray(2816**-0.5, jnp.bfloat16)).tolist()   # c rounded first
    [0.056396484375, 0.09375]
  """
  return (x.astype(jnp.float32) * jnp.float32(c)).astype(x.dtype)


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
  """Compute ``x * (mean(x^2) + eps)^-0.5`` in float32 (transformers uses a pow, not rsqrt).

  Args:
    x: the input; the mean is over its last dimension.
    eps: added to the mean.

  Returns:
    The normalised ``x``, in float32.
  """
  xf = x.astype(jnp.float32)
  return xf * jnp.power(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps, -0.5)


class RMSNorm(nnx.Module):
  """Gemma 4's RMSNorm: ``RMS(x) * w`` (plain ``w``, not Gemma 1-3's ``1 + w``)
  in float32, cast back to ``x``'s dtype. ``with_scale=False`` has no weight."""

  def __init__(
    self, dim: int, *, eps: float, with_scale: bool = True, rngs: nnx.Rngs | None = None
  ):
    self.eps = eps
    self.with_scale = with_scale
    if with_scale:
      self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))

  def __call__(self, x):
    y = rms_normalize(x, self.eps)
    if self.with_scale:
      y = y * self.weight[...].astype(jnp.float32)
    return y.astype(x.dtype)


class LayerNorm(nnx.Module):
  """torch's ``nn.LayerNorm`` (weight and, unless ``bias=False``, bias; biased
  variance) in float32, cast back to ``x``'s dtype."""

  def __init__(self, dim: int, *, eps: float, bias: bool = True):
    self.eps = eps
    self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))
    if bias:
      self.bias = nnx.Param(jnp.zeros((dim,), jnp.float32))

  def __call__(self, x):
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    centred = xf - mean
    var = jnp.mean(centred * centred, axis=-1, keepdims=True)
    y = centred * jax.lax.rsqrt(var + self.eps)
    y = y * self.weight[...].astype(jnp.float32)
    if hasattr(self, "bias"):
      y = y + self.bias[...].astype(jnp.float32)
    return y.astype(x.dtype)


def rope_angles(
  positions: jax.Array, inv_freq: ArrayLike, dtype: DTypeLike
) -> tuple[jax.Array, jax.Array]:
  """Compute (cos, sin) [..., 2F] of ``positions [...] * inv_freq [F]``.

  Computed in float32, duplicated ``[f, f]`` and then cast to the
  activation dtype, as transformers does.

  Args:
    positions: the positions [...].
    inv_freq: the inverse frequencies [F].
    dtype: the activation dtype.

  Returns:
    (cos, sin) [..., 2F] in ``dtype``.
  """
  freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def _rotate_half(x):
  half = x.shape[-1] // 2
  return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Apply half-split RoPE: ``x * cos + rotate_half(x) * sin``.

  Args:
    x: [B, S, H, D].
    cos, sin: [B, S, D] (broadcast over heads).

  Returns:
    [B, S, H, D], the rotated ``x``.
  """
  return x * cos[..., None, :] + _rotate_half(x) * sin[..., None, :]
