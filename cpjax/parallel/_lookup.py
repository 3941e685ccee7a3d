"""Embedding lookups into sharded tables, and activations made whole for gathers."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from cpjax.parallel._mesh import BATCH_AXES
from cpjax.parallel._placement import param_specs
from cpjax.parallel._vary import filled_after, vary_like, varying_axes


def gathered(table: jax.Array) -> jax.Array:
  """Gather ``table`` whole on every device, for a lookup (``table[ids]``).

  A no-op outside a mesh. Under one, a lookup into a table sharded over an
  Auto axis (``fsdp``) by ids sharded over that same axis (the batch rows)
  inside the ring's ``shard_map`` makes XLA's SPMD partitioner fail a check
  when the mesh has a second Auto axis (jax 0.10, CPU; fsdp x cp x tp):
  asking for the table whole first, as ZeRO-3 gathers any weight before
  use, gives the partitioner a plain local gather. The gathered table is a
  temporary, freed after the lookup and its backward.

  Args:
    table: the table.

  Returns:
    ``table``, whole on every device.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not any(kind == AxisType.Auto for kind in mesh.axis_types):
    return table
  return jax.lax.with_sharding_constraint(table, P())


def lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
  """Look up ``table[ids]`` [B, ..., D] without the whole table on any device.

  On a mesh whose Auto axes (``fsdp``, ``tp``) split the table's rows, as
  :func:`param_specs` places a table (both axes on the vocabulary), each
  device looks up the ids that fall in its own block of rows, gives zeros
  for the rest, and a sum over the table's axes completes every row: a
  reduce-scatter back to the batch's rows over the batch axis, an all-reduce
  over the others. Only the integer ids travel whole over the batch axis.
  The gradient is a scatter-add into each device's own block, so it stays
  sharded too. The lookup is a ``shard_map`` manual over those axes: it does
  not depend on the SPMD partitioner's handling of gathers (which fails a
  check on fsdp x cp x tp meshes on this JAX, see :func:`gathered`).
  Without such a mesh (one device, or inside a ``shard_map`` manual over
  every axis) it is ``table[ids]``.

  Args:
    table: [V, D] rows to look up.
    ids: int[B, ...] row numbers in ``[0, V)``; ``B`` split over the mesh's
      batch axis when it has one that divides it.

  Returns:
    ``table[ids]`` [B, ..., D].

  Example:
    >>> import numpy as np
    >>> from jax.sharding import NamedSharding
    >>> from cpjax.parallel import make_mesh
    >>> mesh = make_mesh(fsdp=2, cp=1, tp=2)
    >>> table = np.arange(16.0).reshape(8, 2)
    >>> ids = np.array([[7, 0], [3, 3]])
    >>> with jax.set_mesh(mesh):
    ...   out = jax.jit(lookup)(jax.device_put(table, NamedSharding(mesh, P(("fsdp", "tp")))), ids)
    >>> np.asarray(out)[:, :, 0].tolist()
    [[14.0, 0.0], [6.0, 6.0]]
  """
  where = row_placement(table, ids.shape[0])
  if where is None:
    return table[ids]
  if not where.table_axes:
    return gathered(table)[ids]
  return _sharded_lookup(table, ids, where)


class RowPlacement(NamedTuple):
  """Where a table split over its rows (vocabulary) lives, for code manual over the mesh."""

  table_axes: tuple[str, ...]  # mesh axes splitting the table's rows, major first (or none)
  batch: str | None  # the axis splitting the batch's rows (B), if it divides B
  auto: frozenset[str]  # every Auto axis of size > 1: be manual over them all
  rows: int  # the table's rows, V
  dtype: Any
  vma: frozenset[str]  # manual axes (cp) the table varies over: none, usually

  def block_rows(self) -> int:
    """Return the table rows each device holds: ``rows`` over the ``table_axes``' sizes.

    The sizes are the current abstract mesh's.

    Returns:
      The rows of one device's block.
    """
    mesh = jax.sharding.get_abstract_mesh()
    return self.rows // int(np.prod([mesh.shape[a] for a in self.table_axes], dtype=int))


def row_placement(table: jax.Array, batch_rows: int) -> RowPlacement | None:
  """Return how ``table`` [V, ...] splits over the current mesh's Auto axes.

  As :func:`param_specs` places it: None without Auto axes (one device, or
  every axis manual); ``table_axes`` empty when the split is not over the
  rows alone (then gather it).

  Args:
    table: the table [V, ...].
    batch_rows: the batch's ``B``.

  Returns:
    The :class:`RowPlacement`, or None.
  """
  mesh = jax.sharding.get_abstract_mesh()
  auto = (
    ()
    if mesh.empty
    else tuple(
      n
      for n, kind in zip(mesh.axis_names, mesh.axis_types)
      if kind == AxisType.Auto and mesh.shape[n] > 1
    )
  )
  if not auto:
    return None
  # The Auto axes' part: a split over cp was gathered when the ring's
  # shard_map began (manual over cp, the table is whole over it here).
  spec = param_specs(jax.ShapeDtypeStruct(table.shape, table.dtype), mesh, state_axes=("fsdp",))
  rows = spec[0] if len(spec) else None
  table_axes = () if rows is None else (rows,) if isinstance(rows, str) else tuple(rows)
  if any(p is not None for p in spec[1:]):
    table_axes = ()
  batch = next((a for a in auto if a in BATCH_AXES and batch_rows % mesh.shape[a] == 0), None)
  return RowPlacement(
    table_axes, batch, frozenset(auto), table.shape[0], jnp.dtype(table.dtype), varying_axes(table)
  )


