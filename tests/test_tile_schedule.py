"""Performance claims, asserted: the tiles each ring hop visits (and those it
computes without a mask) are exactly the non-empty (and full) tiles of the
mask, counted in numpy from global positions, for every mask kind, both
layouts, and every (rank, source rank) pair; hops the plan leaves out hold no
allowed pair."""

import jax.numpy as jnp
import numpy as np
import pytest

import cpjax
from cpjax.attention.ring._passes import PassConfig, _kernel_chunk, _tile_schedule, _tokens
from cpjax.attention.ring.kernels import _common as common

KINDS = ("contiguous", "load_balanced")
S, B = 128, 2


# ------------------------------------------------ the numpy reference (no cpjax)
def np_allowed(
  *, causal=True, sliding_window=None, document_ids=None, padding_mask=None, vision_group_ids=None
):
  """bool[B, S, S] over global positions, straight from the README's rule:
  (window | same image) & same document & key not padding."""
  i, j = np.arange(S)[:, None], np.arange(S)[None, :]
  ok = (j <= i) if causal else np.ones((S, S), bool)
  if sliding_window is not None:
    ok = ok & ((i - j < sliding_window) if causal else (np.abs(i - j) < sliding_window))
  ok = np.broadcast_to(ok, (B, S, S))
  if vision_group_ids is not None:
    g = vision_group_ids
    ok = ok | ((g[:, :, None] == g[:, None, :]) & (g[:, :, None] >= 0))
  if document_ids is not None:
    d = document_ids
    ok = ok & (d[:, :, None] == d[:, None, :]) & (d[:, :, None] > 0)
  if padding_mask is not None:
    ok = ok & ~padding_mask[:, None, :]
  return ok


