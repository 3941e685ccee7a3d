"""ring_attention against the dense float32 reference: values and gradients."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import cpjax
from tests import attention_harness as H
from tests.helpers import cp_mesh

KINDS = ("contiguous", "load_balanced")
# float32: the ring and the oracle differ only by summation order.
F32 = dict(rtol=1e-5, atol=1e-5)
# bfloat16: inputs are rounded to bf16 for both; the ring feeds bf16 tiles to
# its matmuls (accumulating in f32) and rounds its output to bf16 (2^-8).
BF16 = dict(rtol=2e-2, atol=2e-2)


def check(q, k, v, w, *, cp, kind, meta=None, tol=F32, **kw):
  out, grads = H.ring(q, k, v, w, cp=cp, kind=kind, meta=meta, **kw)
  for ring_only in (
    "block_q",
    "block_kv",
    "mesh",
    "batch_axis",
    "stripes",
    "strategy",
    "implementation",
    "interpret",
  ):
    kw.pop(ring_only, None)
  ref_out, ref_grads = H.reference(q, k, v, w, meta=meta, **kw)
  chex.assert_tree_all_finite((out, grads))
  chex.assert_trees_all_close(out, ref_out, **tol)
  for name, got, want in zip("qkv", grads, ref_grads):
    chex.assert_trees_all_close(got, want, **tol, custom_message=f"d{name}")
  return out, grads


@pytest.fixture(scope="module")
def inputs():
  return H.make_inputs(np.random.default_rng(0))


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("causal", [True, False])
def test_packed_padded(inputs, cp, kind, causal):
  meta = H.packed_metadata(np.random.default_rng(cp), 2, 64, pad_from=53)
  check(*inputs, cp=cp, kind=kind, meta=meta, causal=causal)


@pytest.mark.parametrize("cp", [2, 8])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("window_vs_local", ["smaller", "equal", "larger"])
def test_sliding_window(inputs, cp, kind, window_vs_local):
  local = 64 // cp
  window = {"smaller": max(local // 2, 1) + 1, "equal": local, "larger": local + 5}[window_vs_local]
  meta = H.packed_metadata(np.random.default_rng(1), 2, 64, pad_from=60, n_docs=2)
  check(*inputs, cp=cp, kind=kind, meta=meta, causal=True, sliding_window=window)


@pytest.mark.parametrize(
  "cp, kind, window", [(8, "contiguous", 3), (8, "load_balanced", 6), (4, "load_balanced", 1)]
)
def test_bidirectional_window(inputs, cp, kind, window):
  check(*inputs, cp=cp, kind=kind, causal=False, sliding_window=window)


@pytest.mark.parametrize("cp", [2, 8])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("causal, window", [(True, 6), (False, None)])
def test_vision_groups_straddling_ranks(inputs, cp, kind, causal, window):
  rng = np.random.default_rng(2)
  meta = H.packed_metadata(rng, 2, 64, pad_from=58, vision=True, n_docs=2)
  # One image over tokens 12..37: it straddles a rank boundary in both layouts
  # (load-balanced cp=2 puts 16..47 on rank 1, so an image inside them would not).
  types = np.zeros((2, 64), np.int32)
  types[:, 12:38] = 1
  types[:, 3:5] = 2
  meta["vision_group_ids"] = np.asarray(cpjax.vision_group_ids(types))
  ranks = owner_ranks(cpjax.ShardLayout(64, 64, cp, kind))
  assert len(set(ranks[12:38])) >= 2, "the image must straddle ranks"
  check(*inputs, cp=cp, kind=kind, meta=meta, causal=causal, sliding_window=window)


@pytest.mark.parametrize("hq, hkv", [(4, 4), (4, 2), (8, 2)])
def test_gqa_ratios(hq, hkv):
  inputs = H.make_inputs(np.random.default_rng(3), hq=hq, hkv=hkv)
  check(*inputs, cp=4, kind="load_balanced", causal=True)


@pytest.mark.parametrize("kind", KINDS)
def test_soft_cap_and_scale(inputs, kind):
  q, k, v, w = inputs
  check(q * 3, k * 3, v, w, cp=4, kind=kind, logits_soft_cap=5.0, scale=0.7)


@pytest.mark.parametrize("kind", KINDS)
def test_small_tiles_skip_inside_a_step(inputs, kind):
  meta = H.packed_metadata(np.random.default_rng(4), 2, 64, pad_from=40, vision=True)
  check(*inputs, cp=2, kind=kind, meta=meta, sliding_window=7, block_q=4, block_kv=2)


@pytest.mark.parametrize("kind", KINDS)
def test_bfloat16(kind):
  inputs = H.make_inputs(np.random.default_rng(5), dtype=jnp.bfloat16)
  meta = H.packed_metadata(np.random.default_rng(5), 2, 64, pad_from=50)
  out, _ = check(*inputs, cp=4, kind=kind, meta=meta, tol=BF16)


def test_output_dtype_follows_q():
  inputs = H.make_inputs(np.random.default_rng(5), dtype=jnp.bfloat16, s=16)
  mesh = cp_mesh(2)
  lay = cpjax.ShardLayout(16, 16, 2)
  f = jax.shard_map(
    lambda q, k, v: cpjax.ring_attention(q, k, v, layout=lay),
    mesh=mesh,
    in_specs=P(None, "cp"),
    out_specs=P(None, "cp"),
  )
  spec = jax.NamedSharding(mesh, P(None, "cp"))
  out = jax.eval_shape(
    f, *(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=spec) for x in inputs[:3])
  )
  assert out.dtype == jnp.bfloat16 and out.shape == inputs[0].shape


def owner_ranks(lay):
  """int[S]: the rank holding each global (padded) token."""
  return np.argsort(cpjax.rank_order(lay)) // lay.local_seq_len


@pytest.mark.parametrize("kind", KINDS)
def test_fully_padded_ranks_are_finite_and_zero(inputs, kind):
  """Everything from token 22 on is padding: ranks 3-7 (contiguous) and 6-7
  (load-balanced, whose head chunk r must be padding too) hold nothing real."""
  q, k, v, w = inputs
  pad_from = 22
  lay = cpjax.ShardLayout(64, 64, 8, kind)
  padded = [r for r in range(8) if (owner_ranks(lay) == r)[:pad_from].sum() == 0]
  assert padded == {"contiguous": [3, 4, 5, 6, 7], "load_balanced": [6, 7]}[kind]
  meta = H.packed_metadata(np.random.default_rng(6), 2, 64, pad_from=pad_from)
  out, (dq, dk, dv) = check(q, k, v, w, cp=8, kind=kind, meta=meta)
  # Padded queries see nothing; padded keys are never attended to: exact zeros.
  for name, x in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
    chex.assert_trees_all_equal(
      x[:, pad_from:], np.zeros_like(x[:, pad_from:]), custom_message=name
    )


def test_everything_masked_is_zero_not_nan(inputs):
  q, k, v, w = inputs
  meta = {"document_ids": np.zeros((2, 64), np.int32)}
  out, grads = H.ring(q, k, v, w, cp=4, kind="load_balanced", meta=meta)
  chex.assert_trees_all_equal(
    (out, grads), (np.zeros_like(out), tuple(np.zeros_like(g) for g in grads))
  )


def test_dp_cp_mesh_and_batch_axis(inputs):
  mesh = cp_mesh(4, ("dp", 2))
  meta = H.packed_metadata(np.random.default_rng(7), 2, 64, pad_from=55)
  check(*inputs, cp=4, kind="load_balanced", meta=meta, mesh=mesh, batch_axis="dp")


@given(
  cp=st.sampled_from([2, 4, 8]),
  kind=st.sampled_from(KINDS),
  causal=st.booleans(),
  window=st.sampled_from([None, 1, 4, 11, 40]),
  docs=st.booleans(),
  pad_from=st.sampled_from([None, 45, 20]),
  vision=st.booleans(),
  cap=st.sampled_from([None, 3.0]),
  gqa=st.sampled_from([1, 2]),
  block_q=st.sampled_from([None, 2, 4]),
  block_kv=st.sampled_from([None, 1, 4]),
  seed=st.integers(0, 1000),
)
def test_random_combinations(
  cp, kind, causal, window, docs, pad_from, vision, cap, gqa, block_q, block_kv, seed
):
  """Every chunk here is >= 4 tokens, so drawn tiles split it into several
  tiles per chunk, with partial and skipped tiles inside one hop."""
  rng = np.random.default_rng(seed)
  inputs = H.make_inputs(rng, hq=2 * gqa, hkv=2)
  meta = H.packed_metadata(rng, 2, 64, pad_from=pad_from, vision=vision)
  if not docs:
    meta.pop("document_ids")
  if pad_from is None:
    meta.pop("padding_mask")
  check(
    *inputs,
    cp=cp,
    kind=kind,
    meta=meta,
    causal=causal,
    sliding_window=window,
    logits_soft_cap=cap,
    block_q=block_q,
    block_kv=block_kv,
  )


@pytest.mark.parametrize("kind", [pytest.param(KINDS[0], marks=pytest.mark.slow), KINDS[1]])
def test_mask_object_equals_keywords(inputs, kind):
  """The same mask given as an AttentionMask and as keywords: identical output."""
  meta = H.packed_metadata(np.random.default_rng(8), 2, 64, pad_from=50, vision=True)
  keywords, _ = H.ring(*inputs, cp=4, kind=kind, meta=meta, sliding_window=5, grads=False)
  lay = cpjax.ShardLayout(64, 64, 4, kind)
  order = cpjax.rank_order(lay)
  mesh = cp_mesh(4)
  spec = jax.NamedSharding(mesh, P(None, "cp"))
  mask = cpjax.AttentionMask.create(
    sliding_window=5, **{n: jax.device_put(x[:, order], spec) for n, x in meta.items()}
  )
  ring = jax.jit(  # (eager, shard_map runs op by op: 300 compiles)
    jax.shard_map(
      lambda q, k, v, m: cpjax.ring_attention(q, k, v, layout=lay, mask=m),
      mesh=mesh,
      in_specs=(P(None, "cp"),) * 3 + (P(None, "cp"),),
      out_specs=P(None, "cp"),
    )
  )
  out = ring(*(jax.device_put(x[:, order], spec) for x in inputs[:3]), mask)
  chex.assert_trees_all_equal(np.asarray(out)[:, np.argsort(order)], keywords)


# ------------------------------------------------------------------- the plan
def test_ring_plan_hops():
  lb = cpjax.ShardLayout(8192, 8192, 8, "load_balanced")  # chunk 512
  co = cpjax.ShardLayout(8192, 8192, 8, "contiguous")  # chunk 1024
  assert cpjax.ring_plan(co) == cpjax.RingPlan(7, 0)
  assert cpjax.ring_plan(lb) == cpjax.RingPlan(7, 0)
  assert cpjax.ring_plan(co, sliding_window=1) == cpjax.RingPlan(0, 0)
  assert cpjax.ring_plan(co, sliding_window=1025) == cpjax.RingPlan(1, 0)
  assert cpjax.ring_plan(co, sliding_window=1026) == cpjax.RingPlan(2, 0)
  assert cpjax.ring_plan(co, sliding_window=512, causal=False) == cpjax.RingPlan(1, 1)
  assert cpjax.ring_plan(lb, sliding_window=512) == cpjax.RingPlan(1, 1)
  assert cpjax.ring_plan(lb, sliding_window=1537) == cpjax.RingPlan(3, 3)
  assert cpjax.ring_plan(lb, sliding_window=1538) == cpjax.RingPlan(7, 0)  # 2*4 >= 7: whole ring
  assert cpjax.ring_plan(lb, sliding_window=512, has_vision_groups=True) == cpjax.RingPlan(7, 0)
  assert cpjax.ring_plan(cpjax.ShardLayout(64, 64, 1), sliding_window=4) == cpjax.RingPlan(0, 0)


def test_window_of_one_token_sends_nothing(inputs):
  """W=1 needs no other rank's keys: the compiled program has no ppermute."""
  q, k, v, _ = inputs
  mesh = cp_mesh(8)
  lay = cpjax.ShardLayout(64, 64, 8, "contiguous")
  spec = jax.NamedSharding(mesh, P(None, "cp"))

  def hlo(**kw):
    f = jax.shard_map(
      lambda q, k, v: cpjax.ring_attention(q, k, v, layout=lay, **kw),
      mesh=mesh,
      in_specs=P(None, "cp"),
      out_specs=P(None, "cp"),
    )
    return jax.jit(f).lower(*(jax.device_put(x, spec) for x in (q, k, v))).as_text()

  assert "collective_permute" in hlo(sliding_window=9)
  assert "collective_permute" not in hlo(sliding_window=1)


