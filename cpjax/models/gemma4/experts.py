"""Mixture-of-experts dispatch: tokens to their top-k experts and back, on
one device or with the experts split over mesh axes (expert parallelism).

Expert parallelism folds onto the mesh axes whose devices already hold
different tokens: the context-parallel axis ``cp`` and the batch axis
(``fsdp`` or ``dp``), as Megatron-Core folds its expert-parallel groups onto
the data- and context-parallel ranks. With ``expert_axes`` the experts'
leading dimension is split over those axes (``cp`` major), so each device
stores ``E / ep`` experts and only their weights and optimizer state. When
``ep`` covers every token axis no expert weight is ever gathered (when it
folds onto ``cp`` alone beside a batch axis, FSDP still shards each group's
experts over that axis and gathers them where used). Tokens travel instead: each device sorts
its (token, slot) pairs by expert, one ``all_to_all`` over the expert axes
carries them to the devices owning their experts, the local experts run
through :func:`grouped_matmul`, and a second ``all_to_all`` brings the
results back to their tokens, where the router weights are applied.

Shape letters: ``T`` tokens here, ``D`` model width, ``k`` experts per
token, ``E`` experts, ``G`` expert groups (``ep``, the product of the
expert axes' sizes), ``R`` rows each device sends to each group.

Without a capacity factor no token is ever dropped: each device's block for
each group has room for all its ``T * k`` pairs (the case of every token
choosing one group), so the dispatch holds four buffers (sent, received,
computed, returned) of ``G * T * k * D`` values per device. A
``capacity_factor`` ``c`` bounds each expert to ``C = ceil(c * T * k / E)``
pairs from the ``T`` tokens of one dispatch (one device's under expert
parallelism; without it, every batch row of the cp rank), in token order;
later pairs are dropped (their expert output is zero, the token keeps its
residual and shared MLP, as in GShard and Switch), counted in
:class:`ExpertStats`, and the blocks shrink to ``min(T * k, E / G * C)``
rows.

Example (one device; an "expert" that scales its rows by ``e + 1``):
  >>> import numpy as np
  >>> scale = jnp.arange(1.0, 5.0)                       # E = 4
  >>> def fn(rows, sizes, scale):                        # rows grouped by expert
  ...   return rows * jnp.repeat(scale, sizes, total_repeat_length=rows.shape[0])[:, None]
  >>> x = np.ones((2, 3), np.float32)
  >>> ids = np.array([[0, 3], [1, 1]], np.int32); w = np.full((2, 2), 0.5, np.float32)
  >>> y, stats = routed_experts(x, w, ids, scale, fn, num_experts=4)
  >>> y[:, 0].tolist(), stats.tokens.tolist()
  ([2.5, 2.0], [1.0, 2.0, 0.0, 1.0])
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from cpjax.parallel import filled_after, vary_like

__all__ = ["ExpertStats", "grouped_matmul", "routed_experts"]

# Rows a tile of grouped_matmul's loop off TPU (at most; a divisor of M).
GROUPED_TILE = 512

# expert_fn(rows [R, D], group_sizes int32[E_here], params_here) -> [R, D]:
# rows arrive grouped by expert (sizes in order); rows after sum(group_sizes)
# are padding, and whatever expert_fn makes of them is discarded.
ExpertFn = Callable[[jax.Array, jax.Array, Any], jax.Array]


class ExpertStats(NamedTuple):
  """What the router did with the tokens it was given (float32): under
  ``cp``, those of this cp rank, every batch row included; the caller sums
  over ``cp``.

  Attributes:
    tokens: float32[E] (token, slot) pairs routed to each expert, padding
      positions included: the load each expert carries.
    dropped: float32[] pairs dropped by the capacity factor (0 without one).
  """

  tokens: jax.Array
  dropped: jax.Array


def routed_experts(
  x: jax.Array,
  weights: jax.Array,
  expert_ids: jax.Array,
  params: Any,
  expert_fn: ExpertFn,
  *,
  num_experts: int,
  expert_axes: tuple[str, ...] = (),
  capacity_factor: float | None = None,
) -> tuple[jax.Array, ExpertStats]:
  """Compute ``y[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t])``, and :class:`ExpertStats`.

  Args:
    x: [T..., D] tokens (any leading shape; the first dimension is the
      batch rows when a batch axis splits them).
    weights: float32[T..., k] router weights.
    expert_ids: int[T..., k] chosen experts in ``[0, E)``.
    params: the experts' weights, a pytree of arrays whose leading
      dimension is ``E`` (split over ``expert_axes``).
    expert_fn: ``(rows [R, D], group_sizes int32[E_here], params_here) ->
      [R, D]`` for the experts present (``E`` of them, or ``E / G``).
    num_experts: ``E``.
    expert_axes: mesh axes the experts are split over (``cp`` first), empty
      for none: see :func:`cpjax.parallel.expert_axes`. Must be called
      inside the ``shard_map`` that is manual over the ``cp`` axis.
    capacity_factor: None (never drop) or ``c > 0``: see the module docs.

  Returns:
    ``y`` [T..., D] in ``x``'s dtype, and :class:`ExpertStats`.
  """
  e = num_experts
  shape = x.shape
  if expert_ids.shape[:-1] != shape[:-1] or weights.shape != expert_ids.shape:
    raise ValueError(
      f"routed_experts: x {shape}, weights {weights.shape} and expert_ids "
      f"{expert_ids.shape} must share their leading dimensions [T..., k]"
    )
  if capacity_factor is not None and not (
    isinstance(capacity_factor, (int, float))
    and not isinstance(capacity_factor, bool)
    and capacity_factor > 0
  ):
    raise ValueError(
      f"capacity_factor must be None (never drop) or a positive number, got {capacity_factor!r}"
    )
  expert_axes = tuple(expert_axes)
  if not expert_axes:
    return _local(x, weights, expert_ids, params, expert_fn, e, capacity_factor)
  mesh = jax.sharding.get_abstract_mesh()
  missing = [a for a in expert_axes if mesh.empty or a not in mesh.axis_names]
  if missing:
    raise ValueError(
      f"expert_axes {expert_axes} name axes {missing} that the current mesh "
      f"{None if mesh.empty else mesh.axis_names} does not have"
    )
  groups = math.prod(mesh.shape[a] for a in expert_axes)
  if e % groups:
    raise ValueError(
      f"expert_axes {expert_axes} split the experts {groups} ways, which does "
      f"not divide the {e} experts"
    )
  # Manual over every Auto axis as well (as cpjax.parallel.lookup is): the
  # SPMD partitioner then sees no data-dependent gather of sharded tokens.
  auto = tuple(
    n
    for n, kind in zip(mesh.axis_names, mesh.axis_types)
    if kind == AxisType.Auto and mesh.shape[n] > 1
  )
  batch = next((a for a in auto if a in ("dp", "fsdp")), None)
  if batch is not None and shape[0] % mesh.shape[batch]:
    if batch in expert_axes:
      raise ValueError(
        f"expert axis {batch!r} of size {mesh.shape[batch]} must split the "
        f"{shape[0]} batch rows (their tokens are what it exchanges)"
      )
    batch = None
  nested = tuple(a for a in expert_axes if a in auto)
  # Here (manual over cp) the experts must already be split over the expert
  # axes that are not Auto: partition_rule(..., expert_axes=...) places them.
  lead = {leaf.shape[0] for leaf in jax.tree.leaves(params)}
  want = e // math.prod(mesh.shape[a] for a in expert_axes if a not in auto)
  if lead != {want}:
    raise ValueError(
      f"with expert_axes {expert_axes} the experts' parameters must have "
      f"leading dimension {want} here (E = {e} split over the manual ones), got "
      f"{sorted(lead)}: place them with partition_rule(..., expert_axes=...)"
    )

  def local(x, weights, expert_ids, params):
    y, stats = _exchange(
      x, weights, expert_ids, params, expert_fn, e, expert_axes, groups, capacity_factor
    )
    if batch is not None:  # the stats of every row this cp rank holds
      stats = jax.tree.map(lambda s: jax.lax.psum(s, batch), stats)
    return y, stats

  if not auto:
    return local(x, weights, expert_ids, params)
  tokens = P(batch)
  return _manual(
    x,
    weights,
    expert_ids,
    params,
    _Manual(local, (tokens, tokens, tokens, P(nested or None)), tokens, auto, _Saved()),
  )


class _Manual(NamedTuple):
  """A function run in a ``shard_map`` manual over ``axes`` (inside the cp one)."""

  fn: Callable
  in_specs: tuple
  out_spec: P
  axes: tuple
  pullback: "_Saved"


class _Saved:
  """The structure of the forward's pullback, read back by the backward."""

  tree: Any = None


