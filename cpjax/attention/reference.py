"""Dense float32 attention: the oracle every fast path is tested against.

Deliberately plain: the full [B, H, S, S] mask and score matrix are built
from the formula in :mod:`cpjax.masks`' docstring, written out again here so
a bug in the mask rules cannot hide in the reference when it is called with
the mask keywords. Given an :class:`cpjax.AttentionMask` instead, it uses that
mask's token predicate (the only definition a custom rule has). Use it for
sequences up to a few thousand tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from cpjax import _deprecations, checks
from cpjax.masks import AttentionMask, resolve_mask

__all__ = ["reference_attention"]


@_deprecations.renamed_keywords("cpjax.reference_attention", segment_ids="document_ids")
def reference_attention(
  q: jax.Array | np.ndarray,
  k: jax.Array | np.ndarray,
  v: jax.Array | np.ndarray,
  *,
  mask: AttentionMask | None = None,
  causal: bool | None = None,
  sliding_window: int | None = None,
  document_ids: ArrayLike | None = None,
  padding_mask: ArrayLike | None = None,
  vision_group_ids: ArrayLike | None = None,
  scale: float | None = None,
  logits_soft_cap: float | None = None,
) -> jax.Array:
  """Compute masked softmax attention over full, unsharded sequences, in float32.

  Args:
    q: [B, S, Hq, D]; k, v: [B, S, Hkv, D] with Hq a multiple of Hkv (query
      head h reads KV head ``h // (Hq // Hkv)``).
    mask: a :class:`cpjax.AttentionMask` with [B, S] arrays in natural
      order; or, instead of it, the keywords below.
    causal, sliding_window, document_ids, padding_mask, vision_group_ids: the
      standard mask (see :mod:`cpjax.masks`): causal by default, arrays
      [B, S] (``padding_mask``: True = pad).
    scale: logit scale, default ``1 / sqrt(D)``.
    logits_soft_cap: ``c`` for ``c * tanh(logits / c)``.

  Returns:
    [B, S, Hq, D] in q's dtype; rows with nothing allowed are 0.

  Example:
    >>> import numpy as np
    >>> q = k = np.zeros((1, 2, 1, 1), np.float32)
    >>> v = np.array([1.0, 3.0], np.float32).reshape(1, 2, 1, 1)
    >>> reference_attention(q, k, v).ravel().tolist()   # token 1 averages both
    [1.0, 2.0]
  """
  # The same checks as ring_attention: inputs, options, then the mask (its
  # arrays' shapes, dtypes and the window), before any compute.
  b, s, hq, hkv, d = checks.attention_inputs(q, k, v, length="S")
  scale, logits_soft_cap = checks.attention_options(scale=scale, logits_soft_cap=logits_soft_cap)
  checked = resolve_mask(
    mask,
    causal=causal,
    sliding_window=sliding_window,
    document_ids=document_ids,
    padding_mask=padding_mask,
    vision_group_ids=vision_group_ids,
  ).validate(b, s, where="[B, S] (q's first two dimensions)")
  qf, kf, vf = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
  kf = jnp.repeat(kf, hq // hkv, axis=2)
  vf = jnp.repeat(vf, hq // hkv, axis=2)
  scale = d**-0.5 if scale is None else scale
  logits = jnp.einsum("bqhd,bkhd->bhqk", qf, kf, precision=jax.lax.Precision.HIGHEST) * scale
  if logits_soft_cap is not None:
    logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)

  if mask is not None:
    allowed = jnp.broadcast_to(checked.allowed(jnp.arange(s)), (b, s, s))
  else:
    # The keywords' mask written out again from its formula, not through the
    # rule objects, so that a bug in a rule cannot hide in the oracle.
    allowed = _standard_mask(
      b,
      s,
      causal=True if causal is None else causal,
      sliding_window=sliding_window,
      document_ids=document_ids,
      padding_mask=padding_mask,
      vision_group_ids=vision_group_ids,
    )
  allowed = allowed[:, None]

  # A finite fill keeps fully masked rows (and their gradients) free of NaN;
  # such rows are zeroed explicitly below.
  logits = jnp.where(allowed, logits, -1e30)
  weights = jax.nn.softmax(logits, axis=-1)
  weights = jnp.where(allowed, weights, 0.0)
  out = jnp.einsum("bhqk,bkhd->bqhd", weights, vf, precision=jax.lax.Precision.HIGHEST)
  return out.astype(q.dtype)


def _standard_mask(b, s, *, causal, sliding_window, document_ids, padding_mask, vision_group_ids):
  """bool[B, S, S], the standard mask written out from its formula."""
  i = jnp.arange(s)[:, None]
  j = jnp.arange(s)[None, :]
  allowed = jnp.broadcast_to(j <= i if causal else True, (b, s, s))
  if sliding_window is not None:
    near = (i - j < sliding_window) if causal else (jnp.abs(i - j) < sliding_window)
    allowed = allowed & near
  if vision_group_ids is not None:
    vg = jnp.asarray(vision_group_ids)
    allowed = allowed | ((vg[:, :, None] == vg[:, None, :]) & (vg[:, :, None] >= 0))
  if document_ids is not None:
    doc = jnp.asarray(document_ids)
    allowed = allowed & (doc[:, :, None] == doc[:, None, :]) & (doc[:, :, None] > 0)
  if padding_mask is not None:
    allowed = allowed & ~jnp.asarray(padding_mask, bool)[:, None, :]
  return allowed
