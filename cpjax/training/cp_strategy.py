"""Which CP strategy each attention layer kind takes: the rule ``cpjax plan``
shows and ``cpjax train`` follows by default (``parallel.strategy: auto``).

The rule reads the shapes :mod:`benchmarks.cp_strategies` measured with the
TPU and GPU compilers (one Gemma 4 layer's gradient per strategy, layer kind,
S and cp):

1. A bounded reach (a sliding window, without vision groups that override
   it) whose neighbours hold it takes the
   all-gather's halo: each rank receives the key blocks its window reaches
   (``W - 1`` keys a side, in whole tiles) where the ring sends whole chunks
   a hop, and holds ``L + halo`` keys, not ``3 L``.
2. K/V heads that cp splits (``Hkv`` and ``Hq`` multiples of cp) take
   Ulysses: all-to-alls of the local tensors and ``O(S/cp)`` memory, with no
   K/V head repeated.
3. Otherwise the all-gather, while the gathered row (K and V, and their
   float32 gradients in the backward) is at most 1/8 of a device's memory:
   few K/V heads (Gemma 4's global layers: 1 or 2, K = V in 26B-A4B) make it
   small beside the queries, and it sends fewer bytes than the ring's hops.
4. Past that share, the hybrid where K/V heads share a factor ``U`` with cp
   (:func:`cpjax.ring.hybrid_ulysses_size`): Ulysses inside groups of ``U``
   ranks keeps the ring's ``O(S/cp)`` memory, and the ring over the groups
   takes ``cp/U - 1`` hops of ``U`` times the tokens instead of ``cp - 1``:
   the same K/V bytes in fewer, longer hops, the all-to-alls' bytes besides.
5. The ring, which keeps ``O(S/cp)`` memory at any length.

The loss reads the same share (:func:`row_fits`): with ``auto`` it gathers
the row's hidden states over cp while they and their float32 gradient fit,
else its tokens travel the ring (:func:`cpjax.training.loss.cross_entropy`).

>>> from cpjax.models.gemma4 import Gemma4Config
>>> e2b = Gemma4Config.preset("e2b").text
>>> for kind, c in choose(e2b, seq_len=131072, cp=8).items():
...   print(kind, c.strategy)
full_attention all_gather
sliding_attention all_gather
>>> choose(e2b, seq_len=2**21, cp=8)["full_attention"].strategy   # a 2 GiB row, 1 K/V head
'ring'
>>> a4b = Gemma4Config.preset("a4b").text
>>> choose(a4b, seq_len=2**18, cp=8)["full_attention"].strategy   # a 3 GiB row, 2 K/V heads
'hybrid'
"""

from __future__ import annotations

import math
from typing import NamedTuple

from cpjax.layout import ShardLayout
from cpjax.masks import MaskSpec
from cpjax.ring import halo, hybrid_ulysses_size

__all__ = ["DEFAULT_DEVICE_MEMORY", "Choice", "as_strategy", "choose", "describe", "row_fits"]

#: The device memory the rule budgets for when none is given (a v5e's 16 GiB HBM).
DEFAULT_DEVICE_MEMORY = 16 * 2**30
_ROW_SHARE = 8  # the gathered row may take 1/8 of a device's memory
_KEY_BLOCK = 128  # the halo's tiles (a TPU's lanes; the GPU's are smaller)


class Choice(NamedTuple):
  """One layer kind's strategy and why the rule took it."""

  strategy: str
  why: str


