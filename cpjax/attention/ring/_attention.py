"""Ring attention over a named mesh axis: ppermute K/V, flash-style online softmax.

Inside ``jax.shard_map`` every rank holds ``L`` query and key/value tokens of a
sequence sharded by a :class:`cpjax.ShardLayout`. K/V chunks (only the
``Hkv`` heads, with the per-token mask metadata) travel around a
``lax.ppermute`` ring; each rank folds every visiting chunk into float32
online-softmax statistics, one ``block_q x block_kv`` tile at a time, and
skips tiles the mask leaves empty. The backward pass (``jax.custom_vjp``)
replays the ring from the saved log-sum-exp, rotating K/V together with their
dK/dV accumulators so every gradient arrives home: per-device memory is O(L).

Each hop's compute has two backends (``implementation``): the portable XLA
tile loop below (a ``fori_loop`` over the hop's non-empty tiles), or fused
Pallas kernels for TPU (Mosaic) and GPU (Triton) from :mod:`cpjax.attention.ring.kernels`,
which fold a visiting chunk into (out, lse) that the ring merges, and take the
saved global lse for their dq and dk/dv kernels. Both read the same per-hop
tile schedule from the mask's block map and keep the same ring around them.

The mask is a :class:`cpjax.AttentionMask`: its rule says which tiles are
empty, partial or full, and how far allowed keys reach. Which hops are taken
is static (:func:`ring_plan`, from that reach): the whole ring in one
direction by default; with a bounded reach (a sliding window and no vision
groups, which override the window) only the hops that can reach it, in one
direction for a causal contiguous layout and in both directions otherwise
(in a load-balanced layout a chunk's neighbours sit on both sides).

Shape letters: ``B`` batch, ``L`` local tokens, ``Hq``/``Hkv`` query and
key/value heads, ``G = Hq // Hkv``, ``D`` head dim, ``bq``/``bk`` tile sizes.
Internally tensors are head-major with the G query heads sharing a KV head
folded into the rows: q [B, Hkv, N = L*G, D] (row ``t*G + g`` is token t, head
g), k/v [B, Hkv, L, D]. A query tile is then ``bq*G`` consecutive rows and
every tile product is a plain 4-D matmul, with no layout copies on CPU.

This module checks the inputs and runs the ring; the static schedule is
:mod:`cpjax.attention.ring._schedule` and the passes are :mod:`cpjax.attention.ring._passes`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import tpu as pltpu
from jax.typing import ArrayLike

from cpjax import _deprecations, checks
from cpjax.attention.ring._passes import PassConfig, kernel_density, ring_passes
from cpjax.attention.ring._schedule import block_sizes, halo, ring_plan
from cpjax.attention.ring.kernels._common import KernelParams
from cpjax.attention.ring.kernels._implementations import resolve_implementation
from cpjax.batch.layout import ShardLayout
from cpjax.masks import AttentionMask, resolve_mask
from cpjax.parallel import vary_like as _vary_like

__all__ = ["STRATEGIES", "hybrid_ulysses_size", "ring_attention", "ulysses_kv_repeats"]

#: How K/V reach a rank's queries (``ring_attention(strategy=...)``).
STRATEGIES = ("ring", "all_gather", "ulysses", "hybrid")


def ulysses_kv_repeats(q_heads: int, kv_heads: int, cp_size: int) -> int:
  """How many times Ulysses repeats each K/V head so that cp splits them.

  The all-to-all gives rank r query heads ``r*Hq/cp ..``; their K/V heads
  must arrive with them. Repeating each K/V head ``f`` times (f a divisor of
  ``G = Hq/Hkv``) keeps query head h on K/V head ``h // (G/f)``; the smallest
  ``f`` with ``Hkv * f`` a multiple of cp sends the least.

  Raises:
    ValueError: ``Hq`` is not a multiple of ``cp_size``.

  >>> ulysses_kv_repeats(8, 1, 4), ulysses_kv_repeats(16, 2, 8), ulysses_kv_repeats(8, 8, 4)
  (4, 4, 1)
  """
  if q_heads % cp_size:
    raise ValueError(
      f"strategy='ulysses' splits the query heads over the cp ranks: {q_heads} query heads "
      f"(local, after any tp split) is not a multiple of cp_size = {cp_size}; use "
      f"strategy='ring' or 'all_gather', or a cp size dividing {q_heads}"
    )
  groups = q_heads // kv_heads
  return min(f for f in range(1, groups + 1) if groups % f == 0 and kv_heads * f % cp_size == 0)


def hybrid_ulysses_size(q_heads: int, kv_heads: int, cp_size: int) -> int:
  """The Ulysses degree ``U`` of ``strategy="hybrid"``: cp factored as ``R x U``.

  The hybrid (USP's Ulysses and ring degrees) runs Ulysses inside groups of
  ``U`` neighbouring cp ranks and the ring over the ``R = cp / U`` groups.
  ``U`` is the largest divisor of cp that splits the K/V heads (and so the
  query heads) with no K/V head repeated: a rank then holds ``U*L`` tokens
  of ``Hkv/U`` K/V heads, the ring's memory, and the ring takes ``R - 1``
  hops instead of ``cp - 1``. ``U = cp`` is Ulysses itself.

  Raises:
    ValueError: no divisor of cp above 1 splits the K/V heads (the hybrid
      would have no Ulysses axis: use ``"ring"`` or ``"ulysses"``, which
      repeats K/V heads).

  >>> hybrid_ulysses_size(16, 2, 8), hybrid_ulysses_size(16, 8, 8), hybrid_ulysses_size(12, 6, 4)
  (2, 8, 2)
  """
  size = max(u for u in range(1, cp_size + 1) if cp_size % u == 0 and kv_heads % u == 0)
  if size == 1:
    raise ValueError(
      f"strategy='hybrid' runs Ulysses over a factor of cp that splits the K/V heads: "
      f"{kv_heads} K/V head(s) (local, after any tp split) share no factor with "
      f"cp_size = {cp_size}, so there is no Ulysses axis; use strategy='ring', or "
      f"'ulysses' (which repeats K/V heads)"
    )
  return size


def _is_pair(axis_name) -> bool:
  return len(axis_name) == 2 and all(isinstance(a, str) for a in axis_name)


def _ulysses_axis_size(name: str, q_heads: int) -> int:
  """The size of the hybrid's Ulysses mesh axis ``name``, which must split the query heads."""
  size = checks.bound_axis_size(name)
  if size is None:
    raise ValueError(
      f"strategy='hybrid' with a pair of axes runs Ulysses over mesh axis {name!r} "
      f"inside shard_map; that axis is not bound"
    )
  if q_heads % size:
    raise ValueError(
      f"strategy='hybrid' splits the query heads over the Ulysses axis {name!r}: {q_heads} "
      f"query heads (local, after any tp split) is not a multiple of its size {size}"
    )
  return size


def _groups(cp_size: int, size: int):
  """The cp ranks of each Ulysses group: ``size`` neighbours each, or None
  for one group of the whole axis."""
  if size == cp_size:
    return None
  return [list(range(start, start + size)) for start in range(0, cp_size, size)]


def _heads_to_row(x, axis_name: str, groups=None):
  """[B, L, H, D] -> [B, U*L, H/U, D]: every group rank's tokens (rank order)
  of this rank's ``H/U`` heads (U: the group's size, cp for one group)."""
  return lax.all_to_all(
    x, axis_name, split_axis=2, concat_axis=1, tiled=True, axis_index_groups=groups
  )


def _row_to_heads(x, axis_name: str, groups=None):
  """The inverse of :func:`_heads_to_row`."""
  return lax.all_to_all(
    x, axis_name, split_axis=1, concat_axis=2, tiled=True, axis_index_groups=groups
  )


def _group_layout(layout: ShardLayout, size: int) -> ShardLayout:
  """The layout of the ring over groups of ``size`` neighbouring ranks.

  A group's tokens are exactly rank ``g`` of the same kind of layout over
  ``cp / size`` ranks with chunks ``size`` times as long: on pass k of the
  serpentine its ranks hold ``size`` neighbouring chunks, in ascending
  order on even passes and descending on odd ones (:func:`_group_order`).
  """
  return ShardLayout(
    layout.original_seq_len,
    layout.padded_seq_len,
    layout.cp_size // size,
    layout.kind,
    stripes=layout.stripes,
  )


def _group_order(x, size: int, stripes: int, *, inverse: bool = False):
  """Reorder a group's gathered tokens [B, U*L, ...] (rank order) into its
  :func:`_group_layout` order, or back with ``inverse``: per stripe, the
  ranks' chunks side by side, reversed on odd passes. Layout copies only."""
  if stripes == 1:  # contiguous: rank order is already the group's order
    return x
  b, t, rest = x.shape[0], x.shape[1], x.shape[2:]
  c = t // (size * stripes)
  y = x.reshape(b, stripes, size, c, *rest) if inverse else x.reshape(b, size, stripes, c, *rest)
  if not inverse:
    y = jnp.swapaxes(y, 1, 2)  # [B, K, U, C, ...]
  # Odd passes of the serpentine run the ranks backwards (K is even here).
  y = y.reshape(b, stripes // 2, 2, size, c, *rest)
  y = jnp.concatenate([y[:, :, :1], jnp.flip(y[:, :, 1:], axis=3)], axis=2)
  y = y.reshape(b, stripes, size, c, *rest)
  if inverse:
    y = jnp.swapaxes(y, 1, 2)  # [B, U, K, C, ...]
  return y.reshape(b, t, *rest)


@_deprecations.renamed_keywords("cpjax.ring_attention", segment_ids="document_ids")
def ring_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  layout: ShardLayout,
  axis_name: str | tuple[str, str] = "cp",
  mask: AttentionMask | None = None,
  causal: bool | None = None,
  sliding_window: int | None = None,
  document_ids: ArrayLike | None = None,
  padding_mask: ArrayLike | None = None,
  vision_group_ids: ArrayLike | None = None,
  scale: float | None = None,
  logits_soft_cap: float | None = None,
  block_q: int | None = None,
  block_kv: int | None = None,
  implementation: str | None = None,
  interpret: bool | np.bool_ | pltpu.InterpretParams = False,
  strategy: str = "ring",
) -> jax.Array:
  """Exact attention over a sequence sharded on ``axis_name``, inside ``shard_map``.

  Local position i of rank r is global token ``local_token_indices(layout,
  r)[i]``; the mask (see :mod:`cpjax.masks`) is defined on global indices, so
  contiguous and load-balanced layouts give the same result.

  Args:
    q: [B, L, Hq, D] local queries.
    k, v: [B, L, Hkv, D] local keys and values; Hq a multiple of Hkv (query
      head h reads KV head ``h // (Hq // Hkv)``); only these Hkv heads travel.
    layout: the :class:`cpjax.ShardLayout` the sequence was sharded with.
    axis_name: the context-parallel mesh axis (unused when cp_size is 1);
      for ``strategy="hybrid"`` also a pair ``(ring_axis, ulysses_axis)``
      of mesh axes the sequence is split over together, the ring's major
      (``P(None, (ring_axis, ulysses_axis))``): Ulysses over the second,
      the ring over the first.
    mask: a :class:`cpjax.AttentionMask` whose arrays are [B, L] (this rank's
      tokens); or, instead of it, the keywords of
      :meth:`cpjax.AttentionMask.create`:
    causal: mask keys after the query (default True).
    sliding_window: W >= 1, keys with ``q - k < W`` (``|q - k| < W`` when not
      causal); shortens the ring (:func:`ring_plan`).
    document_ids: int[B, L] document ids; 0 = pad, attends to nothing.
    padding_mask: bool[B, L], True = pad key.
    vision_group_ids: int[B, L]; tokens of one group (>= 0) attend to each
      other bidirectionally, overriding causal and window.
    scale: logit scale, default ``1 / sqrt(D)``.
    logits_soft_cap: ``c`` for ``c * tanh(logits / c)``.
    block_q, block_kv: tile sizes in tokens; must divide ``layout.chunk_len``
      (default: :func:`default_block_size` for XLA, the implementation's tile
      record for Pallas; see :mod:`cpjax.attention.ring.kernels`).
    implementation: the per-hop backend: ``"xla"`` (a tile loop, any
      backend), ``"pallas_tpu"`` or ``"pallas_gpu"`` (fused kernels), or
      None for the default backend's Pallas implementation (XLA on CPU).
    interpret: run the Pallas implementation's kernels in Pallas' HLO interpreter
      (any backend; slow, for tests), or, for ``"pallas_tpu"``, a
      ``pltpu.InterpretParams`` for Pallas' TPU interpreter (which simulates
      Mosaic's memory spaces and DMAs and can detect races; much slower).
      Ignored by ``"xla"``.
    strategy: how K/V reach the queries (:data:`STRATEGIES`): ``"ring"``
      passes each rank's chunk around a ``ppermute`` ring (O(L) memory, only
      the hops the mask can reach); ``"all_gather"`` gathers every rank's
      K/V over the axis at once and attends to the whole row in one pass,
      reduce-scattering dK/dV in the backward (O(S) K/V memory, no hops;
      cheap when few K/V heads serve many query heads), and under a bounded
      reach (a window) receives only its halo, the neighbours' key blocks
      the window reaches; ``"ulysses"`` turns the sequence split into a
      head split with an all-to-all (``[B, L, H, D] -> [B, S, H/cp, D]``),
      attends each rank's heads over the whole row and turns the output
      back (``Hq`` must be a multiple of cp; K/V heads are repeated only
      as far as cp needs, :func:`ulysses_kv_repeats`); ``"hybrid"`` (USP)
      factors cp as ``R x U``: Ulysses' all-to-alls inside each group of
      ``U`` neighbouring ranks (``U``: :func:`hybrid_ulysses_size`, as many
      as split the K/V heads unrepeated), the ring over the ``R`` groups,
      each rank with its peers (the ring's O(L) memory in ``R - 1`` hops
      instead of ``cp - 1``; a group of the whole axis is Ulysses). All give
      the same values and gradients. Passing the same array as ``k`` and ``v``
      moves it once and its gradient once.

  Returns:
    [B, L, Hq, D] in q's dtype. Rows with nothing allowed are 0, with zero
    gradient.

  Example:
    >>> import jax, numpy as np, cpjax
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((4,), ("cp",), devices=jax.devices()[:4])
    >>> lay = cpjax.ShardLayout(32, 32, 4, "load_balanced")
    >>> x = np.random.default_rng(0).standard_normal((1, 32, 2, 8), np.float32)
    >>> order = cpjax.rank_order(lay)   # global arrays in rank order, as shard_batch gives
    >>> xs = jax.device_put(x[:, order], jax.NamedSharding(mesh, P(None, "cp")))
    >>> ring = jax.jit(jax.shard_map(  # (jitted: one program, not op by op)
    ...     lambda q, k, v: cpjax.ring_attention(q, k, v, layout=lay),
    ...     mesh=mesh, in_specs=P(None, "cp"), out_specs=P(None, "cp")))
    >>> out = np.asarray(ring(xs, xs, xs))[:, np.argsort(order)]
    >>> bool(np.allclose(out, cpjax.reference_attention(x, x, x), atol=1e-5))
    True
  """
  if not isinstance(layout, ShardLayout):
    raise TypeError(f"layout must be a ShardLayout, got {type(layout).__name__}")
  pair = isinstance(axis_name, tuple)
  if pair and not _is_pair(axis_name):
    raise TypeError(
      f"axis_name as a tuple is strategy='hybrid''s pair (ring axis, Ulysses axis) of "
      f"names, got {axis_name!r}"
    )
  if not pair and not isinstance(axis_name, str):
    raise TypeError(f"axis_name must be a mesh axis name (str), got {type(axis_name).__name__}")
  b, l, hq, hkv, d = checks.attention_inputs(q, k, v)
  scale, logits_soft_cap = checks.attention_options(scale=scale, logits_soft_cap=logits_soft_cap)
  checks.cp_axis("ring_attention", axis_name, layout.cp_size)
  if l != layout.local_seq_len:
    raise ValueError(
      f"q must hold layout.local_seq_len = {layout.local_seq_len} tokens on dim 1, got {l}"
    )
  mask = resolve_mask(
    mask,
    causal=causal,
    sliding_window=sliding_window,
    document_ids=document_ids,
    padding_mask=padding_mask,
    vision_group_ids=vision_group_ids,
  )
  mask = mask.validate(b, l, where="[B, L] (q's first two dimensions)")
  implementation = resolve_implementation(implementation)
  if isinstance(interpret, pltpu.InterpretParams):
    if implementation != "pallas_tpu":
      raise ValueError(
        f"interpret=pltpu.InterpretParams(...) runs Mosaic kernels: it needs "
        f"implementation='pallas_tpu', got {implementation!r}"
      )
  elif not isinstance(interpret, (bool, np.bool_)):
    raise TypeError(
      f"interpret must be a bool or a pltpu.InterpretParams, got "
      f"{type(interpret).__name__} ({interpret!r})"
    )
  else:
    interpret = bool(interpret)
  if strategy not in STRATEGIES:
    raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
  if pair and strategy != "hybrid":
    raise ValueError(
      f"axis_name={axis_name!r} names two mesh axes (ring axis, Ulysses axis): that is "
      f"strategy='hybrid', got strategy={strategy!r}"
    )
  if layout.cp_size == 1:
    strategy = "ring"  # one rank: every strategy is the same single pass
  # Ulysses runs over groups of `size` neighbouring ranks (the whole axis for
  # "ulysses", a factor of it for "hybrid": the second of a pair of axes, or
  # as many as split the K/V heads), the passes over the groups.
  if strategy == "hybrid" and pair:
    size = _ulysses_axis_size(axis_name[1], hq)
  elif strategy == "hybrid":
    size = hybrid_ulysses_size(hq, hkv, layout.cp_size)
  else:
    size = layout.cp_size if strategy == "ulysses" else 1
  if strategy == "hybrid" and size == layout.cp_size:
    strategy = "ulysses"  # one group: Ulysses itself
  ulysses_axis = axis_name[1] if pair else axis_name
  repeats = ulysses_kv_repeats(hq, hkv, size) if size > 1 else 1
  g = hq // hkv // repeats
  ring_layout = _group_layout(layout, size) if strategy == "hybrid" else layout
  row = layout.padded_seq_len
  block_q, block_kv = block_sizes(
    ring_layout,
    implementation,
    d,
    g,
    block_q,
    block_kv,
    q.dtype,
    query_len=row if strategy == "ulysses" else None,
    key_len=row if strategy in ("all_gather", "ulysses") else None,
  )
  kernel = None
  if implementation != "xla":
    kernel = KernelParams(
      rule=mask.rule,
      soft_cap=logits_soft_cap,
      block_q=block_q,
      block_kv=block_kv,
      groups=g,
      interpret=interpret,
    )
  cfg = PassConfig(
    layout=ring_layout,
    axis_name=axis_name,
    rule=mask.rule,
    plan=ring_plan(ring_layout, mask=mask),
    scale=d**-0.5 if scale is None else scale,
    soft_cap=logits_soft_cap,
    block_q=block_q,
    block_kv=block_kv,
    groups=g,
    implementation=implementation,
    kernel=kernel,
    strategy="ring" if strategy == "hybrid" else strategy,
    shared_kv=k is v,
    halo=halo(layout, mask.rule, block_kv) if strategy == "all_gather" else None,
    ulysses_size=size if strategy == "hybrid" else 1,
  )
  if kernel is not None:  # each kernel call's cost estimate: its share of the mask's blocks
    cfg = dataclasses.replace(cfg, kernel=dataclasses.replace(kernel, density=kernel_density(cfg)))
  arrays = mask.arrays
  if layout.cp_size > 1:
    # The mask's arrays ride the ring, so they must vary over the axis like K/V do.
    arrays = jax.tree.map(lambda x: _vary_like(x, k), arrays)
  if size == 1:
    return _head_major(cfg, q, k, v, arrays)
  # Ulysses: a sequence split becomes a head split (one all-to-all each way
  # inside each group), and every rank attends its heads over its group's
  # tokens: the whole row for "ulysses", one chunk of the groups' ring for
  # "hybrid"; the mask's arrays are gathered likewise. Repeats keep each
  # query head with its K/V head.
  groups = None if pair else _groups(layout.cp_size, size)
  if strategy == "hybrid":
    assert layout.stripes is not None  # ShardLayout.__post_init__ fills it
    order = functools.partial(_group_order, size=size, stripes=layout.stripes)
  else:  # the passes read the row in rank order
    order = lambda x, inverse=False: x  # noqa: E731
  to_row = lambda x: order(_heads_to_row(x, ulysses_axis, groups))  # noqa: E731
  shared = k is v
  if repeats > 1:
    k = jnp.repeat(k, repeats, axis=2)
    v = k if shared else jnp.repeat(v, repeats, axis=2)
  q_row, k_row = to_row(q), to_row(k)
  v_row = k_row if shared else to_row(v)
  gather = functools.partial(lax.all_gather, axis_name=ulysses_axis, axis=1, tiled=True)
  arrays = {n: order(gather(x, axis_index_groups=groups)) for n, x in arrays.items()}
  out = _head_major(cfg, q_row, k_row, v_row, arrays)
  return _row_to_heads(order(out, inverse=True), ulysses_axis, groups)


def _head_major(cfg: PassConfig, q, k, v, arrays):
  """Run the passes on [B, T, Hq, D] queries (T: this rank's tokens or the
  row) in the passes' head-major layout, and return [B, T, Hq, D]."""
  b, t, hq, d = q.shape
  hkv, g = k.shape[2], cfg.groups
  qh = q.reshape(b, t, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, t * g, d)
  kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
  out = ring_passes(cfg, qh, kh, vh, arrays)
  return out.reshape(b, hkv, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, hq, d)
