"""The attention mask as an object: rules on global token indices and per-token ids.

A mask rule answers three questions, and each rule class is the ONE place
that answers them for its rule:

* ``allowed(q, k)``: the token-level predicate, bool[B', Q, K];
* ``classify(q, k, block_q, block_kv)``: the conservative tri-state block map
  (empty / partial / full, as splash attention's ``MaskInfo``): a block called
  empty has no allowed pair, a block called full has no masked pair;
* ``reach()``: how far, in global tokens, an allowed key can sit behind or
  ahead of its query, which tells the ring how many hops it needs.

Rules compose with ``&`` (both allow) and ``|`` (either allows), and every
question composes with them. The standard cpjax mask (:meth:`AttentionMask.create`)
is, for query token q and key token k::

    (LocalWindow | SameVisionGroup) & SameDocument & KeyNotPadding

    LocalWindow(left, right):  q - left <= k <= q + right   (None: unbounded)
        causal = (None, 0); causal window W = (W-1, 0); bidirectional W = (W-1, W-1)
    SameVisionGroup:  vg[q] == vg[k] and vg[q] >= 0          (images attend both ways)
    SameDocument:     doc[q] == doc[k] and doc[q] > 0         (documents; 0 = pad)
    KeyNotPadding:    not pad[k]

Rules only see global indices and per-token arrays, so any layout
(contiguous, load-balanced) and any ring hop uses them unchanged. An
:class:`AttentionMask` pairs a static, hashable rule with the per-token arrays
it reads: a pytree whose leaves are those arrays.

Adding a rule is one class in :mod:`cpjax.masks._rules`: subclass :class:`MaskRule`,
declare the per-token arrays it reads in ``arrays``, and write the three methods.

Shape letters: ``B`` batch (``B'`` is B or 1), ``Q``/``K`` query and key
tokens, ``nq``/``nk`` query and key blocks.
"""

from cpjax.masks._attention_mask import MASK_KEYWORDS as MASK_KEYWORDS
from cpjax.masks._attention_mask import AttentionMask as AttentionMask
from cpjax.masks._attention_mask import MaskSpec as MaskSpec
from cpjax.masks._attention_mask import resolve_mask as resolve_mask
from cpjax.masks._rules import ARRAY_KINDS as ARRAY_KINDS
from cpjax.masks._rules import AllOf as AllOf
from cpjax.masks._rules import AnyOf as AnyOf
from cpjax.masks._rules import BlockMap as BlockMap
from cpjax.masks._rules import KeyNotPadding as KeyNotPadding
from cpjax.masks._rules import LocalWindow as LocalWindow
from cpjax.masks._rules import MaskRule as MaskRule
from cpjax.masks._rules import Reach as Reach
from cpjax.masks._rules import SameDocument as SameDocument
from cpjax.masks._rules import SameVisionGroup as SameVisionGroup
from cpjax.masks._rules import Tokens as Tokens

__all__ = [
  "AllOf",
  "AnyOf",
  "AttentionMask",
  "BlockMap",
  "KeyNotPadding",
  "LocalWindow",
  "MaskRule",
  "MaskSpec",
  "Reach",
  "SameDocument",
  "SameVisionGroup",
  "Tokens",
  "resolve_mask",
  "ARRAY_KINDS",
  "MASK_KEYWORDS",
]


def __getattr__(name: str) -> object:
  # SameSegment, the documents' rule's name in 0.1, resolves for one release
  # with a warning.
  from cpjax import _deprecations

  return _deprecations.moved_attribute(__name__, name)
