"""context_parallel_attention on global rank-ordered arrays against the dense reference."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpjax
from tests import attention_harness as H
from tests.helpers import cp_mesh

KINDS = ("contiguous", "load_balanced")
F32 = dict(rtol=1e-5, atol=1e-5)


def run(q, k, v, w, *, mesh, lay, mask_fn, batch_axis=None, head_axis=None, **kw):
  """Global natural-order inputs in, (out, grads) in natural order out: the
  user's view. ``mask_fn(to_rank)`` builds the mask from rank-ordered arrays."""
  to = lambda x: cpjax.to_rank_order(x, lay)  # noqa: E731
  back = lambda x: np.asarray(cpjax.from_rank_order(x, lay))  # noqa: E731
  mask = mask_fn(to)

  def f(q, k, v):
    return cpjax.context_parallel_attention(
      q, k, v, mesh=mesh, layout=lay, batch_axis=batch_axis, head_axis=head_axis, **mask, **kw
    )

  @jax.jit
  def value_and_grads(q, k, v, w):
    out = f(q, k, v)
    grads = jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2))(q, k, v)
    return out, grads

  out, grads = value_and_grads(to(q), to(k), to(v), to(w))
  return back(out), tuple(back(g) for g in grads)


def check(got, want):
  chex.assert_tree_all_finite(got)
  chex.assert_trees_all_close(got[0], want[0], **F32)
  for name, a, b in zip("qkv", got[1], want[1]):
    chex.assert_trees_all_close(a, b, **F32, custom_message=f"d{name}")


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", KINDS)
def test_keywords_equal_reference(cp, kind):
  inputs = H.make_inputs(np.random.default_rng(cp), s=64)
  meta = H.packed_metadata(np.random.default_rng(cp), 2, 64, pad_from=50, vision=True)
  lay = cpjax.ShardLayout(64, 64, cp, kind)
  got = run(
    *inputs,
    mesh=cp_mesh(cp),
    lay=lay,
    sliding_window=9,
    mask_fn=lambda to: {name: to(x) for name, x in meta.items()},
  )
  check(got, H.reference(*inputs, meta=meta, sliding_window=9))


@pytest.mark.parametrize("kind", KINDS)
def test_mask_object_with_a_custom_rule(kind):
  """Gemma 4's vision rule, built from rules, through the ring vs the dense reference
  given the same mask object in natural order."""
  inputs = H.make_inputs(np.random.default_rng(3), s=64)
  meta = H.packed_metadata(np.random.default_rng(3), 2, 64, pad_from=60, vision=True)
  rule = (
    cpjax.LocalWindow(5, None)
    & (cpjax.LocalWindow(None, 0) | cpjax.SameVisionGroup())
    & cpjax.SameDocument()
  )
  arrays = {n: meta[n] for n in ("document_ids", "vision_group_ids")}
  lay = cpjax.ShardLayout(64, 64, 4, kind)
  got = run(
    *inputs,
    mesh=cp_mesh(4),
    lay=lay,
    mask_fn=lambda to: {"mask": cpjax.AttentionMask(rule, {n: to(x) for n, x in arrays.items()})},
  )
  check(got, H.reference(*inputs, mask=cpjax.AttentionMask(rule, arrays)))


def test_batch_and_head_axes():
  """(dp, cp, tp) = (2, 2, 2): batch and heads sharded too, padding in the tail."""
  mesh = jax.make_mesh((2, 2, 2), ("dp", "cp", "tp"))
  q, k, v, w = H.make_inputs(np.random.default_rng(4), s=60, hq=4, hkv=2)
  lay = cpjax.ShardLayout(
    60, cpjax.padded_length(60, 2, kind="load_balanced", pad_multiple=8), 2, "load_balanced"
  )
  meta = H.packed_metadata(np.random.default_rng(4), 2, 60, pad_from=55)

  def mask_fn(to):
    return {
      "document_ids": to(meta["document_ids"]),
      "padding_mask": cpjax.to_rank_order(meta["padding_mask"], lay, pad_value=True),
    }

  out, grads = run(
    q, k, v, w, mesh=mesh, lay=lay, batch_axis="dp", head_axis="tp", mask_fn=mask_fn, causal=False
  )
  want = H.reference(q, k, v, w, meta=meta, causal=False)
  s = lay.original_seq_len
  check((out[:, :s], tuple(g[:, :s] for g in grads)), want)


