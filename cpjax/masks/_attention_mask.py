"""The attention mask as an object: a static rule and the per-token arrays it reads.

:class:`AttentionMask` is a pytree whose leaves are the arrays; its rule is
static and hashable. :class:`MaskSpec` is the static part of the standard
mask, and :func:`resolve_mask` turns the attention functions' keywords into
an :class:`AttentionMask`. The rules are :mod:`cpjax.masks._rules`.

Shape letters: ``B`` batch, ``S`` tokens, ``T`` tokens the arrays cover.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from cpjax import _deprecations, checks
from cpjax.masks._rules import (
  ARRAY_KINDS,
  KeyNotPadding,
  LocalWindow,
  MaskRule,
  Reach,
  SameDocument,
  SameVisionGroup,
  Tokens,
)

__all__ = ["MASK_KEYWORDS", "AttentionMask", "MaskSpec", "resolve_mask"]


@dataclasses.dataclass(frozen=True)
class MaskSpec:
  """The static part of the standard mask: ``causal`` and ``sliding_window``.

  Attributes:
    causal: keys after the query are masked.
    sliding_window: ``W`` >= 1 (the window includes the query itself), or None.

  >>> MaskSpec(sliding_window=4).rule()
  LocalWindow(left=3, right=0)
  >>> MaskSpec(sliding_window=0)
  Traceback (most recent call last):
  ...
  ValueError: sliding_window must be an int >= 1 or None, got 0
  """

  causal: bool | np.bool_ = True
  sliding_window: int | np.integer | None = None

  def __post_init__(self):
    w = self.sliding_window
    if w is not None and (isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 1):
      raise ValueError(f"sliding_window must be an int >= 1 or None, got {w!r}")
    if not isinstance(self.causal, (bool, np.bool_)):
      raise TypeError(f"causal must be a bool, got {type(self.causal).__name__} ({self.causal!r})")

  def rule(self) -> LocalWindow:
    """The :class:`LocalWindow` these two fields describe."""
    w = None if self.sliding_window is None else int(self.sliding_window) - 1
    return LocalWindow(w, 0 if self.causal else w)


@dataclasses.dataclass(frozen=True)
class AttentionMask:
  """A mask rule and the per-token arrays it reads: a pytree (the arrays are its leaves).

  Build the standard mask with :meth:`create`, or any rule with
  ``AttentionMask(rule, {name: array})``. Arrays are [B, T]: [B, S] for global
  arrays, [B, L] (this rank's tokens) inside ``shard_map``.

  Attributes:
    rule: a static, hashable :class:`MaskRule` (a tree of them).
    arrays: ``{name: [B, T] array}``, exactly the arrays ``rule`` reads.

  Example:
    >>> m = AttentionMask.create(sliding_window=2, document_ids=np.array([[1, 1, 1, 2]]))
    >>> m.rule
    AllOf(LocalWindow(left=1, right=0), SameDocument())
    >>> np.asarray(m.allowed()[0]).astype(int).tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 0, 1]]
    >>> [x.shape for x in jax.tree.leaves(m)]
    [(1, 4)]
  """

  rule: MaskRule
  arrays: Mapping[str, jax.Array] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if not isinstance(self.rule, MaskRule):
      raise TypeError(f"rule must be a MaskRule, got {type(self.rule).__name__}")
    if not isinstance(self.arrays, Mapping):
      raise TypeError(
        f"arrays must be a mapping of name to array, got {type(self.arrays).__name__}"
      )
    kinds = self.rule.array_kinds()
    # The documents' array was "segment_ids" in 0.1: still taken, with a warning
    # that points at the caller (stacklevel 4: past this and the dataclass' __init__).
    if "document_ids" in kinds and "segment_ids" not in kinds:
      arrays = _deprecations.rename_keyword(
        "cpjax.AttentionMask.arrays", self.arrays, "segment_ids", "document_ids", stacklevel=4
      )
      object.__setattr__(self, "arrays", arrays)
    bad = {name: kind for name, kind in kinds.items() if kind not in ARRAY_KINDS}
    if bad:
      raise ValueError(f"per-token array kinds must be one of {ARRAY_KINDS}, got {bad}")
    need, have = set(kinds), set(self.arrays)
    if need != have:
      raise KeyError(
        f"the rule reads per-token arrays {sorted(need)}, got arrays "
        f"{sorted(have)} (missing {sorted(need - have)}, unused {sorted(have - need)})"
      )
    for name, x in self.arrays.items():
      # Leaves that are not arrays (a PartitionSpec tree of the same mask,
      # say) carry no shape to check; validate() checks shapes against B, T.
      if hasattr(x, "shape") and hasattr(x, "dtype"):
        _check_array_kind(name, x, kinds[name])
        if jnp.ndim(x) != 2:
          raise ValueError(f"mask array {name} must be 2-D [B, T], got shape {list(jnp.shape(x))}")
    object.__setattr__(self, "arrays", dict(sorted(self.arrays.items())))

  @classmethod
  @_deprecations.renamed_keywords("cpjax.AttentionMask.create", segment_ids="document_ids")
  def create(
    cls,
    *,
    causal: bool = True,
    sliding_window: int | None = None,
    document_ids: ArrayLike | None = None,
    padding_mask: ArrayLike | None = None,
    vision_group_ids: ArrayLike | None = None,
  ) -> "AttentionMask":
    """The standard mask ``(window | vision groups) & documents & key padding``.

    Args:
      causal: mask keys after the query.
      sliding_window: W >= 1, keys with ``q - k < W`` (``|q - k| < W`` when
        not causal).
      document_ids: int[B, T] document ids; 0 = pad, attends to nothing.
      padding_mask: bool[B, T], True = pad key.
      vision_group_ids: int[B, T]; tokens of one group (>= 0) attend to each
        other both ways, overriding causal and window.
    """
    rule: MaskRule = MaskSpec(causal=causal, sliding_window=sliding_window).rule()
    arrays: dict[str, Any] = {}  # as given: validate() makes them arrays
    if vision_group_ids is not None:
      rule = rule | SameVisionGroup()
      arrays["vision_group_ids"] = vision_group_ids
    if document_ids is not None:
      rule = rule & SameDocument()
      arrays["document_ids"] = document_ids
    if padding_mask is not None:
      rule = rule & KeyNotPadding()
      arrays["padding_mask"] = padding_mask
    return cls(rule, arrays)

  def validate(self, batch: int, length: int, *, where: str = "[B, S]") -> "AttentionMask":
    """Check every array is ``[batch, length]`` of its kind; ints become int32.

    Raises ``ValueError`` (shape) or ``TypeError`` (dtype) naming the array.
    """
    out = {}
    for name, kind in self.rule.array_kinds().items():
      x = self.arrays[name]
      shape = tuple(jnp.shape(x))
      if shape != (batch, length):
        raise ValueError(
          f"mask array {name} must have shape {where} = {[batch, length]}, got {list(shape)}"
        )
      _check_array_kind(name, x, kind)
      if kind == "int":
        checks.fits_int32(f"mask array {name}", x)
        x = jnp.asarray(x, jnp.int32)
      out[name] = jnp.asarray(x)
    return AttentionMask(self.rule, out)

  def tokens(self, positions: ArrayLike) -> Tokens:
    """The :class:`Tokens` of these arrays at global ``positions`` int[T]."""
    return Tokens(jnp.asarray(positions, jnp.int32), dict(self.arrays))

  def allowed(self, positions: ArrayLike | None = None) -> jax.Array:
    """bool[B', T, T], the dense mask of tokens at ``positions`` (default ``arange(T)``)."""
    if positions is None:
      lengths = {jnp.shape(x)[1] for x in self.arrays.values()}
      if len(lengths) != 1:
        raise ValueError(
          "pass positions: the mask has no per-token array to take T from"
          if not lengths
          else f"mask arrays disagree on T: {sorted(lengths)}"
        )
      positions = jnp.arange(lengths.pop())
    t = self.tokens(positions)
    allowed = self.rule.allowed(t, t)
    n = t.positions.shape[0]
    return jnp.broadcast_to(allowed, (allowed.shape[0], n, n))

  def reach(self) -> Reach:
    """The rule's :class:`Reach`."""
    return self.rule.reach()


def _check_array_kind(name: str, x, kind: str) -> None:
  dtype = jnp.result_type(x)
  if kind == "int" and not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(f"mask array {name} must have an integer dtype, got {dtype}")
  if kind == "bool" and dtype != jnp.bool_:
    raise TypeError(f"mask array {name} must be bool (True = pad), got {dtype}")


jax.tree_util.register_dataclass(AttentionMask, data_fields=["arrays"], meta_fields=["rule"])

MASK_KEYWORDS = ("causal", "sliding_window", "document_ids", "padding_mask", "vision_group_ids")


@_deprecations.renamed_keywords("cpjax.masks.resolve_mask", segment_ids="document_ids")
def resolve_mask(mask: AttentionMask | None = None, **keywords: Any) -> AttentionMask:
  """``mask``, or the standard mask the keywords of :meth:`AttentionMask.create` describe.

  Keywords left at None take :meth:`AttentionMask.create`'s defaults; giving
  ``mask`` and a keyword together is ambiguous and a ``ValueError``.

  >>> resolve_mask(sliding_window=3).rule
  LocalWindow(left=2, right=0)
  """
  unknown = sorted(set(keywords) - set(MASK_KEYWORDS))
  if unknown:
    raise TypeError(
      f"unexpected mask keyword(s) {unknown}; the mask keywords are {list(MASK_KEYWORDS)}"
    )
  given = {name: value for name, value in keywords.items() if value is not None}
  if mask is None:
    return AttentionMask.create(**given)
  if not isinstance(mask, AttentionMask):
    raise TypeError(f"mask must be a cpjax.AttentionMask, got {type(mask).__name__}")
  if given:
    raise ValueError(
      f"pass either mask= or the mask keywords, not both; got mask and {sorted(given)}"
    )
  return mask
