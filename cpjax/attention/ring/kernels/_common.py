"""What every per-hop attention kernel shares: the static tile parameters, the
per-hop tile schedule, the per-token metadata and the float32 tile math.

A ring hop pairs this rank's queries with one visiting K/V chunk. Rows are
(token, query head) pairs in the ring's head-major layout: q is
[B, Hkv, N = L*G, D] with row ``t*G + g`` token t and head g, so one tile
holds ``block_q*G`` rows against ``block_kv`` keys and the G query heads that
share a KV head load it once (GQA without repeating K/V). The per-token
metadata is therefore given per row on the query side (each token's values
repeated G times) and per token on the key side.

Shape letters: ``B`` batch, ``Hkv`` KV heads, ``N`` local rows, ``L`` local
tokens, ``D`` head dim, ``R = block_q * G`` rows and ``K = block_kv`` keys per
tile, ``nq``/``nk`` row and key blocks.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from cpjax.attention.ring.kernels import _cost, _interpret
from cpjax.masks import BlockMap, MaskRule, Tokens
from cpjax.parallel import BATCH_AXES, HEAD_AXIS, vary_over, varying_axes

__all__ = [
  "KernelParams",
  "Metadata",
  "Schedule",
  "cost",
  "f32_like",
  "fold_tile",
  "grad_tile",
  "manual_over_mesh",
  "metadata",
  "schedule",
  "tile_mask",
]


def f32_like(shape: tuple[int, ...], ref: jax.Array) -> jax.ShapeDtypeStruct:
  """A float32 kernel output of ``shape`` that varies over the mesh axes ``ref`` does."""
  return jax.ShapeDtypeStruct(
    shape, jnp.float32, manual_axis_type=getattr(jax.typeof(ref), "manual_axis_type", None)
  )


@dataclasses.dataclass(frozen=True)
class KernelParams:
  """Everything static a kernel needs (hashable)."""

  rule: MaskRule
  soft_cap: float | None
  block_q: int  # tokens per query tile
  block_kv: int  # keys per key tile
  groups: int  # G = Hq // Hkv
  interpret: Any  # bool, or a pltpu.InterpretParams (hashable) for Pallas' TPU interpreter
  # The share of a call's (row, key) pairs its tiles visit, on average over
  # the calls of one ring-attention call: what its cost estimate counts
  # (cpjax.attention.ring.kernels._cost).
  density: float = 1.0

  @property
  def rows(self) -> int:
    """R, query rows per tile."""
    return self.block_q * self.groups

  @property
  def array_names(self) -> tuple[str, ...]:
    return tuple(sorted(self.rule.array_kinds()))


class Metadata(NamedTuple):
  """Per-token mask metadata in the kernels' layout (all int32, bool as 0/1).

  Fields:
    positions: int32[1, T] global token indices.
    arrays: tuple of int32[B, 1, T], the rule's per-token arrays in
      :attr:`KernelParams.array_names` order.
  """

  positions: jax.Array
  arrays: tuple[jax.Array, ...]


def metadata(
  params: KernelParams,
  positions: jax.Array,
  arrays: Mapping[str, jax.Array],
  *,
  repeat: int = 1,
) -> Metadata:
  """Kernel metadata of tokens at ``positions`` int[T] with ``arrays`` {name: [B, T]},
  each token repeated ``repeat`` times (G for query rows)."""
  rep = (lambda x: jnp.repeat(x, repeat, axis=-1)) if repeat > 1 else (lambda x: x)  # noqa: E731
  pos = rep(jnp.asarray(positions, jnp.int32))[None]
  arrs = tuple(rep(jnp.asarray(arrays[n]).astype(jnp.int32))[:, None] for n in params.array_names)
  return Metadata(pos, arrs)


def tokens(params: KernelParams, positions: jax.Array, arrays: Sequence[jax.Array]) -> Tokens:
  """The :class:`Tokens` of one tile, from kernel blocks int32[1, T] and [1, T] each."""
  kinds = params.rule.array_kinds()
  named = {n: (x != 0 if kinds[n] == "bool" else x) for n, x in zip(params.array_names, arrays)}
  return Tokens(positions[0], named)


def tile_mask(params: KernelParams, q: Tokens, k: Tokens) -> jax.Array:
  """bool[R, K]: which pairs of the tile the rule allows."""
  allowed = params.rule.allowed(q, k)
  return jnp.broadcast_to(allowed, (1, q.positions.shape[0], k.positions.shape[0]))[0]


class Schedule(NamedTuple):
  """The blocks of one hop worth computing, per batch row, in both orders.

  A block is a whole number of tiles: one tile, unless the implementation groups
  them to keep the schedule small (``PallasImplementation.schedule_blocks``; the
  kernels read the grouping off the shapes, :meth:`tiles_per_block`).

  Fields (int32):
    cols: [B, nq, nk]; ``cols[b, i, :ncols[b, i]]`` are the non-empty key
      blocks of row block i, ascending; the tail repeats the last of them, so
      a kernel stepping through it fetches nothing new.
    ncols: [B, nq].
    rows, nrows: the same per key block ([B, nk, nq], [B, nk]).
    full: [B, nq, nk]; 1 where the block needs no mask.
  """

  cols: jax.Array
  ncols: jax.Array
  rows: jax.Array
  nrows: jax.Array
  full: jax.Array

  def tiles_per_block(self, row_tiles: int, key_tiles: int) -> tuple[int, int]:
    """(row tiles, key tiles) in one block, given the tiles of a hop's side."""
    nq, nk = self.cols.shape[1:]
    if row_tiles % nq or key_tiles % nk:
      raise ValueError(
        f"a schedule of {nq} x {nk} blocks cannot group {row_tiles} x {key_tiles} tiles"
      )
    return row_tiles // nq, key_tiles // nk


