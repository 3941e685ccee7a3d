"""The attention mask as a pure function of global token indices.

For query token q and key token k (global, padded indices)::

    allowed = (k <= q) if causal else True
    if sliding_window W: allowed &= (q - k) < W      (non-causal: |q - k| < W)
    if vision_group_ids vg: allowed |= (vg[q] == vg[k]) & (vg[q] >= 0)
    if segment_ids doc:     allowed &= (doc[q] == doc[k]) & (doc[q] > 0)
    if padding_mask pad:    allowed &= ~pad[k]

Because the mask only sees global indices and per-token ids, any layout
(contiguous, load-balanced) and any ring step uses it unchanged. Besides the
token-level mask this module gives the *block-level* question a ring step asks
before doing any work: "is anything allowed between these two blocks?",
answered conservatively (never "no" when something is allowed) from per-block
index ranges.

Shape letters: ``B`` batch, ``Q`` query tokens, ``K`` key tokens, ``n`` blocks.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["BlockSummary", "MaskSpec", "TokenInfo", "blocks_full", "blocks_nonempty",
           "summarize_blocks", "token_mask"]

_BIG = np.iinfo(np.int32).max


@dataclasses.dataclass(frozen=True)
class MaskSpec:
  """The static part of the mask.

  Attributes:
    causal: keys after the query are masked.
    sliding_window: ``W`` >= 1 (the window includes the query itself), or None.

  >>> MaskSpec(sliding_window=0)
  Traceback (most recent call last):
  ...
  ValueError: sliding_window must be an int >= 1 or None, got 0
  """

  causal: bool = True
  sliding_window: int | None = None

  def __post_init__(self):
    w = self.sliding_window
    if w is not None and (isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 1):
      raise ValueError(f"sliding_window must be an int >= 1 or None, got {w!r}")


class TokenInfo(NamedTuple):
  """What the mask needs to know about a set of tokens.

  Fields:
    positions: int32[T] global token indices.
    segment_ids: int32[B, T] document ids (0 = pad) or None.
    padding_mask: bool[B, T] (True = pad) or None.
    vision_group_ids: int32[B, T] (-1 = text) or None.
  """

  positions: jax.Array
  segment_ids: jax.Array | None = None
  padding_mask: jax.Array | None = None
  vision_group_ids: jax.Array | None = None

  def slice(self, start, size: int) -> "TokenInfo":
    """Tokens ``[start, start + size)`` (``start`` may be traced)."""
    def cut(x, axis):
      return None if x is None else jax.lax.dynamic_slice_in_dim(x, start, size, axis)
    return TokenInfo(cut(self.positions, 0), cut(self.segment_ids, 1),
                     cut(self.padding_mask, 1), cut(self.vision_group_ids, 1))


def token_mask(spec: MaskSpec, q: TokenInfo, k: TokenInfo) -> jax.Array:
  """bool[B or 1, Q, K]: which (query, key) pairs may attend.

  Example:
    >>> import numpy as np
    >>> m = token_mask(MaskSpec(sliding_window=2), TokenInfo(np.arange(3)), TokenInfo(np.arange(3)))
    >>> np.asarray(m[0]).astype(int).tolist()
    [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
  """
  qp = jnp.asarray(q.positions)[:, None]
  kp = jnp.asarray(k.positions)[None, :]
  allowed = (kp <= qp) if spec.causal else jnp.ones(qp.shape[:1] + kp.shape[1:], bool)
  if spec.sliding_window is not None:
    dist = (qp - kp) if spec.causal else jnp.abs(qp - kp)
    allowed &= dist < spec.sliding_window
  allowed = allowed[None]
  if q.vision_group_ids is not None:
    qv = q.vision_group_ids[:, :, None]
    allowed |= (qv == k.vision_group_ids[:, None, :]) & (qv >= 0)
  if q.segment_ids is not None:
    qs = q.segment_ids[:, :, None]
    allowed &= (qs == k.segment_ids[:, None, :]) & (qs > 0)
  if k.padding_mask is not None:
    allowed &= ~k.padding_mask[:, None, :]
  return allowed


class BlockSummary(NamedTuple):
  """Index ranges of each block of ``size`` consecutive local tokens.

  Fields (``n`` blocks): ``pos_lo``/``pos_hi`` int32[n] global position range;
  ``seg_lo``/``seg_hi`` int32[B, n] range of non-zero document ids (empty
  range lo > hi when none) and ``seg_pure`` bool[B, n] whether every token has
  that one non-zero id; ``vg_lo``/``vg_hi`` the range of vision groups >= 0;
  ``real`` / ``pad_free`` bool[B, n] whether any / every token is not padding.
  """

  pos_lo: jax.Array
  pos_hi: jax.Array
  seg_lo: jax.Array | None
  seg_hi: jax.Array | None
  seg_pure: jax.Array | None
  vg_lo: jax.Array | None
  vg_hi: jax.Array | None
  real: jax.Array | None
  pad_free: jax.Array | None


def _range(ids, valid, n: int, size: int):
  b = ids.shape[0]
  ids = ids.reshape(b, n, size)
  valid = valid.reshape(b, n, size)
  lo = jnp.min(jnp.where(valid, ids, _BIG), axis=-1)
  hi = jnp.max(jnp.where(valid, ids, -1), axis=-1)
  return lo, hi


def summarize_blocks(info: TokenInfo, size: int) -> BlockSummary:
  """Per-block ranges of ``info`` cut into blocks of ``size`` tokens.

  >>> import numpy as np
  >>> s = summarize_blocks(TokenInfo(np.arange(4), segment_ids=np.array([[1, 1, 1, 2]])), 2)
  >>> s.pos_lo.tolist(), s.seg_lo.tolist(), s.seg_hi.tolist(), s.seg_pure.tolist()
  ([0, 2], [[1, 1]], [[1, 2]], [[True, False]])
  """
  t = info.positions.shape[0]
  if t % size:
    raise ValueError(f"block size {size} must divide the token count {t}")
  n = t // size
  pos = info.positions.reshape(n, size)
  seg_lo = seg_hi = seg_pure = vg_lo = vg_hi = real = pad_free = None
  if info.segment_ids is not None:
    seg = info.segment_ids
    seg_lo, seg_hi = _range(seg, seg > 0, n, size)
    all_set = jnp.all((seg > 0).reshape(seg.shape[0], n, size), axis=-1)
    seg_pure = all_set & (seg_lo == seg_hi)
  if info.vision_group_ids is not None:
    vg_lo, vg_hi = _range(info.vision_group_ids, info.vision_group_ids >= 0, n, size)
  if info.padding_mask is not None:
    pad = info.padding_mask.reshape(info.padding_mask.shape[0], n, size)
    real = jnp.any(~pad, axis=-1)
    pad_free = ~jnp.any(pad, axis=-1)
  return BlockSummary(pos.min(-1), pos.max(-1), seg_lo, seg_hi, seg_pure, vg_lo, vg_hi,
                      real, pad_free)


def _overlap(a_lo, a_hi, b_lo, b_hi):
  """bool[B, nq, nk]: do the id ranges of query and key blocks intersect?"""
  return (jnp.maximum(a_lo[:, :, None], b_lo[:, None, :])
          <= jnp.minimum(a_hi[:, :, None], b_hi[:, None, :]))


def blocks_nonempty(spec: MaskSpec, q: BlockSummary, k: BlockSummary) -> jax.Array:
  """bool[nq, nk]: may any pair of the two blocks attend (for any batch row)?

  Conservative: a block it calls empty has no allowed pair; a block it calls
  non-empty may still turn out fully masked (e.g. interleaved document ids).

  >>> import numpy as np
  >>> blocks = summarize_blocks(TokenInfo(np.arange(4)), 2)       # causal: upper tile empty
  >>> blocks_nonempty(MaskSpec(), blocks, blocks).tolist()
  [[True, False], [True, True]]
  """
  q_lo, q_hi = q.pos_lo[:, None], q.pos_hi[:, None]
  k_lo, k_hi = k.pos_lo[None, :], k.pos_hi[None, :]
  ok = (k_lo <= q_hi) if spec.causal else jnp.ones((q_lo.shape[0], k_lo.shape[1]), bool)
  if spec.sliding_window is not None:
    ok &= (q_lo - k_hi) < spec.sliding_window
    if not spec.causal:
      ok &= (k_lo - q_hi) < spec.sliding_window
  ok = ok[None]
  if q.vg_lo is not None:
    ok |= _overlap(q.vg_lo, q.vg_hi, k.vg_lo, k.vg_hi)
  if q.seg_lo is not None:
    ok &= _overlap(q.seg_lo, q.seg_hi, k.seg_lo, k.seg_hi)
  if k.real is not None:
    ok &= k.real[:, None, :]
  return jnp.any(ok, axis=0)


def blocks_full(spec: MaskSpec, q: BlockSummary, k: BlockSummary) -> jax.Array:
  """bool[nq, nk]: is every pair of the two blocks allowed (in every batch row)?

  Conservative the other way: "True" guarantees no masking is needed, so the
  tile can skip building its mask. Vision groups only add pairs, so they
  cannot make a full tile partial.

  >>> import numpy as np
  >>> blocks = summarize_blocks(TokenInfo(np.arange(4)), 2)       # diagonal tiles are partial
  >>> blocks_full(MaskSpec(), blocks, blocks).tolist()
  [[False, False], [True, False]]
  """
  q_lo, q_hi = q.pos_lo[:, None], q.pos_hi[:, None]
  k_lo, k_hi = k.pos_lo[None, :], k.pos_hi[None, :]
  full = (k_hi <= q_lo) if spec.causal else jnp.ones((q_lo.shape[0], k_lo.shape[1]), bool)
  if spec.sliding_window is not None:
    full &= (q_hi - k_lo) < spec.sliding_window
    if not spec.causal:
      full &= (k_hi - q_lo) < spec.sliding_window
  full = full[None]
  if q.seg_lo is not None:
    same = (q.seg_lo[:, :, None] == k.seg_lo[:, None, :])
    full &= q.seg_pure[:, :, None] & k.seg_pure[:, None, :] & same
  if k.pad_free is not None:
    full &= k.pad_free[:, None, :]
  return jnp.all(full, axis=0)
