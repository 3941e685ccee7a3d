"""Per-hop attention kernels for TPU (Mosaic, ``jax.experimental.pallas.tpu``).

Each kernel is a grid whose last dimension walks one tile list of the hop's
:class:`cpjax.attention.ring.kernels._common.Schedule`, which is scalar-prefetched into SMEM:
the block index maps read it, so a K/V (or Q) block is only fetched for a
non-empty tile, and the tail of a list repeats its last entry so the
pipeline fetches nothing there. Statistics live in VMEM scratch across the
walk; full tiles skip the mask.

The scalar tables sit in SMEM (1 MiB on a v5e core), so each is one flat
int32 array with one word per tile: the block index shifted left by one and
the tile's "full" bit in bit 0 (:func:`_packed`). Three-dimensional tables
[B, nq, nk] would be padded there to 128 words on their last dimension, and a
separate ``full`` table would double them: the E2B recipe at S = 131072 on 4
cp ranks ran out of SMEM so (two 512 KiB tables). The packed table still
grows with the square of the tokens per rank, so a hop whose table passes
:data:`TABLE_WORDS` runs as several calls, each over a piece of the walked
lists (row blocks for forward and dq, key blocks for dk/dv) with its piece
of the table: the tiles visited are the same.

* forward: grid (B, Hkv, nq, nk), returns this chunk's (out, lse);
* dq: the same grid, accumulates dq over the row block's key blocks;
* dk/dv: grid (B, Hkv, nk, nq), accumulates over the key block's row blocks.

Shape letters as in :mod:`cpjax.attention.ring.kernels._common`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from cpjax.attention.ring.kernels import _common as common
from cpjax.attention.ring.kernels._common import KernelParams, Metadata, Schedule

_SEMANTICS = ("parallel", "parallel", "parallel", "arbitrary")
# One call's tile table stays within this many words: 256 KiB of a v5e
# core's 1 MiB of SMEM, which also holds Mosaic's own scalars (a 512 KiB
# table beside another was too many for it).
TABLE_WORDS = 1 << 16


def _compiler_params():
  return pltpu.CompilerParams(dimension_semantics=_SEMANTICS)


def _meta_specs(params: KernelParams, size: int, block_of):
  """BlockSpecs of one side's :class:`Metadata` with blocks of ``size`` tokens;
  ``block_of(b, x, t, *prefetch)`` gives the block index along the tokens at
  grid point (b, head, x, t)."""
  pos = pl.BlockSpec((1, size), lambda b, h, x, t, *s: (0, block_of(b, x, t, *s)))
  arr = pl.BlockSpec((None, 1, size), lambda b, h, x, t, *s: (b, 0, block_of(b, x, t, *s)))
  return [pos] + [arr] * len(params.array_names)


def _split_meta(params: KernelParams, refs):
  """(first side's tokens, second side's tokens, other refs) from the kernel's refs."""
  n = 1 + len(params.array_names)
  first, second = refs[:n], refs[n : 2 * n]
  return (
    common.tokens(params, first[0][...], [r[...] for r in first[1:]]),
    common.tokens(params, second[0][...], [r[...] for r in second[1:]]),
    refs[2 * n :],
  )


def _packed(lists, full_of):
  """Flat int32[B * n * m] of ``lists`` [B, n, m] block indices, each shifted
  left by one with bit 0 set where ``full_of`` [B, n, m] (the tile it names
  needs no mask)."""
  return (lists * 2 + full_of.astype(jnp.int32)).reshape(-1)


def _tables(sched: Schedule, *, by_rows: bool):
  """(packed tile lists, counts flat [B * n]) of the schedule walked by row
  blocks (forward, dq: each row block's key blocks) or by key blocks (dk/dv)."""
  if by_rows:
    full = jnp.take_along_axis(sched.full, sched.cols, axis=2)
    return _packed(sched.cols, full), sched.ncols.reshape(-1)
  full = jnp.take_along_axis(jnp.swapaxes(sched.full, 1, 2), sched.rows, axis=2)
  return _packed(sched.rows, full), sched.nrows.reshape(-1)


def _entry(lists, counts, b, x, t, n, m):
  """(block index, full, within the list) of step t of list (b, x) of n lists of m."""
  word = lists[(b * n + x) * m + t]
  return word >> 1, (word & 1) != 0, t < counts[b * n + x]


