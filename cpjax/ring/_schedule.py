"""The ring's static schedule: which hops a mask's reach needs, and the tile sizes.

Everything here is decided before tracing, from the layout and the mask:

* :func:`ring_plan`: the hops that can reach allowed keys (the whole ring in
  one direction by default; with a bounded reach, only the hops that can
  reach it, in one direction for a causal contiguous layout and in both
  directions otherwise).
* :func:`default_block_size` and ``_block_sizes``: the ``block_q x
  block_kv`` tiles of one hop, checked against a Pallas target's tiling rules.

The passes that run the schedule are :mod:`cpjax.ring._passes`; the public
entry point is :func:`cpjax.ring_attention`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from cpjax.layout import ShardLayout
from cpjax.masks import AttentionMask, MaskRule, MaskSpec, Reach
from cpjax.ring.kernels._targets import TARGETS

__all__ = ["DEFAULT_BLOCK", "RingPlan", "default_block_size", "ring_plan"]

DEFAULT_BLOCK = 128


class RingPlan(NamedTuple):
  """Static hop counts: K/V received from ``r - 1 .. r - forward_hops`` and
  from ``r + 1 .. r + backward_hops`` (modulo cp), besides the own chunk."""

  forward_hops: int
  backward_hops: int

  @property
  def num_chunks(self) -> int:
    """K/V chunks each rank attends to (own chunk included)."""
    return 1 + self.forward_hops + self.backward_hops


def ring_plan(
  layout: ShardLayout,
  *,
  causal: bool = True,
  sliding_window: int | None = None,
  has_vision_groups: bool = False,
  mask: AttentionMask | MaskRule | None = None,
) -> RingPlan:
  """Which ring hops can reach allowed keys.

  The mask's :class:`cpjax.masks.Reach` bounds how far (in tokens) an allowed
  key sits behind or ahead of its query; ``t`` tokens reach at most
  ``ceil(t / C)`` chunks of ``C = layout.chunk_len`` tokens. A window of
  ``W`` tokens reaches ``W - 1`` tokens back (and forward when not causal);
  vision groups are unbounded, so they need the whole ring. Pass ``mask``
  (an :class:`cpjax.AttentionMask` or a rule) or the keywords.

  Example:
    >>> lay = ShardLayout(8192, 8192, 8, "contiguous")
    >>> ring_plan(lay), ring_plan(lay, sliding_window=512)
    (RingPlan(forward_hops=7, backward_hops=0), RingPlan(forward_hops=1, backward_hops=0))
    >>> ring_plan(ShardLayout(8192, 8192, 8, "load_balanced"), sliding_window=512)
    RingPlan(forward_hops=1, backward_hops=1)
  """
  if not isinstance(layout, ShardLayout):
    raise TypeError(f"layout must be a ShardLayout, got {type(layout).__name__}")
  if mask is None:
    reach = MaskSpec(causal=causal, sliding_window=sliding_window).rule().reach()
    if not isinstance(has_vision_groups, (bool, np.bool_)):
      raise TypeError(f"has_vision_groups must be a bool, got {type(has_vision_groups).__name__}")
    if has_vision_groups:
      reach = Reach(None, None)
  elif isinstance(mask, (AttentionMask, MaskRule)):
    reach = mask.reach() if isinstance(mask, MaskRule) else mask.rule.reach()
  else:
    raise TypeError(f"mask must be an AttentionMask or a MaskRule, got {type(mask).__name__}")
  cp = layout.cp_size
  full = RingPlan(cp - 1, 0)
  if cp == 1:
    return full
  hops = lambda t: cp if t is None else -(-t // layout.chunk_len)  # noqa: E731
  behind, ahead = hops(reach.behind), hops(reach.ahead)
  if ahead == 0 and layout.kind == "contiguous":
    # Keys only behind, and every earlier token sits on an earlier rank.
    return RingPlan(behind, 0) if behind < cp - 1 else full
  # Both directions: cheaper than the full ring only while 2 * reach < cp - 1.
  hop = max(behind, ahead)
  return RingPlan(hop, hop) if 2 * hop < cp - 1 else full


def default_block_size(chunk_len: int, target: int = DEFAULT_BLOCK) -> int:
  """Largest divisor of ``chunk_len`` not above ``target``.

  Tiles never straddle a chunk, so every tile is a run of consecutive global
  positions and the block-skip test is exact for causal and window masks.
  A chunk length with no divisor near the target (a large prime) is used
  whole; choose ``pad_multiple`` in :func:`cpjax.shard_batch` to avoid that.

  >>> default_block_size(1024), default_block_size(96), default_block_size(1031)
  (128, 96, 1031)
  """
  if chunk_len <= target:
    return chunk_len
  best = max(d for d in range(1, target + 1) if chunk_len % d == 0)
  return best if best * 8 >= target else chunk_len


def _divisors(n: int, top: int):
  return [x for x in range(min(n, top), 0, -1) if n % x == 0]


def _block_sizes(
  layout: ShardLayout,
  implementation: str,
  head_dim: int,
  groups: int,
  block_q,
  block_kv,
  dtype=None,
  key_len: int | None = None,
) -> tuple[int, int]:
  """(block_q, block_kv) for this call: checked if given, else the default.

  ``key_len``: the keys a kernel call sees, when not a rank's own
  ``local_seq_len`` (the all-gather's whole row: a key block as long as one
  rank's row is then not the whole array, which Mosaic requires).

  Tiles never straddle a chunk, so both divide ``layout.chunk_len``; a
  Pallas target adds its tiling rules and takes its defaults from its tile
  record. Nothing falls back silently: a shape the target cannot tile is a
  ValueError that says what would work.
  """
  chunk = layout.chunk_len
  for name, blk in (("block_q", block_q), ("block_kv", block_kv)):
    if blk is not None and (
      isinstance(blk, bool) or not isinstance(blk, int) or blk < 1 or chunk % blk
    ):
      raise ValueError(
        f"{name} must be a positive divisor of layout.chunk_len ({chunk}), got {blk!r}"
      )
  if implementation == "xla":
    return (
      default_block_size(chunk) if block_q is None else block_q,
      default_block_size(chunk) if block_kv is None else block_kv,
    )
  target = TARGETS[implementation]
  problem = target.head_dim_problem(head_dim)
  if problem:
    raise ValueError(
      f"implementation={implementation!r} cannot tile head dim {head_dim}: it "
      f"must be {problem}; pad the head dim or use implementation='xla'"
    )
  rows, keys = target.default_tile(head_dim, dtype)
  local = layout.local_seq_len

  def fits(bq, bk):
    key_count = local if key_len is None else key_len
    return target.block_problem(bq * groups, bk, local_rows=local * groups, local_len=key_count)

  q_options = [block_q] if block_q is not None else _divisors(chunk, max(rows // groups, 1))
  k_options = [block_kv] if block_kv is not None else _divisors(chunk, keys)
  for bq in q_options:
    for bk in k_options:
      if fits(bq, bk) is None:
        return bq, bk
  bq, bk = q_options[0], k_options[0]
  why = fits(bq, bk) or "no divisor of the chunk length fits the tile record"
  raise ValueError(
    f"implementation={implementation!r} cannot tile layout.chunk_len={chunk} with G={groups} "
    f"query heads per KV head (block_q={bq}, block_kv={bk}): {why}. Choose block_q and "
    f"block_kv dividing the chunk length that meet this (a longer sequence or pad_multiple "
    f"in shard_batch helps), or use implementation='xla'."
  )
