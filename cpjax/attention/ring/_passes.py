"""Ring attention's passes: ppermute K/V around the ring, flash-style online softmax.

Called inside ``jax.shard_map`` by :func:`cpjax.ring_attention`, which
checks the inputs and builds the static ``PassConfig``. K/V chunks (only the
``Hkv`` heads, with the per-token mask metadata) travel around a
``lax.ppermute`` ring; each rank folds every visiting chunk into float32
online-softmax statistics, one ``block_q x block_kv`` tile at a time, and
skips tiles the mask leaves empty (each hop's tile schedule, from the
mask's block map). The backward pass (``jax.custom_vjp``) replays the ring
from the saved log-sum-exp, rotating K/V together with their dK/dV
accumulators so every gradient arrives home: per-device memory is O(L).

Each hop's compute has two backends: the portable XLA tile loop (a
``fori_loop`` over the hop's non-empty tiles), or the fused Pallas kernels of
:mod:`cpjax.attention.ring.kernels`, which fold a visiting chunk into (out, lse) that the
ring merges.

The all-gather strategy (``strategy="all_gather"``) takes no hops: each rank
all-gathers K/V (once, when one array is passed as both) and the mask's
arrays over the axis, in rank order, and folds that whole row as one chunk
with the same tile schedule and kernels; its backward reduce-scatters dK/dV
to their owners. Per-device memory is then O(S) in K/V, not O(L). Under a
bounded reach it receives only its halo (``PassConfig.halo``: the neighbours'
key blocks the window reaches) and sends the halo's gradient back.
Ulysses (``strategy="ulysses"``) arrives here with the whole row of queries
and keys for a rank's heads (its all-to-alls are the caller's) and folds it
as one chunk, with no collective at all. The hybrid (``strategy="hybrid"``)
arrives with a Ulysses group's tokens for a rank's heads and runs the ring
over the groups (``PassConfig.ulysses_size`` ranks each): every rank of a
group rotates with its peers in the other groups.

Shape letters: ``B`` batch, ``L`` local tokens, ``Hkv`` key/value heads,
``G`` query heads per KV head, ``D`` head dim, ``bq``/``bk`` tile sizes;
q [B, Hkv, N = L*G, D] (row ``t*G + g`` is token t, head g), k/v
[B, Hkv, L, D].
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from cpjax.attention.ring._schedule import Halo, RingPlan
from cpjax.attention.ring.kernels import _common as kernel_common
from cpjax.attention.ring.kernels._common import KernelParams
from cpjax.attention.ring.kernels._cost import visited_pairs
from cpjax.attention.ring.kernels._implementations import (
  PALLAS_IMPLEMENTATIONS,
  platform_guard,
)
from cpjax.batch.layout import ShardLayout, local_token_indices
from cpjax.masks import MaskRule, Tokens
from cpjax.parallel import filled_after
from cpjax.parallel import vary_like as _vary_like
from cpjax.parallel import varying_axes as _varying_axes


@dataclasses.dataclass(frozen=True)
class PassConfig:
  """Everything static about one ring-attention call (hashable)."""

  layout: ShardLayout
  axis_name: str | tuple[str, str]  # the hybrid's pair: (ring axis, Ulysses axis)
  rule: MaskRule
  plan: RingPlan
  scale: float
  soft_cap: float | None
  block_q: int
  block_kv: int
  groups: int  # G = Hq // Hkv
  implementation: str = "xla"
  kernel: KernelParams | None = None  # the Pallas implementations' static parameters
  strategy: str = "ring"  # or "all_gather", "ulysses" (cp_size > 1 only)
  shared_kv: bool = False  # k is v (one array passed for both): one gradient to scatter
  halo: tuple[Halo, ...] | None = None  # all_gather with a bounded reach: the keys it needs
  # The hybrid: cp ranks per ring position (a Ulysses group of neighbours);
  # ``layout`` then describes the ring over the groups.
  ulysses_size: int = 1

  @property
  def tile_rows(self) -> int:
    """Query rows per tile: ``block_q`` tokens times ``G`` heads."""
    return self.block_q * self.groups

  @property
  def query_len(self) -> int:
    """Query tokens this rank holds: the whole row under Ulysses, else its own."""
    return self.layout.padded_seq_len if self.strategy == "ulysses" else self.layout.local_seq_len

  def schedule_blocks(self, key_len: int) -> tuple[int, int]:
    """(query tokens, keys) per block of a kernel hop's schedule over
    ``key_len`` keys (see
    :meth:`cpjax.attention.ring.kernels.PallasImplementation.schedule_blocks`)."""
    return PALLAS_IMPLEMENTATIONS[self.implementation].schedule_blocks(
      self.block_q,
      self.block_kv,
      chunk_len=self.layout.chunk_len,
      local_len=self.query_len,
      key_len=key_len,
    )


def kernel_density(cfg: PassConfig) -> float:
  """The share of one kernel call's (row, key) pairs that its tiles visit, on
  average over every call this ring-attention call makes on every rank: what
  each call's cost estimate counts (:mod:`cpjax.attention.ring.kernels._cost`)."""
  lay = cfg.layout
  row, local = lay.padded_seq_len, lay.local_seq_len
  key_len = local
  if cfg.strategy == "ulysses" or (cfg.strategy == "all_gather" and cfg.halo is None):
    key_len = row
  elif cfg.strategy == "all_gather" and cfg.halo is not None:
    key_len = local + sum(h.length for h in cfg.halo)
  pairs = visited_pairs(lay, cfg.rule.reach(), *cfg.schedule_blocks(key_len))
  if cfg.strategy == "ulysses":  # one call folds the whole row (for this rank's heads)
    return pairs / (row * row)
  hops, back = cfg.plan
  # Calls a rank makes: the ring's hops and its own chunk (both ways: the
  # loop's two a hop and the last two, one of them idle), or one.
  calls = 1 if cfg.strategy == "all_gather" else hops + 1 if back == 0 else 2 * hops + 2
  return pairs / (lay.cp_size * calls * local * key_len)


