"""The ring's static schedule: which hops a mask's reach needs, and the tile sizes.

Everything here is decided before tracing, from the layout and the mask:

* :func:`ring_plan`: the hops that can reach allowed keys (the whole ring in
  one direction by default; with a bounded reach, only the hops that can
  reach it, in one direction for a causal contiguous layout and in both
  directions otherwise).
* :func:`default_block_size` and ``block_sizes``: the ``block_q x
  block_kv`` tiles of one hop, checked against a Pallas implementation's tiling rules.

The passes that run the schedule are :mod:`cpjax.attention.ring._passes`; the public
entry point is :func:`cpjax.ring_attention`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
from jax.typing import DTypeLike

from cpjax.attention.ring.kernels._implementations import PALLAS_IMPLEMENTATIONS
from cpjax.batch.layout import ShardLayout, rank_order
from cpjax.masks import AttentionMask, MaskRule, MaskSpec, Reach

__all__ = ["DEFAULT_BLOCK", "Halo", "RingPlan", "default_block_size", "halo", "ring_plan"]

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


class Halo(NamedTuple):
  """The keys one hop of the all-gather's halo brings: rank r receives, from
  rank ``r - offset`` (modulo cp), that rank's local tokens ``[start, start +
  length)`` for each ``(start, length)`` of ``runs``."""

  offset: int
  runs: tuple[tuple[int, int], ...]

  @property
  def length(self) -> int:
    """Tokens this hop brings."""
    return sum(n for _, n in self.runs)


@functools.lru_cache(maxsize=64)  # every layer of a model traces it with the same arguments
def halo(
  layout: ShardLayout, mask: AttentionMask | MaskRule, block_kv: int
) -> tuple[Halo, ...] | None:
  """The halo a bounded mask's all-gather needs, or None for the whole row.

  With a bounded reach (a window without vision groups) a rank's queries see
  only keys within the reach of its chunks: the ``W - 1`` tokens before each
  chunk (and after, when not causal), which the layout puts on the
  neighbours :func:`ring_plan` names. For each of those hops the sender's
  tokens any receiver can reach, in whole ``block_kv`` blocks (tiles never
  straddle a chunk), are the same local slices on every rank: a static halo.
  None where the reach is unbounded or the halo would be the whole row.

  Example:
    >>> lay = ShardLayout(8192, 8192, 4, "load_balanced")
    >>> halo(lay, MaskSpec(sliding_window=512).rule(), 128)   # chunk 1024: 511 keys -> 512
    (Halo(offset=1, runs=((512, 512),)), Halo(offset=-1, runs=((1536, 512),)))
  """
  rule = mask.rule if isinstance(mask, AttentionMask) else mask
  plan = ring_plan(layout, mask=rule)
  cp, local = layout.cp_size, layout.local_seq_len
  if cp == 1 or plan.forward_hops + plan.backward_hops >= cp - 1:
    return None
  reach = rule.reach()
  behind = local * cp if reach.behind is None else reach.behind
  ahead = local * cp if reach.ahead is None else reach.ahead
  positions = rank_order(layout).reshape(cp, local)  # rank r's tokens: row r
  hops = [*range(1, plan.forward_hops + 1), *range(-1, -plan.backward_hops - 1, -1)]
  out = []
  for offset in hops:
    needed = np.zeros(local, bool)
    for r in range(cp):
      queries = np.sort(positions[r])
      keys = positions[(r - offset) % cp]
      # A key k is needed if some query q has k - ahead <= q <= k + behind.
      lo = np.searchsorted(queries, keys - ahead, side="left")
      hi = np.searchsorted(queries, keys + behind, side="right")
      needed |= hi > lo
    # Runs of needed blocks: where the padded 0/1 sequence steps up, and down.
    steps = np.diff(
      np.concatenate([[0], needed.reshape(-1, block_kv).any(axis=1), [0]]).astype(int)
    )
    firsts, ends = np.flatnonzero(steps == 1), np.flatnonzero(steps == -1)
    runs = [(int(a) * block_kv, int(b - a) * block_kv) for a, b in zip(firsts, ends)]
    if runs:
      out.append(Halo(offset, tuple(runs)))
  return tuple(out)


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


def block_sizes(
  layout: ShardLayout,
  implementation: str,
  head_dim: int,
  groups: int,
  block_q: int | None,
  block_kv: int | None,
  dtype: DTypeLike | None = None,
  query_len: int | None = None,
  key_len: int | None = None,
) -> tuple[int, int]:
  """(block_q, block_kv) for this call: checked if given, else the default.

  ``query_len``, ``key_len``: the queries and keys a kernel call sees, when
  not a rank's own ``local_seq_len`` (the whole row: all-gathered keys, or
  Ulysses' queries and keys; a block as long as one rank's row is then not
  the whole array, which Mosaic requires).

  Tiles never straddle a chunk, so both divide ``layout.chunk_len``; a
  Pallas implementation adds its tiling rules and takes its defaults from its
  tile record. Nothing falls back silently: a shape it cannot tile is a
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
  pallas = PALLAS_IMPLEMENTATIONS[implementation]
  problem = pallas.head_dim_problem(head_dim)
  if problem:
    raise ValueError(
      f"implementation={implementation!r} cannot tile head dim {head_dim}: it "
      f"must be {problem}; pad the head dim or use implementation='xla'"
    )
  rows, keys = pallas.default_tile(head_dim, dtype)
  queries = layout.local_seq_len if query_len is None else query_len
  keys_seen = layout.local_seq_len if key_len is None else key_len

  def fits(bq, bk):
    return pallas.block_problem(bq * groups, bk, local_rows=queries * groups, local_len=keys_seen)

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