# A custom VJP whose backward is its own shard_map: the transpose JAX derives
# for a shard_map nested in the ring's fails to lower on this JAX (its
# residuals name the outer manual axis), as for cpjax.parallel.lookup. The
# forward's shard_map returns its pullback's residuals, each with a leading
# axis over the manual axes, and the backward's shard_map applies them.
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _manual(x, weights, expert_ids, params, run):
  return jax.shard_map(
    run.fn, in_specs=run.in_specs, out_specs=(run.out_spec, P()), axis_names=set(run.axes)
  )(x, weights, expert_ids, params)


def _manual_fwd(x, weights, expert_ids, params, run):
  def forward(x, weights, expert_ids, params):
    out, pullback = jax.vjp(lambda x, w, p: run.fn(x, w, expert_ids, p), x, weights, params)
    leaves, run.pullback.tree = jax.tree.flatten(pullback)
    return out, [leaf[None] for leaf in leaves]

  out, saved = jax.shard_map(
    forward,
    in_specs=run.in_specs,
    out_specs=((run.out_spec, P()), P(run.axes)),
    axis_names=set(run.axes),
  )(x, weights, expert_ids, params)
  return out, (saved, out[1])


def _manual_bwd(run, residuals, g):
  saved, stats = residuals

  def backward(saved, d_y, stats):
    pullback = jax.tree.unflatten(run.pullback.tree, [leaf[0] for leaf in saved])
    return pullback((d_y, jax.tree.map(jnp.zeros_like, stats)))

  tokens, _, _, experts = run.in_specs
  d_x, d_w, d_params = jax.shard_map(
    backward,
    in_specs=(P(run.axes), run.out_spec, P()),
    out_specs=(tokens, tokens, experts),
    axis_names=set(run.axes),
  )(saved, g[0], stats)
  return d_x, d_w, None, d_params