# ------------------------------------------------------------------ helpers
def _shift(tree, cfg: PassConfig, offset: int):
  """Send every leaf from rank i to rank i + offset on the ring (from each
  rank of group i to its peer in group i + offset under the hybrid)."""
  cp, size = cfg.layout.cp_size, cfg.ulysses_size
  if offset % cp == 0:
    return tree
  perm = [(i, (i + offset * size) % (cp * size)) for i in range(cp * size)]
  return jax.tree.map(lambda x: lax.ppermute(x, cfg.axis_name, perm), tree)


def _tokens(cfg: PassConfig, rank, arrays) -> Tokens:
  """The tokens rank ``rank`` holds: global positions and the mask's arrays.

  ``rank`` None stands for the all-gathered row: every rank's tokens, in rank
  order (``arrays`` then hold the whole row too); a :class:`Tokens` (a
  rank's chunk and its halo) is returned as it is.
  """
  if isinstance(rank, Tokens):
    return rank
  if rank is None:  # (from iota, as a rank's own: no [S] constant in the program)
    each = jax.vmap(functools.partial(local_token_indices, cfg.layout))
    return Tokens(each(jnp.arange(cfg.layout.cp_size)).reshape(-1), arrays)
  return Tokens(local_token_indices(cfg.layout, rank), arrays)


def _stacked(arrays):
  """(the mask's per-token arrays as one int32 [n, B, L], the function that
  takes such a stack back to ``{name: [B, L]}``).

  The ring sends them in one permute a hop rather than one each: alone, a
  bool padding mask's permute (256 bytes at L = 256) was scheduled beside no
  kernel by XLA:TPU, so the hop waited for it.
  """
  names = sorted(arrays)
  if not names:
    return arrays, lambda stack: stack
  dtypes = [arrays[n].dtype for n in names]

  def unstack(stack):
    return {n: stack[i].astype(t) for i, (n, t) in enumerate(zip(names, dtypes))}

  return jnp.stack([arrays[n].astype(jnp.int32) for n in names]), unstack


def _unstacking(fn, unstack, at: int):
  """``fn`` whose positional argument ``at`` (a chunk's mask arrays) arrives stacked."""

  def run(*args, **keywords):
    args = args[:at] + (unstack(args[at]),) + args[at + 1 :]
    return fn(*args, **keywords)

  return run


def _scaled(cfg: PassConfig, q):
  """q * scale, once per call, so no tile multiplies its scores (or, in the
  backward, its score gradients) by the scale; exact for power-of-two scales."""
  return q if cfg.scale == 1.0 else (q * cfg.scale).astype(q.dtype)


