"""ring_attention(strategy="hybrid") against the dense float32 reference.

The hybrid factors cp as ``R x U``: Ulysses inside each group of ``U``
neighbouring ranks (an all-to-all turns the group's sequence split into a
head split), the ring over the ``R`` groups with each rank rotating with its
peers. Its values and gradients must equal the reference for every layout
(a group's tokens are one rank of a coarser layout of the same kind), mask
kind and GQA grouping.
"""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpjax
from cpjax.attention.ring import RingPlan, hybrid_ulysses_size
from tests import attention_harness as H
from tests.helpers import cp_mesh
from tests.test_ring_attention import check

HYBRID = dict(strategy="hybrid")


@pytest.fixture(scope="module")
def inputs():
  return H.make_inputs(np.random.default_rng(0))  # 4 query heads on 2 K/V heads: U = 2


# Every layout and mask kind: tests/test_ulysses.py's head-split strategies.


@pytest.mark.parametrize(
  "hq, hkv, cp, size",
  [(8, 4, 8, 4), (6, 3, 6, 3), (12, 6, 4, 2), (8, 2, 4, 2)],
  ids=["groups-of-4", "groups-of-3", "cp-4-of-6-kv-heads", "gqa-4"],
)
def test_hybrid_takes_the_largest_ulysses_group_the_kv_heads_allow(hq, hkv, cp, size):
  """U is the largest divisor of cp that splits the K/V heads, so no K/V head
  is repeated and each query head stays on its own K/V head."""
  assert hybrid_ulysses_size(hq, hkv, cp) == size
  inputs = H.make_inputs(np.random.default_rng(2), s=48 if cp == 6 else 64, hq=hq, hkv=hkv)
  s = inputs[0].shape[1]
  meta = H.packed_metadata(np.random.default_rng(2), 2, s, pad_from=s - 4)
  check(*inputs, cp=cp, kind="load_balanced", meta=meta, logits_soft_cap=5.0, **HYBRID)


def _configs(monkeypatch) -> list:
  """Record the static configuration of each ring the attention runs."""
  from cpjax.attention.ring import _attention

  seen, real = [], _attention._head_major

  def record(cfg, *args):
    seen.append(cfg)
    return real(cfg, *args)

  monkeypatch.setattr(_attention, "_head_major", record)
  return seen


def test_the_ring_runs_over_the_groups_with_their_fewer_hops(inputs, monkeypatch):
  """cp = 8 in groups of 2: a ring of 4 chunks twice as long, 3 hops
  (the ring's 7); under a window, the groups' ring is shorter still."""
  seen = _configs(monkeypatch)
  H.ring(*inputs, cp=8, kind="load_balanced", grads=False, **HYBRID)
  (cfg,) = seen
  assert (cfg.ulysses_size, cfg.layout.cp_size, cfg.layout.chunk_len) == (2, 4, 8)
  assert cfg.plan == RingPlan(3, 0)
  seen.clear()
  H.ring(*inputs, cp=8, kind="contiguous", grads=False, sliding_window=6, **HYBRID)
  assert seen[0].plan == RingPlan(1, 0)


def test_a_hybrid_of_one_group_is_ulysses(monkeypatch):
  """K/V heads that cp splits whole: one group, the whole row, no ring."""
  calls = H.count_ulysses(monkeypatch)
  seen = _configs(monkeypatch)
  inputs = H.make_inputs(np.random.default_rng(3), hq=8, hkv=4)
  meta = H.packed_metadata(np.random.default_rng(3), 2, 64, pad_from=40)
  check(*inputs, cp=4, kind="load_balanced", meta=meta, **HYBRID)
  assert calls and {(c.strategy, c.ulysses_size) for c in seen} == {("ulysses", 1)}


def test_hybrid_with_a_batch_axis():
  inputs = H.make_inputs(np.random.default_rng(4), hq=4, hkv=2)
  meta = H.packed_metadata(np.random.default_rng(4), 2, 64, pad_from=40)
  mesh = cp_mesh(4, ("dp", 2))
  check(*inputs, cp=4, kind="load_balanced", meta=meta, mesh=mesh, batch_axis="dp", **HYBRID)


def test_hybrid_without_a_ulysses_axis_is_refused_before_any_compute():
  inputs = H.make_inputs(np.random.default_rng(5), hq=4, hkv=1)
  with pytest.raises(ValueError, match="1 K/V head.* share no factor with cp_size = 4"):
    H.ring(*inputs, cp=4, kind="load_balanced", **HYBRID)
  inputs = H.make_inputs(np.random.default_rng(5), hq=6, hkv=3)
  with pytest.raises(ValueError, match="3 K/V head.* share no factor with cp_size = 8"):
    H.ring(*inputs, cp=8, kind="load_balanced", **HYBRID)