_manual.defvjp(_manual_fwd, _manual_bwd)


def _expert_capacity(pairs: int, e: int, capacity_factor: float | None) -> int:
  """Pairs each expert takes from one device: all of them, or ``ceil(c * pairs / E)``."""
  if capacity_factor is None:
    return pairs
  return max(1, min(pairs, math.ceil(capacity_factor * pairs / e)))


def _by_expert(expert_ids, e: int, capacity_factor: float | None):
  """This device's (token, slot) pairs in expert order, and which of them the
  capacity keeps (the first ``C`` of each expert, in token order).

  Returns ``order`` int32[T*k] (pair numbers ``token * k + slot``), the
  expert of each, ``keep`` bool[T*k] and ``sizes`` int32[E] (pairs per
  expert, before dropping)."""
  flat = expert_ids.reshape(-1).astype(jnp.int32)
  order = jnp.argsort(flat, stable=True)
  expert = flat[order]
  sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
  rank = jnp.arange(flat.shape[0], dtype=jnp.int32) - (jnp.cumsum(sizes) - sizes)[expert]
  keep = rank < _expert_capacity(flat.shape[0], e, capacity_factor)
  return order, expert, keep, sizes


def _stats(sizes, keep) -> ExpertStats:
  return ExpertStats(sizes.astype(jnp.float32), jnp.sum(~keep).astype(jnp.float32))