def _soft_cap(cfg: PassConfig, s):
  if cfg.soft_cap is not None:
    s = cfg.soft_cap * jnp.tanh(s / cfg.soft_cap)
  return s


def _tile_mask(cfg: PassConfig, q_info: Tokens, k_info: Tokens, i, j, *, keys_first=False):
  """bool[B or 1, 1, bq*G, bk] mask of tile (i, j) ([.., bk, bq*G] if keys_first)."""
  qi = q_info.slice(i * cfg.block_q, cfg.block_q)
  kj = k_info.slice(j * cfg.block_kv, cfg.block_kv)
  mask = cfg.rule.allowed(qi, kj)
  b = mask.shape[0]
  mask = jnp.broadcast_to(mask, (b, cfg.block_q, cfg.block_kv))
  if keys_first:
    mask = jnp.swapaxes(mask, 1, 2)  # [B', bk, bq]
    mask = jnp.broadcast_to(mask[..., None], mask.shape + (cfg.groups,))
    return mask.reshape(b, 1, cfg.block_kv, cfg.tile_rows)
  mask = jnp.broadcast_to(mask[:, :, None], (b, cfg.block_q, cfg.groups, cfg.block_kv))
  return mask.reshape(b, 1, cfg.tile_rows, cfg.block_kv)


class _Schedule(NamedTuple):
  """The tiles worth computing for one (local queries, key chunk) pair.

  ``tiles`` int32[nq * nk] holds the flat ids (``i * nk + j``) of the
  non-empty tiles first, in row-major order, and ``count`` how many there
  are; ``full`` bool[nq, nk] marks tiles that need no mask at all. Looping
  over ``tiles[:count]`` visits only the work the mask leaves, with no
  per-tile branch around the big accumulators.
  """

  k_info: Tokens
  tiles: jax.Array
  count: jax.Array
  full: jax.Array

  def tile(self, t):
    """(i, j) of the t-th non-empty tile."""
    nk = self.full.shape[1]
    return self.tiles[t] // nk, self.tiles[t] % nk


def _tile_schedule(cfg: PassConfig, q_info: Tokens, src_rank, k_arrays, active) -> _Schedule:
  """Schedule the tiles of the local queries against the chunk of ``src_rank``."""
  k_info = _tokens(cfg, src_rank, k_arrays)
  blocks = cfg.rule.classify(q_info, k_info, cfg.block_q, cfg.block_kv)
  # One schedule serves every batch row: visit a tile if any row needs it,
  # skip its mask only if no row masks anything in it.
  visit = (jnp.any(blocks.any, axis=0) & active).ravel()
  tiles = jnp.nonzero(visit, size=visit.shape[0], fill_value=0)[0].astype(jnp.int32)
  return _Schedule(k_info, tiles, jnp.sum(visit, dtype=jnp.int32), jnp.all(blocks.all, axis=0))


def _cut(x, axis, start, size):
  return lax.dynamic_slice_in_dim(x, start, size, axis)


# ------------------------------------------------------------------ forward
class _Stats(NamedTuple):
  """Online-softmax state of all local queries (float32)."""

  m: jax.Array  # [B, Hkv, N] running max of the logits (-inf: none yet)
  l: jax.Array  # [B, Hkv, N] running sum of exp(logit - m)
  acc: jax.Array  # [B, Hkv, N, D] running sum of exp(logit - m) * v


