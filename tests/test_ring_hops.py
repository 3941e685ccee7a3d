"""End to end: what a real ring_attention call schedules at each hop (recorded
from inside shard_map) equals the numpy count of non-empty / full tiles of
the (rank, source) pairs the ring plan says it visits, and the pairs it does
not visit hold no allowed pair."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import cpjax
from cpjax.attention.ring import (
  _passes as RA,
)  # the ring's passes: where each hop's tiles are scheduled
from tests import attention_harness as H
from tests.test_tile_schedule import CASES, B, S, np_allowed, np_tiles


@pytest.mark.parametrize("case", ["causal", "window", "documents_padding", "vision_window"])
@pytest.mark.parametrize("kind", ["contiguous", "load_balanced"])
def test_ring_hops_schedule_what_numpy_counts(monkeypatch, case, kind):
  cp, bq, bk = 4, 8, 8
  records = collections.defaultdict(list)  # (rank, src) -> [(visited, full & visited)]
  real = RA._tile_schedule

  def spy(cfg, q_info, src_rank, k_arrays, active):
    plan = real(cfg, q_info, src_rank, k_arrays, active)
    nq, nk = plan.full.shape
    visit = (
      jnp.zeros(nq * nk, jnp.int32)
      .at[plan.tiles]
      .add(jnp.arange(nq * nk) < plan.count)
      .reshape(nq, nk)
      > 0
    )
    jax.debug.callback(
      lambda r, s, n, f: records[int(r), int(s)].append((int(n), int(f))),
      lax.axis_index(cfg.axis_name),
      src_rank,
      plan.count,
      jnp.sum(visit & plan.full),
    )
    return plan

  monkeypatch.setattr(RA, "_tile_schedule", spy)
  meta = {n: x for n, x in CASES[case].items() if isinstance(x, np.ndarray)}
  kw = {n: x for n, x in CASES[case].items() if not isinstance(x, np.ndarray)}
  inputs = H.make_inputs(np.random.default_rng(0), b=B, s=S, hq=4, hkv=2, d=8)
  H.ring(*inputs, cp=cp, kind=kind, meta=meta, grads=False, block_q=bq, block_kv=bk, **kw)

  layout = cpjax.ShardLayout(S, S, cp, kind)
  plan = cpjax.ring_plan(layout, mask=cpjax.AttentionMask.create(**CASES[case]))
  allowed = np_allowed(**CASES[case])
  for r in range(cp):
    # The hops the plan promises: forward h = 0..F, and backward h = 1..Bk
    # (plus an inactive h = 0 that schedules nothing).
    active = collections.Counter((r - h) % cp for h in range(plan.forward_hops + 1))
    active.update((r + h) % cp for h in range(1, plan.backward_hops + 1))
    q_pos = np.asarray(cpjax.local_token_indices(layout, r))
    for s in range(cp):
      some, every = np_tiles(
        allowed, q_pos, np.asarray(cpjax.local_token_indices(layout, s)), bq, bk
      )
      want = (int(some.any(0).sum()), int((every.all(0) & some.any(0)).sum()))
      expected = [want] * active[s] + [(0, 0)] * (s == r and plan.backward_hops > 0)
      got = records.pop((r, s), [])
      assert sorted(got) == sorted(expected), (case, kind, r, s, got, expected)
      if not active[s]:
        assert want == (0, 0), f"{case} {kind}: rank {r} never visits rank {s}'s keys it needs"
  assert not records, f"hops outside the ring: {dict(records)}"
  if set(CASES[case]) <= {"causal", "sliding_window"}:
    # A static reach: the farthest hop of each direction does work for some rank.
    for hops, sign in ((plan.forward_hops, -1), (plan.backward_hops, +1)):
      if hops:
        far = [
          np_tiles(
            allowed,
            np.asarray(cpjax.local_token_indices(layout, r)),
            np.asarray(cpjax.local_token_indices(layout, (r + sign * hops) % cp)),
            bq,
            bk,
          )[0].any()
          for r in range(cp)
        ]
        assert any(far), f"{case} {kind}: hop {sign * hops} of {plan} does no work"
