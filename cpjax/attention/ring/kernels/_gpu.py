"""Per-hop attention kernels for NVIDIA GPUs (Pallas on Triton).

Why Triton and not Mosaic GPU: the same tile math (:mod:`cpjax.attention.ring.kernels._common`)
lowers to both Mosaic TPU and Triton as plain block-level ``jnp`` code, it
runs on Hopper (H100/H200) and Ampere alike, and it lowers for ``cuda`` from a
CPU-only machine, which is how CI checks it. Mosaic GPU reaches Hopper's
peak only with warpgroup-level code (TMA, wgmma, explicit pipelining) that
shares nothing with the TPU kernels and would need its own numerics tests on
hardware. Pallas' Triton backend is deprecated from JAX 0.11; this module is
the one place to swap when it goes.

Triton has no sequential grid dimension with scratch memory, so each program
owns one row block (forward, dq) or one key block (dk/dv) and loops over the
hop's :class:`cpjax.attention.ring.kernels._common.Schedule` list in the kernel with a
dynamic trip count: empty blocks cost nothing. Full blocks skip the mask.
Triton's tiles are small (16 x 16 at head dim 512), so past a million tiles a
hop the schedule lists blocks of several tiles
(``PallasImplementation.schedule_blocks``), and a program walks each listed block's
tiles in turn.

Shape letters as in :mod:`cpjax.attention.ring.kernels._common`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from cpjax.attention.ring.kernels import _common as common
from cpjax.attention.ring.kernels._common import KernelParams, Metadata, Schedule


def _compiler_params(params: KernelParams):
  # 8 warps: with 4, ptxas spills every record tile from head dim 256 up on sm_90a.
  del params
  return pltr.CompilerParams(num_warps=8, num_stages=2)


def _whole(shape):
  """The whole array [B, ...] of batch row b (and KV head h when 4-D) in every program."""
  if len(shape) == 4:
    return pl.BlockSpec((None, None) + shape[2:], lambda b, h, x: (b, h, 0, 0))
  if len(shape) == 3:
    return pl.BlockSpec((None,) + shape[1:], lambda b, h, x: (b, 0, 0))
  return pl.BlockSpec(shape, lambda b, h, x: (0,) * len(shape))


def _meta_specs(meta: Metadata):
  return [_whole(meta.positions.shape)] + [_whole(a.shape) for a in meta.arrays]


def _block_tokens(params: KernelParams, refs, start, size):
  """:class:`Tokens` of ``size`` tokens from ``start`` of one side's metadata refs."""
  pos = refs[0][:, pl.ds(start, size)]
  return common.tokens(params, pos, [r[:, pl.ds(start, size)] for r in refs[1:]])


def _split(params: KernelParams, refs):
  n = 1 + len(params.array_names)
  return refs[:n], refs[n : 2 * n], refs[2 * n :]


def _tile(visit_full, step, carry):
  """``step(carry, masked)`` with the mask only where the tile is not full."""
  return lax.cond(
    visit_full, functools.partial(step, masked=False), functools.partial(step, masked=True), carry
  )


def _in_block(t, per: int):
  """(list entry, tile within its block) of step t over blocks of ``per`` tiles
  (``lax``'s truncating div/rem: t >= 0, and Triton lowers jnp's floor forms badly)."""
  return (t, 0) if per == 1 else (lax.div(t, per), lax.rem(t, per))


# ------------------------------------------------------------------ forward
def _walk_keys(params: KernelParams, tables, group, b, i, q_tok, k_ref, v_ref, k_meta, fold, init):
  """Fold row tile i's non-empty key tiles, in order: ``fold(k, v, mask, carry)``.

  ``group`` (row tiles, key tiles) per schedule block: row tile i reads its
  block's list, and each listed key block is that many key tiles, walked in
  the same loop (a nested loop makes ptxas spill dK/dV's tiles).
  """
  cols_ref, ncols_ref, full_ref = tables
  kb = params.block_kv
  per_row, per_key = group
  ib = i // per_row

  def body(t, carry):
    entry, within = _in_block(t, per_key)
    jb = cols_ref[b, ib, entry]
    j = jb * per_key + within

    def step(carry, masked):
      k, v = k_ref[pl.ds(j * kb, kb), :], v_ref[pl.ds(j * kb, kb), :]
      mask = (
        common.tile_mask(params, q_tok, _block_tokens(params, k_meta, j * kb, kb))
        if masked
        else None
      )
      return fold(k, v, mask, carry)

    return _tile(full_ref[b, ib, jb] != 0, step, carry)

  return lax.fori_loop(0, ncols_ref[b, ib] * per_key, body, init)