def _attend_chunk(
  cfg: PassConfig, q, q_info: Tokens, stats: _Stats, kv, k_arrays, src_rank, active=True
) -> _Stats:
  """Fold one K/V chunk (owned by ``src_rank``) into the statistics."""
  k, v = kv
  plan = _tile_schedule(cfg, q_info, src_rank, k_arrays, active)
  bk, rq = cfg.block_kv, cfg.tile_rows

  def tile(i, j, carry, *, masked: bool):
    m, l, acc = carry
    qi, kj, vj = _cut(q, 2, i * rq, rq), _cut(k, 2, j * bk, bk), _cut(v, 2, j * bk, bk)
    s = _soft_cap(cfg, jnp.einsum("bhnd,bhkd->bhnk", qi, kj, preferred_element_type=jnp.float32))
    if masked:
      mask = _tile_mask(cfg, q_info, plan.k_info, i, j)
      m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, -jnp.inf), axis=-1))
      # A row that has seen nothing keeps m = -inf; subtracting a finite
      # stand-in avoids inf - inf, and the mask zeroes its p exactly.
      m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
      p = jnp.where(mask, jnp.exp(s - m_safe[..., None]), 0.0)
    else:
      # Every pair allowed: m_new is finite and there is no mask to build.
      m_new = m_safe = jnp.maximum(m, jnp.max(s, axis=-1))
      p = jnp.exp(s - m_safe[..., None])
    alpha = jnp.exp(m - m_safe)
    l = alpha * l + jnp.sum(p, axis=-1)
    pv = jnp.einsum("bhnk,bhkd->bhnd", p.astype(vj.dtype), vj, preferred_element_type=jnp.float32)
    return m_new, l, alpha[..., None] * acc + pv

  def step(t, stats):
    i, j = plan.tile(t)
    rows = tuple(_cut(x, 2, i * rq, rq) for x in stats)
    rows = lax.cond(
      plan.full[i, j],
      functools.partial(tile, masked=False),
      functools.partial(tile, masked=True),
      i,
      j,
      rows,
    )
    return _Stats(*(lax.dynamic_update_slice_in_dim(x, r, i * rq, 2) for x, r in zip(stats, rows)))

  return lax.fori_loop(0, plan.count, step, stats)


def _rank(cfg: PassConfig) -> jax.Array:
  """This rank's place on the ring (its group's, under the hybrid)."""
  if cfg.layout.cp_size == 1:
    return jnp.int32(0)
  return lax.axis_index(cfg.axis_name) // cfg.ulysses_size


# A backend's (initial state, attend(state, kv, k_arrays, src_rank, active=True)
# -> state, finish(state) -> (out, lse)); each backend's state is its own pytree.
_Fold = tuple[Any, Callable[..., Any], Callable[[Any], tuple[jax.Array, jax.Array]]]


def _xla_fold(cfg: PassConfig, q, q_info: Tokens) -> _Fold:
  """(initial state, attend, finish) of the XLA tile loop."""
  init = _Stats(
    filled_after(q, q.shape[:-1], -jnp.inf), filled_after(q, q.shape[:-1]), filled_after(q, q.shape)
  )

  def finish(stats):
    seen = stats.l > 0
    l_safe = jnp.where(seen, stats.l, 1.0)
    out = jnp.where(seen[..., None], stats.acc / l_safe[..., None], 0.0)
    return out, jnp.where(seen, stats.m + jnp.log(l_safe), -jnp.inf)

  return init, functools.partial(_attend_chunk, cfg, _scaled(cfg, q), q_info), finish


def _kernels(cfg: PassConfig):
  """The module holding ``cfg.implementation``'s kernels (imported on first use)."""
  if cfg.implementation == "pallas_tpu":
    from cpjax.attention.ring.kernels import _tpu as module
  else:
    from cpjax.attention.ring.kernels import _gpu as module
  return module


def _guarded(cfg: PassConfig, x):
  """``x``, tied to a lowering-time check that the platform suits the kernels."""
  assert cfg.kernel is not None  # the Pallas implementations set it
  return x if cfg.kernel.interpret else platform_guard(x, cfg.implementation)


def _kernel_chunk(cfg: PassConfig, q_info: Tokens, kv, k_arrays, src_rank, active):
  """(k, v, key metadata, schedule) of one visiting chunk for the kernels."""
  assert cfg.kernel is not None  # the Pallas implementations set it
  k_info = _tokens(cfg, src_rank, k_arrays)
  blocks = cfg.rule.classify(q_info, k_info, *cfg.schedule_blocks(kv[0].shape[2]))
  sched = kernel_common.schedule(blocks, kv[0].shape[0], active)
  k_meta = kernel_common.metadata(cfg.kernel, k_info.positions, k_info.arrays)
  # A pallas_call's operands vary over the same mesh axes as its results.
  k_meta, sched = jax.tree.map(lambda x: _vary_like(x, kv[0]), (k_meta, sched))
  return kv[0], kv[1], k_meta, sched