def _pieces(batch: int, lists: int, per_list: int):
  """Slices of ``lists`` (tile lists of ``per_list`` entries, per batch row)
  cut into the fewest equal pieces whose tables fit :data:`TABLE_WORDS`."""
  count = next(
    (
      p
      for p in range(1, lists + 1)
      if lists % p == 0 and batch * (lists // p) * per_list <= TABLE_WORDS
    ),
    lists,
  )
  size = lists // count
  return [slice(i * size, (i + 1) * size) for i in range(count)]


def _span(blocks: slice, block: int) -> slice:
  """The tokens of ``blocks``, ``block`` tokens (or rows) each."""
  return slice(blocks.start * block, blocks.stop * block)


def _meta_piece(meta: Metadata, tokens: slice) -> Metadata:
  return Metadata(meta.positions[..., tokens], tuple(a[..., tokens] for a in meta.arrays))


def _row_piece(sched: Schedule, blocks: slice) -> Schedule:
  """The schedule of row blocks ``blocks``, walked by rows (forward, dq)."""
  return sched._replace(
    cols=sched.cols[:, blocks], ncols=sched.ncols[:, blocks], full=sched.full[:, blocks]
  )


def _key_piece(sched: Schedule, blocks: slice) -> Schedule:
  """The schedule of key blocks ``blocks``, walked by keys (dk/dv)."""
  return sched._replace(
    rows=sched.rows[:, blocks], nrows=sched.nrows[:, blocks], full=sched.full[:, :, blocks]
  )


def _joined(parts):
  """The pieces' results (each a list of [B, Hkv, T, ...]) joined along T."""
  if len(parts) == 1:
    return parts[0]
  return [jnp.concatenate(xs, axis=2) for xs in zip(*parts)]


def _visit(visit, full, step):
  """Run ``step(masked=False)`` on a full tile, ``step(masked=True)`` on a
  partial one, nothing past the end of the tile list."""
  pl.when(visit & full)(lambda: step(False))
  pl.when(visit & jnp.logical_not(full))(lambda: step(True))


# ------------------------------------------------------------------ forward
def _forward_kernel(cols_ref, ncols_ref, q_ref, k_ref, v_ref, *refs, params: KernelParams):
  q_tok, k_tok, (o_ref, lse_ref, m_sc, l_sc, acc_sc) = _split_meta(params, refs)
  b, i, t = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  nq, nk = pl.num_programs(2), pl.num_programs(3)

  @pl.when(t == 0)
  def _():
    m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  def step(masked):
    mask = common.tile_mask(params, q_tok, k_tok) if masked else None
    m, l, acc = common.fold_tile(
      params, q_ref[...], k_ref[...], v_ref[...], mask, m_sc[...], l_sc[...], acc_sc[...]
    )
    m_sc[...], l_sc[...], acc_sc[...] = m, l, acc

  _, full, within = _entry(cols_ref, ncols_ref, b, i, t, nq, nk)
  _visit(within, full, step)

  @pl.when(t == pl.num_programs(3) - 1)
  def _():
    out, lse = common.finish(m_sc[...], l_sc[...], acc_sc[...])
    o_ref[...] = out
    lse_ref[...] = lse


@common.manual_over_mesh
def forward(
  params: KernelParams,
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  q_meta: Metadata,
  k_meta: Metadata,
  sched: Schedule,
) -> Sequence[jax.Array]:
  """(out f32[B, Hkv, N, D], lse f32[B, Hkv, N, 1]) of q against one K/V chunk."""
  r, nk = params.rows, k.shape[2] // params.block_kv
  return _joined(
    [
      _forward(
        params,
        q[:, :, _span(s, r)],
        k,
        v,
        _meta_piece(q_meta, _span(s, r)),
        k_meta,
        _row_piece(sched, s),
      )
      for s in _pieces(q.shape[0], q.shape[2] // r, nk)
    ]
  )


def _forward(params: KernelParams, q, k, v, q_meta: Metadata, k_meta: Metadata, sched: Schedule):
  b, h, n, d = q.shape
  r, kb = params.rows, params.block_kv
  nq, nk = n // r, k.shape[2] // kb
  col = lambda b_, i, t, cols, *_: cols[(b_ * nq + i) * nk + t] >> 1  # noqa: E731
  row = lambda b_, i, t, *_: i  # noqa: E731
  key_blk = pl.BlockSpec(
    (None, None, kb, d), lambda b_, h_, i, t, *s: (b_, h_, col(b_, i, t, *s), 0)
  )
  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=2,
    grid=(b, h, nq, nk),
    in_specs=[
      pl.BlockSpec((None, None, r, d), lambda b_, h_, i, t, *_: (b_, h_, i, 0)),
      key_blk,
      key_blk,
      *_meta_specs(params, r, row),
      *_meta_specs(params, kb, col),
    ],
    out_specs=[
      pl.BlockSpec((None, None, r, d), lambda b_, h_, i, t, *_: (b_, h_, i, 0)),
      pl.BlockSpec((None, None, r, 1), lambda b_, h_, i, t, *_: (b_, h_, i, 0)),
    ],
    scratch_shapes=[
      pltpu.VMEM((r, 1), jnp.float32),
      pltpu.VMEM((r, 1), jnp.float32),
      pltpu.VMEM((r, d), jnp.float32),
    ],
  )
  return common.launch(
    params,
    functools.partial(
      pl.pallas_call,
      functools.partial(_forward_kernel, params=params),
      grid_spec=grid_spec,
      out_shape=[common.f32_like((b, h, n, d), q), common.f32_like((b, h, n, 1), q)],
      compiler_params=_compiler_params(),
      name="cpjax_ring_forward",
      cost_estimate=common.cost(params, "forward", q, k),
    ),
    *_tables(sched, by_rows=True),
    q,
    k,
    v,
    q_meta.positions,
    *q_meta.arrays,
    k_meta.positions,
    *k_meta.arrays,
  )


# ----------------------------------------------------------------- backward
def _dq_kernel(
  cols_ref, ncols_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, params: KernelParams
):
  q_tok, k_tok, (dq_ref, dq_sc) = _split_meta(params, refs)
  b, i, t = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  nq, nk = pl.num_programs(2), pl.num_programs(3)

  @pl.when(t == 0)
  def _():
    dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

  def step(masked):
    mask = common.tile_mask(params, q_tok, k_tok) if masked else None
    dq, _, _ = common.grad_tile(
      params, q_ref[...], k_ref[...], v_ref[...], do_ref[...], lse_ref[...], delta_ref[...], mask
    )
    dq_sc[...] += dq

  _, full, within = _entry(cols_ref, ncols_ref, b, i, t, nq, nk)
  _visit(within, full, step)

  @pl.when(t == pl.num_programs(3) - 1)
  def _():
    dq_ref[...] = dq_sc[...]


def _dkdv_kernel(
  rows_ref, nrows_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, params: KernelParams
):
  # The metadata comes key side first here (the fixed block of this grid).
  k_tok, q_tok, (dk_ref, dv_ref, dk_sc, dv_sc) = _split_meta(params, refs)
  b, j, t = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  nk, nq = pl.num_programs(2), pl.num_programs(3)

  @pl.when(t == 0)
  def _():
    dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
    dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

  def step(masked):
    mask = common.tile_mask(params, q_tok, k_tok) if masked else None
    _, dk, dv = common.grad_tile(
      params, q_ref[...], k_ref[...], v_ref[...], do_ref[...], lse_ref[...], delta_ref[...], mask
    )
    dk_sc[...] += dk
    dv_sc[...] += dv

  _, full, within = _entry(rows_ref, nrows_ref, b, j, t, nk, nq)
  _visit(within, full, step)

  @pl.when(t == pl.num_programs(3) - 1)
  def _():
    dk_ref[...] = dk_sc[...]
    dv_ref[...] = dv_sc[...]


@common.manual_over_mesh
def backward(
  params: KernelParams,
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  do: jax.Array,
  lse: jax.Array,
  delta: jax.Array,
  q_meta: Metadata,
  k_meta: Metadata,
  sched: Schedule,
) -> Sequence[jax.Array]:
  """(dq f32[B, Hkv, N, D], dk f32[B, Hkv, L, D], dv f32[B, Hkv, L, D]) of one chunk;
  ``lse``/``delta`` f32[B, Hkv, N, 1]."""
  b, r, kb = q.shape[0], params.rows, params.block_kv
  nq, nk = q.shape[2] // r, k.shape[2] // kb
  dq_parts = []
  for s in _pieces(b, nq, nk):
    rows = _span(s, r)
    dq_parts.append(
      [
        _dq(
          params,
          q[:, :, rows],
          k,
          v,
          do[:, :, rows],
          lse[:, :, rows],
          delta[:, :, rows],
          _meta_piece(q_meta, rows),
          k_meta,
          _row_piece(sched, s),
        )
      ]
    )
  dk_dv = []
  for s in _pieces(b, nk, nq):
    keys = _span(s, kb)
    dk_dv.append(
      _dkdv(
        params,
        q,
        k[:, :, keys],
        v[:, :, keys],
        do,
        lse,
        delta,
        q_meta,
        _meta_piece(k_meta, keys),
        _key_piece(sched, s),
      )
    )
  (dq,), (dk, dv) = _joined(dq_parts), _joined(dk_dv)
  return dq, dk, dv


def _dq(
  params: KernelParams, q, k, v, do, lse, delta, q_meta: Metadata, k_meta: Metadata, sched: Schedule
):
  b, h, n, d = q.shape
  r, kb = params.rows, params.block_kv
  nq, nk = n // r, k.shape[2] // kb
  by_col = lambda b_, i, t, cols, *_: cols[(b_ * nq + i) * nk + t] >> 1  # noqa: E731
  fixed = lambda b_, x, t, *_: x  # noqa: E731
  row_blk = lambda shape: pl.BlockSpec(shape, lambda b_, h_, i, t, *_: (b_, h_, i, 0))  # noqa: E731
  col_blk = lambda shape: pl.BlockSpec(  # noqa: E731
    shape, lambda b_, h_, i, t, *s: (b_, h_, by_col(b_, i, t, *s), 0)
  )
  return common.launch(
    params,
    functools.partial(
      pl.pallas_call,
      functools.partial(_dq_kernel, params=params),
      grid_spec=pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(b, h, nq, nk),
        in_specs=[
          row_blk((None, None, r, d)),
          col_blk((None, None, kb, d)),
          col_blk((None, None, kb, d)),
          row_blk((None, None, r, d)),
          row_blk((None, None, r, 1)),
          row_blk((None, None, r, 1)),
          *_meta_specs(params, r, fixed),
          *_meta_specs(params, kb, by_col),
        ],
        out_specs=row_blk((None, None, r, d)),
        scratch_shapes=[pltpu.VMEM((r, d), jnp.float32)],
      ),
      out_shape=common.f32_like((b, h, n, d), q),
      compiler_params=_compiler_params(),
      name="cpjax_ring_dq",
      cost_estimate=common.cost(params, "dq", q, k),
    ),
    *_tables(sched, by_rows=True),
    q,
    k,
    v,
    do,
    lse,
    delta,
    q_meta.positions,
    *q_meta.arrays,
    k_meta.positions,
    *k_meta.arrays,
  )


