"""Reorder each packed row's documents so every cp rank does the same work.

A ``"document_balanced"`` :class:`cpjax.ShardLayout` deals stripes of the
row to the ranks in a serpentine. Which rank's stripes hold the long
documents' late tokens (the expensive ones: a token at position p of its
document attends p + 1 keys) depends on where the documents sit in the row.
Documents do not attend to each other, so their order in the row is free: the
host picks, per row, an order of whole documents that evens out the ranks'
work, and the sharder applies it as data (``_source_index``). Inside each
document nothing moves, so every mask and every position id means what it
meant on the original row.

Everything here is numpy on the host: it reads concrete document ids.

Shape letters: ``B`` batch, ``S`` padded row length, ``n`` documents of a row.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from jax.typing import ArrayLike

from cpjax import checks
from cpjax.batch.layout import ShardLayout, rank_order

__all__ = ["balance_documents", "rank_work", "renumber_documents", "token_work"]

# Local search budget per row: candidate orders scored per round, rounds.
_CANDIDATES = 256
_ROUNDS = 64
# Stop once the busiest rank is within this of the mean.
_GOOD_ENOUGH = 1.01


def token_work(
  document_ids: ArrayLike, layer_windows: Sequence[int | None] | None = None
) -> np.ndarray:
  """Return each token's attention work, summed over the model's layers.

  A token's work is ``min(p + 1, W)`` keys at position ``p`` of its document (a
  maximal run of one non-zero id) in a layer of window ``W``, ``p + 1`` in a
  full causal one; 0 for padding.

  Args:
    document_ids: int[B, S], 0 = pad.
    layer_windows: the window of each attention layer, None for a full
      causal one (default: one full causal layer).

  Returns:
    float64[B, S]: each token's attention work, summed over the model's layers.

  >>> token_work(np.array([[1, 1, 1, 2, 2, 0]])).tolist()
  [[1.0, 2.0, 3.0, 1.0, 2.0, 0.0]]
  >>> token_work(np.array([[1, 1, 1, 1]]), layer_windows=[2, None]).tolist()
  [[2.0, 4.0, 5.0, 6.0]]
  """
  ids = _rows(document_ids)
  windows = _windows(layer_windows)
  out = np.zeros(ids.shape)
  for b, row in enumerate(ids):
    starts, lengths = _runs(row)
    for s, n in zip(starts, lengths):
      if row[s] != 0:
        keys = np.arange(1, n + 1)
        out[b, s : s + n] = sum(
          c * (keys if w is None else np.minimum(keys, w)) for w, c in windows
        )
  return out


def _windows(layer_windows) -> tuple[tuple[int | None, int], ...]:
  """``((window or None, layers), ...)`` from a per-layer list."""
  if layer_windows is None:
    return ((None, 1),)
  if isinstance(layer_windows, (str, bytes)) or not hasattr(layer_windows, "__iter__"):
    raise TypeError(
      f"layer_windows must be a sequence of ints >= 1 or None (one per "
      f"attention layer), got {type(layer_windows).__name__}"
    )
  layer_windows = list(layer_windows)
  if not layer_windows:
    raise ValueError("layer_windows must name at least one attention layer, got []")
  for i, w in enumerate(layer_windows):
    if w is not None:
      checks.integer(f"layer_windows[{i}]", w, minimum=1)
  counts = {}
  for w in layer_windows:
    w = None if w is None else int(w)
    counts[w] = counts.get(w, 0) + 1
  return tuple(counts.items())


def _prefix_work(n, windows) -> np.ndarray:
  """float64: the work of a document's first ``n`` tokens (``n`` an int array)."""
  n = np.asarray(n, np.float64)
  out = np.zeros(n.shape)
  for w, c in windows:
    m = n if w is None else np.minimum(n, w)
    # sum_{p=1..n} min(p, W) = m(m + 1)/2 + (n - m) W, m = min(n, W)
    out += c * (m * (m + 1) / 2 + (0 if w is None else (n - m) * w))
  return out


