"""ring_attention(strategy="all_gather") against the dense float32 reference.

The all-gather takes no hops: every rank gathers the row's K/V at once and
reduce-scatters dK/dV home. Its values and gradients must equal the
reference (and so the ring) for every layout and mask kind.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import cpjax
from cpjax.attention.ring import _passes
from cpjax.attention.ring._schedule import Halo, halo
from cpjax.masks import MaskSpec
from tests import attention_harness as H
from tests.helpers import cp_mesh
from tests.test_ring_attention import check, owner_ranks

GATHER = dict(strategy="all_gather")


@pytest.fixture(scope="module")
def inputs():
  return H.make_inputs(np.random.default_rng(0))


@pytest.mark.parametrize("kind", ["contiguous", "load_balanced", "document_balanced"])
@pytest.mark.parametrize(
  "mask",
  [
    dict(),
    dict(sliding_window=6),
    dict(causal=False, vision=True),
  ],
  ids=["causal", "window", "bidirectional-vision"],
)
def test_all_gather_equals_the_reference(inputs, kind, mask):
  mask = dict(mask)
  vision = mask.pop("vision", False)
  meta = H.packed_metadata(np.random.default_rng(1), 2, 64, pad_from=50, vision=vision)
  check(*inputs, cp=4, kind=kind, meta=meta, **mask, **GATHER)


def test_all_gather_with_gqa_soft_cap_and_a_batch_axis():
  inputs = H.make_inputs(np.random.default_rng(2), hq=8, hkv=2)
  meta = H.packed_metadata(np.random.default_rng(2), 2, 64, pad_from=60)
  mesh = cp_mesh(4, ("dp", 2))
  check(
    *inputs,
    cp=4,
    kind="load_balanced",
    meta=meta,
    mesh=mesh,
    batch_axis="dp",
    logits_soft_cap=5.0,
    **GATHER,
  )


@pytest.mark.parametrize("kind", ["contiguous", "load_balanced", "document_balanced"])
@pytest.mark.parametrize(
  "mask",
  [dict(sliding_window=6), dict(sliding_window=3, causal=False), dict(sliding_window=11)],
  ids=["window-6", "bidirectional-window-3", "window-11"],
)
def test_a_window_gathers_only_its_halo(inputs, kind, mask, monkeypatch):
  """cp = 8, 2-token key tiles: each rank receives only the blocks of its
  neighbours that its queries' window reaches (window 11 reaches past the
  8-token chunk, two hops, on a contiguous layout)."""
  halos = H.spy(monkeypatch, _passes, "_with_halo")
  gathers = H.count_gathers(monkeypatch)
  meta = H.packed_metadata(np.random.default_rng(1), 2, 64, pad_from=50)
  check(*inputs, cp=8, kind=kind, meta=meta, block_q=2, block_kv=2, **mask, **GATHER)
  assert halos and not gathers


def test_the_halo_is_the_reach_before_each_chunk_in_whole_key_blocks():
  """Hand-worked: 4 ranks, 1024-token chunks, 128-key blocks."""
  causal = MaskSpec(sliding_window=512).rule()  # 511 keys back -> 4 blocks
  both = MaskSpec(sliding_window=200, causal=False).rule()  # 199 each way -> 2 blocks
  contiguous = cpjax.ShardLayout(4096, 4096, 4, "contiguous")
  balanced = cpjax.ShardLayout(8192, 8192, 4, "load_balanced")
  assert halo(contiguous, causal, 128) == (Halo(1, ((512, 512),)),)
  assert halo(contiguous, both, 128) == (Halo(1, ((768, 256),)), Halo(-1, ((0, 256),)))
  # Rank r holds chunks r and 7 - r: the end of r - 1's first chunk reaches
  # chunk r, the end of r + 1's second chunk reaches chunk 7 - r.
  assert halo(balanced, causal, 128) == (Halo(1, ((512, 512),)), Halo(-1, ((1536, 512),)))
  assert halo(balanced, both, 128) == (
    Halo(1, ((768, 512),)),
    Halo(-1, ((0, 256), (1792, 256))),
  )
  assert halo(balanced, MaskSpec().rule(), 128) is None  # causal: unbounded
  assert halo(balanced, MaskSpec(sliding_window=2000).rule(), 128) is None  # the whole ring


@pytest.mark.parametrize(
  "strategy, hkv, cp", [("all_gather", 1, 2), ("ulysses", 1, 2), ("hybrid", 2, 4)]
)
@pytest.mark.parametrize("implementation", ["pallas_tpu", "pallas_gpu"])
def test_the_row_strategies_run_the_kernels_over_the_whole_row(implementation, strategy, hkv, cp):
  """Pallas' interpreter: one kernel call folds the gathered row (128-key
  tiles for the TPU implementation, whose lanes need them); under Ulysses the
  kernels see every query of the row too, and under the hybrid (groups of
  2 ranks) every query of the group, on a ring of 2 groups."""
  inputs = H.make_inputs(np.random.default_rng(3), s=512, hq=4, hkv=hkv, d=16)
  meta = H.packed_metadata(np.random.default_rng(3), 2, 512, pad_from=450)
  check(
    *inputs,
    cp=cp,
    kind="load_balanced",
    meta=meta,
    sliding_window=150,
    implementation=implementation,
    interpret=True,
    strategy=strategy,
  )


@pytest.mark.parametrize(
  "strategy, cp, padded_ranks",
  [("all_gather", 8, [6, 7]), ("ulysses", 4, [3]), ("hybrid", 8, [6, 7])],
)
def test_the_row_strategies_zero_fully_padded_ranks(inputs, strategy, cp, padded_ranks):
  """(Ulysses splits the 4 query heads: cp = 4; the hybrid, the 2 K/V heads:
  groups of 2, one of them all padding.)"""
  q, k, v, w = inputs
  pad_from = 22
  lay = cpjax.ShardLayout(64, 64, cp, "load_balanced")
  assert [r for r in range(cp) if (owner_ranks(lay) == r)[:pad_from].sum() == 0] == padded_ranks
  meta = H.packed_metadata(np.random.default_rng(6), 2, 64, pad_from=pad_from)
  out, grads = check(q, k, v, w, cp=cp, kind="load_balanced", meta=meta, strategy=strategy)
  for name, x in zip(("out", "dq", "dk", "dv"), (out, *grads)):
    chex.assert_trees_all_equal(
      x[:, pad_from:], np.zeros_like(x[:, pad_from:]), custom_message=name
    )


def test_all_gather_takes_no_hops_and_reduce_scatters_the_key_gradients():
  ring = H.gradient_program("ring")
  gathered = H.gradient_program("all_gather")
  assert H.count_ops(ring, "collective-permute") > 0 and H.count_ops(ring, "all-gather") == 0
  assert H.count_ops(gathered, "collective-permute") == 0
  # dK and dV: one reduce-scatter each, home to the rank that owns the keys.
  assert H.count_ops(gathered, "reduce-scatter") == 2, gathered


def test_all_gather_of_one_tensor_for_k_and_v_gathers_and_scatters_it_once():
  """The same array passed as K and V travels once each way."""
  two = H.gradient_program("all_gather")
  one = H.gradient_program("all_gather", shared=True)
  assert H.count_ops(one, "reduce-scatter") == 1 < H.count_ops(two, "reduce-scatter")
  assert H.count_ops(one, "all-gather") < H.count_ops(two, "all-gather")


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_one_tensor_for_k_and_v_gets_the_sum_of_both_gradients(strategy):
  """K = V: the shared tensor's gradient is dK + dV, as the reference's."""
  q, k, _, w = H.make_inputs(np.random.default_rng(4), s=32, hq=4, hkv=1)
  mesh = cp_mesh(4)
  lay = cpjax.ShardLayout(32, 32, 4, "load_balanced")
  order = cpjax.rank_order(lay)
  spec = jax.NamedSharding(mesh, P(None, "cp"))
  put = lambda x: jax.device_put(jnp.asarray(np.asarray(x)[:, order]), spec)  # noqa: E731
  f = jax.shard_map(
    lambda q, kv: cpjax.ring_attention(q, kv, kv, layout=lay, strategy=strategy),
    mesh=mesh,
    in_specs=P(None, "cp"),
    out_specs=P(None, "cp"),
  )
  with jax.set_mesh(mesh):
    got = jax.jit(jax.grad(lambda q, kv: jnp.sum(f(q, kv) * put(w)), argnums=(0, 1)))(
      put(q), put(k)
    )
  want = jax.grad(lambda q, kv: jnp.sum(cpjax.reference_attention(q, kv, kv) * w), argnums=(0, 1))(
    q, k
  )
  inverse = np.argsort(order)
  for g, r in zip(got, want):
    chex.assert_trees_all_close(np.asarray(g)[:, inverse], r, rtol=1e-5, atol=1e-5)


def test_an_unknown_strategy_is_refused_before_any_compute():
  from tests.test_ring_attention import KV, Q, _call

  with pytest.raises(
    ValueError,
    match=r"strategy must be one of \('ring', 'all_gather', 'ulysses', 'hybrid'\), got 'a2a'",
  ):
    _call(Q, KV, KV, strategy="a2a")


def test_context_parallel_attention_and_flax_take_the_strategy(monkeypatch):
  """The global-array entry point all-gathers too; the flax attention_fn
  takes the strategy or the context's."""
  gathers = H.count_gathers(monkeypatch)
  mesh, lay, x = H.check_global_documents(2, strategy="all_gather")
  xr = cpjax.to_rank_order(x, lay)
  assert len(gathers) == 1

  def flax_attention(q, context_strategy, strategy):
    context = cpjax.CPContext(lay, strategy=context_strategy)
    with cpjax.use_cp(context):
      return cpjax.ring_attention_fn(strategy=strategy)(q, q, q, is_causal=True)

  spec = jax.NamedSharding(mesh, P(None, "cp"))
  for context_strategy, strategy, gathered in (
    ("all_gather", None, 1),
    ("ring", "all_gather", 1),
    ("all_gather", "ring", 0),
  ):
    gathers.clear()
    f = jax.shard_map(
      lambda q: flax_attention(q, context_strategy, strategy),
      mesh=mesh,
      in_specs=P(None, "cp"),
      out_specs=P(None, "cp"),
    )
    out = jax.jit(f)(jax.device_put(jnp.asarray(xr), spec))
    want = cpjax.reference_attention(x, x, x)
    chex.assert_trees_all_close(cpjax.from_rank_order(out, lay), want, rtol=1e-5, atol=1e-5)
    assert len(gathers) == gathered, (context_strategy, strategy)
  with pytest.raises(
    ValueError,
    match=r"strategy must be one of \('ring', 'all_gather', 'ulysses', 'hybrid'\) or None",
  ):
    cpjax.ring_attention_fn(strategy="a2a")


