"""The kernels' cost estimates: what each Pallas call tells XLA it computes.

The visited blocks are counted again here from a dense numpy mask (every
rank's queries against every chunk's keys, block by block), and the whole
ring's estimates, compiled by XLA:TPU for a v5e slice, against the FLOPs of
those blocks: loop by loop (:class:`cpjax.training.hlo.Program`) and as
``cost_analysis()`` counts them (a loop's body once).
"""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpjax
from cpjax.attention.ring.kernels import PALLAS_IMPLEMENTATIONS
from cpjax.attention.ring.kernels._cost import estimate, visited_pairs
from cpjax.batch.layout import rank_order
from cpjax.masks import Reach
from cpjax.training.hlo import Program


def dense_visited(layout, reach, bq, bk) -> int:
  """Pairs in blocks with an allowed pair, from the dense [S, S] mask."""
  order = rank_order(layout)
  d = order[:, None] - order[None, :]  # q - k, rows and columns in rank order
  ok = np.ones(d.shape, bool)
  if reach.behind is not None:
    ok &= d <= reach.behind
  if reach.ahead is not None:
    ok &= -d <= reach.ahead
  s = order.size
  blocks = ok.reshape(s // bq, bq, s // bk, bk).any(axis=(1, 3))
  return int(blocks.sum()) * bq * bk


@pytest.mark.parametrize("kind", ["contiguous", "load_balanced", "document_balanced"])
@pytest.mark.parametrize("reach", [Reach(None, 0), Reach(40, 0), Reach(24, 24), Reach(None, None)])
def test_visited_pairs_count_the_blocks_a_dense_mask_leaves_non_empty(kind, reach):
  layout = cpjax.ShardLayout(512, 512, 4, kind)
  for bq, bk in ((16, 16), (8, 32), (64, 16)):
    assert visited_pairs(layout, reach, bq, bk) == dense_visited(layout, reach, bq, bk)


def test_one_calls_estimate_by_hand():
  """One causal hop of 2 x 2 tiles (R = 4 rows of 2 tokens x 2 heads, K = 4
  keys, D = 8, bfloat16), 3 of 4 tiles visited: 12 rows x 4 keys x density."""
  q = jax.ShapeDtypeStruct((1, 1, 8, 8), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 1, 8, 8), jnp.bfloat16)
  pairs = 0.75 * 8 * 8  # 48
  kw = dict(density=0.75, soft_cap=False, rows=4, block_kv=4)
  forward, dq, dkdv = (estimate(n, q, k, **kw) for n in ("forward", "dq", "dkdv"))
  assert (forward.flops, dq.flops, dkdv.flops) == (4 * 8 * pairs, 6 * 8 * pairs, 8 * 8 * pairs)
  assert forward.transcendentals == pairs
  assert estimate("dq", q, k, **{**kw, "soft_cap": True}).transcendentals == 2 * pairs
  # forward: q (8 rows x 8 x 2 B) + out and lse in float32 (8 x 9 x 4) + 3 tiles' K and V.
  assert forward.bytes_accessed == 8 * 8 * 2 + 8 * 9 * 4 + 3 * (2 * 4 * 8 * 2)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs 'cpjax[tpu]'")
def test_the_compiled_rings_flops_are_the_kernels_blocks_on_the_tpu():
  """Causal ring, load-balanced, S = 32768 on 8 v5e chips, head dim 256, 8
  query heads on one K/V head, bfloat16, forward and backward."""
  from tests.test_compile_targets import compiled_ring

  s, cp, d, hq = 32768, 8, 256, 8
  compiled = compiled_ring("v5e-8", "causal", "load_balanced", d, hq, 1, jnp.bfloat16, seq_len=s)
  program = Program.parse(compiled.as_text())
  layout = cpjax.ShardLayout(s, s, cp, "load_balanced")
  rows, keys = PALLAS_IMPLEMENTATIONS["pallas_tpu"].default_tile(d, jnp.bfloat16)
  # Every rank's queries on every chunk's keys; one device's share.
  pairs = dense_tiles(layout, rows // hq, keys) * rows * keys / cp
  per_pair = (4 + 6 + 8) * d  # forward, dq, dk/dv
  expected = pairs * per_pair
  kernels = program.kernel_costs()
  assert kernels["calls"] == 3 * cp  # each kernel once a hop
  np.testing.assert_allclose(kernels["flops"], expected, rtol=0.1)
  # cost_analysis() counts the ring loop's body once: 2 of each kernel's 8
  # calls (the loop's and the last hop's), and little else.
  sites = [i for body in program.computations.values() for i in body if i.cost_estimate()]
  assert len(sites) == 3 * 2
  flops = compiled.cost_analysis()["flops"]
  np.testing.assert_allclose(flops, expected * 2 / cp, rtol=0.1)
  assert kernels["transcendentals"] == pytest.approx(pairs * 3, rel=0.1)


def dense_tiles(layout, bq: int, bk: int) -> int:
  """Causal tiles with an allowed pair, from block ends (a block's tokens
  are consecutive): the query block's last token reaches the key block's first."""
  order = rank_order(layout)
  q_last = order[bq - 1 :: bq]
  k_first = order[::bk]
  return int((q_last[:, None] >= k_first[None, :]).sum())