def np_tiles(allowed, q_pos, k_pos, bq, bk):
  """(non-empty, full) bool[B, nq, nk] of the tiles of queries q_pos x keys k_pos."""
  sub = allowed[:, q_pos][:, :, k_pos]
  t = sub.reshape(B, len(q_pos) // bq, bq, len(k_pos) // bk, bk)
  return t.any(axis=(2, 4)), t.all(axis=(2, 4))


# ------------------------------------------------------------- the masks
def _docs(cuts_per_row, pad_from=None):
  doc_ids = np.zeros((B, S), np.int32)
  for b, cuts in enumerate(cuts_per_row):
    doc_ids[b] = 1 + np.searchsorted(np.asarray(cuts), np.arange(S), side="right")
    if pad_from is not None:
      doc_ids[b, pad_from[b] :] = 0
  return doc_ids


DOCS = _docs([[37, 90], [13, 64, 100]])
PAD_FROM = (100, 77)
PAD = np.arange(S)[None, :] >= np.asarray(PAD_FROM)[:, None]
DOCS_PADDED = _docs([[37, 90], [13, 64, 70]], PAD_FROM)
VG = np.full((B, S), -1, np.int32)
VG[0, 20:45], VG[0, 60:62], VG[1, 5:9], VG[1, 30:100] = 0, 1, 0, 1  # images straddling chunks

CASES = {
  "causal": dict(),
  "window": dict(sliding_window=40),
  "bidirectional_window": dict(causal=False, sliding_window=30),
  "documents": dict(document_ids=DOCS),
  "padding": dict(padding_mask=PAD),
  "documents_padding": dict(document_ids=DOCS_PADDED, padding_mask=PAD),
  "vision_documents": dict(vision_group_ids=VG, document_ids=DOCS),
  "vision_window": dict(sliding_window=28, vision_group_ids=VG),
}


# ------------------------------------------------------ the schedule under test
def _schedules(layout, mask, bq, bk):
  """``run(rank, src)``: the schedules one ring hop builds, from the very functions
  the ring calls: the XLA loop's (count, visited bool-as-int [nq, nk], full
  [nq, nk]) and the kernels' (ncols [B, nq], cols [B, nq, nk], full [B, nq, nk])."""
  kernel = common.KernelParams(
    rule=mask.rule, soft_cap=None, block_q=bq, block_kv=bk, groups=1, interpret=True
  )
  cfg = PassConfig(
    layout=layout,
    axis_name="cp",
    rule=mask.rule,
    plan=cpjax.ring_plan(layout, mask=mask),
    scale=1.0,
    soft_cap=None,
    block_q=bq,
    block_kv=bk,
    groups=1,
    implementation="pallas_gpu",
    kernel=kernel,
  )
  arrays = {n: jnp.asarray(x) for n, x in mask.arrays.items()}
  kv = jnp.zeros((B, 1, layout.local_seq_len, 8), jnp.float32)  # only its batch size is read

  def run(r, s):  # eager: cheaper than one compile per configuration
    local = lambda rank: {
      n: x[:, cpjax.local_token_indices(layout, rank)]  # noqa: E731
      for n, x in arrays.items()
    }
    q_info = _tokens(cfg, r, local(r))
    xla = _tile_schedule(cfg, q_info, s, local(s), True)
    nq, nk = xla.full.shape
    # tiles[:count] are the visited flat ids; the tail is fill (0): add, not set.
    visit = jnp.zeros(nq * nk, jnp.int32).at[xla.tiles].add(jnp.arange(nq * nk) < xla.count)
    _, _, _, ker = _kernel_chunk(cfg, q_info, (kv, kv), local(s), s, True)
    return xla.count, visit.reshape(nq, nk), xla.full, ker.ncols, ker.cols, ker.full

  return run


def check_hop_schedules(case, kind, cp, bq, bk):
  """Assert every (rank, source) schedule against numpy; return the tile totals."""
  layout = cpjax.ShardLayout(S, S, cp, kind)
  mask = cpjax.AttentionMask.create(**CASES[case])
  allowed = np_allowed(**CASES[case])
  run = _schedules(layout, mask, bq, bk)
  # The block classifier is exact for windows, and for documents and padding laid
  # out as runs (tiles never straddle a chunk); an OR of rules (vision groups)
  # may call a full tile partial (masks.AnyOf), so there "full" is only checked
  # to be sound.
  exact_full = "vision_group_ids" not in CASES[case]
  plan = cpjax.ring_plan(layout, mask=mask)
  totals = dict(visited=0, tiles=0, nonempty=0, full=0, claimed_full=0)
  for r in range(cp):
    q_pos = np.asarray(cpjax.local_token_indices(layout, r))
    sources = {(r - h) % cp for h in range(plan.forward_hops + 1)}
    sources |= {(r + h) % cp for h in range(1, plan.backward_hops + 1)}
    for s in range(cp):
      k_pos = np.asarray(cpjax.local_token_indices(layout, s))
      some, every = np_tiles(allowed, q_pos, k_pos, bq, bk)
      # The XLA loop: one schedule for the batch (a tile any row needs; unmasked
      # only if no row masks anything in it).
      want_visit, want_full = some.any(0), every.all(0) & some.any(0)
      where = f"{case} {kind} cp={cp} bq={bq} bk={bk} rank {r} <- {s}"
      count, visit, full, ncols, cols, kfull = map(np.asarray, run(r, s))
      assert visit.max() <= 1, f"{where}: a tile listed twice"
      visit = visit.astype(bool)
      assert count == want_visit.sum(), where
      np.testing.assert_array_equal(visit, want_visit, err_msg=where)
      if exact_full:
        np.testing.assert_array_equal(full & visit, want_full, err_msg=where)
      else:
        assert not np.any(full & visit & ~want_full), f"{where}: a tile called full is not"
      # The kernels: a schedule per batch row.
      np.testing.assert_array_equal(ncols, some.sum(-1), err_msg=where)
      for b in range(B):
        for i in range(some.shape[1]):
          assert sorted(cols[b, i, : ncols[b, i]]) == list(np.flatnonzero(some[b, i])), where
      claimed = kfull.astype(bool) & some
      if exact_full:
        np.testing.assert_array_equal(claimed, every & some, err_msg=where)
      else:  # AnyOf.all is conservative: it may call a full tile partial, never the reverse
        assert not np.any(claimed & ~every), f"{where}: a tile called full has a masked pair"
      if s not in sources:  # a hop the plan skips must hold nothing allowed
        assert not some.any(), f"{where}: the plan skips a hop with allowed pairs"
      totals["visited"] += int(count)
      totals["nonempty"] += int(some.sum())  # per batch row, as the kernels see them
      totals["full"] += int((every & some).sum())
      totals["claimed_full"] += int(claimed.sum())
      totals["tiles"] += visit.size
  # Not vacuous: every configuration skips tiles, and has both full and partial ones.
  assert 0 < totals["visited"] < totals["tiles"], totals
  assert 0 < totals["full"] < totals["nonempty"], totals
  return totals


@pytest.mark.parametrize("blocks", [(8, 8), (8, 16)], ids=lambda b: f"bq{b[0]}-bk{b[1]}")
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", CASES)
def test_each_hop_visits_exactly_the_nonempty_tiles(case, kind, cp, blocks):
  check_hop_schedules(case, kind, cp, *blocks)
