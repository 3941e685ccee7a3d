"""Where every token lives: the sequence layout of a context-parallel shard.

A sequence of ``original_seq_len`` tokens is padded on the right to
``padded_seq_len`` and split over ``cp_size`` ranks, each holding
``local_seq_len = padded_seq_len // cp_size`` tokens:

* ``"contiguous"``: rank r owns global tokens ``[r*L, (r+1)*L)``.
* ``"load_balanced"``: the padded sequence is cut into ``2*cp`` chunks of
  ``C = L // 2`` tokens and rank r owns chunk ``r`` followed by chunk
  ``2*cp - 1 - r`` (head-tail, a.k.a. zigzag), so every rank does the same
  amount of causal-attention work on ONE causal sequence.
* ``"document_balanced"``: for rows that pack many documents. The padded row
  is cut into ``R * cp`` stripes dealt to the ranks in a serpentine,
  ``0 .. cp-1, cp-1 .. 0, 0 .. cp-1, ...`` (``R = stripes``, even; ``R = 2``
  is the head-tail split), and the sharder reorders each row's whole
  documents (:mod:`cpjax.batch.balance`) so that every rank gets the same
  attention work. Neighbouring stripes sit on the same or neighbouring
  ranks, so a window no longer than a stripe still needs one hop each way.

A ``layout`` parameter that picks how a batch is split takes the kind's name
(a :data:`LayoutKind`) or a whole :class:`ShardLayout` (its kind, and where
the sharder reads it, exactly its stripes and padding); :func:`layout_kind`
reads either.

Everything else in cpjax (batch sharding, masks, ring attention) is written in
terms of *global* token indices, so it works for any layout unchanged. Under
``"document_balanced"`` a global index is a token's place in the reordered
row: documents stay whole and in order inside, so causal, window, document
and vision-group masks mean what they meant on the original row.

Shape letters: ``S`` padded global length, ``L`` local length.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from cpjax import checks
from cpjax.parallel import gather_dim

__all__ = [
  "LAYOUT_KINDS",
  "LayoutKind",
  "ShardLayout",
  "local_token_indices",
  "default_stripes",
  "from_rank_order",
  "layout_kind",
  "padded_length",
  "rank_order",
  "take_rows",
  "to_rank_order",
]

# A layout's kind, by name: the values of ShardLayout.kind.
LayoutKind = Literal["contiguous", "load_balanced", "document_balanced"]
LAYOUT_KINDS: tuple[LayoutKind, ...] = typing.get_args(LayoutKind)
# document_balanced: stripes of at least this many tokens (Gemma 4's longest
# sliding window), so windowed layers keep the one-hop ring; at most this
# many stripes per rank (more buys little balance, see benchmarks/document_balance.py).
MIN_STRIPE_LEN = 1024
MAX_STRIPES = 16


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class ShardLayout:
  """How a padded sequence is split over the ``cp`` ranks.

  A static (hashable, leaf-free pytree) description: it can be returned from
  ``jax.jit`` and passed as a static argument.

  Attributes:
    original_seq_len: tokens before padding.
    padded_seq_len: tokens after right-padding; a multiple of ``cp_size``
      (of ``2 * cp_size`` for ``"load_balanced"``).
    cp_size: number of ranks on the context-parallel axis.
    kind: one of :data:`LAYOUT_KINDS`.
    stripes: stripes per rank (``R``): 1 for ``"contiguous"``, 2 for
      ``"load_balanced"``, an even number for ``"document_balanced"``
      (None: :func:`default_stripes` of ``original_seq_len``).
    replicated_keys: batch keys that :func:`cpjax.shard_batch` left full
      length and replicated (``aux_only=True``), so that
      :func:`cpjax.unshard_batch` leaves them alone. Bookkeeping only: it does
      not take part in equality or hashing.

  Example:
    >>> layout = ShardLayout(6, 8, 2, kind="load_balanced")
    >>> layout.local_seq_len, layout.chunk_len
    (4, 2)
  """

  original_seq_len: int
  padded_seq_len: int
  cp_size: int
  kind: LayoutKind = "contiguous"
  replicated_keys: tuple[str, ...] = dataclasses.field(default=(), compare=False)
  stripes: int | None = None

  def __post_init__(self):
    checks.integer("original_seq_len", self.original_seq_len, minimum=1)
    checks.integer("padded_seq_len", self.padded_seq_len, minimum=1)
    checks.integer("cp_size", self.cp_size, minimum=1)
    if self.kind not in LAYOUT_KINDS:
      raise ValueError(f"kind must be one of {LAYOUT_KINDS}, got {self.kind!r}")
    fixed = {"contiguous": 1, "load_balanced": 2}.get(self.kind)
    stripes = self.stripes
    if stripes is None:
      stripes = fixed or default_stripes(self.original_seq_len, self.cp_size)
    checks.integer("stripes", stripes, minimum=1)
    if fixed is not None and stripes != fixed:
      raise ValueError(f"a {self.kind!r} layout has stripes={fixed}, got {stripes}")
    if fixed is None and stripes % 2:
      raise ValueError(
        f"a {self.kind!r} layout needs an even number of stripes per rank "
        f"(each pair of passes balances a causal run), got {stripes}"
      )
    object.__setattr__(self, "stripes", stripes)
    if self.padded_seq_len < self.original_seq_len:
      raise ValueError(
        f"padded_seq_len ({self.padded_seq_len}) must be >= original_seq_len"
        f" ({self.original_seq_len})"
      )
    divisor = self.num_chunks
    if self.padded_seq_len % divisor:
      raise ValueError(
        f"padded_seq_len must be a multiple of {divisor} for a {self.kind!r}"
        f" layout with cp_size={self.cp_size}, got {self.padded_seq_len}"
      )
    object.__setattr__(self, "replicated_keys", tuple(self.replicated_keys))

  @property
  def local_seq_len(self) -> int:
    """Tokens held by each rank (``L``)."""
    return self.padded_seq_len // self.cp_size

  @property
  def num_chunks(self) -> int:
    """Number of equal contiguous chunks the padded sequence is cut into."""
    assert self.stripes is not None  # __post_init__ fills it
    return self.cp_size * self.stripes

  @property
  def chunk_len(self) -> int:
    """Length of one contiguous run of global tokens on a rank."""
    return self.padded_seq_len // self.num_chunks

  @property
  def pad_len(self) -> int:
    return self.padded_seq_len - self.original_seq_len

  def rank_chunks(self, rank: int) -> tuple[int, ...]:
    """Return the global chunk indices rank ``rank`` holds, in local order.

    One per pass of the serpentine (forward on even passes, backward on odd ones).

    Args:
      rank: the rank, in ``[0, cp_size)``.

    Returns:
      The rank's global chunk indices, in local order.
    """
    cp = self.cp_size
    assert self.stripes is not None  # __post_init__ fills it
    return tuple(k * cp + (rank if k % 2 == 0 else cp - 1 - rank) for k in range(self.stripes))


def layout_kind(layout: LayoutKind | ShardLayout) -> LayoutKind:
  """Return the kind of ``layout``: a :data:`LayoutKind` as it is, or a
  :class:`ShardLayout`'s ``kind``.

  The one place a ``layout`` parameter is read in either form.

  Args:
    layout: a :data:`LayoutKind` or a :class:`ShardLayout`.

  Returns:
    The :data:`LayoutKind`.

  >>> layout_kind("contiguous"), layout_kind(ShardLayout(6, 8, 2, "load_balanced"))
  ('contiguous', 'load_balanced')
  >>> layout_kind("zigzag")
  Traceback (most recent call last):
  ...
  ValueError: layout must be one of ('contiguous', ..., 'document_balanced') or a ShardLayout,
  got 'zigzag'
  """
  if isinstance(layout, ShardLayout):
    return layout.kind
  if not isinstance(layout, str):
    raise TypeError(
      f"layout must be a layout kind ({', '.join(LAYOUT_KINDS)}) or a ShardLayout, "
      f"got {type(layout).__name__}"
    )
  if layout not in LAYOUT_KINDS:
    raise ValueError(f"layout must be one of {LAYOUT_KINDS} or a ShardLayout, got {layout!r}")
  return layout


def default_stripes(seq_len: int, cp_size: int, *, min_stripe_len: int = MIN_STRIPE_LEN) -> int:
  """Return the stripes per rank of a ``"document_balanced"`` layout of a row this long.

  The largest even ``R <= MAX_STRIPES`` whose stripes hold at least
  ``min_stripe_len`` tokens (2 when none does). :func:`padded_length` pads
  to a multiple of ``R * cp_size``, so padding never costs a stripe.

  More stripes balance a packed row more finely and cut the causal work of
  each rank into smaller triangles; a stripe at least as long as a sliding
  window keeps that window's ring at one hop each way (the stripes beside a
  stripe sit on the same or the neighbouring rank). So give the model's
  longest window as ``min_stripe_len``; the default, ``MIN_STRIPE_LEN``, is
  Gemma 4's longest.

  Args:
    seq_len: the row's length in tokens.
    cp_size: the number of CP ranks.
    min_stripe_len: the fewest tokens a stripe should hold.

  Returns:
    ``R``, the number of stripes per rank.

  >>> default_stripes(131072, 8), default_stripes(131071, 8), default_stripes(64, 2)
  (16, 14, 2)
  >>> default_stripes(32768, 8), default_stripes(32768, 8, min_stripe_len=256)
  (4, 16)
  """
  checks.integer("seq_len", seq_len, minimum=1)
  checks.integer("cp_size", cp_size, minimum=1)
  checks.integer("min_stripe_len", min_stripe_len, minimum=1)
  for r in range(MAX_STRIPES, 2, -2):
    if seq_len // (cp_size * r) >= min_stripe_len:
      return r
  return 2


def padded_length(
  seq_len: int,
  cp_size: int,
  *,
  kind: LayoutKind = "contiguous",
  pad_multiple: int = 1,
  chunk_multiple: int = 1,
  stripes: int | None = None,
) -> int:
  """Return the padded length ``shard_batch`` uses for ``seq_len`` tokens.

  Rounds up to a multiple of ``cp_size * max(pad_multiple, 2)`` (as the
  original, in every layout) and, for ``"load_balanced"``, also of
  ``2 * cp_size`` (they differ only for odd ``pad_multiple`` > 2). For
  ``"document_balanced"`` also of ``R * cp_size``, ``R`` = ``stripes`` (None:
  what :func:`default_stripes` gives a row of ``seq_len`` tokens). With
  ``chunk_multiple``, every chunk of the layout also holds a multiple of
  that many tokens (what a Pallas implementation's tiles need).

  Args:
    seq_len: the number of tokens.
    cp_size: the number of CP ranks.
    kind: the layout, ``"contiguous"``, ``"load_balanced"`` or
      ``"document_balanced"``.
    pad_multiple: the padded length is a multiple of ``cp_size * max(pad_multiple, 2)``.
    chunk_multiple: every chunk of the layout holds a multiple of this many tokens.
    stripes: ``R`` of a ``"document_balanced"`` layout (None: :func:`default_stripes`).

  Returns:
    The padded length.

  >>> padded_length(6, 2), padded_length(7, 3, pad_multiple=4)
  (8, 12)
  >>> padded_length(131071, 8, kind="document_balanced")   # 14 stripes per rank
  131152
  >>> padded_length(56, 2, kind="load_balanced", chunk_multiple=16)   # 4 chunks of 16
  64
  """
  checks.integer("seq_len", seq_len, minimum=1)
  checks.integer("cp_size", cp_size, minimum=1)
  checks.integer("pad_multiple", pad_multiple, minimum=1)
  checks.integer("chunk_multiple", chunk_multiple, minimum=1)
  if kind not in LAYOUT_KINDS:
    raise ValueError(f"layout must be one of {LAYOUT_KINDS}, got {kind!r}")
  fixed = {"contiguous": 1, "load_balanced": 2}.get(kind)
  if stripes is None:
    stripes = fixed or default_stripes(seq_len, cp_size)
  checks.integer("stripes", stripes, minimum=1)
  multiple = math.lcm(cp_size * max(pad_multiple, 2), cp_size * stripes * chunk_multiple)
  return -(-seq_len // multiple) * multiple


def local_token_indices(layout: ShardLayout, rank: int | jax.Array) -> jax.Array:
  """Return the global (padded) token index of each local position of ``rank``.

  Args:
    layout: the :class:`ShardLayout`.
    rank: an int in ``[0, cp_size)``, or an int32 scalar array; a traced rank
      (``jax.lax.axis_index("cp")``) cannot be range-checked, and one outside
      ``[0, cp_size)`` gives indices outside the sequence.

  Returns:
    int32[L] global indices, increasing within each chunk.

  Example:
    >>> import numpy as np
    >>> np.asarray(local_token_indices(ShardLayout(8, 8, 2, "load_balanced"), 1))
    array([2, 3, 4, 5], dtype=int32)
  """
  if not isinstance(layout, ShardLayout):
    raise TypeError(f"layout must be a ShardLayout, got {type(layout).__name__}")
  if isinstance(rank, (bool, np.bool_)) or not (
    isinstance(rank, (int, np.integer))
    or (
      hasattr(rank, "dtype")
      and jnp.ndim(rank) == 0
      and jnp.issubdtype(jnp.result_type(rank), jnp.integer)
    )
  ):
    raise TypeError(
      f"rank must be an int or an integer scalar array, got {type(rank).__name__} ({rank!r})"
    )
  if not isinstance(rank, jax.core.Tracer) and not 0 <= int(rank) < layout.cp_size:
    raise ValueError(f"rank must be in [0, {layout.cp_size}), got {int(rank)}")
  c, cp = layout.chunk_len, layout.cp_size
  rank = jnp.asarray(rank, jnp.int32)
  passes = jnp.arange(layout.stripes, dtype=jnp.int32)
  chunks = passes * cp + jnp.where(passes % 2 == 0, rank, cp - 1 - rank)
  return (chunks[:, None] * c + jnp.arange(c, dtype=jnp.int32)).reshape(-1)


def rank_order(layout: ShardLayout) -> np.ndarray:
  """Return the global index at each position of the rank-ordered array.

  ``x_rank_ordered = x_global[..., rank_order(layout)]``; its inverse
  permutation (``np.argsort``) restores global order.

  Args:
    layout: the :class:`ShardLayout`.

  Returns:
    int[S] numpy: the global index at each position of the rank-ordered array.

  >>> rank_order(ShardLayout(8, 8, 2, "load_balanced")).tolist()
  [0, 1, 6, 7, 2, 3, 4, 5]
  """
  if not isinstance(layout, ShardLayout):
    raise TypeError(f"layout must be a ShardLayout, got {type(layout).__name__}")
  c = layout.chunk_len
  chunks = [ch for r in range(layout.cp_size) for ch in layout.rank_chunks(r)]
  return np.concatenate([np.arange(ch * c, (ch + 1) * c) for ch in chunks])


# -- Moving arrays between natural and rank order ------------------------------


def take_rows(x: jax.Array, index: jax.Array, *, seq_dim: int, batch_dim: int | None) -> jax.Array:
  """Gather ``x`` along ``seq_dim`` with a per-row index int[B, T].

  Row b of the result takes positions ``index[b]`` (``batch_dim`` None: x has
  no batch dimension and every row of ``index`` must be the same; row 0 is used).

  Args:
    x: the array.
    index: int[B, T], the positions each row takes.
    seq_dim: ``x``'s sequence dimension.
    batch_dim: ``x``'s batch dimension, or None.

  Returns:
    ``x`` gathered along ``seq_dim``.
  """
  if batch_dim is None:
    return jnp.take(x, index[0], axis=seq_dim)
  shape = [1] * x.ndim
  shape[batch_dim], shape[seq_dim] = index.shape
  full = list(x.shape)
  full[seq_dim] = index.shape[1]
  return jnp.take_along_axis(x, jnp.broadcast_to(index.reshape(shape), full), axis=seq_dim)


def _check_layout(layout) -> None:
  if not isinstance(layout, ShardLayout):
    raise TypeError(f"layout must be a ShardLayout, got {type(layout).__name__}")


def _axis(x, axis: int | np.integer) -> int:
  ndim = jnp.ndim(x)
  if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) or not -ndim <= axis < ndim:
    raise ValueError(
      f"axis must be an int in [{-ndim}, {ndim}) for an array of shape "
      f"{tuple(jnp.shape(x))}, got {axis!r}"
    )
  return int(axis) % ndim


def _rows_index(x, layout: ShardLayout, axis: int, source_index, inverse: bool):
  """The per-row index of a ``"document_balanced"`` move (argsort: the inverse)."""
  index = checks.source_index(source_index, x, axis, layout.padded_seq_len)
  index = gather_dim(index, 1)
  return jnp.argsort(index, axis=1).astype(jnp.int32) if inverse else index


def to_rank_order(
  x: ArrayLike,
  layout: ShardLayout,
  *,
  axis: int = 1,
  pad_value: ArrayLike = 0,
  source_index: ArrayLike | None = None,
) -> jax.Array:
  """Reorder tokens from natural order to rank order, along ``axis``.

  ``x`` has ``layout.original_seq_len`` tokens on ``axis`` (it is then
  right-padded with ``pad_value``) or already ``layout.padded_seq_len``.
  Differentiable; works under ``jit``. On a mesh, a sharded ``axis`` is
  gathered first: the result is ready for :func:`jax.device_put` or
  ``jax.reshard`` onto the ``cp`` axis.

  Args:
    x: [..., S or original length, ...].
    layout: the :class:`cpjax.ShardLayout`.
    axis: the token axis.
    pad_value: value of padded tokens.
    source_index: int[B, S], the batch's ``_source_index`` (rank order,
      as :func:`cpjax.shard_batch` returns it); required by a
      ``"document_balanced"`` layout, whose order differs per row. B is the
      dimension before ``axis``.

  Returns:
    [..., S, ...], same dtype.

  Example:
    >>> import numpy as np, cpjax
    >>> lay = cpjax.ShardLayout(6, 8, 2, "load_balanced")
    >>> cpjax.to_rank_order(np.arange(1, 7)[None], lay).tolist()
    [[1, 2, 0, 0, 3, 4, 5, 6]]
  """
  _check_layout(layout)
  x = jnp.asarray(x)
  axis = _axis(x, axis)
  length = x.shape[axis]
  if length not in (layout.original_seq_len, layout.padded_seq_len):
    raise ValueError(
      f"x must have layout.original_seq_len = {layout.original_seq_len} (or "
      f"layout.padded_seq_len = {layout.padded_seq_len}) tokens on axis {axis}, "
      f"got shape {tuple(x.shape)}"
    )
  if length != layout.padded_seq_len:
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, layout.padded_seq_len - length)
    x = jnp.pad(x, widths, constant_values=jnp.asarray(pad_value, x.dtype))
  if layout.kind == "document_balanced":
    index = _rows_index(x, layout, axis, source_index, inverse=False)
    return take_rows(gather_dim(x, axis), index, seq_dim=axis, batch_dim=axis - 1)
  if layout.kind == "contiguous":
    return x
  return jnp.take(gather_dim(x, axis), jnp.asarray(rank_order(layout), jnp.int32), axis=axis)


def from_rank_order(
  x: ArrayLike, layout: ShardLayout, *, axis: int = 1, source_index: ArrayLike | None = None
) -> jax.Array:
  """Reorder tokens from rank order to natural order, along ``axis``; padding is kept.

  The inverse of :func:`to_rank_order`: slice ``[:layout.original_seq_len]``
  on ``axis`` to drop the padded tail.

  Args:
    x: [..., S, ...] in rank order (``layout.padded_seq_len`` on ``axis``).
    layout: the :class:`cpjax.ShardLayout`.
    axis: the token axis.
    source_index: as :func:`to_rank_order`.

  Returns:
    [..., S, ...] in natural order, same dtype.

  Example:
    >>> import numpy as np, cpjax
    >>> lay = cpjax.ShardLayout(6, 8, 2, "load_balanced")
    >>> cpjax.from_rank_order(np.array([[1, 2, 0, 0, 3, 4, 5, 6]]), lay).tolist()
    [[1, 2, 3, 4, 5, 6, 0, 0]]
  """
  _check_layout(layout)
  x = jnp.asarray(x)
  axis = _axis(x, axis)
  if x.shape[axis] != layout.padded_seq_len:
    raise ValueError(
      f"x must have layout.padded_seq_len = {layout.padded_seq_len} tokens on "
      f"axis {axis}, got shape {tuple(x.shape)}"
    )
  if layout.kind == "document_balanced":
    inverse = _rows_index(x, layout, axis, source_index, inverse=True)
    return take_rows(gather_dim(x, axis), inverse, seq_dim=axis, batch_dim=axis - 1)
  if layout.kind == "contiguous":
    return x
  inverse = jnp.asarray(np.argsort(rank_order(layout)), jnp.int32)
  return jnp.take(gather_dim(x, axis), inverse, axis=axis)