def test_a_strategy_per_layer_kind_is_checked_and_kept_hashable():
  from cpjax.attention.cp_context import parse_strategy

  cp = cpjax.CPContext(cpjax.ShardLayout(8, 8, 2), strategy="full_attention=all_gather")
  assert cp.strategy == (("full_attention", "all_gather"),) and hash(cp)
  assert cp.attention_options("full_attention")["strategy"] == "all_gather"
  assert cp.attention_options("sliding_attention")["strategy"] == "ring"
  with pytest.raises(ValueError, match=r"strategy\['full'\] must be one of .*, got 'a2a'"):
    parse_strategy({"full": "a2a"})
  with pytest.raises(ValueError, match=r"\(kind=name,\.\.\.\), got 'full=ring=x'"):
    parse_strategy("full=ring=x")
  with pytest.raises(TypeError, match="got 3"):
    parse_strategy(3)
  with pytest.raises(ValueError, match="which this model lacks: its layer kinds are"):
    cp.check_layer_kinds(("sliding_attention",))
  with pytest.raises(ValueError, match="names no layer kind: give one strategy"):
    cp.attention_options()
  for bad, error, message in (
    ("full=ring,full=all_gather", ValueError, "names layer kind 'full' twice"),
    ({1: "ring"}, ValueError, "layer kinds must be non-empty names, got 1"),
    ({"": "ring"}, ValueError, "non-empty names, got ''"),
    (("ring",), TypeError, "got \\('ring',\\)"),
  ):
    with pytest.raises(error, match=message):
      parse_strategy(bad)


def test_all_gather_checks_its_key_tiles_against_the_whole_row():
  """Mosaic takes a key block that is not a multiple of 128 only as the whole
  key array: one rank's row is that for the ring, not for the gathered row."""
  from tests.test_ring_attention import _call

  lay = cpjax.ShardLayout(128, 128, 2, "contiguous")
  x = jax.ShapeDtypeStruct((1, 128, 2, 128), jnp.float32)
  _call(x, x, x, lay=lay, mesh_cp=2, implementation="pallas_tpu")
  with pytest.raises(ValueError, match="block_kv = 64 must be a multiple of 128"):
    _call(x, x, x, lay=lay, mesh_cp=2, implementation="pallas_tpu", strategy="all_gather")