def _compact(visit):
  """Per row of bool[B, n, m]: indices of the True entries first, then the last one repeated."""
  m = visit.shape[-1]
  count = jnp.sum(visit, axis=-1, dtype=jnp.int32)
  order = jnp.argsort(~visit, axis=-1, stable=True).astype(jnp.int32)
  idx = jnp.minimum(jnp.arange(m, dtype=jnp.int32), jnp.maximum(count - 1, 0)[..., None])
  return jnp.take_along_axis(order, idx, axis=-1), count


def schedule(blocks: BlockMap, batch: int, active: bool | jax.Array) -> Schedule:
  """The :class:`Schedule` of a hop from its block map (``active`` False: skip all).

  >>> import numpy as np
  >>> causal = BlockMap(np.tril(np.ones((3, 3), bool))[None], np.eye(3, k=-1, dtype=bool)[None])
  >>> s = schedule(causal, 1, True)
  >>> s.cols[0].tolist(), s.ncols[0].tolist()      # row block i visits key blocks 0..i
  ([[0, 0, 0], [0, 1, 1], [0, 1, 2]], [1, 2, 3])
  >>> s.rows[0].tolist(), s.nrows[0].tolist()      # key block j is seen by row blocks j..2
  ([[0, 1, 2], [1, 2, 2], [2, 2, 2]], [3, 2, 1])
  """
  shape = (batch,) + blocks.any.shape[1:]
  visit = jnp.broadcast_to(blocks.any, shape) & active
  cols, ncols = _compact(visit)
  rows, nrows = _compact(jnp.swapaxes(visit, 1, 2))
  full = jnp.broadcast_to(blocks.all, shape).astype(jnp.int32)
  return Schedule(cols, ncols, rows, nrows, full)


def _split_of(mesh, free: tuple[str, ...], batch: int, heads: int):
  """(axes over the batch, axes over the KV heads) of a kernel's operands: the
  batch axes and ``tp`` where they divide, as the step's shardings put them
  there; any other free axis (or one that does not divide) holds the whole
  operand, every device of it computing the same kernel."""
  over_b, over_h = [], []
  for name in free:
    size = mesh.shape[name]
    if size == 1:
      continue
    if name in BATCH_AXES and batch % (math.prod(mesh.shape[a] for a in over_b) * size) == 0:
      over_b.append(name)
    elif name == HEAD_AXIS and heads % size == 0:
      over_h.append(name)
  return tuple(over_b) or None, tuple(over_h) or None


def manual_over_mesh(kernel: Callable[..., Any]) -> Callable[..., Any]:
  """``kernel(params, *operands)`` run where no mesh axis is left to XLA's partitioner.

  Mosaic (and Triton) calls cannot be partitioned automatically: inside the
  training step's ``shard_map``, manual over ``cp`` only, the fsdp and tp
  axes are XLA's to split, and a kernel there fails to compile for a TPU
  ("Mosaic kernels cannot be automatically partitioned"). This wraps the
  kernel in a ``shard_map`` manual over every axis of the current mesh that
  is not manual yet: the batch over the batch axes (``dp``, ``fsdp``) and
  the KV heads over ``tp`` where they divide, every other axis holding the
  operands whole. The operands' leaves are ``[B, Hkv, ...]`` (4-D: q, k, v
  and their gradients' inputs), ``[B, ...]`` (per-token arrays, the tile
  schedule) or ``[1, T]`` (token positions, the same for every row); the
  results are 4-D. Without such axes (one device, or already manual
  everywhere) the kernel runs as it is.
  """

  @functools.wraps(kernel)
  def run(params: KernelParams, *operands):
    mesh = jax.sharding.get_abstract_mesh()
    free = (
      ()
      if mesh.empty
      else tuple(n for n, t in zip(mesh.axis_names, mesh.axis_types) if t != AxisType.Manual)
    )
    if not free:
      return kernel(params, *operands)
    ref = next(x for x in jax.tree.leaves(operands) if x.ndim == 4)
    batch = ref.shape[0]
    over_b, over_h = _split_of(mesh, free, batch, ref.shape[1])

    def spec(x):
      if x.ndim == 4:
        return P(over_b, over_h)
      # Per-row tables lead with the batch; token positions ([1, T]) are shared.
      return P(over_b) if x.shape[0] == batch else P()

    specs = jax.tree.map(spec, operands)

    def local(*operands):
      # A pallas_call's operands vary over the same mesh axes as its results.
      axes = frozenset().union(*map(varying_axes, jax.tree.leaves(operands)))
      return kernel(params, *jax.tree.map(lambda x: vary_over(x, axes), operands))

    return jax.shard_map(local, in_specs=specs, out_specs=P(over_b, over_h), axis_names=set(free))(
      *operands
    )

  return run