def test_output_sharding_and_rank_order():
  """Rank r's shard of the output holds exactly the tokens local_token_indices(layout, r)
  names, and from_rank_order restores natural order (distinct random tokens, so any
  mix-up of ranks or chunks shows)."""
  mesh = cp_mesh(4)
  lay = cpjax.ShardLayout(32, 32, 4, "load_balanced")
  rng = np.random.default_rng(0)
  q, k, v = (rng.standard_normal((1, 32, 2, 8)).astype(np.float32) for _ in range(3))
  ref = np.asarray(cpjax.reference_attention(q, k, v))  # natural order, causal
  to = lambda x: cpjax.to_rank_order(x, lay)  # noqa: E731
  out = cpjax.context_parallel_attention(to(q), to(k), to(v), mesh=mesh, layout=lay)
  assert out.sharding.spec == jax.sharding.PartitionSpec(None, "cp", None)
  chex.assert_shape(out, (1, 32, 2, 8))
  np.testing.assert_allclose(np.asarray(cpjax.from_rank_order(out, lay)), ref, rtol=1e-5, atol=1e-5)
  # Each device's shard: the rank is the position of its device on the mesh's cp axis.
  rank_of = {d: r for r, d in enumerate(mesh.devices.reshape(-1))}
  local = lay.local_seq_len
  assert len(out.addressable_shards) == 4
  for shard in out.addressable_shards:
    r = rank_of[shard.device]
    assert shard.index[1] == slice(r * local, (r + 1) * local)
    np.testing.assert_allclose(
      np.asarray(shard.data),
      ref[:, np.asarray(cpjax.local_token_indices(lay, r))],
      rtol=1e-5,
      atol=1e-5,
      err_msg=f"rank {r}",
    )
  # The rank-ordered output is not the natural-order one (the check above can fail).
  assert not np.allclose(np.asarray(out), ref, atol=1e-3)


_COMPILES = []
jax.monitoring.register_event_duration_secs_listener(
  lambda event, _, **__: (
    _COMPILES.append(event) if event == "/jax/core/compile/backend_compile_duration" else None
  )
)


def test_an_eager_call_is_one_program_made_once():
  """Outside jit the attention runs as one jitted program, made once for its
  settings: not a shard_map run op by op (about 190 compiles for this call),
  and a second call with other values compiles nothing."""
  mesh = cp_mesh(4)
  lay = cpjax.ShardLayout(48, 48, 4, "contiguous")  # a length no other test uses
  rng = np.random.default_rng(3)
  x, y = (rng.standard_normal((1, 48, 2, 8)).astype(np.float32) for _ in range(2))
  docs = np.repeat([[1, 2]], 24, axis=1)
  call = lambda x: cpjax.context_parallel_attention(  # noqa: E731
    x, x, x, mesh=mesh, layout=lay, document_ids=docs, sliding_window=9
  )
  start = len(_COMPILES)
  first = call(x)
  assert len(_COMPILES) - start <= 8, len(_COMPILES) - start
  start = len(_COMPILES)
  second = call(y)
  assert len(_COMPILES) == start
  want = cpjax.reference_attention(y, y, y, document_ids=docs, sliding_window=9)
  np.testing.assert_allclose(np.asarray(second), np.asarray(want), **F32)
  assert not np.allclose(np.asarray(first), np.asarray(second))


