"""The loss: token-mean cross entropy, its exact reduction over the ranks, and
cross entropy straight from hidden states and the output head, never holding [L, V].

Shapes: ``B`` rows, ``L`` tokens per row, ``D`` width, ``V`` vocabulary,
``N = B * L`` tokens, ``C`` tokens per chunk.

The loss is ``sum(CE over labels != -100) / count(labels != -100)`` with both
sums reduced exactly (``psum``) across the ``cp`` axis and a data-parallel
axis when the mesh has one (:func:`cross_entropy_sums`), so it equals the
single-device loss of the same batch, and so do its gradients. A forward
returns logits, or :class:`cpjax.attention.cp_context.HiddenStates` (the final hidden
states and the head), whose loss :func:`linear_cross_entropy` computes chunk
by chunk.

The logits of a long row dominate a language model's training memory (for
Gemma 4's 262144-token vocabulary, 1 MiB per token in float32, and their
gradient again). :func:`linear_cross_entropy` scans the tokens ``C`` at a
time: each chunk's logits are computed in float32 (with Gemma's soft cap,
``cap * tanh(z / cap)``), reduced to their log-sum-exp and the label's logit,
and dropped. The backward recomputes each chunk's logits, forms
``softmax - onehot`` and accumulates the head's gradient chunk by chunk, so
only O(N) values (one log-sum-exp per token) are kept between the passes.

Vocabulary-parallel: when the head is split over its rows by the mesh's
Auto axes (``fsdp`` and ``tp``, as :func:`cpjax.parallel.param_specs`
places it), each device computes its block ``[C, V / shards]`` of every
chunk's logits, and the maximum, the sum of exponentials and the label's
logit are combined over those axes with collectives of ``C`` values
(Megatron's vocabulary-parallel cross entropy). Rows split over the batch
axis are all-gathered when that axis also splits the vocabulary; the
hidden states' gradient returns to its rows with a reduce-scatter and the
head's gradient stays in its shard. The head is never whole on a device.

Over ``cp`` too (``vocab_axis``): when the training state is split over
``fsdp x cp`` (:data:`cpjax.parallel.STATE_AXES`) the head enters the ring's
``shard_map`` as this rank's block of rows, beside this rank's tokens. The
tokens then travel the ``cp`` ring, as the ring attention's keys do: each
rank adds its block's statistics (the online log-sum-exp's maximum and sum,
and the label's logit) to the visiting chunk's, which travel with it and
come home whole; the backward sends the chunks round again with their
log-sum-exps and their hidden states' gradient, which each rank adds its
block's part to, while the head's gradient stays on its rank. No rank holds
more than two ranks' tokens (``[B, 2 L, D]``), never the whole row's. Rows
short enough take the all-gather instead (``strategy="all_gather"``, or
``"auto"`` by the CP strategy rule): every rank gathers the row's hidden
states and labels at once, its block's statistics combine with the others'
by collectives of ``C`` values as the Auto axes' do, and the hidden states'
gradient is reduce-scattered home.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jax.typing import ArrayLike

from cpjax.attention.cp_context import HiddenStates
from cpjax.batch import IGNORE_INDEX
from cpjax.parallel import (
  RowPlacement,
  filled_after,
  gathered,
  row_placement,
  vary_like,
  varying_axes,
)
from cpjax.training.cp_strategy import row_fits

__all__ = [
  "LOSS_CHUNK_LOGITS",
  "cross_entropy",
  "cross_entropy_sums",
  "linear_cross_entropy",
  "token_cross_entropy",
]

# Tokens per chunk of the chunked loss: about 2**26 logits (256 MiB of
# float32) per chunk whole, fewer per device when the head is split.
LOSS_CHUNK_LOGITS = 1 << 26


#: How the loss's tokens meet a head split over cp (``cross_entropy(strategy=...)``).
LOSS_STRATEGIES = ("ring", "all_gather", "auto")


def cross_entropy(
  output: ArrayLike | HiddenStates,
  labels: ArrayLike,
  *,
  ignore_index: int = IGNORE_INDEX,
  strategy: str = "ring",
) -> tuple[jax.Array, jax.Array]:
  """Compute the (CE sum, count) of a forward's output.

  :func:`token_cross_entropy` of logits [B, L, V], or
  :func:`linear_cross_entropy` of :class:`HiddenStates`.

  Args:
    output: logits [B, L, V] or :class:`HiddenStates`.
    labels: int[B, L]; ``ignore_index`` is not counted.
    ignore_index: the label of tokens not counted.
    strategy: for a head split over the cp ranks (``head_axis``), how the
      tokens meet its blocks: ``"ring"``, ``"all_gather"`` (see
      :func:`linear_cross_entropy`), or ``"auto"``: the all-gather while the
      row's gathered hidden states and their float32 gradient fit the CP
      strategy rule's share of a device
      (:func:`cpjax.training.cp_strategy.row_fits`), else the ring.

  Returns:
    (CE sum, count).

  >>> import numpy as np
  >>> out = HiddenStates(np.ones((1, 2, 3), np.float32), np.zeros((4, 3), np.float32))
  >>> s, n = cross_entropy(out, np.array([[1, -100]]))
  >>> round(float(s), 4), float(n)     # log(4), one token
  (1.3863, 1.0)
  """
  if isinstance(output, HiddenStates):
    # Chunks sized by the whole vocabulary, as with a head split over Auto
    # axes: a rank's block of a chunk's logits then shrinks with the split.
    vocab = output.head.shape[0] * (
      1 if output.head_axis is None else jax.lax.axis_size(output.head_axis)
    )
    chunk = max(16, min(4096, LOSS_CHUNK_LOGITS // vocab))
    if strategy == "auto":
      strategy = "ring"
      if output.head_axis is not None:
        # Attention's rule (cpjax.training.cp_strategy): the row's hidden
        # states and their float32 gradient, gathered, within the share.
        h = output.hidden
        row = h.shape[0] * h.shape[1] * jax.lax.axis_size(output.head_axis) * h.shape[2]
        strategy = "all_gather" if row_fits(row * (h.dtype.itemsize + 4)) else "ring"
    return linear_cross_entropy(
      output.hidden,
      output.head,
      labels,
      chunk_size=chunk,
      logits_soft_cap=output.logits_soft_cap,
      ignore_index=ignore_index,
      vocab_axis=output.head_axis,
      strategy=strategy,
    )
  return token_cross_entropy(output, labels, ignore_index=ignore_index)


def token_cross_entropy(
  logits: ArrayLike, labels: ArrayLike, *, ignore_index: int = IGNORE_INDEX
) -> tuple[jax.Array, jax.Array]:
  """Compute the sum of per-token cross-entropies and the number of counted tokens.

  Args:
    logits: [B, L, V].
    labels: int[B, L] (``ignore_index`` = not counted).
    ignore_index: the label of tokens not counted.

  Returns:
    (sum of per-token CE, number of counted tokens), both float32 scalars.

  >>> import numpy as np
  >>> s, n = token_cross_entropy(np.zeros((1, 2, 4)), np.array([[1, -100]]))
  >>> round(float(s), 4), float(n)     # log(4), one token
  (1.3863, 1.0)
  """
  labels = jnp.asarray(labels)
  logits = jnp.asarray(logits, jnp.float32)
  valid = labels != ignore_index
  # The label's logit by a masked sum over V rather than a gather: with the
  # vocabulary sharded over an Auto mesh axis (an FSDP-sharded head) a gather
  # trips XLA's SPMD partitioner inside the ring's shard_map, and the masked
  # sum fuses into one pass over the logits anyway.
  vocab = jnp.arange(logits.shape[-1], dtype=labels.dtype)
  picked = jnp.sum(jnp.where(vocab == labels[..., None], logits, 0.0), axis=-1)
  ce = jax.nn.logsumexp(logits, axis=-1) - picked
  return jnp.sum(jnp.where(valid, ce, 0.0)), jnp.sum(valid, dtype=jnp.float32)


def cross_entropy_sums(
  logits: ArrayLike | HiddenStates,
  labels: ArrayLike,
  *,
  axis_names: tuple[str, ...] = ("cp",),
  ignore_index: int = IGNORE_INDEX,
  strategy: str = "ring",
) -> tuple[jax.Array, jax.Array]:
  """Reduce the CP loss: (CE sum, token count) over every rank of ``axis_names``.

  Call it inside ``shard_map`` on this rank's logits [B, L, V] (or
  :class:`HiddenStates`) and labels int[B, L]; both sums are ``psum`` -ed
  over ``axis_names`` (the ``cp`` axis
  and a data-parallel axis), so ``ce_sum / count`` is the token-mean loss of
  the whole global batch on every rank, exactly the single-device loss, and
  differentiating it gives the single-device gradients. With
  ``axis_names=()`` it is :func:`token_cross_entropy`.

  Args:
    logits: this rank's logits [B, L, V] (or :class:`HiddenStates`).
    labels: this rank's labels int[B, L].
    axis_names: the mesh axes to sum over.
    ignore_index: the label of tokens not counted.
    strategy: as :func:`cross_entropy`.

  Returns:
    (CE sum, token count) over every rank of ``axis_names``.

  Example:
    >>> import jax, numpy as np
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((2,), ("cp",), devices=jax.devices()[:2])
    >>> f = jax.jit(jax.shard_map(lambda x, y: cross_entropy_sums(x, y), mesh=mesh,
    ...                           in_specs=P(None, "cp"), out_specs=P()))
    >>> put = lambda x: jax.device_put(x, jax.NamedSharding(mesh, P(None, "cp")))
    >>> s, n = f(put(np.zeros((1, 4, 4))), put(np.array([[1, -100, 2, 3]])))
    >>> round(float(s / n), 4), float(n)       # log(4) over 3 counted tokens
    (1.3863, 3.0)
  """
  ce_sum, count = cross_entropy(logits, labels, ignore_index=ignore_index, strategy=strategy)
  if not axis_names:
    return ce_sum, count
  return jax.lax.psum(ce_sum, tuple(axis_names)), jax.lax.psum(count, tuple(axis_names))


def linear_cross_entropy(
  hidden: ArrayLike,
  head: ArrayLike,
  labels: ArrayLike,
  *,
  chunk_size: int = 1024,
  logits_soft_cap: float | None = None,
  ignore_index: int = IGNORE_INDEX,
  vocab_axis: str | None = None,
  strategy: str = "ring",
) -> tuple[jax.Array, jax.Array]:
  """Compute :func:`token_cross_entropy` of ``cap(hidden @ head.T)``.

  Args:
    hidden: [B, L, D] final hidden states (any float dtype; the matmul
      accumulates in float32).
    head: [V, D] output projection (a tied embedding table as it is).
    labels: int[B, L]; ``ignore_index`` is not counted.
    chunk_size: tokens per chunk ``C``; ``N`` need not be a multiple of it.
    logits_soft_cap: Gemma's final soft cap, or None.
    vocab_axis: None, or (inside a ``shard_map`` manual over it) the mesh
      axis whose rank ``i`` holds block ``i`` of the head's rows while
      ``hidden`` and ``labels`` are that rank's own tokens (the ring's
      ``cp``); the sums are then this rank's tokens'.
    strategy: how the tokens meet every block of the head over
      ``vocab_axis``: ``"ring"`` (they travel the ring; no rank holds more
      than two ranks' tokens) or ``"all_gather"`` (every rank gathers the
      row's hidden states and labels at once, combines its block's
      statistics with the others' by ``C``-value collectives, and
      reduce-scatters the hidden states' gradient home; for rows whose
      gathered hidden states fit). Both give the same sums and gradients.

  Returns:
    (sum of per-token CE, number of counted tokens), both float32 scalars.

  Example:
    >>> import numpy as np
    >>> h = np.ones((1, 3, 2), np.float32)
    >>> w = np.zeros((4, 2), np.float32)
    >>> s, n = linear_cross_entropy(h, w, np.array([[1, -100, 3]]), chunk_size=2)
    >>> round(float(s), 4), float(n)       # 2 * log(4)
    (2.7726, 2.0)
  """
  hidden, head, labels = jnp.asarray(hidden), jnp.asarray(head), jnp.asarray(labels)
  if hidden.ndim != 3 or head.ndim != 2 or hidden.shape[-1] != head.shape[-1]:
    raise ValueError(
      f"hidden must be [B, L, D] and head [V, D] with the same D, got "
      f"{hidden.shape} and {head.shape}"
    )
  if labels.shape != hidden.shape[:2] or not jnp.issubdtype(labels.dtype, jnp.integer):
    raise ValueError(
      f"labels must be an integer [B, L] = {list(hidden.shape[:2])} array, got "
      f"{labels.dtype}{list(labels.shape)}"
    )
  if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
    raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
  if logits_soft_cap is not None and not logits_soft_cap > 0:
    raise ValueError(f"logits_soft_cap must be > 0 or None, got {logits_soft_cap!r}")
  if strategy not in LOSS_STRATEGIES[:2]:
    raise ValueError(f"strategy must be 'ring' or 'all_gather', got {strategy!r}")
  where = row_placement(head, hidden.shape[0])
  if where is not None and not where.table_axes:  # not split by vocabulary: whole
    head, where = gathered(head), None
  tokens = (
    hidden.shape[0] * hidden.shape[1] * (1 if vocab_axis is None else jax.lax.axis_size(vocab_axis))
  )
  setup = _Setup(
    min(chunk_size, max(tokens, 1)),
    logits_soft_cap,
    ignore_index,
    where,
    varying_axes(head),
    vocab_axis,
    vocab_axis is not None and strategy == "all_gather",
  )
  ce_sum = _ce_sum(hidden, head, labels, setup)
  return ce_sum, jnp.sum(labels != ignore_index, dtype=jnp.float32)


class _Setup(NamedTuple):
  chunk: int
  cap: float | None
  ignore_index: int
  where: RowPlacement | None  # the head split over its vocabulary (None: whole here)
  head_vma: frozenset[str]  # manual axes the head varies over (the ring's cp: none)
  vocab_axis: str | None = None  # a manual axis the head's rows are split over (the ring's cp)
  gather_tokens: bool = False  # over vocab_axis: the row's tokens gathered, not a ring


def _vocab_axes(s: _Setup) -> tuple[str, ...]:
  """Every axis splitting the head's rows, major first: the manual one, then the Auto ones."""
  manual = () if s.vocab_axis is None else (s.vocab_axis,)
  return manual + _auto_axes(s)