def cost(params: KernelParams, kernel: str, q: jax.Array, keys: jax.Array) -> pl.CostEstimate:
  """The cost estimate of one ``kernel`` call ("forward", "dq", "dkdv") of
  queries ``q`` [B, Hkv, N, D] against ``keys`` [B, Hkv, Lk, D]."""
  return _cost.estimate(
    kernel,
    q,
    keys,
    density=params.density,
    soft_cap=params.soft_cap is not None,
    rows=params.rows,
    block_kv=params.block_kv,
  )


def launch(params: KernelParams, make_call: functools.partial, *args: jax.Array) -> Any:
  """Run ``make_call(interpret=...)`` (a partial ``pl.pallas_call``) on ``args``:
  compiled for its platform, or in Pallas' HLO interpreter when
  ``params.interpret`` (see :mod:`cpjax.attention.ring.kernels._interpret`)."""
  if not params.interpret:
    return make_call(interpret=False)(*args)
  if not isinstance(params.interpret, bool):
    # Pallas' TPU interpreter threads ordered callback effects, which the
    # opaque wrapper below cannot carry: it runs as is (one device, cp = 1).
    return make_call(interpret=params.interpret)(*args)
  out = make_call.keywords["out_shape"]
  single = not isinstance(out, (list, tuple))
  outs = [out] if single else list(out)
  results = _interpret.run(
    lambda *a: jax.tree.leaves(make_call(interpret=params.interpret)(*a)),
    *args,
    out_shapes=[(o.shape, o.dtype) for o in outs],
  )
  return results[0] if single else results


# ------------------------------------------------------------- tile math
def _dot_nt(a, b):
  """a @ b.T, float32 accumulation."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot(a, b):
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def scores(params: KernelParams, q: jax.Array, k: jax.Array) -> jax.Array:
  """f32[R, K] logits of pre-scaled q [R, D] against k [K, D], soft-capped."""
  s = _dot_nt(q, k)
  if params.soft_cap is not None:
    s = params.soft_cap * jnp.tanh(s / params.soft_cap)
  return s


def fold_tile(
  params: KernelParams,
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  mask: jax.Array | None,
  m: jax.Array,
  l: jax.Array,
  acc: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One online-softmax step: fold tile (q [R, D], k/v [K, D]) into
  (m, l f32[R, 1], acc f32[R, D]); ``mask`` bool[R, K] or None (full tile)."""
  s = scores(params, q, k)
  if mask is None:
    m_new = m_safe = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
    p = jnp.exp(s - m_safe)
  else:
    m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, -jnp.inf), axis=-1, keepdims=True))
    # A row that has seen nothing keeps m = -inf; a finite stand-in avoids
    # inf - inf, and the mask zeroes its p exactly.
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.where(mask, jnp.exp(s - m_safe), 0.0)
  alpha = jnp.exp(m - m_safe)
  l = alpha * l + jnp.sum(p, axis=-1, keepdims=True)
  acc = alpha * acc + _dot(p.astype(v.dtype), v)
  return m_new, l, acc


def finish(m: jax.Array, l: jax.Array, acc: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(out f32[R, D], lse f32[R, 1]) of the folded state; rows with nothing
  allowed give out 0 and lse -inf."""
  seen = l > 0
  l_safe = jnp.where(seen, l, 1.0)
  out = jnp.where(seen, acc / l_safe, 0.0)
  return out, jnp.where(seen, m + jnp.log(l_safe), -jnp.inf)


def grad_tile(
  params: KernelParams,
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  do: jax.Array,
  lse: jax.Array,
  delta: jax.Array,
  mask: jax.Array | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(dq f32[R, D], dk f32[K, D], dv f32[K, D]) of one tile.

  ``lse`` is the global log-sum-exp (+inf for rows with nothing allowed, so
  their p is exactly 0) and ``delta`` = rowsum(dO * O), both f32[R, 1]. q is
  pre-scaled, so dk carries the scale and dq gets it once at the end.
  """
  s = scores(params, q, k)
  p = jnp.exp(s - lse)
  if mask is not None:
    p = jnp.where(mask, p, 0.0)
  dv = _dot(p.T.astype(do.dtype), do)
  dp = _dot_nt(do, v)
  ds = p * (dp - delta)
  if params.soft_cap is not None:
    ds = ds * (1.0 - jnp.square(s / params.soft_cap))  # d(c*tanh(x/c))/dx
  dk = _dot(ds.T.astype(q.dtype), q)
  dq = _dot(ds.astype(k.dtype), k)
  return dq, dk, dv