def _dkdv(
  params: KernelParams, q, k, v, do, lse, delta, q_meta: Metadata, k_meta: Metadata, sched: Schedule
):
  # Walk the row blocks of each key block: the schedule's transposed lists.
  b, h, n, d = q.shape
  length = k.shape[2]
  r, kb = params.rows, params.block_kv
  nq, nk = n // r, length // kb
  fixed = lambda b_, x, t, *_: x  # noqa: E731
  key_blk = lambda shape: pl.BlockSpec(shape, lambda b_, h_, j, t, *_: (b_, h_, j, 0))  # noqa: E731
  by_row = lambda b_, j, t, rows, *_: rows[(b_ * nk + j) * nq + t] >> 1  # noqa: E731
  q_blk = lambda shape: pl.BlockSpec(  # noqa: E731
    shape, lambda b_, h_, j, t, *s: (b_, h_, by_row(b_, j, t, *s), 0)
  )
  return common.launch(
    params,
    functools.partial(
      pl.pallas_call,
      functools.partial(_dkdv_kernel, params=params),
      grid_spec=pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(b, h, nk, nq),
        in_specs=[
          q_blk((None, None, r, d)),
          key_blk((None, None, kb, d)),
          key_blk((None, None, kb, d)),
          q_blk((None, None, r, d)),
          q_blk((None, None, r, 1)),
          q_blk((None, None, r, 1)),
          *_meta_specs(params, kb, fixed),
          *_meta_specs(params, r, by_row),
        ],
        out_specs=[key_blk((None, None, kb, d)), key_blk((None, None, kb, d))],
        scratch_shapes=[pltpu.VMEM((kb, d), jnp.float32), pltpu.VMEM((kb, d), jnp.float32)],
      ),
      out_shape=[common.f32_like((b, h, length, d), q)] * 2,
      compiler_params=_compiler_params(),
      name="cpjax_ring_dkdv",
      cost_estimate=common.cost(params, "dkdv", q, k),
    ),
    *_tables(sched, by_rows=False),
    q,
    k,
    v,
    do,
    lse,
    delta,
    k_meta.positions,
    *k_meta.arrays,
    q_meta.positions,
    *q_meta.arrays,
  )
