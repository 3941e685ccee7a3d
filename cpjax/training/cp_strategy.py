"""Which CP strategy each attention layer kind takes: the rule ``cpjax plan``
shows and ``cpjax train`` follows by default (``parallel.strategy: auto``).

The rule reads what :mod:`benchmarks.cp_strategies` measured with the TPU
and GPU compilers (one Gemma 4 layer's gradient per strategy, layer kind, S
and cp: ``benchmarks/README.md``):

1. A bounded reach (a sliding window, without vision groups that override
   it) whose neighbours hold it takes the all-gather's halo: each rank
   receives the key blocks its window reaches (``W - 1`` keys a side, in
   whole tiles) where the ring sends whole chunks a hop, and holds
   ``L + halo`` keys, not ``3 L``.
2. Otherwise, of the strategies the heads allow whose whole-row K/V (and
   their float32 gradients) take at most 1/8 of a device's memory, the one
   that sends the fewest bytes a step (:func:`bytes_sent`, the benchmark's
   count): the all-gather holds the row's ``Hkv`` heads; Ulysses (``Hq`` a
   multiple of cp) the row's ``Hkv / cp``, a ring chunk's size, or with
   K/V heads repeated ``f`` times the row's ``Hkv * f / cp``; the hybrid
   (K/V heads sharing a factor with cp) and the ring hold ``O(S/cp)`` and
   always fit. Ulysses' all-to-alls send about the same at
   any cp while the all-gather's and the ring's grow with it: the
   all-gather wins at small cp, Ulysses at cp = 8 (26B-A4B's full layers,
   v5e, S = 131072: 1344 MiB and 2.42 GiB against the all-gather's 1793 and
   3.88, the hybrid's 1473 and 3.07, the ring's 1921 and 3.07), and past
   the share the hybrid's fewer hops beat the ring at cp = 8, not at cp = 4.

The loss reads the same share (:func:`row_fits`): with ``auto`` it gathers
the row's hidden states over cp while they and their float32 gradient fit,
else its tokens travel the ring (:func:`cpjax.training.loss.cross_entropy`).

>>> from cpjax.models.gemma4 import Gemma4Config
>>> e2b = Gemma4Config.preset("e2b").text
>>> for kind, c in choose(e2b, seq_len=131072, cp=8).items():
...   print(kind, c.strategy)
full_attention ulysses
sliding_attention all_gather
>>> choose(e2b, seq_len=2**21, cp=8)["full_attention"].strategy   # no row fits, 1 K/V head
'ring'
>>> a4b = Gemma4Config.preset("a4b").text
>>> choose(a4b, seq_len=2**20, cp=8)["full_attention"].strategy   # 2 K/V heads: groups of 2
'hybrid'
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from cpjax.attention.ring import (
  STRATEGIES,
  halo,
  hybrid_ulysses_size,
  ring_plan,
  ulysses_kv_repeats,
)
from cpjax.batch.layout import LayoutKind, ShardLayout, layout_kind
from cpjax.masks import MaskSpec

if TYPE_CHECKING:
  from cpjax.models.gemma4.text_config import Gemma4TextConfig
  from cpjax.training.run_config import RunConfig

__all__ = [
  "DEFAULT_DEVICE_MEMORY",
  "Choice",
  "as_strategy",
  "bytes_sent",
  "choose",
  "describe",
  "for_run",
  "for_step",
  "row_buffer",
  "row_fits",
  "run_choices",
]

#: The device memory the rule budgets for when none is given (a v5e's 16 GiB HBM).
DEFAULT_DEVICE_MEMORY = 16 * 2**30
_ROW_SHARE = 8  # the gathered row may take 1/8 of a device's memory
_KEY_BLOCK = 128  # the halo's tiles (a TPU's lanes; the GPU's are smaller)


class Choice(NamedTuple):
  """One layer kind's strategy and why the rule took it."""

  strategy: str
  why: str