@pytest.mark.parametrize("kind", KINDS)
def test_rank_order_helpers(kind):
  lay = cpjax.ShardLayout(13, cpjax.padded_length(13, 4, kind=kind), 4, kind)
  x = np.arange(3 * 2 * 13).reshape(3, 2, 13)
  ranked = cpjax.to_rank_order(x, lay, axis=-1, pad_value=-1)
  padded = np.pad(x, ((0, 0), (0, 0), (0, lay.pad_len)), constant_values=-1)
  np.testing.assert_array_equal(ranked, padded[..., cpjax.rank_order(lay)])
  np.testing.assert_array_equal(cpjax.from_rank_order(ranked, lay, axis=2), padded)
  # What rank r holds is the r-th block of the rank-ordered array.
  for r in range(4):
    block = np.asarray(ranked)[..., r * lay.local_seq_len : (r + 1) * lay.local_seq_len]
    np.testing.assert_array_equal(block, padded[..., np.asarray(cpjax.local_token_indices(lay, r))])
  # Differentiable: the gradient of a permutation is the inverse permutation.
  wts = np.arange(lay.padded_seq_len, dtype=np.float32)
  g = jax.grad(lambda y: jnp.sum(cpjax.to_rank_order(y, lay, axis=0) * wts))(jnp.ones(13))
  np.testing.assert_array_equal(g, wts[np.argsort(cpjax.rank_order(lay))][:13])


def test_rank_order_of_a_sharded_array():
  mesh = cp_mesh(4)
  lay = cpjax.ShardLayout(16, 16, 4, "load_balanced")
  x = jax.device_put(
    jnp.arange(32.0).reshape(2, 16), jax.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "cp"))
  )
  np.testing.assert_array_equal(cpjax.from_rank_order(cpjax.to_rank_order(x, lay), lay), x)


# ------------------------------------------------------------------ bad input
X = jnp.zeros((2, 16, 4, 8))


@pytest.mark.parametrize(
  "kwargs, err, match",
  [
    (
      {"layout": cpjax.ShardLayout(16, 16, 4)},
      ValueError,
      r"layout.cp_size \(4\) must equal the size of mesh axis 'cp' \(2\)",
    ),
    (
      {"layout": cpjax.ShardLayout(32, 32, 2)},
      ValueError,
      r"q must hold layout.padded_seq_len = 32 tokens on dim 1 .*got shape \(2, 16, 4, 8\)",
    ),
    (
      {"document_ids": np.zeros((2, 14), np.int32)},
      ValueError,
      r"mask array document_ids must have shape \[B, S\] .* = \[2, 16\], got \[2, 14\]",
    ),
    (
      {"padding_mask": np.zeros((2, 16), np.int32)},
      TypeError,
      r"mask array padding_mask must be bool \(True = pad\), got int32",
    ),
    (
      {"mask": cpjax.AttentionMask.create(), "causal": False},
      ValueError,
      r"pass either mask= or the mask keywords, not both; got mask and \['causal'\]",
    ),
    (
      {"mask": np.ones((2, 16, 16), bool)},
      TypeError,
      "mask must be a cpjax.AttentionMask, got ndarray",
    ),
    ({"axis_name": "sp"}, ValueError, r"axis_name='sp' is not an axis of the mesh"),
    ({"layout": "contiguous"}, TypeError, "layout must be a ShardLayout, got str"),
    ({"head_axis": "cp"}, ValueError, r"head_axis='cp' must differ from the other axes"),
    ({"windw": 3}, TypeError, r"unexpected mask keyword\(s\) \['windw'\]"),
  ],
)
def test_bad_input(kwargs, err, match):
  kwargs = {"mesh": cp_mesh(2), "layout": cpjax.ShardLayout(16, 16, 2), **kwargs}
  with pytest.raises(err, match=match):
    cpjax.context_parallel_attention(X, X, X, **kwargs)