# A custom VJP whose backward is its own shard_map (the scatter-add into each
# device's block): the transpose JAX derives for a shard_map nested in the
# ring's fails to lower on this JAX (its residuals name the outer manual axis).
@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _sharded_lookup(table, ids, where):
  return _lookup_forward(table, ids, where)[0]


def _block_ids(ids, size, table_axes, batch):
  """(row within this device's block, whether it is in the block) of every id."""
  if batch in table_axes:  # every row's ids meet every block of the table
    ids = jax.lax.all_gather(ids, batch, axis=0, tiled=True)
  rel = ids - jax.lax.axis_index(table_axes) * size
  hit = (rel >= 0) & (rel < size)
  return jnp.where(hit, rel, 0), hit


def _lookup_forward(table, ids, where):
  table_axes, batch = where.table_axes, where.batch

  def local(block, ids):
    rel, hit = _block_ids(ids, block.shape[0], table_axes, batch)
    out = jnp.where(hit[..., None], block[rel], jnp.zeros((), block.dtype))
    if batch in table_axes:
      out = jax.lax.psum_scatter(out, batch, scatter_dimension=0, tiled=True)
    rest = tuple(a for a in table_axes if a != batch)
    return jax.lax.psum(out, rest) if rest else out

  out = jax.shard_map(
    local, in_specs=(P(table_axes), P(batch)), out_specs=P(batch), axis_names=set(where.auto)
  )(table, ids)
  return out, ids


def _lookup_backward(where, ids, g):
  table_axes, batch = where.table_axes, where.batch
  size = where.block_rows()

  def local(ids, g):
    rel, hit = _block_ids(ids, size, table_axes, batch)
    if batch in table_axes:
      g = jax.lax.all_gather(g, batch, axis=0, tiled=True)
    g = jnp.where(hit[..., None], g, jnp.zeros((), g.dtype))
    block = filled_after(g, (size, g.shape[-1]), dtype=where.dtype)
    block = block.at[rel].add(g.astype(where.dtype))
    # Rows split over a batch axis that does not split the table (dp) all
    # add into the same (replicated) block.
    return block if batch in table_axes or batch is None else jax.lax.psum(block, batch)

  d_table = jax.shard_map(
    local, in_specs=(P(batch), P(batch)), out_specs=P(table_axes), axis_names=set(where.auto)
  )(ids, g)
  # Inside the ring's shard_map the ids differ per cp rank while the table
  # does not: its gradient is the sum over those ranks.
  spread = tuple(sorted(varying_axes(d_table) - where.vma))
  return (jax.lax.psum(d_table, spread) if spread else d_table), None


_sharded_lookup.defvjp(_lookup_forward, _lookup_backward)


def ring_lookup(block: jax.Array, ids: jax.Array, axis_name: str = "cp") -> jax.Array:
  """Look up ``table[ids]`` [B, L, D] inside a ``shard_map`` manual over ``axis_name``.

  Each rank holds one block of the table's rows and its own tokens.

  Rank ``i`` holds rows ``[i * Vb, (i + 1) * Vb)`` (``block`` [Vb, D], as
  :func:`param_specs` stores a table over ``fsdp x cp``, cp major) and the
  ids of its ``L`` tokens. Each rank's ids travel round the ring with their
  partial rows: every rank adds the rows that fall in its block and passes
  both on, and after ``n`` hops (one ``ppermute`` of ``[B, L, D]`` each, as
  a reduce-scatter moves) they are home, complete. No rank holds the whole
  table or more than one ``[B, L, D]`` partial at a time; the gradient is a
  scatter-add into each rank's own block (the transposed ring). The block's
  split over Auto axes (``fsdp``, ``tp``) is :func:`lookup`'s.

  Args:
    block: [Vb, D] this rank's rows of the table.
    ids: int[B, ...] row numbers in ``[0, n * Vb)``, this rank's tokens.
    axis_name: the manual mesh axis the rows are split over.

  Returns:
    ``table[ids]`` [B, L, D] of this rank's tokens.

  Example:
    >>> import numpy as np
    >>> from jax.sharding import NamedSharding
    >>> mesh = jax.make_mesh((2,), ("cp",), devices=jax.devices()[:2])
    >>> table = np.arange(8.0).reshape(4, 2)           # rank 0: rows 0-1, rank 1: rows 2-3
    >>> ids = np.array([[3, 0, 1, 2]])                  # rank 0: [3, 0], rank 1: [1, 2]
    >>> f = jax.shard_map(ring_lookup, mesh=mesh, in_specs=(P("cp"), P(None, "cp")),
    ...                   out_specs=P(None, "cp"))
    >>> put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    >>> np.asarray(jax.jit(f)(put(table, P("cp")), put(ids, P(None, "cp"))))[0, :, 0].tolist()
    [6.0, 0.0, 2.0, 4.0]
  """
  return _ring_lookup(block, ids, axis_name)