def _auto_axes(s: _Setup) -> tuple[str, ...]:
  """The Auto axes splitting the head's rows: every device of them sees the same tokens."""
  return () if s.where is None else s.where.table_axes


def _gather_rows(hidden, labels, s: _Setup):
  """Every row's tokens when the batch axis also splits the vocabulary, else these rows'."""
  if _gathers_rows(s):
    assert s.where is not None  # _gathers_rows says so
    hidden = jax.lax.all_gather(hidden, s.where.batch, axis=0, tiled=True)
    labels = jax.lax.all_gather(labels, s.where.batch, axis=0, tiled=True)
  return hidden, labels


def _gathers_rows(s: _Setup) -> bool:
  """Whether the batch axis also splits the vocabulary: then every device
  needs every row's hidden states against its block of the head."""
  return s.where is not None and s.where.batch in s.where.table_axes


def _gather_tokens(hidden, labels, s: _Setup):
  """The row's tokens, every rank's in rank order, when they are gathered over ``vocab_axis``."""
  if not s.gather_tokens:
    return hidden, labels
  gather = functools.partial(jax.lax.all_gather, axis_name=s.vocab_axis, axis=1, tiled=True)
  return gather(hidden), gather(labels)


def _own(y, local_len: int, s: _Setup):
  """bool[K, C]: which tokens of the gathered rows' chunks ``y`` are this
  rank's own (each row holds every rank's ``local_len`` tokens in rank order)."""
  token = jnp.arange(y.size).reshape(y.shape) % (local_len * jax.lax.axis_size(s.vocab_axis))
  return token // local_len == jax.lax.axis_index(s.vocab_axis)