def test_the_all_to_alls_stay_in_neighbour_groups_and_the_ring_steps_over_them():
  """Ulysses' all-to-alls in groups {0,1}, {2,3}, ...; every hop sends rank i
  to its peer i + 2 in the next group."""
  text = H.gradient_program("hybrid", cp=8, hkv=2)
  groups = set(re.findall(r"all-to-all\(.*?replica_groups=(\{[\d,{}]*\})", text))
  pairs = set(
    re.findall(r"collective-permute(?:-start)?\(.*?source_target_pairs=(\{[\d,{}]*\})", text)
  )
  assert groups == {"{{0,1},{2,3},{4,5},{6,7}}"}, groups
  peers = "{" + ",".join(f"{{{i},{(i + 2) % 8}}}" for i in range(8)) + "}"
  back = "{" + ",".join(f"{{{i},{(i - 2) % 8}}}" for i in range(8)) + "}"
  assert pairs <= {peers, back} and peers in pairs, pairs


@pytest.mark.parametrize(
  "shape, hq, hkv",
  [((4, 2), 4, 2), ((2, 4), 8, 2)],
  ids=["ring-4-ulysses-2", "ring-2-ulysses-4-kv-repeated"],
)
def test_hybrid_over_two_mesh_axes_equals_the_reference(shape, hq, hkv):
  """A mesh with a ring axis and a Ulysses axis, the sequence split over both
  (the ring's major): Ulysses over the second axis (repeating K/V heads
  where it needs, as Ulysses does), the ring over the first."""
  mesh = jax.make_mesh(shape, ("ring", "ulysses"), devices=jax.devices()[:8])
  lay = cpjax.ShardLayout(64, 64, 8, "load_balanced")
  q, k, v, _ = H.make_inputs(np.random.default_rng(6), b=1, hq=hq, hkv=hkv)
  docs = H.packed_metadata(np.random.default_rng(6), 1, 64, pad_from=58)["document_ids"]
  rank = functools.partial(cpjax.to_rank_order, layout=lay)

  def loss(q, k, v):
    out = cpjax.context_parallel_attention(
      q,
      k,
      v,
      mesh=mesh,
      layout=lay,
      axis_name=("ring", "ulysses"),
      strategy="hybrid",
      document_ids=rank(docs),
    )
    return jnp.sum(out * jnp.arange(out.size, dtype=out.dtype).reshape(out.shape) / out.size), out

  def want(q, k, v):
    out = cpjax.to_rank_order(cpjax.reference_attention(q, k, v, document_ids=docs), lay)
    return jnp.sum(out * jnp.arange(out.size, dtype=out.dtype).reshape(out.shape) / out.size), out

  with jax.set_mesh(mesh):
    (_, got), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
      rank(q), rank(k), rank(v)
    )
  (_, ref), ref_grads = jax.value_and_grad(want, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  chex.assert_trees_all_close(got, ref, rtol=1e-5, atol=1e-5)
  for g, r in zip(grads, ref_grads):
    chex.assert_trees_all_close(g, rank(r), rtol=1e-5, atol=1e-5)


def test_two_axes_are_the_hybrids_and_its_ulysses_axis_must_split_the_heads():
  mesh = jax.make_mesh((2, 4), ("ring", "ulysses"), devices=jax.devices()[:8])
  lay = cpjax.ShardLayout(64, 64, 8, "load_balanced")
  x = jnp.zeros((1, 64, 2, 8))
  call = functools.partial(
    cpjax.context_parallel_attention, x, x, x, mesh=mesh, layout=lay, axis_name=("ring", "ulysses")
  )
  with pytest.raises(
    ValueError, match=r"names two mesh axes .* strategy='hybrid', got strategy='ring'"
  ):
    call(strategy="ring")
  with pytest.raises(ValueError, match="2 query heads .* not a multiple of its size 4"):
    call(strategy="hybrid")
  local = jnp.zeros((1, 8, 2, 8))
  with pytest.raises(ValueError, match=r"shard_map over a mesh axis \('ring', 'ulysses'\)"):
    cpjax.ring_attention(
      local, local, local, layout=lay, axis_name=("ring", "ulysses"), strategy="hybrid"
    )
  with pytest.raises(
    TypeError, match=r"pair \(ring axis, Ulysses axis\) of names, got \('ring',\)"
  ):
    cpjax.ring_attention(x, x, x, layout=lay, axis_name=("ring",), strategy="hybrid")