def _query_metadata(cfg: PassConfig, q_info: Tokens, q):
  """Kernel metadata of the local query rows (each token repeated G times)."""
  assert cfg.kernel is not None  # the Pallas implementations set it
  meta = kernel_common.metadata(cfg.kernel, q_info.positions, q_info.arrays, repeat=cfg.groups)
  return jax.tree.map(lambda x: _vary_like(x, q), meta)


def _pallas_fold(cfg: PassConfig, q, q_info: Tokens) -> _Fold:
  """(initial state, attend, finish) of the Pallas kernels: each chunk's
  (out, lse) merge into the running pair, both float32."""
  assert cfg.kernel is not None  # the Pallas implementations set it
  kernels = _kernels(cfg)
  qs = _scaled(cfg, _guarded(cfg, q))
  q_meta = _query_metadata(cfg, q_info, q)
  init = (filled_after(q, q.shape), filled_after(q, q.shape[:-1] + (1,), -jnp.inf))

  def attend(state, kv, k_arrays, src_rank, active=True):
    k, v, k_meta, sched = _kernel_chunk(cfg, q_info, kv, k_arrays, src_rank, active)
    out_c, lse_c = kernels.forward(cfg.kernel, qs, k, v, q_meta, k_meta, sched)
    out, lse = state
    new = jnp.logaddexp(lse, lse_c)
    # -inf: nothing allowed yet; a finite stand-in keeps exp() at exactly 0.
    safe = jnp.where(new == -jnp.inf, 0.0, new)
    return out * jnp.exp(lse - safe) + out_c * jnp.exp(lse_c - safe), new

  return init, attend, lambda state: (state[0], state[1][..., 0])


def _gathered(cfg: PassConfig, k, v, arrays):
  """((k, v), arrays) of the whole row: every rank's, gathered in rank order."""
  gather = lambda x, axis: lax.all_gather(x, cfg.axis_name, axis=axis, tiled=True)  # noqa: E731
  # (K = V: XLA merges the two gathers of one tensor into one.)
  return (gather(k, 2), gather(v, 2)), {n: gather(x, 1) for n, x in arrays.items()}


def _scatter_home(cfg: PassConfig, grad):
  """The gathered row's key gradient [B, Hkv, cp*L, D], summed over the ranks
  (each holds its queries' share) and cut to the keys this rank owns."""
  shard = lax.psum_scatter(grad, cfg.axis_name, scatter_dimension=2, tiled=True)
  # XLA:TPU compiles a large reduce-scatter as a whole-row all-reduce and a
  # slice, and fuses the slice into the shard's next use. Layers that share
  # one K/V (Gemma 4's KV-shared layers) meet in one add of their gradients,
  # so every sharing layer's whole row stayed alive until the last one's
  # (six bfloat16 [262144, 512] rows, 1.5 GiB, in E2B's step at S = 262144 on
  # a v5e-16). Behind the barrier the slice is its own op: a row dies at once.
  return lax.optimization_barrier(shard)


def _halo_pieces(x, axis: int, halo: Halo):
  """The tokens of ``x`` (a rank's own, along ``axis``) that ``halo`` sends."""
  cut = [lax.slice_in_dim(x, start, start + n, axis=axis) for start, n in halo.runs]
  return cut[0] if len(cut) == 1 else jnp.concatenate(cut, axis=axis)


def _with_halo(cfg: PassConfig, k, v, arrays, rank):
  """((k, v), Tokens) of this rank's chunk followed by its halo: from each
  neighbour the halo names, the keys this rank's queries can reach."""
  assert cfg.halo is not None  # only called for an all-gather with a halo
  own = _tokens(cfg, rank, arrays)
  ks, vs, positions, parts = [k], [v], [own.positions], [arrays]
  for h in cfg.halo:
    piece = functools.partial(_halo_pieces, halo=h)
    sent = (piece(k, 2), piece(v, 2), {n: piece(x, 1) for n, x in arrays.items()})
    hk, hv, harrays = _shift(sent, cfg, h.offset)
    src = (rank - h.offset) % cfg.layout.cp_size
    ks, vs, parts = ks + [hk], vs + [hv], parts + [harrays]
    positions.append(piece(local_token_indices(cfg.layout, src), 0))
  join = lambda xs, axis: jnp.concatenate(xs, axis=axis)  # noqa: E731
  arrays = {n: join([p[n] for p in parts], 1) for n in arrays}
  return (join(ks, 2), join(vs, 2)), Tokens(join(positions, 0), arrays)