def _chunks(hidden, labels, s: _Setup):
  """[K, C, D] hidden, int[K, C] labels: the tokens in chunks, padded with
  ignored tokens (they add nothing to either sum)."""
  n = hidden.shape[0] * hidden.shape[1]
  pad = -n % s.chunk
  h = jnp.pad(hidden.reshape(n, -1), ((0, pad), (0, 0))).reshape(-1, s.chunk, hidden.shape[-1])
  y = jnp.pad(labels.reshape(n), (0, pad), constant_values=s.ignore_index).reshape(-1, s.chunk)
  return h, y


def _logits(h, head, cap):
  """float32 [C, Vb] logits of one chunk against this device's block of the
  head, soft-capped, and the uncapped tanh (for the VJP)."""
  z = jnp.einsum("cd,vd->cv", h, head, preferred_element_type=jnp.float32)
  if cap is None:
    return z, None
  t = jnp.tanh(z / cap)
  return cap * t, t


def _is_label(z, y, start):
  # The label's column by comparison, not a gather: labels outside this
  # device's block of the vocabulary match no column.
  return jnp.arange(z.shape[-1]) == (y - start)[:, None]


def _block_start(head, s: _Setup):
  axes = _vocab_axes(s)
  return jax.lax.axis_index(axes) * head.shape[0] if axes else 0


