"""Where every token lives: the sequence layout of a context-parallel shard.

A sequence of ``original_seq_len`` tokens is padded on the right to
``padded_seq_len`` and split over ``cp_size`` ranks, each holding
``local_seq_len = padded_seq_len // cp_size`` tokens:

* ``"contiguous"``: rank r owns global tokens ``[r*L, (r+1)*L)``.
* ``"load_balanced"``: the padded sequence is cut into ``2*cp`` chunks of
  ``C = L // 2`` tokens and rank r owns chunk ``r`` followed by chunk
  ``2*cp - 1 - r`` (head-tail, a.k.a. zigzag), so every rank does the same
  amount of causal-attention work.

Everything else in cpjax (batch sharding, masks, ring attention) is written in
terms of *global* token indices, so it works for either layout unchanged.

Shape letters: ``S`` padded global length, ``L`` local length.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from cpjax import validation

__all__ = [
    "LAYOUT_KINDS",
    "ShardLayout",
    "local_token_indices",
    "padded_length",
    "rank_order",
]

LAYOUT_KINDS = ("contiguous", "load_balanced")


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
    kind: ``"contiguous"`` or ``"load_balanced"``.
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
  kind: str = "contiguous"
  replicated_keys: tuple[str, ...] = dataclasses.field(default=(), compare=False)

  def __post_init__(self):
    validation.integer("original_seq_len", self.original_seq_len, minimum=1)
    validation.integer("padded_seq_len", self.padded_seq_len, minimum=1)
    validation.integer("cp_size", self.cp_size, minimum=1)
    if self.kind not in LAYOUT_KINDS:
      raise ValueError(f"kind must be one of {LAYOUT_KINDS}, got {self.kind!r}")
    if self.padded_seq_len < self.original_seq_len:
      raise ValueError(
          f"padded_seq_len ({self.padded_seq_len}) must be >= original_seq_len"
          f" ({self.original_seq_len})")
    divisor = self.num_chunks
    if self.padded_seq_len % divisor:
      raise ValueError(
          f"padded_seq_len must be a multiple of {divisor} for a {self.kind!r}"
          f" layout with cp_size={self.cp_size}, got {self.padded_seq_len}")
    object.__setattr__(self, "replicated_keys", tuple(self.replicated_keys))

  @property
  def local_seq_len(self) -> int:
    """Tokens held by each rank (``L``)."""
    return self.padded_seq_len // self.cp_size

  @property
  def num_chunks(self) -> int:
    """Number of equal contiguous chunks the padded sequence is cut into."""
    return self.cp_size * (2 if self.kind == "load_balanced" else 1)

  @property
  def chunk_len(self) -> int:
    """Length of one contiguous run of global tokens on a rank."""
    return self.padded_seq_len // self.num_chunks

  @property
  def pad_len(self) -> int:
    return self.padded_seq_len - self.original_seq_len

  def rank_chunks(self, rank: int) -> tuple[int, ...]:
    """The global chunk indices rank ``rank`` holds, in local order."""
    if self.kind == "contiguous":
      return (rank,)
    return (rank, 2 * self.cp_size - 1 - rank)


def padded_length(seq_len: int, cp_size: int, *, kind: str = "contiguous",
                  pad_multiple: int = 1) -> int:
  """The padded length ``shard_batch`` uses for ``seq_len`` tokens.

  Rounds up to a multiple of ``cp_size * max(pad_multiple, 2)`` (as the
  original, in both layouts) and, for ``"load_balanced"``, also of
  ``2 * cp_size`` (they differ only for odd ``pad_multiple`` > 2).

  >>> padded_length(6, 2), padded_length(7, 3, pad_multiple=4)
  (8, 12)
  """
  validation.integer("seq_len", seq_len, minimum=1)
  validation.integer("cp_size", cp_size, minimum=1)
  validation.integer("pad_multiple", pad_multiple, minimum=1)
  if kind not in LAYOUT_KINDS:
    raise ValueError(f"layout must be one of {LAYOUT_KINDS}, got {kind!r}")
  multiple = cp_size * max(pad_multiple, 2)
  if kind == "load_balanced":
    multiple = math.lcm(multiple, 2 * cp_size)
  return -(-seq_len // multiple) * multiple


def local_token_indices(layout: ShardLayout, rank) -> jax.Array:
  """Global (padded) token index of each local position of ``rank``.

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
      isinstance(rank, (int, np.integer)) or (
          hasattr(rank, "dtype") and jnp.ndim(rank) == 0
          and jnp.issubdtype(jnp.result_type(rank), jnp.integer))):
    raise TypeError(f"rank must be an int or an integer scalar array, got "
                    f"{type(rank).__name__} ({rank!r})")
  if not isinstance(rank, jax.core.Tracer) and not 0 <= int(rank) < layout.cp_size:
    raise ValueError(f"rank must be in [0, {layout.cp_size}), got {int(rank)}")
  c = layout.chunk_len
  offsets = jnp.arange(c, dtype=jnp.int32)
  rank = jnp.asarray(rank, jnp.int32)
  if layout.kind == "contiguous":
    return rank * c + offsets
  tail = 2 * layout.cp_size - 1 - rank
  return jnp.concatenate([rank * c + offsets, tail * c + offsets])


def rank_order(layout: ShardLayout) -> np.ndarray:
  """int[S] numpy: the global index at each position of the rank-ordered array.

  ``x_rank_ordered = x_global[..., rank_order(layout)]``; its inverse
  permutation (``np.argsort``) restores global order.

  >>> rank_order(ShardLayout(8, 8, 2, "load_balanced")).tolist()
  [0, 1, 6, 7, 2, 3, 4, 5]
  """
  if not isinstance(layout, ShardLayout):
    raise TypeError(f"layout must be a ShardLayout, got {type(layout).__name__}")
  c = layout.chunk_len
  chunks = [ch for r in range(layout.cp_size) for ch in layout.rank_chunks(r)]
  return np.concatenate([np.arange(ch * c, (ch + 1) * c) for ch in chunks])