def test_bad_axes_sizes():
  mesh = jax.make_mesh((4, 2), ("tp", "cp"))
  lay = cpjax.ShardLayout(16, 16, 2)
  with pytest.raises(
    ValueError,
    match=r"key/value heads \(2\) must be divisible by the size 4 "
    r"of head_axis='tp'",
  ):
    cpjax.context_parallel_attention(
      X, X[:, :, :2], X[:, :, :2], mesh=mesh, layout=lay, head_axis="tp"
    )
  with pytest.raises(
    ValueError,
    match=r"batch size 2 must be divisible by the size 4 of "
    r"batch_axis='tp'",
  ):
    cpjax.context_parallel_attention(X, X, X, mesh=mesh, layout=lay, batch_axis="tp")
  with pytest.raises(ValueError, match=r"x must have layout.padded_seq_len = 16 tokens on axis 1"):
    cpjax.from_rank_order(np.zeros((1, 12)), lay)
  with pytest.raises(ValueError, match=r"axis must be an int in \[-2, 2\) .* got 2"):
    cpjax.to_rank_order(np.zeros((1, 16)), lay, axis=2)


# ------------------------------------------------- a rule written by a user


@dataclasses.dataclass(frozen=True)
class PrefixLM(cpjax.MaskRule):
  """A user's rule, one class: tokens of the first ``prefix`` attend both ways."""

  prefix: int

  def allowed(self, q, k):
    return ((q.positions[:, None] < self.prefix) & (k.positions[None, :] < self.prefix))[None]

  def classify(self, q, k, block_q, block_kv):
    qb, kb = q.blocks(block_q), k.blocks(block_kv)
    some = (qb.min(-1)[:, None] < self.prefix) & (kb.min(-1)[None, :] < self.prefix)
    every = (qb.max(-1)[:, None] < self.prefix) & (kb.max(-1)[None, :] < self.prefix)
    return cpjax.masks.BlockMap(some[None], every[None])

  def reach(self):
    return cpjax.masks.Reach(self.prefix - 1, self.prefix - 1)


@pytest.mark.parametrize("kind", KINDS)
def test_a_rule_written_by_a_user(kind):
  """Prefix LM = causal | PrefixLM(p), through the ring, against a dense mask
  written out here."""
  s, p = 64, 21
  q, k, v, w = H.make_inputs(np.random.default_rng(9), s=s)
  rule = cpjax.LocalWindow(None, 0) | PrefixLM(p)
  i, j = np.arange(s)[:, None], np.arange(s)[None]
  dense = (j <= i) | ((i < p) & (j < p))
  np.testing.assert_array_equal(
    np.asarray(cpjax.AttentionMask(rule).allowed(np.arange(s)))[0], dense
  )
  lay = cpjax.ShardLayout(s, s, 8, kind)
  got = run(
    q,
    k,
    v,
    w,
    mesh=cp_mesh(8),
    lay=lay,
    block_q=2,
    block_kv=4,
    mask_fn=lambda to: {"mask": cpjax.AttentionMask(rule)},
  )
  # The rule's predicate equals the dense mask above; the reference applies it.
  check(got, H.reference(q, k, v, w, mask=cpjax.AttentionMask(rule)))


def test_grad_outside_jit_under_set_mesh_equals_jit():
  """As the README says: outside jit, an Explicit mesh goes in as context."""
  mesh = cp_mesh(4)
  lay = cpjax.ShardLayout(32, 32, 4, "load_balanced")
  rng = np.random.default_rng(1)
  q, k, v = (rng.standard_normal((1, 32, 2, 8)).astype(np.float32) for _ in range(3))
  to = lambda x: cpjax.to_rank_order(x, lay)  # noqa: E731
  f = lambda q: jnp.sum(
    cpjax.context_parallel_attention(
      to(q),
      to(k),
      to(v),
      mesh=mesh,  # noqa: E731
      layout=lay,
    )
    ** 2
  )
  with jax.set_mesh(mesh):
    eager = jax.grad(f)(q)
  chex.assert_trees_all_close(eager, jax.jit(jax.grad(f))(q), rtol=1e-6, atol=1e-6)
  ref = jax.grad(lambda q: jnp.sum(cpjax.reference_attention(q, k, v) ** 2))(q)
  chex.assert_trees_all_close(eager, ref, rtol=1e-4, atol=1e-5)