def _zeros(shape, *refs):
  """float32 zeros varying over every mesh axis one of ``refs`` varies over
  (a scan carry must keep one type; check_vma), made after the first of them
  (:func:`cpjax.parallel.filled_after`)."""
  out = filled_after(refs[0], shape)
  for ref in refs[1:]:
    out = vary_like(out, ref)
  return out


class _Stats(NamedTuple):
  """Per token [K, C]: the largest logit, the sum of exp(logit - top) and the
  label's logit, over the part of the vocabulary seen so far."""

  top: jax.Array
  sum_exp: jax.Array
  picked: jax.Array

  def merge(self, other: "_Stats") -> "_Stats":
    # The online log-sum-exp: an empty side (top -inf, sum 0) adds nothing.
    top = jnp.maximum(self.top, other.top)
    return _Stats(
      top,
      self.sum_exp * jnp.exp(self.top - top) + other.sum_exp * jnp.exp(other.top - top),
      self.picked + other.picked,
    )

  def lse(self):
    return self.top + jnp.log(self.sum_exp)


def _block_stats(h, y, head, s: _Setup) -> _Stats:
  """The statistics of chunks h [K, C, D] over this device's block of the
  vocabulary, combined over the Auto axes splitting it (collectives of ``C``
  values)."""
  axes, start = _auto_axes(s), _block_start(head, s)
  if s.gather_tokens:  # every rank holds the row: combine the blocks as the Auto axes' are
    axes = (s.vocab_axis, *axes)

  def chunk(_, xs):
    hc, yc = xs
    z, _ = _logits(hc, head, s.cap)
    top = jnp.max(z, axis=-1)
    top = jax.lax.pmax(top, axes) if axes else top
    sum_exp = jnp.sum(jnp.exp(z - top[:, None]), axis=-1)
    picked = jnp.sum(jnp.where(_is_label(z, yc, start), z, 0.0), axis=-1)
    if axes:
      sum_exp, picked = jax.lax.psum((sum_exp, picked), axes)
    return None, _Stats(top, sum_exp, picked)

  return jax.lax.scan(chunk, None, (h, y))[1]


