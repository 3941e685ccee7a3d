"""The "document_balanced" layout: serpentine stripes, whole documents reordered
per row on the host, and everything that cuts or restores a row reading that
order. References: hand-dealt stripes, numpy re-derivations, the dense
float32 attention on the original row, and a brute-force hop count."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import cpjax
from cpjax.batch import balance
from tests import attention_harness as H
from tests.helpers import cp_mesh
from tests.test_ring_attention import check

KIND = "document_balanced"


def dealt(n_stripes: int, cp: int) -> list[int]:
  """The owner of each stripe, dealt like cards: 0..cp-1, then cp-1..0, ..."""
  owners, forward = [], True
  while len(owners) < n_stripes:
    owners += list(range(cp)) if forward else list(reversed(range(cp)))
    forward = not forward
  return owners


def packed_ids(rng, b: int, s: int, *, pad: int = 0, median: float = 8.0) -> np.ndarray:
  """int32[b, s]: log-normal document lengths packed until the row is full, then
  ``pad`` tokens of id-0 padding."""
  rows = []
  for _ in range(b):
    lengths = []
    while sum(lengths) < s - pad:
      lengths.append(max(1, int(rng.lognormal(np.log(median), 1.0))))
    lengths[-1] -= sum(lengths) - (s - pad)
    row = np.repeat(np.arange(1, len(lengths) + 1), lengths)
    rows.append(np.pad(row, (0, pad)))
  return np.asarray(rows, np.int32)


# ------------------------------------------------------------------ layout
@given(
  cp=st.sampled_from([1, 2, 3, 4, 8]),
  stripes=st.sampled_from([2, 4, 6]),
  stripe_len=st.integers(1, 3),
)
def test_stripes_are_dealt_in_a_serpentine(cp, stripes, stripe_len):
  s = cp * stripes * stripe_len
  lay = cpjax.ShardLayout(s, s, cp, KIND, stripes=stripes)
  owners = dealt(cp * stripes, cp)
  for r in range(cp):
    want = [t for t in range(s) if owners[t // stripe_len] == r]
    assert np.asarray(cpjax.local_token_indices(lay, r)).tolist() == want
  with jax.ensure_compile_time_eval():
    traced = jax.jit(lambda r: cpjax.local_token_indices(lay, r))
  chex.assert_trees_all_equal(traced(jnp.int32(cp - 1)), cpjax.local_token_indices(lay, cp - 1))


def test_two_stripes_are_the_head_tail_split():
  for cp in (1, 2, 8):
    a = cpjax.ShardLayout(64, 64, cp, KIND, stripes=2)
    np.testing.assert_array_equal(
      cpjax.rank_order(a), cpjax.rank_order(cpjax.ShardLayout(64, 64, cp, "load_balanced"))
    )


def test_default_stripes_and_padding():
  """Stripes of >= 1024 tokens, at most 16 per rank; padding never costs one."""
  assert cpjax.batch.layout.default_stripes(131072, 8) == 16
  assert cpjax.batch.layout.default_stripes(32768, 8) == 4
  assert (
    cpjax.batch.layout.default_stripes(16383, 8) == 2
    and cpjax.batch.layout.default_stripes(64, 2) == 2
  )
  assert cpjax.padded_length(131071, 8, kind=KIND) == 131152  # 14 stripes of 1171
  assert cpjax.ShardLayout(131071, 131152, 8, KIND).stripes == 14
  assert cpjax.padded_length(30, 4, kind=KIND) == 32  # 2 stripes: as load_balanced
  lay = cpjax.ShardLayout(32768, 32768, 8, KIND)
  assert (lay.stripes, lay.chunk_len) == (4, 1024)


def test_window_of_a_stripe_keeps_the_one_hop_ring():
  """A window of 1024 at S = 32768, cp = 8: one hop each way, as load_balanced."""
  lay = cpjax.ShardLayout(32768, 32768, 8, KIND)
  lb = cpjax.ShardLayout(32768, 32768, 8, "load_balanced")
  assert cpjax.ring_plan(lay, sliding_window=1024) == cpjax.ring_plan(lb, sliding_window=1024)
  assert cpjax.ring_plan(lay, sliding_window=1024) == cpjax.RingPlan(1, 1)
  assert cpjax.ring_plan(lay, sliding_window=1026) == cpjax.RingPlan(2, 2)


def test_min_stripe_len_sets_the_stripes_shard_batch_deals():
  """Shorter stripes for a model without windows; Gemma 4's sharder keeps
  its window's one-hop ring (a stripe is at least a window long)."""
  from cpjax.models import gemma4

  s, cp = 512, 4
  ids = np.repeat(np.arange(1, 9), 64)[None].astype(np.int32)
  batch = {"input_ids": ids, "labels": ids, "_packed_seq_ids": ids}
  mesh = cp_mesh(cp)
  for min_len, stripes in ((1024, 2), (32, 4), (16, 8), (1, 16)):
    assert cpjax.shard_batch(batch, mesh, layout=KIND, min_stripe_len=min_len)[1].stripes == stripes
  # A Pallas implementation's tile is a floor: GPU chunks hold multiples of 16 tokens.
  lay = cpjax.shard_batch(batch, mesh, layout=KIND, min_stripe_len=1, implementation="pallas_gpu")[
    1
  ]
  assert (lay.stripes, lay.padded_seq_len) == (8, s)
  cfg = gemma4.Gemma4Config.preset("tiny")  # window 8, sliding and full layers
  model = gemma4.Gemma4(cfg, rngs=nnx.Rngs(0))
  sharder = model.prepare_model_inputs_for_cp(layout=KIND)["cp_sharder"]
  ids = np.repeat(np.arange(1, 9), [100, 20, 60, 8, 30, 200, 40, 54])[None].astype(np.int32)
  out, lay = sharder.shard_batch(
    gemma4.prepare_batch({"input_ids": ids, "labels": ids, "_packed_seq_ids": ids}, cfg), mesh
  )
  window = cfg.text.effective_sliding_window
  assert lay.chunk_len >= window and lay.stripes == cpjax.default_stripes(
    s, cp, min_stripe_len=window
  )
  assert cpjax.ring_plan(lay, sliding_window=window) == cpjax.RingPlan(1, 1)
  # ... and it balances the work of its own layers, sliding and full (on this
  # row that order differs from the causal-only one).
  layers = [window if t == "sliding_attention" else None for t in cfg.text.layer_types]
  src = balance.balance_documents(ids, lay, layer_windows=layers)
  np.testing.assert_array_equal(np.asarray(out["_source_index"]), src[:, cpjax.rank_order(lay)])
  assert (src != balance.balance_documents(ids, lay)).any()