def _halo_home(cfg: PassConfig, grad, local_len: int):
  """A key gradient over the chunk and its halo, [B, Hkv, L + halo, D]: the
  halo's parts sent back to their owners and added to the chunk's."""
  assert cfg.halo is not None  # only called for an all-gather with a halo
  own, start = grad[:, :, :local_len], local_len
  for h in cfg.halo:
    back = _shift(grad[:, :, start : start + h.length], cfg, -h.offset)
    start, at = start + h.length, 0
    for first, n in h.runs:
      own = own.at[:, :, first : first + n].add(back[:, :, at : at + n])
      at += n
  return own


def _query_rank(cfg: PassConfig) -> jax.Array | None:
  """The rank whose tokens the queries are; None for the whole row (Ulysses,
  whose caller turned a sequence split into a head split)."""
  return None if cfg.strategy == "ulysses" else _rank(cfg)


def _forward(cfg: PassConfig, q, k, v, arrays):
  """Returns out [B, Hkv, N, D] (q's dtype) and lse f32[B, Hkv, N]."""
  cp = cfg.layout.cp_size
  rank = _query_rank(cfg)
  q_info = _tokens(cfg, rank, arrays)
  fold = _xla_fold if cfg.kernel is None else _pallas_fold
  stats, attend, finish = fold(cfg, q, q_info)
  travel = ((k, v), arrays)
  hops, back = cfg.plan
  if cfg.strategy == "ring":
    stack, unstack = _stacked(arrays)
    travel, attend = ((k, v), stack), _unstacking(attend, unstack, 2)

  if cfg.strategy == "ulysses":  # the whole row is here already
    stats = attend(stats, *travel, None)
  elif cfg.strategy == "all_gather" and cfg.halo is not None:
    kv, k_info = _with_halo(cfg, k, v, arrays, rank)
    stats = attend(stats, kv, k_info.arrays, k_info)
  elif cfg.strategy == "all_gather":
    stats = attend(stats, *_gathered(cfg, k, v, arrays), None)
  elif back == 0:
    assert rank is not None  # the ring: a rank's own queries

    def step(h, carry):
      stats, here = carry
      nxt = _shift(here, cfg, +1)  # independent of this step's compute: overlaps
      return attend(stats, *here, (rank - h) % cp), nxt

    stats, here = lax.fori_loop(0, hops, step, (stats, travel))
    stats = attend(stats, *here, (rank - hops) % cp)
  else:
    assert rank is not None  # the ring: a rank's own queries

    def step(h, carry):
      stats, fwd, bwd = carry
      nxt_f, nxt_b = _shift(fwd, cfg, +1), _shift(bwd, cfg, -1)
      stats = attend(stats, *fwd, (rank - h) % cp)
      stats = attend(stats, *bwd, (rank + h) % cp, active=h > 0)  # h = 0: own chunk, done
      return stats, nxt_f, nxt_b

    stats, fwd, bwd = lax.fori_loop(0, hops, step, (stats, travel, travel))
    stats = attend(stats, *fwd, (rank - hops) % cp)
    stats = attend(stats, *bwd, (rank + hops) % cp)

  out, lse = finish(stats)
  # +inf for rows with nothing allowed: exp(s - lse) is then exactly 0.
  return out.astype(q.dtype), jnp.where(lse == -jnp.inf, jnp.inf, lse)