def _ring_hop(s: _Setup):
  """One hop of the ``vocab_axis`` ring: rank ``i`` sends to rank ``i + 1``."""
  n = jax.lax.axis_size(s.vocab_axis)
  return functools.partial(
    jax.lax.ppermute, axis_name=s.vocab_axis, perm=[(i, (i + 1) % n) for i in range(n)]
  )


def _ring(step, moving, kept, home, s: _Setup):
  """Runs ``step(moving, kept) -> (moving, kept)`` on every rank's tokens in
  turn: ``moving`` (a chunk and what is known of it) travels the
  ``vocab_axis`` ring after each step, ``kept`` stays; after the last rank's
  step only ``home(moving)`` makes the hop back to the tokens' own rank.
  Returns (that, kept)."""
  hop = _ring_hop(s)

  def visit(carry, _):
    moving, kept = step(*carry)
    return (hop(moving), kept), None

  carry, _ = jax.lax.scan(visit, (moving, kept), None, length=jax.lax.axis_size(s.vocab_axis) - 1)
  moving, kept = step(*carry)
  return hop(home(moving)), kept


def _local_forward(hidden, head, labels, s: _Setup):
  """(CE sum of these rows, log-sum-exp per token [K, C]) on one device,
  with its block of the head; the blocks combine with small collectives.

  Over ``vocab_axis`` the tokens travel the ring: each rank adds its block's
  statistics to the visiting chunk's, which travel with it and come home
  whole, so no rank holds more than two ranks' tokens."""
  hidden, labels = _gather_rows(hidden, labels, s)
  local_len = hidden.shape[1]
  hidden, labels = _gather_tokens(hidden, labels, s)
  h, y = _chunks(hidden, labels, s)
  if s.vocab_axis is None or s.gather_tokens:
    stats = _block_stats(h, y, head, s)
  else:

    def step(moving, _):
      h, y, stats = moving
      return (h, y, stats.merge(_block_stats(h, y, head, s))), None

    empty = _zeros(y.shape, h, y)  # combined over the Auto axes: varies as the tokens do
    stats, _ = _ring(
      step, (h, y, _Stats(empty - jnp.inf, empty, empty)), None, lambda moving: moving[2], s
    )
  lse = stats.lse()
  counted = y != s.ignore_index
  if s.gather_tokens:  # the sum is this rank's tokens' (each rank has the row's)
    counted &= _own(y, local_len, s)
  total = jnp.sum(jnp.where(counted, lse - stats.picked, 0.0))
  if s.where is not None and s.where.batch is not None and not _gathers_rows(s):
    total = jax.lax.psum(total, s.where.batch)  # rows split over dp: add them
  return total[None], lse