@given(
  cp=st.sampled_from([2, 4, 8]),
  stripes=st.sampled_from([2, 4]),
  window=st.integers(1, 40),
  seed=st.integers(0, 10_000),
)
def test_ring_plan_bounds_the_hops_that_reach_allowed_keys(cp, stripes, window, seed):
  """Brute force on the reordered row: every rank pair holding an allowed
  (query, key) pair is within the plan's hops."""
  s = cp * stripes * 8
  lay = cpjax.ShardLayout(s, s, cp, KIND, stripes=stripes)
  ids = packed_ids(np.random.default_rng(seed), 1, s, pad=3)
  slots = balance.balance_documents(ids, lay)[0]  # slot -> row index
  docs = ids[0, slots]  # document ids in slot order
  owner = np.argsort(cpjax.rank_order(lay)) // lay.local_seq_len
  t = np.arange(s)
  allowed = (
    (docs[:, None] == docs[None, :])
    & (docs[:, None] > 0)
    & (t[None, :] <= t[:, None])
    & (t[:, None] - t[None, :] < window)
  )
  qs, ks = np.nonzero(allowed)
  behind = (owner[qs] - owner[ks]) % cp  # the key came this many hops forward
  plan = cpjax.ring_plan(lay, sliding_window=window)
  reached = set(behind.tolist())
  allowed_hops = {h for h in range(plan.forward_hops + 1)} | {
    (cp - h) % cp for h in range(plan.backward_hops + 1)
  }
  assert reached <= allowed_hops, (reached, plan)


# ------------------------------------------------------------------ balance
@given(
  cp=st.sampled_from([1, 2, 4, 8]),
  b=st.integers(1, 3),
  pad=st.integers(0, 40),
  seed=st.integers(0, 10_000),
)
def test_orders_move_whole_documents(cp, b, pad, seed):
  """Each row's order is a permutation; each document's tokens stay consecutive
  and in their original order."""
  s = cp * 32
  ids = packed_ids(np.random.default_rng(seed), b, s, pad=pad)
  src = balance.balance_documents(ids, cpjax.ShardLayout(s, s, cp, KIND))
  assert src.dtype == np.int32 and src.shape == ids.shape
  for row, order in zip(ids, src):
    np.testing.assert_array_equal(np.sort(order), np.arange(s))
    moved = row[order]
    same_run = moved[1:] == moved[:-1]
    np.testing.assert_array_equal(np.diff(order)[same_run & (moved[1:] > 0)], 1)
    # A document appears as one run in the new order.
    starts = moved[np.r_[True, ~same_run]]
    assert len(set(starts[starts > 0].tolist())) == int((starts > 0).sum())


