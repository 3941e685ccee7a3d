"""What a per-hop kernel call costs, known before it runs: the ``pl.CostEstimate``
each ``pallas_call`` gives XLA.

XLA cannot see into a Mosaic or Triton kernel: without an estimate its cost
analysis, its profiles and its latency-hiding scheduler take the kernel for
free (jax-ml/jax#29463 says this of splash). A hop's tile schedule is data (it
depends on the rank, the visiting chunk and the mask's per-token arrays), but
the estimate is one static figure per call site, so each call is given the
*average* work of the calls a ring-attention call makes: over every rank and
every kernel call it runs, the (query, key) pairs in the blocks that the mask's
position envelope leaves non-empty (:func:`visited_pairs`), divided evenly.
Summed over the calls a rank runs, the estimates are that rank's share of the
whole mask's blocks; for a causal mask or a window (a rule whose
:class:`cpjax.masks.Reach` is its whole story) the count is exact, for
documents, padding, images and users' rules (which skip more blocks, or which
only the data decides) it is the envelope's: an upper bound.

Per (query row, key) pair, per head: the forward does two matmuls (4 D FLOPs)
and one exponential; the dq kernel recomputes the scores, then dP and dQ (6 D)
and one exponential; the dk/dv kernel recomputes the scores, then dV, dP and
dK (8 D) and one exponential. A soft cap adds a tanh per pair to each.
Bytes: the tile's own side once, the other side once per visited tile, the
float32 outputs once.

Shape letters as in :mod:`cpjax.attention.ring.kernels._common`.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.experimental import pallas as pl

from cpjax.batch.layout import ShardLayout, rank_order
from cpjax.masks import Reach

__all__ = ["FLOPS_PER_PAIR", "estimate", "visited_pairs"]

#: FLOPs per (query row, key) pair and head dim unit of each kernel.
FLOPS_PER_PAIR = {"forward": 4, "dq": 6, "dkdv": 8}


@functools.lru_cache(maxsize=64)
def visited_pairs(layout: ShardLayout, reach: Reach, block_q: int, block_kv: int) -> int:
  """(query token, key token) pairs in non-empty blocks of the whole row.

  Every rank's queries against every rank's keys, cut into blocks of
  ``block_q`` query tokens and ``block_kv`` keys within one chunk (as the
  kernels' schedules cut them), a block counted whole when some pair of it
  lies within ``reach`` (keys at most ``behind`` tokens before the query and
  ``ahead`` after it; None: unbounded).

  >>> lay = ShardLayout(1024, 1024, 2, "contiguous")
  >>> visited_pairs(lay, Reach(None, 0), 256, 256) / 1024**2   # causal: 10 of 16 blocks
  0.625
  >>> visited_pairs(lay, Reach(None, None), 256, 256) == 1024**2
  True
  """
  c = layout.chunk_len
  if c % block_q or c % block_kv:
    raise ValueError(f"blocks of {block_q} x {block_kv} tokens must divide the chunk's {c}")
  order = rank_order(layout)
  q_lo = order[::block_q]  # positions rise by one within a chunk, so within a block
  k_lo = np.sort(order[::block_kv])
  s = order.size
  lo = np.zeros_like(q_lo) if reach.behind is None else q_lo - reach.behind - block_kv + 1
  hi = np.full_like(q_lo, s) if reach.ahead is None else q_lo + block_q - 1 + reach.ahead
  # A key block [k, k + block_kv) reaches a query block [q, q + block_q) when
  # k + block_kv - 1 >= q - behind and k <= q + block_q - 1 + ahead.
  blocks = np.searchsorted(k_lo, hi, side="right") - np.searchsorted(k_lo, lo, side="left")
  return int(blocks.sum()) * block_q * block_kv


def estimate(
  kernel: str,
  q: jax.Array,
  keys: jax.Array,
  *,
  density: float,
  soft_cap: bool,
  rows: int,
  block_kv: int,
) -> pl.CostEstimate:
  """The :class:`pl.CostEstimate` of one kernel call.

  Args:
    kernel: ``"forward"``, ``"dq"`` or ``"dkdv"``.
    q: the call's queries, [B, Hkv, N, D] (N rows: tokens times G).
    keys: the call's keys, [B, Hkv, Lk, D].
    density: the share of the call's (row, key) pairs it visits, on average.
    soft_cap: whether the scores are soft-capped (a tanh a pair).
    rows, block_kv: R and K, a tile's rows and keys.

  Returns:
    FLOPs, transcendentals and bytes of the call on one device.
  """
  b, h, n, d = q.shape
  lk = keys.shape[2]
  item = np.dtype(q.dtype).itemsize
  pairs = density * b * h * n * lk
  tiles = pairs / (rows * block_kv)
  kv_tile = 2 * block_kv * d * item  # one tile's K and V
  row_side = {  # bytes of the rows' side read or written once, per row
    "forward": d * item + (d + 1) * 4,  # q; out and lse in float32
    "dq": 2 * d * item + 8 + d * 4,  # q, dO, lse, delta; dq in float32
  }
  if kernel == "dkdv":  # K, V once and dK, dV in float32; each tile's q, dO, lse, delta
    moved = b * h * lk * (2 * d * item + 2 * d * 4) + tiles * rows * (2 * d * item + 8)
  else:
    moved = b * h * n * row_side[kernel] + tiles * kv_tile
  return pl.CostEstimate(
    flops=int(FLOPS_PER_PAIR[kernel] * d * pairs),
    transcendentals=int(pairs * (2 if soft_cap else 1)),
    bytes_accessed=int(moved),
  )