def _local(x, weights, expert_ids, params, expert_fn, e, capacity_factor):
  """Every expert on this device: the pairs grouped by expert, one pass."""
  d, dt = x.shape[-1], x.dtype
  flat_x = x.reshape(-1, d)
  t, k = flat_x.shape[0], expert_ids.shape[-1]
  order, expert, keep, sizes = _by_expert(expert_ids, e, capacity_factor)
  kept = sizes
  if capacity_factor is not None:
    # Dropped pairs move past every group (ragged_dot leaves them out).
    order = order[jnp.argsort(jnp.where(keep, expert, e), stable=True)]
    kept = jnp.minimum(sizes, _expert_capacity(t * k, e, capacity_factor))
  token = order // k
  y = expert_fn(flat_x[token], kept, params).astype(jnp.float32)
  w = weights.reshape(-1)[order]
  if capacity_factor is not None:
    live = jnp.arange(t * k) < jnp.sum(kept)
    y, w = jnp.where(live[:, None], y, 0.0), jnp.where(live, w, 0.0)
  out = jnp.zeros((t, d), jnp.float32).at[token].add(y * w[:, None]).astype(dt)
  return out.reshape(x.shape), _stats(sizes, keep)


def _exchange(x, weights, expert_ids, params, expert_fn, e, expert_axes, groups, capacity_factor):
  """One device's side of the expert-parallel dispatch (manual over every axis).

  Group ``g`` (linear index over ``expert_axes``, first axis major) owns
  experts ``[g * E / G, (g + 1) * E / G)``. Pairs are packed per group into
  ``R`` rows in expert order; one all_to_all sends row block ``g`` to group
  ``g``, which regroups what it received by local expert, runs them, and the
  reverse all_to_all returns every row to the slot it left from.
  """
  d, dt = x.shape[-1], x.dtype
  flat_x = x.reshape(-1, d)
  t, k = flat_x.shape[0], expert_ids.shape[-1]
  per_group = e // groups
  order, expert, keep, sizes = _by_expert(expert_ids, e, capacity_factor)
  rows = min(t * k, per_group * _expert_capacity(t * k, e, capacity_factor))
  group = expert // per_group
  # Slot of each kept pair in its group's block: kept pairs before it, minus
  # the kept pairs of earlier groups (pairs are in expert, hence group, order).
  kept_before = jnp.cumsum(keep) - keep
  kept_per_group = jax.ops.segment_sum(keep.astype(jnp.int32), group, num_segments=groups)
  first = jnp.cumsum(kept_per_group) - kept_per_group
  slot = jnp.where(keep, group * rows + kept_before - first[group], groups * rows)
  # (Buffers filled after their data exists: XLA:GPU would build every
  # layer's zeros at the step's start.)
  send = (
    filled_after(flat_x, (groups * rows, d), dtype=dt).at[slot].set(flat_x[order // k], mode="drop")
  )
  local_expert = (
    jnp.full((groups * rows,), per_group, jnp.int32).at[slot].set(expert % per_group, mode="drop")
  )
  a2a = lambda v: jax.lax.all_to_all(v, expert_axes, 0, 0, tiled=True)
  received, received_expert = a2a(send), a2a(local_expert)
  # Regroup by local expert; empty rows (expert id ``per_group``) sort last.
  regroup = jnp.argsort(received_expert, stable=True)
  counts = jnp.bincount(received_expert, length=per_group + 1)[:per_group].astype(jnp.int32)
  out = expert_fn(received[regroup], counts, params)
  out = jnp.where(
    (jnp.arange(groups * rows) < jnp.sum(counts))[:, None], out, jnp.zeros((), out.dtype)
  )
  back = a2a(filled_after(out, out.shape, dtype=out.dtype).at[regroup].set(out))
  # A dropped pair's slot is past the end: it reads zeros.
  y = back.at[slot].get(mode="fill", fill_value=0).astype(jnp.float32)
  w = weights.reshape(-1)[order]
  out = jnp.zeros((t, d), jnp.float32).at[order // k].add(y * w[:, None]).astype(dt)
  return out.reshape(x.shape), _stats(sizes, keep)


def grouped_matmul(
  rows: jax.Array, weights: jax.Array, sizes: jax.Array, *, tile: int = GROUPED_TILE
) -> jax.Array:
  """Compute ``rows[i] @ weights[g]`` for each row ``i`` of group ``g``.

  As ``jax.lax.ragged_dot``: rows [M, K] in group order (``sizes`` int32[G]
  rows a group; rows past ``sum(sizes)`` give zeros), weights [G, K, N] ->
  [M, N] in the operands' dtype (float32 accumulation).

  On TPU this is ``ragged_dot`` (XLA:TPU's grouped matmul), whose two
  gradients its backward makes together (see ``_ragged_dot``). Elsewhere JAX
  lowers ``ragged_dot`` and its transposes by expanding the rows to a dense
  [G, M, K]: on 8 H200s the 26B-A4B slice's step (2 layers, S = 8192,
  fsdp=2 x cp=4, ep=8) held three float32 [16, 131072, 2816] of them, 22 GiB
  each, and computed every row with every group's weights. There it is a
  loop over (tile of ``tile`` rows, group) pairs, as megablox's grouped
  matmul walks them: a tile meets the groups its rows belong to, so at most
  ``M / tile + G - 1`` products of [tile, K] x [K, N], masked to the
  group's rows; its backward (rows' and weights' gradients) walks the same
  pairs.

  Args:
    rows: [M, K] in group order.
    weights: [G, K, N].
    sizes: int32[G], the rows of each group.
    tile: the rows of one tile of the loop.

  Returns:
    [M, N] in the operands' dtype.

  >>> w = jnp.stack([jnp.eye(2), 2 * jnp.eye(2)])            # G = 2
  >>> grouped_matmul(jnp.ones((3, 2)), w, jnp.array([1, 1], jnp.int32))
  Array([[1., 1.],
         [2., 2.],
         [0., 0.]], dtype=float32)
  """
  rows, weights, sizes = jnp.asarray(rows), jnp.asarray(weights), jnp.asarray(sizes)
  tile = math.gcd(rows.shape[0], tile)  # a divisor of M (M itself when small)

  # Inside shard_map: operands varying over the same axes, so the weights'
  # gradient is summed over the rows' other axes outside (pcast's transpose).
  rows, weights = vary_like(rows, weights), vary_like(weights, rows)
  looped = functools.partial(_looped_matmul, tile)
  return lax.platform_dependent(rows, weights, sizes, tpu=_ragged_dot, default=looped)


# XLA:TPU schedules a weight gradient as late as its last use, the step's
# gradient norm, and keeps the rows and the output's gradient it is made from
# alive till then: every layer's dispatch-sized pair at the backward's end
# (26B-A4B full fine-tuning at S = 131072 on v5e-64: refused past 21.1 GiB a
# device; 9.54 with the barrier, where the closed form says 8.97). Both
# gradients leave the backward through one optimization barrier, so the
# weights' is made where the rows' is.
@jax.custom_vjp
def _ragged_dot(rows, weights, sizes):
  return lax.ragged_dot(rows, weights, sizes)


def _ragged_dot_fwd(rows, weights, sizes):
  return lax.ragged_dot(rows, weights, sizes), (rows, weights, sizes)


def _ragged_dot_bwd(residuals, d_out):
  rows, weights, sizes = residuals
  _, pullback = jax.vjp(lambda x, w: lax.ragged_dot(x, w, sizes), rows, weights)
  d_rows, d_weights = lax.optimization_barrier(pullback(d_out))
  return d_rows, d_weights, None


_ragged_dot.defvjp(_ragged_dot_fwd, _ragged_dot_bwd)


def _pairs(sizes, m: int, tile: int):
  """The (tile, group) pairs whose products make the grouped matmul:
  ``(tiles, groups, valid)`` int32/bool [P], P = M / tile + G - 1 (pairs past
  the last are not valid), and each row's group (``G`` past the last)."""
  g = sizes.shape[0]
  group = _at_most(jnp.cumsum(sizes), m)
  first = group[::tile]  # [M / tile]
  last = jnp.minimum(group[tile - 1 :: tile], g - 1)
  count = jnp.where(first < g, last - first + 1, 0)
  start = jnp.cumsum(count) - count
  p = jnp.arange(m // tile + g - 1, dtype=sizes.dtype)
  tiles = jnp.clip(_at_most(start + count, p.shape[0]), 0, m // tile - 1)
  return tiles, first[tiles] + p - start[tiles], p < jnp.sum(count), group


def _at_most(ends, n: int):
  """For each i < ``n``, how many of the sorted ``ends`` [G] are at most i:
  int [n], ``searchsorted(ends, arange(n), side="right")`` as a histogram's
  running sum. (In this JAX, jnp.searchsorted fails its shape check on
  operands varying over a mesh axis in a shard_map manual over only some.)"""
  marks = vary_like(jnp.zeros((n + 1,), ends.dtype), ends)
  return jnp.cumsum(marks.at[jnp.minimum(ends, n)].add(1))[:n]


def _zeros(shape, dtype, *refs):
  """Zeros filled after ``refs[0]`` exists (XLA:GPU builds operandless fills
  at the step's start, every layer's at once), varying as all ``refs``."""
  out = filled_after(refs[0], shape, dtype=dtype)
  for ref in refs[1:]:
    out = vary_like(out, ref)
  return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _looped_matmul(tile, rows, weights, sizes):
  tiles, groups, valid, group = _pairs(sizes, rows.shape[0], tile)

  def one(p, out):
    at, g = tiles[p] * tile, groups[p]
    x = lax.dynamic_slice_in_dim(rows, at, tile)
    mine = ((lax.dynamic_slice_in_dim(group, at, tile) == g) & valid[p])[:, None]
    product = jnp.dot(x, weights[g], preferred_element_type=jnp.float32).astype(out.dtype)
    now = lax.dynamic_slice_in_dim(out, at, tile)
    return lax.dynamic_update_slice_in_dim(out, jnp.where(mine, product, now), at, 0)

  init = _zeros((rows.shape[0], weights.shape[-1]), rows.dtype, rows, weights)
  return lax.fori_loop(0, tiles.shape[0], one, init)


def _looped_matmul_fwd(tile, rows, weights, sizes):
  return _looped_matmul(tile, rows, weights, sizes), (rows, weights, sizes)


def _looped_matmul_bwd(tile, residuals, d_out):
  rows, weights, sizes = residuals
  tiles, groups, valid, group = _pairs(sizes, rows.shape[0], tile)

  def one(p, carry):
    d_rows, d_weights = carry
    at, g = tiles[p] * tile, groups[p]
    mine = ((lax.dynamic_slice_in_dim(group, at, tile) == g) & valid[p])[:, None]
    x = jnp.where(mine, lax.dynamic_slice_in_dim(rows, at, tile), jnp.zeros((), rows.dtype))
    dy = lax.dynamic_slice_in_dim(d_out, at, tile)
    back = jnp.dot(dy, weights[g].T, preferred_element_type=jnp.float32).astype(d_rows.dtype)
    now = lax.dynamic_slice_in_dim(d_rows, at, tile)
    d_rows = lax.dynamic_update_slice_in_dim(d_rows, jnp.where(mine, back, now), at, 0)
    d_w = d_weights[g] + jnp.dot(x.T, dy, preferred_element_type=jnp.float32)
    return d_rows, lax.dynamic_update_index_in_dim(d_weights, d_w, g, 0)

  init = (
    _zeros(rows.shape, rows.dtype, d_out, rows, weights),
    _zeros(weights.shape, jnp.float32, d_out, weights, rows),
  )
  d_rows, d_weights = lax.fori_loop(0, tiles.shape[0], one, init)
  return d_rows, d_weights.astype(weights.dtype), None


_looped_matmul.defvjp(_looped_matmul_fwd, _looped_matmul_bwd)