def rank_work(work: ArrayLike, layout: ShardLayout) -> np.ndarray:
  """Return the work each rank holds, from per-token work in **rank order**.

  Rank order is as :func:`cpjax.shard_batch` returns its streams: rank r holds
  columns ``r*L .. (r+1)*L - 1``.

  Args:
    work: per-token work [B, S] in rank order (e.g. from :func:`token_work`).
    layout: the :class:`ShardLayout`.

  Returns:
    float64[B, cp]: the work each rank holds.

  >>> lay = ShardLayout(8, 8, 2, "load_balanced")
  >>> rank_work(np.arange(1.0, 9.0)[None], lay).tolist()
  [[10.0, 26.0]]
  """
  work = np.asarray(work, np.float64)
  if work.ndim != 2 or work.shape[1] != layout.padded_seq_len:
    raise ValueError(
      f"work must be [B, {layout.padded_seq_len}] (the padded length), got shape {work.shape}"
    )
  return work.reshape(work.shape[0], layout.cp_size, layout.local_seq_len).sum(-1)


def balance_documents(
  document_ids: ArrayLike,
  layout: ShardLayout,
  *,
  seed: int = 0,
  layer_windows: Sequence[int | None] | None = None,
) -> np.ndarray:
  """Return, for each slot of the reordered row, the index it takes its token from.

  The indices are chosen so that ``layout``'s ranks get even attention work
  (:func:`token_work` over ``layer_windows``).

  Each row's documents (maximal runs of one id; padding, id 0, is a run of
  zero work) are permuted whole: first the best rotation of the original
  order, then a seeded local search over swaps and moves of documents,
  scoring whole batches of candidate orders at once from the work at the
  stripe boundaries. A row whose non-zero id appears in two separate runs
  keeps its order (moving one run would change which tokens it sees).
  Deterministic for a given ``seed``.

  Args:
    document_ids: int[B, S] of the padded row (its ``_packed_seq_ids``, NeMo's
      name for the document ids; 0 = pad).
    layout: the ``"document_balanced"`` layout the row will be sharded with.
    seed: the local search's random seed.
    layer_windows: the window of each of the model's attention layers, None
      for a full causal one (default: one full causal layer). A windowed
      layer's work is nearly even along a document; balancing causal work
      alone would uneven it.

  Returns:
    int32[B, S]: for each slot of the reordered row, the index it takes its
    token from.

  Example:
    >>> lay = ShardLayout(16, 16, 2, "document_balanced", stripes=2)
    >>> ids = np.array([[1] * 8 + [2, 2, 3, 3, 4, 4, 5, 5]])
    >>> rank_work(token_work(ids), lay).tolist()          # as packed
    [[36.0, 12.0]]
    >>> src = balance_documents(ids, lay)
    >>> order = src[:, rank_order(lay)]                   # rank order
    >>> rank_work(np.take_along_axis(token_work(ids), order, 1), lay).tolist()
    [[24.0, 24.0]]
  """
  if not isinstance(layout, ShardLayout):
    raise TypeError(f"layout must be a ShardLayout, got {type(layout).__name__}")
  ids = _rows(document_ids)
  windows = _windows(layer_windows)
  if ids.shape[1] != layout.padded_seq_len:
    raise ValueError(
      f"document_ids must be [B, {layout.padded_seq_len}] (the padded length), "
      f"got shape {ids.shape}"
    )
  slot_rank = np.empty(layout.padded_seq_len, np.int64)
  slot_rank[rank_order(layout)] = np.arange(layout.padded_seq_len) // layout.local_seq_len
  stripe_rank = slot_rank[:: layout.chunk_len]
  out = np.empty(ids.shape, np.int32)
  for b, row in enumerate(ids):
    starts, lengths = _runs(row)
    real = row[starts] != 0
    order = np.arange(len(starts))
    if len(np.unique(row[starts][real])) == int(real.sum()):
      order = _search(lengths, real, stripe_rank, layout, windows, np.random.default_rng(seed))
    out[b] = np.concatenate([np.arange(starts[i], starts[i] + lengths[i]) for i in order])
  return out