# -------------------------------------------------------------- bad input
def _call(q, k, v, lay=None, mesh_cp=2, **kw):
  lay = lay or cpjax.ShardLayout(16, 16, mesh_cp)
  mesh = cp_mesh(mesh_cp)
  f = jax.shard_map(
    lambda q, k, v: cpjax.ring_attention(q, k, v, layout=lay, **kw),
    mesh=mesh,
    in_specs=P(None, "cp"),
    out_specs=P(None, "cp"),
    check_vma=True,
  )
  spec = jax.NamedSharding(mesh, P(None, "cp"))
  return jax.eval_shape(
    f, *(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=spec) for x in (q, k, v))
  )


Q = jax.ShapeDtypeStruct((1, 16, 4, 8), jnp.float32)
KV = jax.ShapeDtypeStruct((1, 16, 2, 8), jnp.float32)


@pytest.mark.parametrize(
  "args, kw, err, match",
  [
    ((jax.ShapeDtypeStruct((16, 4, 8), jnp.float32), KV, KV), {}, ValueError, "q must be 4-D"),
    (
      (Q, KV, jax.ShapeDtypeStruct((1, 16, 2, 4), jnp.float32)),
      {},
      ValueError,
      "k and v must have the same shape",
    ),
    (
      (
        Q,
        jax.ShapeDtypeStruct((1, 16, 3, 8), jnp.float32),
        jax.ShapeDtypeStruct((1, 16, 3, 8), jnp.float32),
      ),
      {},
      ValueError,
      r"query heads \(4\) must be a multiple of key/value heads \(3\)",
    ),
    (
      (
        Q,
        jax.ShapeDtypeStruct((1, 16, 2, 4), jnp.float32),
        jax.ShapeDtypeStruct((1, 16, 2, 4), jnp.float32),
      ),
      {},
      ValueError,
      "k/v must have shape",
    ),
    ((Q, KV, KV), {"sliding_window": 0}, ValueError, "sliding_window must be an int >= 1"),
    (
      (Q, KV, KV),
      {"document_ids": np.zeros((1, 6), np.int32)},
      ValueError,
      r"mask array document_ids must have shape \[B, L\] \(q's first two dimensions\) = "
      r"\[1, 8\], got \[1, 6\]",
    ),
    (
      (Q, KV, KV),
      {"mask": cpjax.AttentionMask.create(), "sliding_window": 4},
      ValueError,
      r"pass either mask= or the mask keywords, not both; got mask and \['sliding_window'\]",
    ),
    (
      (Q, KV, KV),
      {"lay": cpjax.ShardLayout(16, 16, 4)},
      ValueError,
      r"layout.cp_size \(4\) must equal the size of mesh axis 'cp' \(2\)",
    ),
    (
      (Q, KV, KV),
      {"lay": cpjax.ShardLayout(32, 32, 2)},
      ValueError,
      "q must hold layout.local_seq_len = 16 tokens",
    ),
    (
      (Q, KV, KV),
      {"block_q": 3},
      ValueError,
      r"block_q must be a positive divisor of layout.chunk_len \(8\)",
    ),
    ((Q, KV, KV), {"logits_soft_cap": 0.0}, ValueError, "logits_soft_cap must be > 0"),
  ],
)
def test_bad_input(args, kw, err, match):
  with pytest.raises(err, match=match):
    _call(*args, **kw)


def test_bad_metadata_dtypes():
  with pytest.raises(
    TypeError, match="mask array document_ids must have an integer dtype, got float32"
  ):
    _call(Q, KV, KV, document_ids=np.zeros((1, 8), np.float32))
  with pytest.raises(
    TypeError, match=r"mask array padding_mask must be bool \(True = pad\), got int32"
  ):
    _call(Q, KV, KV, padding_mask=np.zeros((1, 8), np.int32))


def test_outside_shard_map_needs_cp_one():
  x = jnp.ones((1, 8, 2, 4))
  out = cpjax.ring_attention(x, x, x, layout=cpjax.ShardLayout(8, 8, 1))
  chex.assert_trees_all_close(out, cpjax.reference_attention(x, x, x), rtol=1e-6)
  with pytest.raises(ValueError, match="must run inside shard_map over a mesh axis 'cp'"):
    cpjax.ring_attention(x, x, x, layout=cpjax.ShardLayout(16, 16, 2))
