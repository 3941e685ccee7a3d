"""Mask rules: the token-level predicate, the block map and the reach of each rule.

See :mod:`cpjax.masks` for the rules' semantics; the mask object that pairs a
rule with its per-token arrays is :mod:`cpjax.masks._attention_mask`.

Shape letters: ``B`` batch (``B'`` is B or 1), ``Q``/``K`` query and key
tokens, ``nq``/``nk`` query and key blocks.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
  "ARRAY_KINDS",
  "AllOf",
  "AnyOf",
  "BlockMap",
  "KeyNotPadding",
  "LocalWindow",
  "MaskRule",
  "Reach",
  "SameDocument",
  "SameVisionGroup",
  "Tokens",
]

_BIG = np.iinfo(np.int32).max
ARRAY_KINDS = ("int", "bool")


# --------------------------------------------------------------- the inputs
class Tokens(NamedTuple):
  """What a rule may know about a set of tokens.

  Fields:
    positions: int32[T] global (padded) token indices.
    arrays: {name: [B, T]} per-token arrays (document ids, padding, ...).
  """

  positions: jax.Array
  arrays: Mapping[str, jax.Array]

  def slice(self, start: int | jax.Array, size: int) -> "Tokens":
    """Tokens ``[start, start + size)`` (``start`` may be traced)."""
    cut = lambda x, axis: jax.lax.dynamic_slice_in_dim(x, start, size, axis)  # noqa: E731
    return Tokens(cut(self.positions, 0), {n: cut(x, 1) for n, x in self.arrays.items()})

  def blocks(self, size: int) -> jax.Array:
    """int32[n, size]: the positions cut into blocks of ``size`` tokens."""
    t = self.positions.shape[0]
    if t % size:
      raise ValueError(f"block size {size} must divide the token count {t}")
    return jnp.asarray(self.positions).reshape(t // size, size)

  def array_blocks(self, name: str, size: int) -> jax.Array:
    """[B, n, size]: per-token array ``name`` cut into blocks."""
    x = jnp.asarray(self.arrays[name])
    return x.reshape(x.shape[0], x.shape[1] // size, size)


class BlockMap(NamedTuple):
  """Tri-state classification of (query block, key block) pairs.

  Fields (bool[B', nq, nk]): ``any`` False means *empty* (no allowed pair);
  ``all`` True means *full* (no masked pair); otherwise *partial*. Both are
  conservative: ``any`` may say True for an empty block, ``all`` may say False
  for a full one, never the other way round.
  """

  any: jax.Array
  all: jax.Array

  def states(self) -> jax.Array:
    """int8[B', nq, nk]: 0 empty, 1 partial, 2 full."""
    return jnp.where(self.all, 2, jnp.where(self.any, 1, 0)).astype(jnp.int8)


class Reach(NamedTuple):
  """How far an allowed key can be from its query, in global tokens.

  ``behind``: the largest ``q - k``; ``ahead``: the largest ``k - q``;
  ``None`` means unbounded.
  """

  behind: int | None
  ahead: int | None


def _min_reach(a, b):
  return b if a is None else a if b is None else min(a, b)


def _max_reach(a, b):
  return None if a is None or b is None else max(a, b)


def _id_ranges(ids, valid):
  """(lo, hi) int32[B, n] of the valid ids of each block (lo > hi: none)."""
  lo = jnp.min(jnp.where(valid, ids, _BIG), axis=-1)
  hi = jnp.max(jnp.where(valid, ids, -1), axis=-1)
  return lo, hi


def _group_blocks(q_ids, q_valid, k_ids, k_valid) -> BlockMap:
  """Block map of ``ids[q] == ids[k] and valid[q]`` from per-block id ranges.

  Some pair can match only where the query block's range of valid ids meets
  the key block's; every pair matches only where both blocks hold one single
  valid id, the same one.
  """
  q_lo, q_hi = _id_ranges(q_ids, q_valid)
  k_lo, k_hi = _id_ranges(k_ids, k_valid)
  overlap = jnp.maximum(q_lo[:, :, None], k_lo[:, None, :]) <= jnp.minimum(
    q_hi[:, :, None], k_hi[:, None, :]
  )
  q_pure = jnp.all(q_valid, axis=-1) & (q_lo == q_hi)
  k_pure = jnp.all(k_valid, axis=-1) & (k_lo == k_hi)
  same = q_pure[:, :, None] & k_pure[:, None, :] & (q_lo[:, :, None] == k_lo[:, None, :])
  return BlockMap(overlap, same)


# ---------------------------------------------------------------- the rules
class MaskRule:
  """A rule on (query token, key token) pairs; subclasses are frozen dataclasses.

  Class attribute ``arrays``: ``{name: "int" | "bool"}``, the per-token
  arrays the rule reads from :class:`Tokens`.
  """

  arrays: ClassVar[Mapping[str, str]] = {}

  def array_kinds(self) -> dict[str, str]:
    """``{name: kind}`` of every per-token array this rule (tree) reads."""
    return dict(self.arrays)

  def allowed(self, q: Tokens, k: Tokens) -> jax.Array:
    """bool, broadcastable to [B', Q, K]: may query q attend to key k?"""
    raise NotImplementedError

  def classify(self, q: Tokens, k: Tokens, block_q: int, block_kv: int) -> BlockMap:
    """Conservative tri-state map of the blocks of ``block_q`` x ``block_kv`` tokens."""
    raise NotImplementedError

  def reach(self) -> Reach:
    """The farthest an allowed key can be from its query."""
    raise NotImplementedError

  def __and__(self, other: "MaskRule") -> "AllOf":
    return AllOf(self, other)

  def __or__(self, other: "MaskRule") -> "AnyOf":
    return AnyOf(self, other)


def _check_reach(name: str, value) -> None:
  if value is not None and (
    isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0
  ):
    raise ValueError(f"{name} must be an int >= 0 or None (unbounded), got {value!r}")


@dataclasses.dataclass(frozen=True)
class LocalWindow(MaskRule):
  """Keys within ``left`` tokens behind and ``right`` tokens ahead of the query.

  ``LocalWindow(None, 0)`` is causal, ``LocalWindow(W - 1, 0)`` a causal
  sliding window of W tokens (the query included), ``LocalWindow(None, None)``
  no restriction at all.

  >>> q = Tokens(np.arange(3), {})
  >>> np.asarray(LocalWindow(1, 0).allowed(q, q)[0]).astype(int).tolist()
  [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
  >>> np.asarray(LocalWindow(None, 0).classify(Tokens(np.arange(4), {}), Tokens(np.arange(4), {}),
  ...                                          2, 2).states()[0]).tolist()   # causal
  [[1, 0], [2, 1]]
  """

  left: int | None = None
  right: int | None = 0

  def __post_init__(self):
    _check_reach("left", self.left)
    _check_reach("right", self.right)

  def allowed(self, q: Tokens, k: Tokens) -> jax.Array:
    d = jnp.asarray(q.positions)[:, None] - jnp.asarray(k.positions)[None, :]  # q - k
    ok = jnp.ones(d.shape, bool)
    if self.left is not None:
      ok &= d <= self.left
    if self.right is not None:
      ok &= -d <= self.right
    return ok[None]

  def classify(self, q: Tokens, k: Tokens, block_q: int, block_kv: int) -> BlockMap:
    qb, kb = q.blocks(block_q), k.blocks(block_kv)
    q_lo, q_hi = qb.min(-1)[:, None], qb.max(-1)[:, None]
    k_lo, k_hi = kb.min(-1)[None, :], kb.max(-1)[None, :]
    some = jnp.ones((qb.shape[0], kb.shape[0]), bool)
    every = some
    if self.left is not None:  # q - k <= left
      some, every = some & (q_lo - k_hi <= self.left), every & (q_hi - k_lo <= self.left)
    if self.right is not None:  # k - q <= right
      some, every = some & (k_lo - q_hi <= self.right), every & (k_hi - q_lo <= self.right)
    return BlockMap(some[None], every[None])

  def reach(self) -> Reach:
    return Reach(self.left, self.right)


@dataclasses.dataclass(frozen=True)
class SameDocument(MaskRule):
  """Tokens of one packed document: ``document_ids[q] == document_ids[k] > 0`` (0 = pad).

  >>> t = Tokens(np.arange(3), {"document_ids": np.array([[1, 1, 2]])})
  >>> np.asarray(SameDocument().allowed(t, t)[0]).astype(int).tolist()
  [[1, 1, 0], [1, 1, 0], [0, 0, 1]]
  """

  arrays: ClassVar[Mapping[str, str]] = {"document_ids": "int"}

  def allowed(self, q: Tokens, k: Tokens) -> jax.Array:
    dq, dk = q.arrays["document_ids"][:, :, None], k.arrays["document_ids"][:, None, :]
    return (dq == dk) & (dq > 0)

  def classify(self, q: Tokens, k: Tokens, block_q: int, block_kv: int) -> BlockMap:
    qs, ks = q.array_blocks("document_ids", block_q), k.array_blocks("document_ids", block_kv)
    return _group_blocks(qs, qs > 0, ks, ks > 0)

  def reach(self) -> Reach:
    return Reach(None, None)


@dataclasses.dataclass(frozen=True)
class KeyNotPadding(MaskRule):
  """Keys that are not padding: ``not padding_mask[k]`` (True = pad).

  >>> t = Tokens(np.arange(3), {"padding_mask": np.array([[False, False, True]])})
  >>> np.asarray(KeyNotPadding().allowed(t, t)).astype(int).tolist()
  [[[1, 1, 0]]]
  """

  arrays: ClassVar[Mapping[str, str]] = {"padding_mask": "bool"}

  def allowed(self, q: Tokens, k: Tokens) -> jax.Array:
    return ~k.arrays["padding_mask"][:, None, :]

  def classify(self, q: Tokens, k: Tokens, block_q: int, block_kv: int) -> BlockMap:
    pad = k.array_blocks("padding_mask", block_kv)
    return BlockMap(jnp.any(~pad, axis=-1)[:, None, :], ~jnp.any(pad, axis=-1)[:, None, :])

  def reach(self) -> Reach:
    return Reach(None, None)


@dataclasses.dataclass(frozen=True)
class SameVisionGroup(MaskRule):
  """Tokens of one image: ``vision_group_ids[q] == vision_group_ids[k] >= 0`` (-1 = text).

  Combined with ``|``, it lets an image attend to itself in both directions.

  >>> t = Tokens(np.arange(3), {"vision_group_ids": np.array([[-1, 0, 0]])})
  >>> np.asarray(SameVisionGroup().allowed(t, t)[0]).astype(int).tolist()
  [[0, 0, 0], [0, 1, 1], [0, 1, 1]]
  """

  arrays: ClassVar[Mapping[str, str]] = {"vision_group_ids": "int"}

  def allowed(self, q: Tokens, k: Tokens) -> jax.Array:
    gq, gk = q.arrays["vision_group_ids"][:, :, None], k.arrays["vision_group_ids"][:, None, :]
    return (gq == gk) & (gq >= 0)

  def classify(self, q: Tokens, k: Tokens, block_q: int, block_kv: int) -> BlockMap:
    qg = q.array_blocks("vision_group_ids", block_q)
    kg = k.array_blocks("vision_group_ids", block_kv)
    return _group_blocks(qg, qg >= 0, kg, kg >= 0)

  def reach(self) -> Reach:
    return Reach(None, None)


def _flatten(cls, rules):
  out = []
  for rule in rules:
    if not isinstance(rule, MaskRule):
      raise TypeError(f"{cls.__name__} takes MaskRule objects, got {type(rule).__name__}")
    out.extend(rule.rules if isinstance(rule, cls) else (rule,))
  return tuple(out)


class _Combination(MaskRule):
  rules: tuple[MaskRule, ...]
  # Each subclass's connective: of two masks, and of two reaches.
  _join: ClassVar[Callable[[Any, Any], Any]]
  _reach: ClassVar[Callable[[Any, Any], Any]]

  def __init__(self, *rules: MaskRule):
    if not rules:
      raise ValueError(f"{type(self).__name__} needs at least one rule")
    object.__setattr__(self, "rules", _flatten(type(self), rules))

  def __eq__(self, other):
    return type(self) is type(other) and self.rules == other.rules

  def __hash__(self):
    return hash((type(self).__name__, self.rules))

  def __setattr__(self, name, value):
    raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

  def __repr__(self):
    return f"{type(self).__name__}({', '.join(map(repr, self.rules))})"

  def allowed(self, q: Tokens, k: Tokens) -> jax.Array:
    return functools.reduce(self._join, (r.allowed(q, k) for r in self.rules))

  def classify(self, q: Tokens, k: Tokens, block_q: int, block_kv: int) -> BlockMap:
    # Both fields combine with the rule's own connective: it is exact for
    # "allowed" and stays conservative for "any" and "all".
    maps = [r.classify(q, k, block_q, block_kv) for r in self.rules]
    return BlockMap(
      functools.reduce(self._join, (m.any for m in maps)),
      functools.reduce(self._join, (m.all for m in maps)),
    )

  def reach(self) -> Reach:
    reaches = [r.reach() for r in self.rules]
    return Reach(
      functools.reduce(self._reach, (r.behind for r in reaches)),
      functools.reduce(self._reach, (r.ahead for r in reaches)),
    )

  def array_kinds(self):
    kinds: dict[str, str] = {}
    for rule in self.rules:
      for name, kind in rule.array_kinds().items():
        if kinds.setdefault(name, kind) != kind:
          raise ValueError(f"rules disagree on per-token array {name!r}: {kinds[name]} and {kind}")
    return kinds


class AllOf(_Combination):
  """A pair is allowed when every rule allows it (``a & b``).

  Block maps: empty if any rule's is, full if every rule's is; reach: the
  smallest.
  """

  _join: ClassVar[Callable[[Any, Any], Any]] = staticmethod(jnp.logical_and)
  _reach = staticmethod(_min_reach)


class AnyOf(_Combination):
  """A pair is allowed when some rule allows it (``a | b``).

  Block maps: empty if every rule's is, full if any rule's is; reach: the
  largest.
  """

  _join: ClassVar[Callable[[Any, Any], Any]] = staticmethod(jnp.logical_or)
  _reach = staticmethod(_max_reach)