def _kind_shapes(text, kind: str, tp: int) -> tuple[int, int, int, int | None]:
  """(query heads, K/V heads, head dim, bounded window) of a layer kind, per tp rank."""
  layer = list(text.layer_types).index(kind)
  hq = max(text.num_attention_heads // tp, 1)
  hkv = max(text.kv_heads(layer) // tp, 1)
  # Vision groups bidirectional on a kind make its reach unbounded in rows
  # with images (26B-A4B's sliding layers): no window bounds it there.
  vision = kind == "sliding_attention" and text.use_bidirectional_attention == "vision"
  window = text.sliding_window if kind == "sliding_attention" and not vision else None
  return hq, hkv, text.layer_head_dim(layer), window


def choose(
  text: Gemma4TextConfig,
  *,
  seq_len: int,
  cp: int,
  tp: int = 1,
  device_memory: int | None = None,
  layout: LayoutKind | ShardLayout = "load_balanced",
) -> dict[str, Choice]:
  """Pick the CP strategy of each of a model's attention layer kinds.

  Args:
    text: a Gemma 4 text config (its ``layer_types``, heads and head dims).
    seq_len: the row length ``S``.
    cp: the cp size.
    tp: the tp size (heads a rank holds: ``H / tp``).
    device_memory: one device's memory in bytes (default
      :data:`DEFAULT_DEVICE_MEMORY`).
    layout: the kind of layout the rows are split with, a
      :data:`~cpjax.batch.LayoutKind` or a :class:`cpjax.ShardLayout` (its
      ``kind``).

  Returns:
    ``{layer kind: Choice}``, sorted by kind.
  """
  budget = (DEFAULT_DEVICE_MEMORY if device_memory is None else device_memory) // _ROW_SHARE
  out = {}
  assert text.layer_types is not None  # Gemma4TextConfig.__post_init__ fills it
  for kind in sorted(set(text.layer_types)):
    hq, hkv, d, window = _kind_shapes(text, kind, tp)
    if cp == 1:
      out[kind] = Choice("ring", "one cp rank: every strategy is the same single pass")
      continue
    lay = _padded_layout(seq_len, cp, layout)
    sides = window and halo(lay, MaskSpec(sliding_window=window).rule(), _key_block(lay))
    if sides:
      keys = sum(h.length for h in sides)
      out[kind] = Choice(
        "all_gather",
        f"window {window}: a halo of {keys} keys from {len(sides)} neighbour(s) "
        f"instead of whole {lay.local_seq_len}-token chunks a hop",
      )
      continue
    # The whole-row K/V (bfloat16) and their float32 gradients each holds.
    held = functools.partial(row_buffer, text, kind, seq_len=seq_len, cp=cp, tp=tp, layout=layout)
    share = f"1/{_ROW_SHARE} of {_gib(budget * _ROW_SHARE)}"
    why_not = {}  # the strategies left out, and why
    if not row_fits(held("all_gather"), device_memory):
      why_not["all_gather"] = f"its row of {_gib(held('all_gather'))} is over {share}"
    if hq % cp:
      why_not["ulysses"] = f"{hq} query heads are not a multiple of cp"
    elif not row_fits(held("ulysses"), device_memory):
      why_not["ulysses"] = f"its repeated K/V row of {_gib(held('ulysses'))} is over {share}"
    if math.gcd(hkv, cp) == 1:
      why_not["hybrid"] = f"{hkv} K/V head(s) share no factor with cp"
    elif hybrid_ulysses_size(hq, hkv, cp) == cp:
      why_not["hybrid"] = "one group is Ulysses"
    shape: dict[str, Any] = dict(
      seq_len=seq_len, cp=cp, q_heads=hq, kv_heads=hkv, head_dim=d, layout=layout
    )
    shape["window"] = window
    sent = {s: bytes_sent(s, **shape)[0] for s in STRATEGIES if s not in why_not}
    # sent.get of sent's own keys never gives None, which pyrefly cannot tell.
    # pyrefly: ignore[no-matching-overload]
    best = min(sent, key=sent.get)  # (ties: the first in STRATEGIES' order)
    others = ", ".join(f"{s} {_mib(b)}" for s, b in sent.items() if s != best)
    left = "".join(f"; {s}: {why}" for s, why in why_not.items())
    out[kind] = Choice(
      best,
      f"{hq} query / {hkv} K/V heads of dim {d}: the fewest bytes a step, "
      f"{_mib(sent[best])} ({others}){left}",
    )
  return out


def bytes_sent(
  strategy: str,
  *,
  seq_len: int,
  cp: int,
  q_heads: int,
  kv_heads: int,
  head_dim: int,
  window: int | None = None,
  layout: LayoutKind | ShardLayout = "load_balanced",
) -> tuple[int, int]:
  """Return (bytes each rank sends in one forward + backward, ring hops a pass).

  Counted from the shapes (a compiled program's text holds a loop's
  collectives once, not once a hop), K/V and the activations in bfloat16,
  with one int32 mask array a token (the document ids). The ring sends its
  K/V chunk and ids once a hop in the forward, and with them the float32
  dK/dV accumulators in the backward, then those home (one more send,
  unless the ring came full circle). The all-gather sends its share to each
  other rank in the forward and again in the backward (it recomputes rather
  than keeps the row), and reduce-scatters the row's float32 dK/dV; under a
  window it sends only its halo (:func:`cpjax.attention.ring.halo`, 128-key tiles)
  the same way, and its gradient back. Ulysses all-to-alls (``(cp - 1) /
  cp`` of each tensor leaves the rank) q, the repeated K and V and the
  output, then the output's gradient and dq, dK, dV, and all-gathers the
  ids once. The hybrid does Ulysses' all-to-alls inside its groups of ``U``
  ranks, then the ring's hops over the groups: the same K/V bytes a hop,
  ``U`` times the ids.

  >>> bytes_sent("ring", seq_len=1024, cp=4, q_heads=8, kv_heads=1, head_dim=128)
  (1841152, 3)
  """
  local = seq_len // cp
  kv, ids = 2 * local * kv_heads * head_dim * 2, local * 4
  grads = 2 * local * kv_heads * head_dim * 4
  lay = _padded_layout(seq_len, cp, layout)

  def ring(ranks: int, ids: int) -> tuple[int, int]:
    plan = ring_plan(_padded_layout(seq_len, ranks, layout), sliding_window=window)
    both = 2 if plan.backward_hops else 1
    hops = plan.forward_hops * both
    home = both * int(plan.forward_hops % ranks != 0) * grads
    return hops * (kv + ids) + hops * (kv + ids + grads) + home, hops

  if strategy in ("ulysses", "hybrid"):
    size = cp if strategy == "ulysses" else hybrid_ulysses_size(q_heads, kv_heads, cp)
    repeated = kv_heads * ulysses_kv_repeats(q_heads, kv_heads, size)
    heads = 4 * q_heads + 4 * repeated  # q, out, do, dq; k, v, dk, dv
    within = (size - 1) * (local * heads * head_dim * 2 // size + ids)
    if size == cp:
      return within, 0
    sent, hops = ring(cp // size, size * ids)
    return within + sent, hops
  if strategy == "all_gather":
    rule = MaskSpec(sliding_window=window).rule()
    sides = halo(lay, rule, _key_block(lay)) if window else None
    if sides:
      tokens = sum(h.length for h in sides)
      return 2 * tokens * (kv + ids) // local + tokens * grads // local, 0
    return (cp - 1) * (2 * (kv + ids) + grads), 0
  if strategy == "ring":
    return ring(cp, ids)
  raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")


def _key_block(lay: ShardLayout) -> int:
  """The halo's key tiles: a TPU's 128 lanes, or the longest a short chunk divides."""
  return next(b for b in (_KEY_BLOCK, 64, 32, 16, 8, 4, 2, 1) if lay.chunk_len % b == 0)


def row_buffer(
  text: Gemma4TextConfig,
  kind: str,
  strategy: str,
  *,
  seq_len: int,
  cp: int,
  tp: int = 1,
  itemsize: int = 2,
  layout: LayoutKind | ShardLayout = "load_balanced",
) -> int:
  """Return the bytes of whole-row K/V that ``strategy`` holds in one layer of ``kind``.

  K and V in the activations' dtype (``itemsize`` bytes) and their float32
  gradients, over the tokens the strategy brings to a rank beyond the O(S/cp)
  a ring holds: the all-gather's row (or a window's halo), Ulysses' row of
  its ``Hkv * f / cp`` K/V heads when it repeats them (``f > 1``). The ring,
  the hybrid and unrepeated Ulysses hold none. A batch row's worth; the
  closed form (:func:`cpjax.training.plan.estimate`) adds the worst layer.

  >>> from cpjax.models.gemma4 import Gemma4Config
  >>> e2b = Gemma4Config.preset("e2b").text
  >>> row_buffer(e2b, "full_attention", "all_gather", seq_len=131072, cp=8) / 2**30
  0.75
  """
  hq, hkv, d, window = _kind_shapes(text, kind, tp)
  if cp == 1 or strategy in ("ring", "hybrid"):
    return 0
  per_token = d * (2 * itemsize + 8)
  if strategy == "ulysses":
    repeats = ulysses_kv_repeats(hq, hkv, cp)
    return 0 if repeats == 1 else seq_len * per_token * hkv * repeats // cp
  if strategy != "all_gather":
    raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
  lay = _padded_layout(seq_len, cp, layout)
  sides = window and halo(lay, MaskSpec(sliding_window=window).rule(), _key_block(lay))
  tokens = sum(h.length for h in sides) if sides else lay.padded_seq_len
  return tokens * per_token * hkv


def for_run(run: RunConfig, text: Gemma4TextConfig, *, device_memory: int | None = None) -> dict:
  """Return the CP strategies a run config's step takes, as keywords of
  :func:`cpjax.training.make_train_step` and :func:`cpjax.training.plan.estimate`.

  ``parallel.strategy: auto`` takes the rule's choice per layer kind and the
  loss's ``auto``; a named strategy is taken as it is, with the loss's ring.

  Args:
    run: a :class:`cpjax.training.run_config.RunConfig`.
    text: its model's Gemma 4 text config.
    device_memory: the bytes of the device it runs on (an accelerator's;
      default :data:`DEFAULT_DEVICE_MEMORY`).

  Returns:
    ``{"strategy": ..., "loss_strategy": ...}``.
  """
  return for_step(
    text,
    seq_len=run.dataset.seq_len,
    mesh=run.parallel.mesh_sizes(),
    strategy=run.parallel.strategy,
    layout=run.parallel.layout,
    device_memory=device_memory,
  )


def for_step(
  text: Gemma4TextConfig,
  *,
  seq_len: int,
  mesh: dict,
  strategy: str | Mapping[str, str] | tuple[tuple[str, str], ...] = "auto",
  layout: LayoutKind | ShardLayout = "load_balanced",
  device_memory: int | None = None,
) -> dict:
  """Return the CP strategies of a step, as :func:`for_run` does for a run.

  Args:
    text: the model's Gemma 4 text config.
    seq_len: the row length.
    mesh: ``{axis: size}``.
    strategy: ``"auto"`` (the rule's choice per layer kind and the loss's
      ``auto``) or a strategy to take as it is (with the loss's ring).
    layout: the batch's layout: a :data:`~cpjax.batch.LayoutKind` or a
      :class:`cpjax.ShardLayout` (its ``kind``).
    device_memory: the device's bytes the rule budgets for (default:
      :data:`DEFAULT_DEVICE_MEMORY`).

  Returns:
    ``{"strategy": ..., "loss_strategy": ...}``.

  >>> from cpjax.models.gemma4 import Gemma4Config
  >>> step = for_step(Gemma4Config.preset("e2b").text, seq_len=131072, mesh={"cp": 8})
  >>> step["strategy"], step["loss_strategy"]
  ((('full_attention', 'ulysses'), ('sliding_attention', 'all_gather')), 'auto')
  >>> for_step(Gemma4Config.preset("e2b").text, seq_len=131072, mesh={"cp": 8}, strategy="ring")
  {'strategy': 'ring', 'loss_strategy': 'ring'}
  """
  if strategy != "auto":
    return {"strategy": strategy, "loss_strategy": "ring"}
  choices = choose(
    text,
    seq_len=seq_len,
    cp=mesh.get("cp", 1),
    tp=mesh.get("tp", 1),
    layout=layout,
    device_memory=device_memory,
  )
  return {"strategy": as_strategy(choices), "loss_strategy": "auto"}


def run_choices(
  run: RunConfig, text: Gemma4TextConfig, *, device_memory: int | None = None
) -> dict[str, Choice]:
  """Return :func:`choose`'s choices for a run config's row length, mesh and
  layout on devices of ``device_memory`` bytes (as :func:`for_run`'s)."""
  sizes = run.parallel.mesh_sizes()
  return choose(
    text,
    seq_len=run.dataset.seq_len,
    cp=sizes.get("cp", 1),
    tp=sizes.get("tp", 1),
    layout=run.parallel.layout,
    device_memory=device_memory,
  )


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


def _padded_layout(seq_len: int, cp: int, layout: LayoutKind | ShardLayout) -> ShardLayout:
  """The layout of a row of ``seq_len`` tokens, right-padded as the batch is,
  of ``layout``'s kind (the rule reads only the kind)."""
  kind = layout_kind(layout)
  chunks = ShardLayout(16 * cp, 16 * cp, cp, kind).num_chunks
  padded = -(-seq_len // chunks) * chunks
  return ShardLayout(seq_len, padded, cp, kind)


def _mib(n: float) -> str:
  mib = n / 2**20
  return f"{mib:.0f} MiB" if mib >= 10 else f"{mib:.3g} MiB"


def _gib(n: float) -> str:
  return f"{n / 2**30:.2f} GiB"
