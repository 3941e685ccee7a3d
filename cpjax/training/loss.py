"""The loss: token-mean cross entropy, its exact reduction over the ranks, and
cross entropy straight from hidden states and the output head, never holding [L, V].

Shapes: ``B`` rows, ``L`` tokens per row, ``D`` width, ``V`` vocabulary,
``N = B * L`` tokens, ``C`` tokens per chunk.

The loss is ``sum(CE over labels != -100) / count(labels != -100)`` with both
sums reduced exactly (``psum``) across the ``cp`` axis and a data-parallel
axis when the mesh has one (:func:`cross_entropy_sums`), so it equals the
single-device loss of the same batch, and so do its gradients. A forward
returns logits, or :class:`cpjax.cp_context.HiddenStates` (the final hidden
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
``shard_map`` as this rank's block of rows, beside this rank's tokens. Each
rank all-gathers the ``cp`` ranks' hidden states and labels (``[B, S, D]``,
not ``[S, V]``), computes its block of every token's logits, and the
statistics combine over ``cp`` as over the Auto axes; each rank counts its
own tokens, and the hidden states' gradient returns to its ranks with a
reduce-scatter over ``cp``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from cpjax.batch import IGNORE_INDEX
from cpjax.cp_context import HiddenStates
from cpjax.kernels.common import vary_like, varying_axes
from cpjax.parallel import RowPlacement, gathered, row_placement

__all__ = ["LOSS_CHUNK_LOGITS", "cross_entropy", "cross_entropy_sums", "linear_cross_entropy",
           "token_cross_entropy"]

# Tokens per chunk of the chunked loss: about 2**26 logits (256 MiB of
# float32) per chunk whole, fewer per device when the head is split.
LOSS_CHUNK_LOGITS = 1 << 26


def cross_entropy(output, labels, *, ignore_index: int = IGNORE_INDEX):
  """(CE sum, count) of a forward's output: :func:`token_cross_entropy` of
  logits [B, L, V], or :func:`linear_cross_entropy` of :class:`HiddenStates`.

  >>> import numpy as np
  >>> out = HiddenStates(np.ones((1, 2, 3), np.float32), np.zeros((4, 3), np.float32))
  >>> s, n = cross_entropy(out, np.array([[1, -100]]))
  >>> round(float(s), 4), float(n)     # log(4), one token
  (1.3863, 1.0)
  """
  if isinstance(output, HiddenStates):
    # Chunks sized by the whole vocabulary, as with a head split over Auto
    # axes: a rank's block of a chunk's logits then shrinks with the split.
    vocab = output.head.shape[0] * (1 if output.head_axis is None
                                    else jax.lax.axis_size(output.head_axis))
    chunk = max(16, min(4096, LOSS_CHUNK_LOGITS // vocab))
    return linear_cross_entropy(output.hidden, output.head, labels, chunk_size=chunk,
                                logits_soft_cap=output.logits_soft_cap,
                                ignore_index=ignore_index, vocab_axis=output.head_axis)
  return token_cross_entropy(output, labels, ignore_index=ignore_index)


def token_cross_entropy(logits, labels, *, ignore_index: int = IGNORE_INDEX):
  """(sum of per-token CE, number of counted tokens), both float32 scalars.

  logits: [B, L, V]; labels: int[B, L] (``ignore_index`` = not counted).

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


def cross_entropy_sums(logits, labels, *, axis_names: tuple[str, ...] = ("cp",),
                       ignore_index: int = IGNORE_INDEX):
  """The CP loss reduction: (CE sum, token count) over every rank of ``axis_names``.

  Call it inside ``shard_map`` on this rank's logits [B, L, V] (or
  :class:`HiddenStates`) and labels int[B, L]; both sums are ``psum`` -ed over ``axis_names`` (the ``cp`` axis
  and a data-parallel axis), so ``ce_sum / count`` is the token-mean loss of
  the whole global batch on every rank, exactly the single-device loss, and
  differentiating it gives the single-device gradients. With
  ``axis_names=()`` it is :func:`token_cross_entropy`.

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
  ce_sum, count = cross_entropy(logits, labels, ignore_index=ignore_index)
  if not axis_names:
    return ce_sum, count
  return jax.lax.psum(ce_sum, tuple(axis_names)), jax.lax.psum(count, tuple(axis_names))



def linear_cross_entropy(hidden, head, labels, *, chunk_size: int = 1024,
                         logits_soft_cap: float | None = None,
                         ignore_index: int = IGNORE_INDEX, vocab_axis: str | None = None):
  """(sum of per-token CE, number of counted tokens), both float32 scalars:
  :func:`token_cross_entropy` of ``cap(hidden @ head.T)``.

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
    raise ValueError(f"hidden must be [B, L, D] and head [V, D] with the same D, got "
                     f"{hidden.shape} and {head.shape}")
  if labels.shape != hidden.shape[:2] or not jnp.issubdtype(labels.dtype, jnp.integer):
    raise ValueError(f"labels must be an integer [B, L] = {list(hidden.shape[:2])} array, got "
                     f"{labels.dtype}{list(labels.shape)}")
  if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
    raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
  if logits_soft_cap is not None and not logits_soft_cap > 0:
    raise ValueError(f"logits_soft_cap must be > 0 or None, got {logits_soft_cap!r}")
  where = row_placement(head, hidden.shape[0])
  if where is not None and not where.table_axes:   # not split by vocabulary: whole
    head, where = gathered(head), None
  tokens = hidden.shape[0] * hidden.shape[1] * (1 if vocab_axis is None
                                                 else jax.lax.axis_size(vocab_axis))
  setup = _Setup(min(chunk_size, max(tokens, 1)), logits_soft_cap, ignore_index, where,
                 varying_axes(head), vocab_axis)
  ce_sum = _ce_sum(hidden, head, labels, setup)
  return ce_sum, jnp.sum(labels != ignore_index, dtype=jnp.float32)