def _kind_shapes(text, kind: str, tp: int) -> tuple[int, int, int, int | None]:
  """(query heads, K/V heads, head dim, window) of a layer kind, per tp rank."""
  layer = list(text.layer_types).index(kind)
  hq = max(text.num_attention_heads // tp, 1)
  hkv = max(text.kv_heads(layer) // tp, 1)
  window = text.sliding_window if kind == "sliding_attention" else None
  return hq, hkv, text.layer_head_dim(layer), window


def choose(
  text,
  *,
  seq_len: int,
  cp: int,
  tp: int = 1,
  device_memory: int | None = None,
  layout: str = "load_balanced",
) -> dict[str, Choice]:
  """Pick the CP strategy of each of a model's attention layer kinds.

  Args:
    text: a Gemma 4 text config (its ``layer_types``, heads and head dims).
    seq_len: the row length ``S``.
    cp: the cp size.
    tp: the tp size (heads a rank holds: ``H / tp``).
    device_memory: one device's memory in bytes (default
      :data:`DEFAULT_DEVICE_MEMORY`).
    layout: the :class:`cpjax.ShardLayout` kind the rows are split with.

  Returns:
    ``{layer kind: Choice}``, sorted by kind.
  """
  budget = (DEFAULT_DEVICE_MEMORY if device_memory is None else device_memory) // _ROW_SHARE
  out = {}
  for kind in sorted(set(text.layer_types)):
    hq, hkv, d, window = _kind_shapes(text, kind, tp)
    if cp == 1:
      out[kind] = Choice("ring", "one cp rank: every strategy is the same single pass")
      continue
    lay = _padded_layout(seq_len, cp, layout)
    block = next(b for b in (_KEY_BLOCK, 64, 32, 16, 8, 4, 2, 1) if lay.chunk_len % b == 0)
    # Vision groups bidirectional on a kind make its reach unbounded in rows
    # with images (26B-A4B's sliding layers): no halo holds it there.
    vision = kind == "sliding_attention" and text.use_bidirectional_attention == "vision"
    bounded = window is not None and not vision
    sides = halo(lay, MaskSpec(sliding_window=window).rule(), block) if bounded else None
    row = 12 * seq_len * hkv * d  # K, V bf16 and their f32 gradients, the whole row
    if sides:
      keys = sum(h.length for h in sides)
      out[kind] = Choice(
        "all_gather",
        f"window {window}: a halo of {keys} keys from {len(sides)} neighbour(s) "
        f"instead of whole {lay.local_seq_len}-token chunks a hop",
      )
    elif hq % cp == 0 and hkv % cp == 0:
      out[kind] = Choice(
        "ulysses", f"{hq} query and {hkv} K/V heads split over cp = {cp}: O(S/cp) memory"
      )
    elif row_fits(row, device_memory):
      out[kind] = Choice(
        "all_gather",
        f"{hkv} K/V head(s) of dim {d}: the gathered row ({_gib(row)}) fits 1/{_ROW_SHARE} "
        f"of {_gib(budget * _ROW_SHARE)}, no hops",
      )
    elif math.gcd(hkv, cp) > 1:
      size = hybrid_ulysses_size(hq, hkv, cp)
      out[kind] = Choice(
        "hybrid",
        f"the gathered row ({_gib(row)}) exceeds 1/{_ROW_SHARE} of {_gib(budget * _ROW_SHARE)}; "
        f"{hkv} K/V heads: Ulysses in groups of {size} ranks, the ring over {cp // size} groups "
        f"({cp // size - 1} hops, not {cp - 1}), O(S/cp) memory",
      )
    else:
      out[kind] = Choice(
        "ring",
        f"the gathered row ({_gib(row)}) exceeds 1/{_ROW_SHARE} of "
        f"{_gib(budget * _ROW_SHARE)}: the ring keeps O(S/cp) memory",
      )
  return out


def row_fits(nbytes: int, device_memory: int | None = None) -> bool:
  """Return whether a gathered row of ``nbytes`` takes at most the rule's
  share of a device's memory (the loss's choice between its all-gather and
  its ring reads it too: :func:`cpjax.training.loss.cross_entropy`).

  >>> row_fits(2 * 2**30), row_fits(2 * 2**30 + 1)
  (True, False)
  """
  return nbytes <= (DEFAULT_DEVICE_MEMORY if device_memory is None else device_memory) // _ROW_SHARE


def as_strategy(choices: dict[str, Choice]) -> tuple[tuple[str, str], ...]:
  """Return the choices as :class:`cpjax.CPContext`'s ``strategy`` (sorted pairs)."""
  return tuple((kind, c.strategy) for kind, c in sorted(choices.items()))


def describe(choices: dict[str, Choice]) -> str:
  """Return the choices as ``kind=strategy,...`` (the run config's text)."""
  return ",".join(f"{kind}={c.strategy}" for kind, c in sorted(choices.items()))


def _padded_layout(seq_len: int, cp: int, kind: str) -> ShardLayout:
  """The layout of a row of ``seq_len`` tokens, right-padded as the batch is."""
  chunks = ShardLayout(16 * cp, 16 * cp, cp, kind).num_chunks
  padded = -(-seq_len // chunks) * chunks
  return ShardLayout(seq_len, padded, cp, kind)


def _gib(n: float) -> str:
  return f"{n / 2**30:.2f} GiB"