def _forward_kernel(
  cols_ref, ncols_ref, full_ref, q_ref, k_ref, v_ref, *refs, params: KernelParams, group
):
  q_meta, k_meta, (o_ref, lse_ref) = _split(params, refs)
  b, i = pl.program_id(0), pl.program_id(2)
  r = params.rows
  q = q_ref[...]
  init = (
    jnp.full((r, 1), -jnp.inf, jnp.float32),
    jnp.zeros((r, 1), jnp.float32),
    jnp.zeros(q.shape, jnp.float32),
  )
  state = _walk_keys(
    params,
    (cols_ref, ncols_ref, full_ref),
    group,
    b,
    i,
    _block_tokens(params, q_meta, i * r, r),
    k_ref,
    v_ref,
    k_meta,
    lambda k, v, mask, c: common.fold_tile(params, q, k, v, mask, *c),
    init,
  )
  out, lse = common.finish(*state)
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
  b, h, n, d = q.shape
  r = params.rows
  group = sched.tiles_per_block(n // r, k.shape[2] // params.block_kv)
  row = lambda shape: pl.BlockSpec(shape, lambda b_, h_, i: (b_, h_, i, 0))  # noqa: E731
  tables = (sched.cols, sched.ncols, sched.full)
  return common.launch(
    params,
    functools.partial(
      pl.pallas_call,
      functools.partial(_forward_kernel, params=params, group=group),
      grid=(b, h, n // r),
      in_specs=[pl.no_block_spec] * 3
      + [
        row((None, None, r, d)),
        _whole(k.shape),
        _whole(v.shape),
        *_meta_specs(q_meta),
        *_meta_specs(k_meta),
      ],
      out_specs=[row((None, None, r, d)), row((None, None, r, 1))],
      out_shape=[common.f32_like((b, h, n, d), q), common.f32_like((b, h, n, 1), q)],
      compiler_params=_compiler_params(params),
      name="cpjax_ring_forward",
      cost_estimate=common.cost(params, "forward", q, k),
    ),
    *tables,
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
  cols_ref,
  ncols_ref,
  full_ref,
  q_ref,
  k_ref,
  v_ref,
  do_ref,
  lse_ref,
  delta_ref,
  *refs,
  params: KernelParams,
  group,
):
  q_meta, k_meta, (dq_ref,) = _split(params, refs)
  b, i = pl.program_id(0), pl.program_id(2)
  r = params.rows
  q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]

  def fold(k, v, mask, dq):
    return dq + common.grad_tile(params, q, k, v, do, lse, delta, mask)[0]

  dq_ref[...] = _walk_keys(
    params,
    (cols_ref, ncols_ref, full_ref),
    group,
    b,
    i,
    _block_tokens(params, q_meta, i * r, r),
    k_ref,
    v_ref,
    k_meta,
    fold,
    jnp.zeros(q.shape, jnp.float32),
  )


def _dkdv_kernel(
  rows_ref,
  nrows_ref,
  full_ref,
  q_ref,
  k_ref,
  v_ref,
  do_ref,
  lse_ref,
  delta_ref,
  *refs,
  params: KernelParams,
  group,
):
  k_meta, q_meta, (dk_ref, dv_ref) = _split(params, refs)
  b, j = pl.program_id(0), pl.program_id(2)
  r, kb = params.rows, params.block_kv
  per_row, per_key = group
  jb = j // per_key
  k, v = k_ref[...], v_ref[...]
  k_tok = _block_tokens(params, k_meta, j * kb, kb)

  def body(t, carry):
    entry, within = _in_block(t, per_row)
    ib = rows_ref[b, jb, entry]
    start = (ib * per_row + within) * r

    def step(carry, masked):
      rows = pl.ds(start, r)
      mask = (
        common.tile_mask(params, _block_tokens(params, q_meta, start, r), k_tok) if masked else None
      )
      _, dk, dv = common.grad_tile(
        params, q_ref[rows, :], k, v, do_ref[rows, :], lse_ref[rows, :], delta_ref[rows, :], mask
      )
      return carry[0] + dk, carry[1] + dv

    return _tile(full_ref[b, ib, jb] != 0, step, carry)

  zeros = jnp.zeros(k.shape, jnp.float32)
  dk, dv = lax.fori_loop(0, nrows_ref[b, jb] * per_row, body, (zeros, zeros))
  dk_ref[...] = dk
  dv_ref[...] = dv


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
  b, h, n, d = q.shape
  length = k.shape[2]
  r, kb = params.rows, params.block_kv
  group = sched.tiles_per_block(n // r, length // kb)
  row = lambda shape: pl.BlockSpec(shape, lambda b_, h_, x: (b_, h_, x, 0))  # noqa: E731
  dq = common.launch(
    params,
    functools.partial(
      pl.pallas_call,
      functools.partial(_dq_kernel, params=params, group=group),
      grid=(b, h, n // r),
      in_specs=[pl.no_block_spec] * 3
      + [
        row((None, None, r, d)),
        _whole(k.shape),
        _whole(v.shape),
        row((None, None, r, d)),
        row((None, None, r, 1)),
        row((None, None, r, 1)),
        *_meta_specs(q_meta),
        *_meta_specs(k_meta),
      ],
      out_specs=row((None, None, r, d)),
      out_shape=common.f32_like((b, h, n, d), q),
      compiler_params=_compiler_params(params),
      name="cpjax_ring_dq",
      cost_estimate=common.cost(params, "dq", q, k),
    ),
    sched.cols,
    sched.ncols,
    sched.full,
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
  dk, dv = common.launch(
    params,
    functools.partial(
      pl.pallas_call,
      functools.partial(_dkdv_kernel, params=params, group=group),
      grid=(b, h, length // kb),
      in_specs=[pl.no_block_spec] * 3
      + [
        _whole(q.shape),
        row((None, None, kb, d)),
        row((None, None, kb, d)),
        _whole(do.shape),
        _whole(lse.shape),
        _whole(delta.shape),
        *_meta_specs(k_meta),
        *_meta_specs(q_meta),
      ],
      out_specs=[row((None, None, kb, d))] * 2,
      out_shape=[common.f32_like((b, h, length, d), q)] * 2,
      compiler_params=_compiler_params(params),
      name="cpjax_ring_dkdv",
      cost_estimate=common.cost(params, "dkdv", q, k),
    ),
    sched.rows,
    sched.nrows,
    sched.full,
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
  return dq, dk, dv
