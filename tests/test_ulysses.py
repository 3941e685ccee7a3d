"""ring_attention(strategy="ulysses") (and the hybrid's Ulysses groups)
against the dense float32 reference.

Ulysses turns the sequence split into a head split with one all-to-all, lets
each rank attend its ``Hq/cp`` heads over the whole row, and turns the
output back; K/V heads fewer than cp are repeated only as far as needed. Its
values and gradients must equal the reference for every layout, mask kind and
GQA grouping.
"""

import numpy as np
import pytest

from cpjax.attention.ring._attention import ulysses_kv_repeats
from tests import attention_harness as H
from tests.helpers import cp_mesh
from tests.test_ring_attention import check

ULYSSES = dict(strategy="ulysses")


@pytest.fixture(scope="module")
def inputs():
  return H.make_inputs(np.random.default_rng(0))  # 4 query heads on 2 K/V heads


@pytest.mark.parametrize("kind", ["contiguous", "load_balanced", "document_balanced"])
@pytest.mark.parametrize(
  "mask",
  [dict(), dict(sliding_window=6), dict(causal=False, vision=True)],
  ids=["causal", "window", "bidirectional-vision"],
)
@pytest.mark.parametrize(
  "strategy, cp", [("ulysses", 4), ("hybrid", 8)], ids=["ulysses-cp4", "hybrid-cp8"]
)
def test_the_head_split_strategies_equal_the_reference(inputs, strategy, cp, kind, mask):
  """Ulysses over the whole axis; the hybrid on cp = 8 as 4 groups of 2
  ranks (the 2 K/V heads), the ring over the groups
  (tests/test_hybrid.py)."""
  mask = dict(mask)
  vision = mask.pop("vision", False)
  meta = H.packed_metadata(np.random.default_rng(1), 2, 64, pad_from=50, vision=vision)
  check(*inputs, cp=cp, kind=kind, meta=meta, strategy=strategy, **mask)


@pytest.mark.parametrize(
  "hq, hkv, cp, repeats",
  [(8, 2, 8, 4), (8, 1, 4, 4), (8, 4, 2, 1), (6, 3, 2, 2)],
  ids=["gqa-2kv-cp8", "one-kv-head", "kv-heads-split", "odd-kv-heads"],
)
def test_ulysses_keeps_each_query_head_on_its_kv_head(hq, hkv, cp, repeats):
  """K/V heads are repeated (not tiled) just enough for cp to split them."""
  assert ulysses_kv_repeats(hq, hkv, cp) == repeats
  inputs = H.make_inputs(np.random.default_rng(2), hq=hq, hkv=hkv)
  meta = H.packed_metadata(np.random.default_rng(2), 2, 64, pad_from=60)
  check(*inputs, cp=cp, kind="load_balanced", meta=meta, logits_soft_cap=5.0, **ULYSSES)


def test_ulysses_with_a_batch_axis():
  inputs = H.make_inputs(np.random.default_rng(3), hq=4, hkv=1)
  meta = H.packed_metadata(np.random.default_rng(3), 2, 64, pad_from=40)
  mesh = cp_mesh(4, ("dp", 2))
  check(*inputs, cp=4, kind="load_balanced", meta=meta, mesh=mesh, batch_axis="dp", **ULYSSES)


# The kernels in Pallas' interpreter and fully padded ranks: tests/test_all_gather.py's
# row-strategy tests, for both strategies.


def test_heads_cp_cannot_split_are_refused_before_any_compute(inputs):
  with pytest.raises(ValueError, match="4 query heads .* is not a multiple of cp_size = 8"):
    H.ring(*inputs, cp=8, kind="load_balanced", **ULYSSES)


def test_ulysses_takes_no_hops_and_moves_heads_with_all_to_alls():
  """q, k, v to the row, the output's gradient to the row, dq, dk, dv home
  (the gradient of a sum never needs the output home); one tensor for K and V
  moves once each way."""
  two, one = H.gradient_program("ulysses"), H.gradient_program("ulysses", shared=True)
  assert H.count_ops(two, "collective-permute") == H.count_ops(two, "all-gather") == 0
  assert H.count_ops(two, "all-to-all") == 7 and H.count_ops(one, "all-to-all") == 5, (two, one)


def test_context_parallel_attention_takes_ulysses(monkeypatch):
  calls = H.count_ulysses(monkeypatch)
  H.check_global_documents(4, **ULYSSES)
  assert len(calls) == 1