# ----------------------------------------------------------------- backward
def _grad_chunk(
  cfg: PassConfig, q, do, lse, delta, q_info: Tokens, dq, kv, dkv, k_arrays, src_rank, active=True
):
  """Add one K/V chunk's contributions to dq (local) and dk/dv (travelling)."""
  k, v = kv
  plan = _tile_schedule(cfg, q_info, src_rank, k_arrays, active)
  bk, rq = cfg.block_kv, cfg.tile_rows
  f32 = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)

  def tile(i, j, *, masked: bool):
    """(dq_i, dk_j, dv_j) contributions of tile (i, j), float32.

    Scores are built keys-first ([bk, bq*G]) so that dV = P^T dO and
    dK = dS^T Q are plain matmuls; only dQ contracts over the leading axis.
    """
    qi, doi = _cut(q, 2, i * rq, rq), _cut(do, 2, i * rq, rq)
    lse_i, delta_i = _cut(lse, 2, i * rq, rq), _cut(delta, 2, i * rq, rq)
    kj, vj = _cut(k, 2, j * bk, bk), _cut(v, 2, j * bk, bk)
    s = _soft_cap(cfg, f32("bhkd,bhnd->bhkn", kj, qi))
    p = jnp.exp(s - lse_i[:, :, None, :])
    if masked:
      p = jnp.where(_tile_mask(cfg, q_info, plan.k_info, i, j, keys_first=True), p, 0.0)
    dv_j = f32("bhkn,bhnd->bhkd", p.astype(doi.dtype), doi)
    dp = f32("bhkd,bhnd->bhkn", vj, doi)
    ds = p * (dp - delta_i[:, :, None, :])
    if cfg.soft_cap is not None:
      ds = ds * (1.0 - jnp.square(s / cfg.soft_cap))  # d(c*tanh(x/c))/dx
    ds = ds.astype(qi.dtype)
    # qi is pre-scaled, so dk_j already carries the scale; dq gets it once
    # at the end (_backward).
    dk_j = f32("bhkn,bhnd->bhkd", ds, qi)
    dq_i = f32("bhkn,bhkd->bhnd", ds, kj)
    return dq_i, dk_j, dv_j

  def add(x, delta, start, axis):
    return lax.dynamic_update_slice_in_dim(
      x, _cut(x, axis, start, delta.shape[axis]) + delta, start, axis
    )

  def step(t, carry):
    dq, (dk, dv) = carry
    i, j = plan.tile(t)
    dq_i, dk_j, dv_j = lax.cond(
      plan.full[i, j],
      functools.partial(tile, masked=False),
      functools.partial(tile, masked=True),
      i,
      j,
    )
    return add(dq, dq_i, i * rq, 2), (add(dk, dk_j, j * bk, 2), add(dv, dv_j, j * bk, 2))

  return lax.fori_loop(0, plan.count, step, (dq, dkv))


def _pallas_grad_chunk(
  cfg: PassConfig,
  q,
  do,
  lse,
  delta,
  q_info: Tokens,
  q_meta,
  dq,
  kv,
  dkv,
  k_arrays,
  src_rank,
  active=True,
):
  """:func:`_grad_chunk` with the Pallas kernels; ``lse``/``delta`` f32[B, Hkv, N, 1]."""
  assert cfg.kernel is not None  # the Pallas implementations set it
  k, v, k_meta, sched = _kernel_chunk(cfg, q_info, kv, k_arrays, src_rank, active)
  dq_c, dk_c, dv_c = _kernels(cfg).backward(
    cfg.kernel, q, k, v, do, lse, delta, q_meta, k_meta, sched
  )
  return dq + dq_c, (dkv[0] + dk_c, dkv[1] + dv_c)