# The backward is written out so that every hop's scatter-add lands in one
# gradient buffer of the block: differentiating the hops gives one
# block-sized buffer per hop, which XLA:CPU keeps alive until it sums them
# (the table's size several times over; measured on the E2B slice at
# S = 131072, cp = 8).
@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _ring_lookup(block, ids, axis_name):
  return _ring_forward(block, ids, axis_name)[0]


def _ring(ids, axis_name: str, rows: int):
  """(ring size, one hop's permutation, ``hits(ids) -> (row in this rank's block, in it)``)."""
  n = jax.lax.axis_size(axis_name)
  start = jax.lax.axis_index(axis_name) * rows

  def hits(visiting):
    rel = visiting - start
    hit = (rel >= 0) & (rel < rows)
    return jnp.where(hit, rel, 0), hit

  return n, [(i, (i + 1) % n) for i in range(n)], hits


def _ring_forward(block, ids, axis_name):
  n, hop, hits = _ring(ids, axis_name, block.shape[0])

  def add(visiting, total):
    rel, hit = hits(visiting)
    return total + jnp.where(hit[..., None], lookup(block, rel), jnp.zeros((), block.dtype))

  def step(_, carry):
    visiting, total = carry
    total = jax.lax.ppermute(add(visiting, total), axis_name, hop)
    return jax.lax.ppermute(visiting, axis_name, hop), total

  # A loop, not n unrolled hops: XLA:TPU's scheduler starts the unrolled
  # hops' ppermutes early, several [B, L, D] partials in flight at once.
  total = vary_like(jnp.zeros((*ids.shape, *block.shape[1:]), block.dtype), ids)
  visiting, total = jax.lax.fori_loop(0, n - 1, step, (ids, total))
  return jax.lax.ppermute(add(visiting, total), axis_name, hop), (block, ids)


def _ring_backward(axis_name, residuals, g):
  # Every rank added its rows to each token's row, so the token's cotangent
  # goes to every rank: (ids, g) travel the ring once more, and each rank
  # adds those that fall in its block into one buffer.
  block, ids = residuals
  n, hop, hits = _ring(ids, axis_name, block.shape[0])
  whole = row_placement(block, ids.shape[0]) is None  # no Auto axis splits the block

  def add(visiting, g, d_block):
    rel, hit = hits(visiting)
    part = jnp.where(hit[..., None], g, jnp.zeros((), g.dtype)).astype(block.dtype)
    if whole:  # a scatter-add into the one buffer, in place
      return d_block.at[rel].add(part)
    # lookup's own scatter over the Auto axes, then added
    return d_block + jax.vjp(lambda t: lookup(t, rel), block)[1](part)[0]

  def step(_, carry):
    visiting, g, d_block = carry
    d_block = add(visiting, g, d_block)
    return jax.lax.ppermute(visiting, axis_name, hop), jax.lax.ppermute(g, axis_name, hop), d_block

  # A loop, as the forward: one [B, L, D] cotangent in flight, not several
  # (E2B at S = 262144 on a v6e-16: four float32 [16384, 8960] ones of the
  # per-layer table, 2.2 GiB, at XLA:TPU's peak when unrolled).
  d_block = filled_after(g, block.shape, dtype=block.dtype)
  visiting, g, d_block = jax.lax.fori_loop(0, n - 1, step, (ids, g, d_block))
  return add(visiting, g, d_block), None


_ring_lookup.defvjp(_ring_forward, _ring_backward)


def gather_safe(x: jax.Array) -> jax.Array:
  """Gather ``x`` whole on every device when the mesh has two or more Auto axes.

  For activations entering data-dependent gathers and scatters (MoE
  dispatch): on an fsdp x cp x tp mesh XLA's SPMD partitioner fails a check
  on them (see :func:`gathered`), so the dispatch runs on whole activations
  there, repeated on each fsdp and tp rank. Meshes with one Auto axis keep
  the partitioned dispatch.

  Args:
    x: an activation.

  Returns:
    ``x`` whole on every device when the mesh has two or more Auto axes, else ``x``.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  auto = [
    n
    for n, kind in zip(mesh.axis_names, mesh.axis_types)
    if kind == AxisType.Auto and mesh.shape[n] > 1
  ]
  return jax.lax.with_sharding_constraint(x, P()) if len(auto) >= 2 else x