def renumber_documents(document_ids: ArrayLike) -> np.ndarray:
  """Rename each row's non-zero ids 1, 2, ... in the order they first appear.

  0 (padding) stays 0. Same ids stay equal, different ones different, so every
  document mask means what it meant.

  Why: the ring skips a tile when the id ranges of its query and key blocks
  cannot meet. After :func:`balance_documents` reorders a row its ids are no
  longer increasing, a block's range spans documents it does not hold, and
  tiles the mask leaves empty would be computed.

  Args:
    document_ids: int[B, S], 0 = pad.

  Returns:
    int32[B, S]: each row's ids renamed.

  >>> renumber_documents(np.array([[7, 7, 3, 0, 5, 5, 3]])).tolist()
  [[1, 1, 2, 0, 3, 3, 2]]
  """
  ids = _rows(document_ids)
  out = np.empty(ids.shape, np.int32)
  for b, row in enumerate(ids):
    values, first, inverse = np.unique(row, return_index=True, return_inverse=True)
    real = values != 0
    rename = np.zeros(len(values), np.int32)
    rename[np.flatnonzero(real)[np.argsort(first[real])]] = np.arange(1, real.sum() + 1)
    out[b] = rename[inverse]
  return out


def _rows(document_ids) -> np.ndarray:
  ids = np.asarray(document_ids)
  if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"document_ids must be an int [B, S] array, got {ids.dtype} shape {ids.shape}")
  return ids


def _runs(row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Start and length of each maximal run of equal ids."""
  starts = np.flatnonzero(np.r_[True, row[1:] != row[:-1]])
  return starts, np.diff(np.r_[starts, row.shape[0]])


def _scores(orders, lengths, real, stripe_rank, layout: ShardLayout, windows) -> np.ndarray:
  """float64[K]: the busiest rank's work for each candidate order [K, n]."""
  lens = lengths[orders]  # [K, n]
  offsets = np.concatenate([np.zeros((len(orders), 1), np.int64), np.cumsum(lens, 1)], 1)
  tri = np.where(real[orders], _prefix_work(lens, windows), 0.0)
  before = np.concatenate([np.zeros((len(orders), 1)), np.cumsum(tri, 1)], 1)
  # The work up to each stripe boundary: whole documents before it, plus the
  # first tokens of the document it cuts.
  bounds = np.arange(0, layout.padded_seq_len + 1, layout.chunk_len)  # [nb]
  doc = (offsets[:, None, :-1] <= bounds[None, :, None]).sum(-1) - 1  # [K, nb]
  doc = np.minimum(doc, lens.shape[1] - 1)
  into = np.minimum(
    bounds[None] - np.take_along_axis(offsets, doc, 1), np.take_along_axis(lens, doc, 1)
  )
  cut = np.where(np.take_along_axis(real[orders], doc, 1), _prefix_work(into, windows), 0.0)
  total = np.take_along_axis(before, doc, 1) + cut
  stripes = np.diff(total, axis=1)  # [K, stripes]
  per_rank = np.zeros((len(orders), layout.cp_size))
  # numpy's stubs take only integer arrays as ufunc.at's indices, not a tuple with a slice.
  np.add.at(per_rank, (slice(None), stripe_rank), stripes)  # pyrefly: ignore[bad-argument-type]
  return per_rank.max(1)


def _moves(n: int, rng) -> np.ndarray:
  """int[K, n]: random permutations that swap two documents or move one."""
  i, j = (x[:, None] for x in rng.integers(0, n, (2, _CANDIDATES)))
  p = np.arange(n)[None]
  swap = np.where(p == i, j, np.where(p == j, i, p))
  # Moving document i to place j shifts those between by one towards i.
  lo, hi = np.minimum(i, j), np.maximum(i, j)
  step = np.where(i < j, 1, -1)
  move = np.where(p == j, i, np.where((p >= lo) & (p <= hi), p + step, p))
  return np.where(rng.random((_CANDIDATES, 1)) < 0.5, swap, move)


def _search(lengths, real, stripe_rank, layout: ShardLayout, windows, rng) -> np.ndarray:
  n = len(lengths)
  total = float(np.sum(np.where(real, _prefix_work(lengths, windows), 0.0)))
  if n < 2 or total == 0:
    return np.arange(n)
  goal = _GOOD_ENOUGH * total / layout.cp_size
  rotations = (np.arange(n)[None] + np.arange(n)[:, None]) % n
  scores = _scores(rotations, lengths, real, stripe_rank, layout, windows)
  best = int(np.argmin(scores))
  order, score = rotations[best], scores[best]
  for _ in range(_ROUNDS):
    if score <= goal:
      break
    candidates = order[_moves(n, rng)]
    scores = _scores(candidates, lengths, real, stripe_rank, layout, windows)
    k = int(np.argmin(scores))
    if scores[k] <= score:
      order, score = candidates[k], scores[k]
  return order