def _block_grads(h, y, lse, head, g, dh, d_head, s: _Setup):
  """(dh + this block's part of the chunks' d hidden [K, C, D], d_head + this
  block's gradient from them), in float32.

  The vocabulary goes a tile of ``Vt`` rows at a time: each tile's gradient
  accumulates over every token chunk and is added into ``d_head`` in place,
  so one [V, D] buffer (the gradient itself) is alive, not an accumulator
  beside each chunk's product."""
  start = _block_start(head, s)
  rows = _vocab_tile(head.shape[0], head.shape[1])

  def tile(i, carry):
    dh, d_head = carry
    w = jax.lax.dynamic_slice_in_dim(head, i * rows, rows)

    def chunk(d_w, xs):
      hc, yc, lc, dhc = xs
      z, t = _logits(hc, w, s.cap)
      # d CE / d z = softmax - onehot on counted tokens; through the cap,
      # d (cap tanh(x / cap)) / dx = 1 - tanh^2.
      dz = jnp.exp(z - lc[:, None]) - _is_label(z, yc, start + i * rows)
      dz = jnp.where((yc != s.ignore_index)[:, None], dz, 0.0) * g
      if t is not None:
        dz = dz * (1.0 - t * t)
      d_w = d_w + jnp.einsum("cv,cd->vd", dz, hc, preferred_element_type=jnp.float32)
      return d_w, dhc + jnp.einsum("cv,vd->cd", dz, w, preferred_element_type=jnp.float32)

    d_w, dh = jax.lax.scan(
      chunk, jax.lax.dynamic_slice_in_dim(d_head, i * rows, rows), (h, y, lse, dh)
    )
    return dh, jax.lax.dynamic_update_slice_in_dim(d_head, d_w, i * rows, 0)

  return jax.lax.fori_loop(0, head.shape[0] // rows, tile, (dh, d_head))


def _local_backward(hidden, head, labels, lse, g, s: _Setup):
  """(d hidden of these rows, d head of this device's block).

  Over ``vocab_axis`` the chunks travel the ring again, with their log-sum-
  exps and their d hidden, which each rank adds its block's part to; the
  head's gradient stays on its rank."""
  rows = hidden.shape
  hidden, labels = _gather_rows(hidden, labels, s)
  hidden, labels = _gather_tokens(hidden, labels, s)
  h, y = _chunks(hidden, labels, s)
  dh, d_head = _zeros(h.shape, h, y, head), _zeros(head.shape, h, y, head)
  if s.vocab_axis is None or s.gather_tokens:
    dh, d_head = _block_grads(h, y, lse, head, g, dh, d_head, s)
  else:

    def step(moving, d_head):
      h, y, lse, dh = moving
      dh, d_head = _block_grads(h, y, lse, head, g, dh, d_head, s)
      return (h, y, lse, dh), d_head

    dh, d_head = _ring(step, (h, y, lse, dh), d_head, lambda moving: moving[3], s)
  n = hidden.shape[0] * hidden.shape[1]
  dh = dh.reshape(-1, rows[-1])[:n].reshape(hidden.shape)
  if s.gather_tokens:  # each block's part of every token's: summed, and home
    dh = jax.lax.psum_scatter(dh, s.vocab_axis, scatter_dimension=1, tiled=True)
  # Each block's dh is a partial sum over its part of the vocabulary. (Every
  # rank's g is the same: the step sums the ranks' CE sums.)
  if _gathers_rows(s):
    assert s.where is not None  # _gathers_rows says so
    dh = jax.lax.psum_scatter(dh, s.where.batch, scatter_dimension=0, tiled=True)
    rest = tuple(a for a in _auto_axes(s) if a != s.where.batch)
  else:
    rest = _auto_axes(s)
  dh = jax.lax.psum(dh, rest) if rest else dh
  if s.where is not None and s.where.batch is not None and not _gathers_rows(s):
    d_head = jax.lax.psum(d_head, s.where.batch)  # every dp shard's rows use the same head
  return dh.astype(hidden.dtype), d_head.astype(head.dtype)


# Vocabulary rows per tile of the backward: a tile's gradient of about 2**24
# float32 values (64 MiB).
TILE_VALUES = 1 << 24


def _vocab_tile(rows: int, width: int) -> int:
  """The largest divisor of ``rows`` with at most TILE_VALUES // width values' worth of rows."""
  top = max(1, TILE_VALUES // max(width, 1))
  return max(d for d in range(1, min(rows, top) + 1) if rows % d == 0)


def _specs(s: _Setup):
  """shard_map specs: (rows, head, the CE sum [1], log-sum-exp [K, C]).

  When the batch axis also splits the vocabulary, every device of it
  computes the sum and log-sum-exps of ALL rows (from all-gathered hidden
  states, which check_vma types as varying): each keeps its own copy,
  stacked over the batch axis, and the first is the answer."""
  assert s.where is not None  # only a head split over its vocabulary has specs
  batch = s.where.batch
  return P(batch), P(s.where.table_axes), P(batch) if _gathers_rows(s) else P(), P(batch)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ce_sum(hidden, head, labels, s: _Setup):
  return _ce_forward(hidden, head, labels, s)[0]


def _ce_forward(hidden, head, labels, s: _Setup):
  if s.where is None:
    total, lse = _local_forward(hidden, head, labels, s)
  else:
    rows, block, total_spec, lse_spec = _specs(s)
    total, lse = jax.shard_map(
      functools.partial(_local_forward, s=s),
      in_specs=(rows, block, rows),
      out_specs=(total_spec, lse_spec),
      axis_names=set(s.where.auto),
    )(hidden, head, labels)
  return total[0], (hidden, head, labels, lse)


def _ce_backward(s: _Setup, residuals, g):
  hidden, head, labels, lse = residuals
  if s.where is None:
    dh, d_head = _local_backward(hidden, head, labels, lse, g, s)
  else:
    rows, block, _, lse_spec = _specs(s)
    dh, d_head = jax.shard_map(
      functools.partial(_local_backward, s=s),
      in_specs=(rows, block, rows, lse_spec, P()),
      out_specs=(rows, block),
      axis_names=set(s.where.auto),
    )(hidden, head, labels, lse, g)
  # Inside the ring's shard_map every cp rank used the same head on its own
  # tokens: the head's gradient is the sum over those ranks.
  spread = tuple(sorted(varying_axes(d_head) - s.head_vma))
  return dh, jax.lax.psum(d_head, spread) if spread else d_head, None


_ce_sum.defvjp(_ce_forward, _ce_backward)
