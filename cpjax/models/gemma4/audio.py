"""E2B and E4B's audio tower (transformers' ``Gemma4AudioModel``), a conformer.

Clips arrive as the feature extractor makes them: ``input_features`` [A, T,
F] log-mel frames (``F`` = 128 bins, 10 ms apart) and ``input_features_mask``
bool[A, T] (False on the padding after a shorter clip). The tower runs on
whole clips (before any sequence sharding):

1. two 3x3 stride-2 convolutions (each with a LayerNorm over channels and a
   ReLU) take 4 frames to one soft token (40 ms) and the mel bins to
   ``F / 4``; a projection makes them the width ``H``;
2. conformer layers, each ``FF/2 -> chunked attention -> light conv -> FF/2``:
   the attention splits time into blocks of ``attention_chunk_size``
   queries, each reading a window of keys back to ``attention_context_left
   - 1`` frames before it, with a Transformer-XL relative position bias and
   a tanh soft cap; the light convolution is causal and depthwise;
3. ``output_proj`` to ``output_proj_dims``; ``embed_audio`` (RMS0 and a
   projection) takes the soft tokens into the text width.

Padding frames are zeroed before each subsampling convolution and masked as
keys (the light convolution is causal: they come after the frames that are
read); what the tower computes at them is never placed. The computation follows
transformers' blocked formulation step for step (including the logit a
masked key gets), so that its float64 answer is the reference.

Every operation is local in time, so a long clip can be split over the
ranks of a mesh axis (:class:`Split`, inside ``shard_map``): each rank holds
a contiguous run of frames and takes from its neighbours, by
``lax.ppermute``, the few frames its operations read across the boundary
(one feature frame before each convolution, ``attention_context_left - 1``
frames before and ``attention_context_right`` after each attention, the light
convolution's ``conv_kernel_size - 1`` before). The split result is the
whole clip's, exactly.

Shape letters: ``A`` clips, ``T`` feature frames, ``F`` mel bins, ``U``
soft-token frames (``T / 4``), ``H`` width, ``N`` heads, ``D`` head dim,
``K`` blocks, ``C`` chunk, ``W`` context window.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import ArrayLike, DTypeLike

from cpjax.models.gemma4.audio_config import Gemma4AudioConfig
from cpjax.models.gemma4.layers import ClippableLinear, LayerNorm, Linear, RMSNorm

__all__ = ["AudioTower", "Split"]

# transformers builds these RMS norms without passing the config's epsilon.
_DEFAULT_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class Split:
  """A clip's frames split in order over the ``size`` ranks of ``axis_name``
  (inside ``shard_map``): each rank holds a run of frames, a multiple of
  :meth:`quantum` long, and :meth:`before` / :meth:`after` bring it the
  frames its neighbours hold next to it.

  Example:
    >>> from cpjax.models.gemma4.audio_config import Gemma4AudioConfig
    >>> cfg = Gemma4AudioConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
    ...                         subsampling_conv_channels=(8, 4), output_proj_dims=12)
    >>> tower = AudioTower(cfg, rngs=nnx.Rngs(0))
    >>> graphdef, state = nnx.split(tower)
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("cp",))
    >>> run = lambda f: nnx.merge(graphdef, state)(
    ...   f, f[..., 0] < 9, jnp.float32, split=Split("cp", 2))[0]
    >>> feats = np.random.default_rng(0).normal(size=(1, 2 * Split.quantum(cfg), 8))
    >>> split = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=jax.P(None, "cp"),
    ...                       out_specs=jax.P(None, "cp"), check_vma=False))(feats)
    >>> whole = jax.jit(lambda f: nnx.merge(graphdef, state)(
    ...   f, f[..., 0] < 9, jnp.float32)[0])(feats)
    >>> bool(np.allclose(split, whole, atol=1e-5))
    True
  """

  axis_name: str
  size: int

  def __post_init__(self):
    if self.size < 2:
      raise ValueError(f"a Split needs 2 or more ranks, got size={self.size}")

  @staticmethod
  def quantum(cfg: Gemma4AudioConfig) -> int:
    """Return the feature frames a rank's run must be a multiple of: whole
    attention blocks after the 4x subsampling, enough of them to hold every
    halo a neighbour asks of it (the attention's frames back and ahead, the
    light convolution's)."""
    c = cfg.attention_chunk_size
    halo = max(
      cfg.attention_context_left - 1, cfg.attention_context_right, cfg.conv_kernel_size - 1
    )
    return 4 * c * max(1, -(-halo // c))

  def before(self, x: jax.Array, n: int) -> jax.Array:
    """Return the ``n`` frames (axis 1) before this rank's: the previous
    rank's last, zeros on the first rank (the clip's edge)."""
    pairs = [(i, i + 1) for i in range(self.size - 1)]
    return jax.lax.ppermute(x[:, x.shape[1] - n :], self.axis_name, pairs)

  def after(self, x: jax.Array, n: int) -> jax.Array:
    """Return the ``n`` frames after this rank's: the next rank's first, zeros on the last."""
    pairs = [(i + 1, i) for i in range(self.size - 1)]
    return jax.lax.ppermute(x[:, :n], self.axis_name, pairs)


def _with_halo(x: jax.Array, before: int, after: int, split: Split | None) -> jax.Array:
  """``x`` [A, T, ...] with ``before`` frames in front and ``after`` behind:
  the neighbours' under a :class:`Split`, zeros at the clip's edges."""
  parts = []
  if before:
    edge = jnp.zeros((x.shape[0], before, *x.shape[2:]), x.dtype)
    parts.append(edge if split is None else split.before(x, before))
  parts.append(x)
  if after:
    edge = jnp.zeros((x.shape[0], after, *x.shape[2:]), x.dtype)
    parts.append(edge if split is None else split.after(x, after))
  return jnp.concatenate(parts, axis=1) if len(parts) > 1 else x


def _clamp(x: jax.Array, bound: float) -> jax.Array:
  """transformers' gradient-clipping clamp, its bound capped at the dtype's range."""
  bound = min(bound, float(jnp.finfo(x.dtype).max))
  return jnp.clip(x, -bound, bound)


class ConvWeight(nnx.Module):
  """A bias-free torch convolution's ``weight`` ([out, in / groups, *taps]),
  applied by its owner."""

  def __init__(self, shape: tuple[int, ...], *, rngs: nnx.Rngs | None):
    fan_in = math.prod(shape[1:])
    value = (
      jnp.zeros(shape, jnp.float32)
      if rngs is None
      else jax.random.normal(rngs.params(), shape, jnp.float32) * fan_in**-0.5
    )
    self.weight = nnx.Param(value)


class SubSampleLayer(nnx.Module):
  """A 3x3 stride-2 convolution over (time, mel), LayerNorm over channels, ReLU."""

  def __init__(self, c_in: int, c_out: int, *, eps: float, rngs: nnx.Rngs | None):
    self.conv = ConvWeight((c_out, c_in, 3, 3), rngs=rngs)  # torch's [O, I, kh, kw]
    self.norm = LayerNorm(c_out, eps=eps, bias=False)

  def __call__(
    self, x: jax.Array, real: jax.Array, split: Split | None
  ) -> tuple[jax.Array, jax.Array]:
    """x: [A, T, F, C] (channels last), real: bool[A, T] -> halved in T and F."""
    x = jnp.where(real[:, :, None, None], x, 0)
    kernel = self.conv.weight[...].astype(x.dtype).transpose(2, 3, 1, 0)  # HWIO
    # Output frame i reads frames 2i - 1 ... 2i + 1: one before (a zero at the
    # clip's start); with an even run the frame after is never read.
    x = _with_halo(x, 1, 0, split)
    x = jax.lax.conv_general_dilated(
      x, kernel, (2, 2), ((0, 1), (1, 1)), dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    return jax.nn.relu(self.norm(x)), real[:, ::2]


class SubSampleConvProjection(nnx.Module):
  """Two :class:`SubSampleLayer` and a projection: 4 feature frames to one
  frame of width ``H``."""

  def __init__(self, cfg: Gemma4AudioConfig, *, rngs: nnx.Rngs | None):
    c0, c1 = cfg.subsampling_conv_channels
    self.layer0 = SubSampleLayer(1, c0, eps=cfg.rms_norm_eps, rngs=rngs)
    self.layer1 = SubSampleLayer(c0, c1, eps=cfg.rms_norm_eps, rngs=rngs)
    self.input_proj_linear = Linear((c0 // 4) * c1, cfg.hidden_size, rngs=rngs)

  def __call__(
    self, features: jax.Array, real: jax.Array, split: Split | None
  ) -> tuple[jax.Array, jax.Array]:
    """[A, T, F], bool[A, T] -> [A, U, H], bool[A, U]."""
    x, real = self.layer0(features[..., None], real, split)
    x, real = self.layer1(x, real, split)
    a, u = x.shape[:2]
    return self.input_proj_linear(x.reshape(a, u, -1)), real


class FeedForward(nnx.Module):
  """Half a conformer feed-forward: clamp, RMS, ``H -> 4H``, SiLU, ``4H -> H``,
  clamp, RMS, times ``residual_weight``, plus the residual."""

  def __init__(self, cfg: Gemma4AudioConfig, *, rngs: nnx.Rngs | None):
    h, clip = cfg.hidden_size, cfg.use_clipped_linears
    self.ffw_layer_1 = ClippableLinear(h, 4 * h, clipped=clip, rngs=rngs)
    self.ffw_layer_2 = ClippableLinear(4 * h, h, clipped=clip, rngs=rngs)
    self.pre_layer_norm = RMSNorm(h, eps=_DEFAULT_EPS)
    self.post_layer_norm = RMSNorm(h, eps=_DEFAULT_EPS)
    self.clip, self.scale = cfg.gradient_clipping, cfg.residual_weight

  def __call__(self, x):
    y = self.pre_layer_norm(_clamp(x, self.clip))
    y = self.ffw_layer_2(jax.nn.silu(self.ffw_layer_1(y)))
    y = self.post_layer_norm(_clamp(y, self.clip))
    return x + y * jnp.asarray(self.scale, y.dtype)


class LightConv1d(nnx.Module):
  """RMS, ``H -> 2H`` with a GLU, a causal depthwise convolution, clamp, RMS,
  SiLU, ``H -> H``, plus the residual."""

  def __init__(self, cfg: Gemma4AudioConfig, *, rngs: nnx.Rngs | None):
    h, clip, eps = cfg.hidden_size, cfg.use_clipped_linears, cfg.rms_norm_eps
    self.linear_start = ClippableLinear(h, 2 * h, clipped=clip, rngs=rngs)
    self.linear_end = ClippableLinear(h, h, clipped=clip, rngs=rngs)
    self.depthwise_conv1d = ConvWeight((h, 1, cfg.conv_kernel_size), rngs=rngs)
    self.pre_layer_norm = RMSNorm(h, eps=eps)
    self.conv_norm = RMSNorm(h, eps=eps)
    self.clip = cfg.gradient_clipping

  def __call__(self, x, split: Split | None):
    """x: [A, U, H]."""
    y = self.linear_start(self.pre_layer_norm(x))
    half = y.shape[-1] // 2
    y = y[..., :half] * jax.nn.sigmoid(y[..., half:])
    taps = self.depthwise_conv1d.weight[...][:, 0, :].astype(y.dtype)  # [H, k]
    k = taps.shape[-1]
    padded = _with_halo(y, k - 1, 0, split)  # causal: k - 1 frames before
    u = y.shape[1]
    y = padded[:, :u] * taps[:, 0]
    for i in range(1, k):
      y = y + padded[:, i : i + u] * taps[:, i]
    y = jax.nn.silu(self.conv_norm(_clamp(y, self.clip)))
    return x + self.linear_end(y)


def relative_positions(cfg: Gemma4AudioConfig, dtype: DTypeLike) -> jax.Array:
  """Compute the sinusoids of relative distances ``W/2 ... 0``: [W/2 + 1, H], sines, cosines."""
  half = cfg.hidden_size // 2
  step = math.log(10000.0) / max(half - 1, 1)
  inv = np.exp(np.arange(half, dtype=np.float32) * -step)
  scaled = np.arange(cfg.context_size // 2, -1, -1, dtype=np.float32)[:, None] * inv[None]
  return jnp.asarray(np.concatenate([np.sin(scaled), np.cos(scaled)], axis=-1), dtype)


def _windows(t: jax.Array, cfg: Gemma4AudioConfig, split: Split | None) -> jax.Array:
  """Each block's window of keys: [A, U, ...] -> [A, K, W, ...], frames ``kC - P
  ... kC - P + W - 1`` (``P = attention_context_left - 1``): the neighbours'
  across a split, zeros beyond the clip and in the last block's padding."""
  c, w = cfg.attention_chunk_size, cfg.context_size
  past = cfg.attention_context_left - 1
  u = t.shape[1]
  blocks = -(-u // c)
  # The last block's window ends attention_context_right frames past it.
  t = _with_halo(t, past, blocks * c + cfg.attention_context_right - u, split)
  return t[:, np.arange(blocks)[:, None] * c + np.arange(w)[None, :]]


def _blocked_mask(cfg: Gemma4AudioConfig, real: jax.Array, split: Split | None) -> jax.Array:
  """bool[A, K, C, W]: query ``c`` of block ``k`` may read window key ``w``.

  Query frame ``q = k C + c`` reads key frame ``q - d`` (``d = c + P - w``)
  when that frame is a real one of the clip and ``0 <= d < P`` or ``0 < -d <
  attention_context_right`` (the sliding window transformers ANDs with the
  clip's padding mask)."""
  c, w = cfg.attention_chunk_size, cfg.context_size
  past = cfg.attention_context_left - 1
  d = np.arange(c)[:, None] + past - np.arange(w)[None, :]  # [C, W]
  window = ((d >= 0) & (d < past)) | ((d < 0) & (-d < cfg.attention_context_right))
  real_key = _windows(real, cfg, split)  # [A, K, W]
  return real_key[:, :, None, :] & window[None, None]


class AudioAttention(nnx.Module):
  """Chunked local self-attention with a relative position bias and a soft cap."""

  def __init__(self, cfg: Gemma4AudioConfig, *, rngs: nnx.Rngs | None):
    h, clip = cfg.hidden_size, cfg.use_clipped_linears
    self.q_proj = ClippableLinear(h, h, clipped=clip, rngs=rngs)
    self.k_proj = ClippableLinear(h, h, clipped=clip, rngs=rngs)
    self.v_proj = ClippableLinear(h, h, clipped=clip, rngs=rngs)
    self.post = ClippableLinear(h, h, clipped=clip, rngs=rngs)
    self.relative_k_proj = Linear(h, h, rngs=rngs)
    self.per_dim_scale = nnx.Param(jnp.zeros((cfg.head_dim,), jnp.float32))
    self.cfg = cfg

  def __call__(
    self, x: jax.Array, positions: jax.Array, allowed: jax.Array, split: Split | None
  ) -> jax.Array:
    """x: [A, U, H]; positions: [W/2 + 1, H]; allowed: bool[A, K, C, W]."""
    cfg = self.cfg
    a, u, _ = x.shape
    n, d, c, w = cfg.num_attention_heads, cfg.head_dim, cfg.attention_chunk_size, cfg.context_size
    blocks = allowed.shape[1]
    f32 = jnp.float32

    def heads(proj):
      return proj(x).astype(f32).reshape(a, u, n, d)

    scale = jax.nn.softplus(self.per_dim_scale[...].astype(f32)) * (d**-0.5 / math.log(2))
    q = heads(self.q_proj) * scale
    k = heads(self.k_proj) * (math.log(1 + math.e) / math.log(2))
    v = heads(self.v_proj)
    q = jnp.pad(q, ((0, 0), (0, blocks * c - u), (0, 0), (0, 0))).reshape(a, blocks, c, n, d)
    k, v = _windows(k, cfg, split), _windows(v, cfg, split)  # [A, K, W, N, D]
    content = jnp.einsum("akcnd,akwnd->ankcw", q, k)
    rel = self.relative_k_proj(positions).astype(f32).reshape(-1, n, d)  # [L, N, D]
    bias = jnp.einsum("akcnd,lnd->ankcl", q, rel)
    # Transformer-XL's shift: pad to W + 1 columns, read the rows W apart.
    bias = jnp.pad(bias, ((0, 0),) * 4 + ((0, w + 1 - rel.shape[0]),))
    bias = bias.reshape(a, n, blocks, c * (w + 1))[..., : c * w].reshape(a, n, blocks, c, w)
    cap = cfg.attention_logit_cap
    logits = jnp.tanh((content + bias) / cap) * cap
    logits = jnp.where(allowed[:, None], logits, cfg.attention_invalid_logits_value)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("ankcw,akwnd->akcnd", probs, v).reshape(a, blocks * c, n * d)[:, :u]
    return self.post(out.astype(x.dtype))


class AudioLayer(nnx.Module):
  """A conformer layer: ``FF/2 -> attention -> light conv -> FF/2``, norms and
  clamps around each as transformers places them."""

  def __init__(self, cfg: Gemma4AudioConfig, *, rngs: nnx.Rngs | None):
    h = cfg.hidden_size
    self.feed_forward1 = FeedForward(cfg, rngs=rngs)
    self.feed_forward2 = FeedForward(cfg, rngs=rngs)
    self.self_attn = AudioAttention(cfg, rngs=rngs)
    self.lconv1d = LightConv1d(cfg, rngs=rngs)
    self.norm_pre_attn = RMSNorm(h, eps=_DEFAULT_EPS)
    self.norm_post_attn = RMSNorm(h, eps=_DEFAULT_EPS)
    self.norm_out = RMSNorm(h, eps=_DEFAULT_EPS)
    self.clip = cfg.gradient_clipping

  def __call__(self, x, positions, allowed, split: Split | None):
    x = self.feed_forward1(x)
    y = self.self_attn(self.norm_pre_attn(_clamp(x, self.clip)), positions, allowed, split)
    x = x + self.norm_post_attn(_clamp(y, self.clip))
    x = self.feed_forward2(self.lconv1d(x, split))
    return self.norm_out(_clamp(x, self.clip))


class AudioTower(nnx.Module):
  """``model.audio_tower``: (features [A, T, F], bool[A, T]) -> ([A, U,
  output_proj_dims], bool[A, U] the soft tokens of real frames).

  Example:
    >>> from cpjax.models.gemma4.audio_config import Gemma4AudioConfig
    >>> cfg = Gemma4AudioConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
    ...                         subsampling_conv_channels=(8, 4), output_proj_dims=12)
    >>> tower = AudioTower(cfg, rngs=nnx.Rngs(0))
    >>> out, real = tower(np.ones((1, 10, 8)), np.arange(10)[None] < 7, jnp.float32)
    >>> out.shape, real.tolist()
    ((1, 3, 12), [[True, True, False]])
  """

  def __init__(self, cfg: Gemma4AudioConfig, *, rngs: nnx.Rngs | None):
    self.cfg = cfg
    self.subsample_conv_projection = SubSampleConvProjection(cfg, rngs=rngs)
    self.layers = nnx.List([AudioLayer(cfg, rngs=rngs) for _ in range(cfg.num_hidden_layers)])
    self.output_proj = Linear(cfg.hidden_size, cfg.output_proj_dims, bias=True, rngs=rngs)

  def __call__(
    self,
    input_features: ArrayLike,
    input_features_mask: ArrayLike,
    dtype: DTypeLike,
    *,
    split: Split | None = None,
  ) -> tuple[jax.Array, jax.Array]:
    """With ``split``, the arguments are this rank's run of frames (a multiple
    of :meth:`Split.quantum` long) and so are the results."""
    features = jnp.asarray(input_features).astype(dtype)
    real = jnp.asarray(input_features_mask, bool)
    if features.ndim != 3 or features.shape[2] != self.cfg.mel_bins:
      raise ValueError(
        f"input_features must be [A, T, {self.cfg.mel_bins}] log-mel frames, got shape "
        f"{features.shape}"
      )
    if real.shape != features.shape[:2]:
      raise ValueError(
        f"input_features_mask must have shape {features.shape[:2]} (that of input_features "
        f"[A, T]), got {real.shape}"
      )
    if split is not None and features.shape[1] % Split.quantum(self.cfg):
      raise ValueError(
        f"a split clip's run of frames must be a multiple of {Split.quantum(self.cfg)} "
        f"(whole attention blocks holding every halo), got {features.shape[1]}"
      )
    x, real = self.subsample_conv_projection(features, real, split)
    positions = relative_positions(self.cfg, dtype)
    allowed = _blocked_mask(self.cfg, real, split)
    for layer in self.layers:
      x = layer(x, positions, allowed, split)
    return self.output_proj(x), real