@given(
  cp=st.sampled_from([2, 4]),
  stripes=st.sampled_from([2, 4]),
  seed=st.integers(0, 10_000),
  layer_windows=st.sampled_from([None, [3], [5, 5, None, 9]]),
)
def test_search_scores_equal_the_work_of_the_reordered_row(cp, stripes, seed, layer_windows):
  """The search's closed-form score (work at the stripe boundaries) equals
  the busiest rank's work summed token by token on the reordered row, for
  causal and windowed layers."""
  s = cp * stripes * 16
  lay = cpjax.ShardLayout(s, s, cp, KIND, stripes=stripes)
  rng = np.random.default_rng(seed)
  ids = packed_ids(rng, 1, s, pad=5)
  starts, lengths = balance._runs(ids[0])
  real = ids[0][starts] != 0
  owner = np.empty(s, np.int64)
  owner[cpjax.rank_order(lay)] = np.arange(s) // lay.local_seq_len
  orders = np.stack([rng.permutation(len(starts)) for _ in range(4)])
  got = balance._scores(
    orders, lengths, real, owner[:: lay.chunk_len], lay, balance._windows(layer_windows)
  )
  for order, score in zip(orders, got):
    src = np.concatenate([np.arange(starts[i], starts[i] + lengths[i]) for i in order])
    work = balance.token_work(ids, layer_windows)[0, src]  # slot order
    assert score == np.bincount(owner, weights=work, minlength=cp).max()


def test_repeated_document_id_keeps_the_row_as_it_is():
  ids = np.array([[1, 1, 2, 2, 1, 1, 3, 3]], np.int32)  # id 1 in two runs
  src = balance.balance_documents(ids, cpjax.ShardLayout(8, 8, 2, KIND))
  np.testing.assert_array_equal(src, np.arange(8)[None])


def test_same_rows_give_the_same_order():
  ids = packed_ids(np.random.default_rng(3), 2, 256)
  lay = cpjax.ShardLayout(256, 256, 4, KIND)
  np.testing.assert_array_equal(
    balance.balance_documents(ids, lay), balance.balance_documents(ids, lay)
  )


@pytest.mark.parametrize(
  "median, sigma, first", [(4096, 1.0, 0), (16384, 1.0, 0), (2048, 0.8, 65536)]
)
def test_packed_rows_balance_within_ten_percent(median, sigma, first):
  """The issue's rows (S = 131072, cp = 8), measured through shard_batch's
  rank-order output: the busiest rank's work over the mean."""
  s, cp = 131072, 8
  rng = np.random.default_rng(0)
  lengths = [first] if first else []
  while sum(lengths) < s:
    lengths.append(max(1, int(rng.lognormal(np.log(median), sigma))))
  lengths[-1] -= sum(lengths) - s
  ids = np.repeat(np.arange(1, len(lengths) + 1), lengths)[None].astype(np.int32)
  mesh = cp_mesh(cp)
  batch = {"input_ids": np.zeros_like(ids), "labels": np.zeros_like(ids), "_packed_seq_ids": ids}
  ratio = {}
  for kind in ("load_balanced", KIND):
    out, lay = cpjax.shard_batch(batch, mesh, layout=kind)
    work = balance.rank_work(
      balance.token_work(ids)[:, out.get("_source_index", cpjax.rank_order(lay)[None])[0]], lay
    )
    ratio[kind] = float(work.max() / work.mean())
  assert ratio[KIND] <= 1.10 and ratio[KIND] < ratio["load_balanced"], ratio