class _Setup(NamedTuple):
  chunk: int
  cap: float | None
  ignore_index: int
  where: RowPlacement | None    # the head split over its vocabulary (None: whole here)
  head_vma: frozenset[str]      # manual axes the head varies over (the ring's cp: none)
  vocab_axis: str | None = None  # a manual axis the head's rows are split over (the ring's cp)


def _vocab_axes(s: _Setup) -> tuple[str, ...]:
  """Every axis splitting the head's rows, major first: the manual one, then the Auto ones."""
  manual = () if s.vocab_axis is None else (s.vocab_axis,)
  return manual + (() if s.where is None else s.where.table_axes)


def _gather_tokens(hidden, labels, s: _Setup):
  """Every rank's tokens (rows gathered over the batch axis when it splits
  the vocabulary, tokens over ``vocab_axis``), and which of them are this
  rank's own: bool[B', L'], or None when all are."""
  if _gathers_rows(s):
    hidden = jax.lax.all_gather(hidden, s.where.batch, axis=0, tiled=True)
    labels = jax.lax.all_gather(labels, s.where.batch, axis=0, tiled=True)
  if s.vocab_axis is None:
    return hidden, labels, None
  length = hidden.shape[1]
  hidden = jax.lax.all_gather(hidden, s.vocab_axis, axis=1, tiled=True)
  labels = jax.lax.all_gather(labels, s.vocab_axis, axis=1, tiled=True)
  rank = jnp.arange(labels.shape[1]) // length
  own = jnp.broadcast_to(rank == jax.lax.axis_index(s.vocab_axis), labels.shape)
  return hidden, labels, own


def _gathers_rows(s: _Setup) -> bool:
  """Whether the batch axis also splits the vocabulary: then every device
  needs every row's hidden states against its block of the head."""
  return s.where is not None and s.where.batch in s.where.table_axes


def _chunks(hidden, labels, s: _Setup):
  """[K, C, D] hidden, int[K, C] labels, bool[K, C] counted: the tokens in
  chunks, padded with ignored tokens (they add nothing to either sum)."""
  n = hidden.shape[0] * hidden.shape[1]
  pad = -n % s.chunk
  h = jnp.pad(hidden.reshape(n, -1), ((0, pad), (0, 0))).reshape(-1, s.chunk, hidden.shape[-1])
  y = jnp.pad(labels.reshape(n), (0, pad), constant_values=s.ignore_index).reshape(-1, s.chunk)
  return h, y, y != s.ignore_index