def _backward(cfg: PassConfig, q, k, v, arrays, out, lse, do):
  cp = cfg.layout.cp_size
  rank = _query_rank(cfg)
  q_info = _tokens(cfg, rank, arrays)
  delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
  if cfg.kernel is None:
    grad = functools.partial(_grad_chunk, cfg, _scaled(cfg, q), do, lse, delta, q_info)
  else:
    q_meta = _query_metadata(cfg, q_info, q)
    grad = functools.partial(
      _pallas_grad_chunk,
      cfg,
      _scaled(cfg, _guarded(cfg, q)),
      do,
      lse[..., None],
      delta[..., None],
      q_info,
      q_meta,
    )
  dq = filled_after(do, q.shape)
  zero_kv = _vary_like(filled_after(do, k.shape), k)
  travel = ((k, v), arrays)
  hops, back = cfg.plan
  if cfg.strategy == "ring":
    stack, unstack = _stacked(arrays)
    travel, grad = ((k, v), stack), _unstacking(grad, unstack, 3)

  if cfg.strategy == "ulysses":
    dq, (dk, dv) = grad(dq, (k, v), (zero_kv, zero_kv), arrays, None)
  elif cfg.strategy == "all_gather" and cfg.halo is not None:
    kv, k_info = _with_halo(cfg, k, v, arrays, rank)
    zero = _vary_like(filled_after(do, kv[0].shape), k)
    dq, (dk, dv) = grad(dq, kv, (zero, zero), k_info.arrays, k_info)
    if cfg.shared_kv:  # one tensor: its gradient is dk + dv, sent home once
      dk, dv = _halo_home(cfg, dk + dv, k.shape[2]), zero_kv
    else:
      dk, dv = _halo_home(cfg, dk, k.shape[2]), _halo_home(cfg, dv, k.shape[2])
  elif cfg.strategy == "all_gather":
    kv, row = _gathered(cfg, k, v, arrays)
    zero_row = _vary_like(filled_after(do, kv[0].shape), k)
    dq, (dk, dv) = grad(dq, kv, (zero_row, zero_row), row, None)
    if cfg.shared_kv:  # one tensor: its gradient is dk + dv, scattered once
      dk, dv = _scatter_home(cfg, dk + dv), zero_kv
    else:
      dk, dv = _scatter_home(cfg, dk), _scatter_home(cfg, dv)
  elif back == 0:
    assert rank is not None  # the ring: a rank's own queries

    def step(h, carry):
      dq, here, dkv = carry
      dq, dkv = grad(dq, here[0], dkv, here[1], (rank - h) % cp)
      # The accumulators ride with their chunk towards its next visitor.
      here, dkv = _shift((here, dkv), cfg, +1)
      return dq, here, dkv

    dq, here, dkv = lax.fori_loop(0, hops, step, (dq, travel, (zero_kv, zero_kv)))
    dq, dkv = grad(dq, here[0], dkv, here[1], (rank - hops) % cp)
    dk, dv = _shift(dkv, cfg, -hops)  # home: the chunk here is owned by rank - hops
  else:
    assert rank is not None  # the ring: a rank's own queries

    def step(h, carry):
      dq, fwd, dkv_f, bwd, dkv_b = carry
      dq, dkv_f = grad(dq, fwd[0], dkv_f, fwd[1], (rank - h) % cp)
      dq, dkv_b = grad(dq, bwd[0], dkv_b, bwd[1], (rank + h) % cp, active=h > 0)
      fwd, dkv_f = _shift((fwd, dkv_f), cfg, +1)
      bwd, dkv_b = _shift((bwd, dkv_b), cfg, -1)
      return dq, fwd, dkv_f, bwd, dkv_b

    zeros = (zero_kv, zero_kv)
    dq, fwd, dkv_f, bwd, dkv_b = lax.fori_loop(0, hops, step, (dq, travel, zeros, travel, zeros))
    dq, dkv_f = grad(dq, fwd[0], dkv_f, fwd[1], (rank - hops) % cp)
    dq, dkv_b = grad(dq, bwd[0], dkv_b, bwd[1], (rank + hops) % cp)
    dkv_f, dkv_b = _shift(dkv_f, cfg, -hops), _shift(dkv_b, cfg, +hops)
    dk, dv = dkv_f[0] + dkv_b[0], dkv_f[1] + dkv_b[1]
  return (dq * cfg.scale).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def ring_passes(
  cfg: PassConfig, q: jax.Array, k: jax.Array, v: jax.Array, arrays: dict[str, jax.Array]
) -> jax.Array:
  return _forward(cfg, q, k, v, arrays)[0]


def _ring_fwd(cfg: PassConfig, q, k, v, arrays):
  out, lse = _forward(cfg, q, k, v, arrays)
  return out, (q, k, v, arrays, out, lse)


def _sum_over_replicas(grad, primal):
  """The cotangent of ``primal``: summed over the mesh axes it is replicated on.

  An input that does not vary over an axis (e.g. a model's activations at
  cp_size 1, sliced without ``axis_index``) was used by every rank of it, so
  its gradient is the sum of theirs (check_vma leaves this psum to us).
  """
  extra = tuple(sorted(_varying_axes(grad) - _varying_axes(primal)))
  return lax.psum(grad, extra) if extra else grad


def _ring_bwd(cfg: PassConfig, residuals, do):
  q, k, v, arrays, out, lse = residuals
  grads = _backward(cfg, q, k, v, arrays, out, lse, do)
  dq, dk, dv = (_sum_over_replicas(g, x) for g, x in zip(grads, (q, k, v)))
  return dq, dk, dv, jax.tree.map(lambda _: None, arrays)


ring_passes.defvjp(_ring_fwd, _ring_bwd)