# ------------------------------------------------------------------ sharding
@given(
  cp=st.sampled_from([1, 2, 4]),
  b=st.sampled_from([2, 4]),
  s=st.integers(9, 70),
  pad=st.integers(0, 8),
  aux_only=st.booleans(),
  mrope=st.booleans(),
  dp=st.booleans(),
  seed=st.integers(0, 10_000),
)
def test_shard_then_unshard_is_bit_exact(cp, b, s, pad, aux_only, mrope, dp, seed):
  rng = np.random.default_rng(seed)
  ids = packed_ids(rng, b, s, pad=min(pad, s - 1), median=4)
  batch = {
    "input_ids": rng.integers(0, 100, (b, s)).astype(np.int32),
    "labels": rng.integers(-100, 100, (b, s)).astype(np.int32),
    "_packed_seq_ids": ids,
    "padding_mask": ids == 0,
    "inputs_embeds": rng.standard_normal((b, s, 3)).astype(np.float32),
    "position_ids": (
      rng.integers(0, s, (3, b, s)) if mrope else np.tile(np.arange(s), (b, 1))
    ).astype(np.int32),
  }
  batch.pop("input_ids" if rng.random() < 0.5 else "inputs_embeds")
  mesh = cp_mesh(cp, ("dp", 2)) if dp else cp_mesh(cp)
  out, lay = cpjax.shard_batch(
    batch, mesh, layout=KIND, aux_only=aux_only, batch_axis="dp" if dp else None
  )
  src = np.asarray(out["_source_index"])
  # Independent: every sharded stream in rank order is the padded row taken at src.
  padded = np.pad(ids, ((0, 0), (0, lay.pad_len)))
  own = np.take_along_axis(padded, src, 1)
  np.testing.assert_array_equal(np.asarray(out["_source_packed_seq_ids"]), own)
  # The ring's ids: the same documents (equal where the own ids are equal,
  # 0 exactly at padding), numbered 1, 2, ... in the order the row now has.
  ring = np.asarray(out["_packed_seq_ids"])
  for r, o in zip(ring, own):
    np.testing.assert_array_equal(r[:, None] == r[None], o[:, None] == o[None])
    np.testing.assert_array_equal(r == 0, o == 0)
    slots = r[np.argsort(cpjax.rank_order(lay))]
    firsts = slots[np.sort(np.unique(slots, return_index=True)[1])]
    np.testing.assert_array_equal(firsts[firsts > 0], np.arange(1, (firsts > 0).sum() + 1))
  back = cpjax.unshard_batch(out, lay)
  assert "_source_index" not in back and "_source_packed_seq_ids" not in back
  chex.assert_trees_all_equal(
    {k: np.asarray(back[k]) for k in batch},
    {k: np.asarray(cpjax.normalize_batch(batch)[k]) for k in batch},
  )


def test_shard_sequence_takes_the_rows_source_positions():
  """Inside shard_map, shard_sequence with this rank's _source_index equals
  the sharded stream, and its gradient is each row's owned indicator."""
  rng = np.random.default_rng(0)
  mesh = cp_mesh(4)
  ids = packed_ids(rng, 2, 61, pad=5)
  x = rng.standard_normal((2, 61, 3)).astype(np.float32)
  batch = {"inputs_embeds": x, "labels": np.zeros((2, 61), np.int32), "_packed_seq_ids": ids}
  out, lay = cpjax.shard_batch(batch, mesh, layout=KIND)
  cut = jax.shard_map(
    lambda x, src: cpjax.shard_sequence(x, lay, source_index=src),
    mesh=mesh,
    in_specs=(P(), P(None, "cp")),
    out_specs=P(None, "cp"),
  )
  with jax.set_mesh(mesh):
    got = cut(x, out["_source_index"])
    chex.assert_trees_all_equal(np.asarray(got), np.asarray(out["inputs_embeds"]))
    grad = jax.grad(lambda x: jnp.sum(cut(x, out["_source_index"])))(x)
  np.testing.assert_array_equal(np.asarray(grad), np.ones_like(x))  # every real token once


# ------------------------------------------------------------------ attention
@given(
  cp=st.sampled_from([2, 4, 8]),
  causal=st.booleans(),
  window=st.sampled_from([None, 1, 4, 11, 40]),
  pad_from=st.sampled_from([None, 45, 20]),
  vision=st.booleans(),
  gqa=st.sampled_from([1, 2]),
  stripes=st.sampled_from([2, 4]),
  seed=st.integers(0, 1000),
)
def test_ring_equals_dense_on_the_original_row(
  cp, causal, window, pad_from, vision, gqa, stripes, seed
):
  """Values and gradients of the ring on reordered rows equal the dense
  reference on the rows as packed (the harness reorders each row with
  balance_documents and restores it)."""
  rng = np.random.default_rng(seed)
  inputs = H.make_inputs(rng, hq=2 * gqa, hkv=2)
  meta = H.packed_metadata(rng, 2, 64, pad_from=pad_from, vision=vision, n_docs=4)
  check(*inputs, cp=cp, kind=KIND, meta=meta, causal=causal, sliding_window=window, stripes=stripes)