def _chunked_mask(mask, s: _Setup):
  """bool[K, C]: ``mask`` [B, L] laid out as :func:`_chunks` lays out the tokens."""
  n = mask.size
  return jnp.pad(mask.reshape(n), (0, -n % s.chunk)).reshape(-1, s.chunk)


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
  (a scan carry must keep one type; check_vma)."""
  out = jnp.zeros(shape, jnp.float32)
  for ref in refs:
    out = vary_like(out, ref)
  return out


def _local_forward(hidden, head, labels, s: _Setup):
  """(CE sum of these rows, log-sum-exp per token [K, C]) on one device,
  with its block of the head; the blocks combine with small collectives."""
  axes = _vocab_axes(s)
  hidden, labels, own = _gather_tokens(hidden, labels, s)
  start = _block_start(head, s)
  h, y, valid = _chunks(hidden, labels, s)
  # Every token's statistics over this block of the vocabulary; the sum is
  # of this rank's own tokens.
  counted = valid if own is None else valid & _chunked_mask(own, s)

  def chunk(total, xs):
    hc, yc, vc = xs
    z, _ = _logits(hc, head, s.cap)
    top = jnp.max(z, axis=-1)
    top = jax.lax.pmax(top, axes) if axes else top
    sum_exp = jnp.sum(jnp.exp(z - top[:, None]), axis=-1)
    picked = jnp.sum(jnp.where(_is_label(z, yc, start), z, 0.0), axis=-1)
    if axes:
      sum_exp, picked = jax.lax.psum((sum_exp, picked), axes)
    lse = top + jnp.log(sum_exp)
    return total + jnp.sum(jnp.where(vc, lse - picked, 0.0)), lse

  total = _zeros((), hidden, labels)
  total, lse = jax.lax.scan(chunk, total, (h, y, counted))
  if s.where is not None and s.where.batch is not None and not _gathers_rows(s):
    total = jax.lax.psum(total, s.where.batch)    # rows split over dp: add them
  return total[None], lse


def _local_backward(hidden, head, labels, lse, g, s: _Setup):
  """(d hidden of these rows, d head of this device's block)."""
  axes = _vocab_axes(s)
  rows = hidden.shape
  hidden, labels, _ = _gather_tokens(hidden, labels, s)
  start = _block_start(head, s)

  h, y, valid = _chunks(hidden, labels, s)
  per_tile = _vocab_tile(head.shape[0], head.shape[1])

  def tile(dh, block):
    """One [Vt, D] tile of the head against every token chunk: its whole
    gradient, and its part of every token's dh. Tiling the vocabulary keeps
    a single [V, D] buffer (the gradient itself) alive, not an accumulator
    beside each chunk's product."""
    w, offset = block

    def chunk(d_w, xs):
      hc, yc, vc, lc = xs
      z, t = _logits(hc, w, s.cap)
      # d CE / d z = softmax - onehot on counted tokens; through the cap,
      # d (cap tanh(x / cap)) / dx = 1 - tanh^2.
      dz = jnp.exp(z - lc[:, None]) - _is_label(z, yc, start + offset)
      dz = jnp.where(vc[:, None], dz, 0.0) * g
      if t is not None:
        dz = dz * (1.0 - t * t)
      d_w = d_w + jnp.einsum("cv,cd->vd", dz, hc, preferred_element_type=jnp.float32)
      return d_w, jnp.einsum("cv,vd->cd", dz, w, preferred_element_type=jnp.float32)

    d_w, dh_part = jax.lax.scan(chunk, _zeros(w.shape, hidden, labels, head),
                                (h, y, valid, lse))
    return dh + dh_part, d_w

  tiles = head.reshape(-1, per_tile, head.shape[1])
  offsets = jnp.arange(tiles.shape[0], dtype=jnp.int32) * per_tile
  dh, d_head = jax.lax.scan(tile, _zeros(h.shape, hidden, labels, head), (tiles, offsets))
  d_head = d_head.reshape(head.shape)
  n = hidden.shape[0] * hidden.shape[1]
  dh = dh.reshape(-1, rows[-1])[:n].reshape(hidden.shape)
  # Each block's dh is a partial sum over its part of the vocabulary. (Every
  # rank's g is the same: the step sums the ranks' CE sums.)
  if s.vocab_axis is not None:
    dh = jax.lax.psum_scatter(dh, s.vocab_axis, scatter_dimension=1, tiled=True)
  if _gathers_rows(s):
    dh = jax.lax.psum_scatter(dh, s.where.batch, scatter_dimension=0, tiled=True)
  rest = tuple(a for a in axes if a != s.vocab_axis
               and not (_gathers_rows(s) and a == s.where.batch))
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
    total, lse = jax.shard_map(functools.partial(_local_forward, s=s),
                               in_specs=(rows, block, rows), out_specs=(total_spec, lse_spec),
                               axis_names=set(s.where.auto))(hidden, head, labels)
  return total[0], (hidden, head, labels, lse)


def _ce_backward(s: _Setup, residuals, g):
  hidden, head, labels, lse = residuals
  if s.where is None:
    dh, d_head = _local_backward(hidden, head, labels, lse, g, s)
  else:
    rows, block, _, lse_spec = _specs(s)
    dh, d_head = jax.shard_map(functools.partial(_local_backward, s=s),
                               in_specs=(rows, block, rows, lse_spec, P()),
                               out_specs=(rows, block),
                               axis_names=set(s.where.auto))(hidden, head, labels, lse, g)
  # Inside the ring's shard_map every cp rank used the same head on its own
  # tokens: the head's gradient is the sum over those ranks.
  spread = tuple(sorted(varying_axes(d_head) - s.head_vma))
  return dh, jax.lax.psum(d_head, spread) if spread else d_head, None


_ce_sum.defvjp(_ce_forward, _ce_backward)