def test_context_parallel_attention_through_rank_order_helpers():
  rng = np.random.default_rng(1)
  mesh = cp_mesh(4)
  ids = packed_ids(rng, 2, 128, pad=7)
  batch = {"input_ids": np.zeros_like(ids), "labels": np.zeros_like(ids), "_packed_seq_ids": ids}
  out, lay = cpjax.shard_batch(batch, mesh, layout=KIND)
  src = out["_source_index"]
  q, k, v = (rng.standard_normal((2, 128, 2, 8)).astype(np.float32) for _ in range(3))
  to = lambda x: cpjax.to_rank_order(x, lay, source_index=src)  # noqa: E731
  got = cpjax.context_parallel_attention(
    to(q),
    to(k),
    to(v),
    mesh=mesh,
    layout=lay,
    document_ids=out["_packed_seq_ids"],
    sliding_window=9,
  )
  got = cpjax.from_rank_order(got, lay, source_index=src)
  want = cpjax.reference_attention(q, k, v, document_ids=ids, sliding_window=9)
  chex.assert_trees_all_close(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ bad input
def test_what_the_reorder_needs_is_checked():
  lay = cpjax.ShardLayout(8, 8, 2, KIND)
  mesh = cp_mesh(2)
  batch = {
    "input_ids": np.zeros((2, 8), np.int32),
    "labels": np.zeros((2, 8), np.int32),
    "_packed_seq_ids": np.array([[1] * 6 + [2] * 2, [1] * 2 + [2] * 6], np.int32),
  }
  with pytest.raises(ValueError, match="needs an even number of stripes per rank"):
    cpjax.ShardLayout(12, 12, 2, KIND, stripes=3)
  with pytest.raises(ValueError, match="a 'load_balanced' layout has stripes=2, got 4"):
    cpjax.ShardLayout(16, 16, 2, "load_balanced", stripes=4)
  with pytest.raises(KeyError, match="must carry the '_source_index' stream"):
    cpjax.unshard_batch({"labels": np.zeros((1, 8))}, lay)
  sharded = cpjax.shard_batch(batch, mesh, layout=KIND)[0]
  sharded.pop("_source_packed_seq_ids")
  with pytest.raises(KeyError, match="must carry the '_source_packed_seq_ids' stream"):
    cpjax.unshard_batch(sharded, lay)
  with pytest.raises(ValueError, match="min_stripe_len must be >= 1, got 0"):
    cpjax.shard_batch(batch, mesh, layout=KIND, min_stripe_len=0)
  with pytest.raises(ValueError, match=r"layer_windows\[1\] must be >= 1, got 0"):
    cpjax.shard_batch(batch, mesh, layout=KIND, layer_windows=[512, 0])
  with pytest.raises(TypeError, match="layer_windows must be a sequence of ints >= 1 or None"):
    cpjax.shard_batch(batch, mesh, layout=KIND, layer_windows=512)
  with pytest.raises(ValueError, match=r"layer_windows must name at least one attention layer"):
    cpjax.balance_documents(batch["_packed_seq_ids"], lay, layer_windows=[])
  with pytest.raises(ValueError, match=r"pass source_index=batch\['_source_index'\]"):
    cpjax.to_rank_order(np.zeros((1, 8)), lay)
  with pytest.raises(ValueError, match=r"source_index must be \[B, 8\]"):
    cpjax.from_rank_order(np.zeros((1, 8)), lay, source_index=np.zeros((2, 8), np.int32))
  with pytest.raises(ValueError, match=r"pass source_index=batch\['_source_index'\]"):
    jax.shard_map(
      lambda x: cpjax.shard_sequence(x, lay), mesh=mesh, in_specs=P(), out_specs=P(None, "cp")
    )(np.zeros((1, 8)))
  with pytest.raises(ValueError, match=r"source_index must be \[B, 4\] .* before seq_axis=1\)"):
    jax.shard_map(
      lambda x, i: cpjax.shard_sequence(x, lay, source_index=i),
      mesh=mesh,
      in_specs=(P(), P()),
      out_specs=P(None, "cp"),
    )(np.zeros((1, 8)), np.zeros((1, 8), np.int32))  # the whole row's, not this rank's 4
  with pytest.raises(TypeError, match="call shard_batch outside jit"):
    jax.jit(lambda b: cpjax.shard_batch(b, mesh, layout=KIND)[0])(batch)
  extra = {**batch, "shared": np.arange(8)[None].repeat(3, 0)}
  with pytest.raises(ValueError, match=r"\['shared'\] have no batch dimension"):
    cpjax.shard_batch(extra, mesh, layout=KIND, extra_seq_keys={"shared": 1})
