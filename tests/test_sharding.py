"""shard_batch / unshard_batch / shard_sequence against a numpy re-derivation."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import cpjax
from cpjax.models import gemma4
from tests.helpers import cp_mesh

KINDS = ("contiguous", "load_balanced")


# ----------------------------------------------------------------- reference
def np_owned(padded: int, cp: int, kind: str, rank: int) -> np.ndarray:
  """Global indices rank ``rank`` holds, derived from chunk ownership."""
  n_chunks = cp * (2 if kind == "load_balanced" else 1)
  c = padded // n_chunks
  owner = {ch: ch if ch < cp else n_chunks - 1 - ch for ch in range(n_chunks)}
  if kind == "contiguous":
    owner = {ch: ch for ch in range(n_chunks)}
  return np.array(
    [t for ch in range(n_chunks) if owner[ch] == rank for t in range(ch * c, (ch + 1) * c)]
  )


def np_pad(x: np.ndarray, dim: int, total: int, value) -> np.ndarray:
  pad = total - x.shape[dim]
  if value == "count":
    last = np.take(x, [-1], axis=dim)
    shape = [1] * x.ndim
    shape[dim] = pad
    return np.concatenate([x, last + np.arange(1, pad + 1).reshape(shape)], axis=dim)
  widths = [(0, 0)] * x.ndim
  widths[dim] = (0, pad)
  return np.pad(x, widths, constant_values=value)


def np_shard(x, dim, padded, cp, kind, value):
  """The rank-ordered global array shard_batch must return, in numpy."""
  full = np_pad(np.asarray(x), dim, padded, value)
  return np.concatenate(
    [np.take(full, np_owned(padded, cp, kind, r), axis=dim) for r in range(cp)], axis=dim
  )


def make_batch(rng, b, s, *, packed=True, pad_tail=0, embeds=False, mrope=False, extra=False):
  """A packed, padded, multimodal batch (numpy, int32 ids)."""
  batch = {}
  if embeds:
    batch["inputs_embeds"] = rng.standard_normal((b, s, 3)).astype(np.float32)
  else:
    batch["input_ids"] = rng.integers(1, 1000, (b, s)).astype(np.int32)
  pad = np.zeros((b, s), bool)
  if pad_tail:
    pad[:, s - pad_tail :] = True
  batch["padding_mask"] = pad
  if packed:
    cuts = np.sort(rng.integers(1, s, (b, 2)), axis=1)
    docs = 1 + (np.arange(s)[None] >= cuts[:, :1]) + (np.arange(s)[None] >= cuts[:, 1:])
    batch["_packed_seq_ids"] = np.where(pad, 0, docs).astype(np.int32)
  batch["mm_token_type_ids"] = (rng.random((b, s)) < 0.3).astype(np.int32)
  batch["labels"] = rng.integers(0, 1000, (b, s)).astype(np.int32)
  batch["loss_mask"] = (~pad).astype(np.int32)
  pos = np.tile(np.arange(s, dtype=np.int32), (b, 1))
  batch["position_ids"] = np.stack([pos, pos + 1, pos + 2]) if mrope else pos
  if extra:
    batch["token_weights"] = rng.random((b, s)).astype(np.float32)
  return batch


# ----------------------------------------------------------- original's cases
def test_contiguous_six_to_eight():
  mesh = cp_mesh(2)
  batch = {
    "input_ids": np.arange(1, 7, dtype=np.int32)[None],
    "labels": np.arange(11, 17, dtype=np.int32)[None],
  }
  out, lay = cpjax.shard_batch(batch, mesh, layout="contiguous", padding_token_id=7)
  assert (lay.original_seq_len, lay.padded_seq_len, lay.local_seq_len) == (6, 8, 4)
  assert np.asarray(out["input_ids"]).tolist() == [[1, 2, 3, 4, 5, 6, 7, 7]]
  assert np.asarray(out["labels"]).tolist() == [[11, 12, 13, 14, 15, 16, -100, -100]]
  assert np.asarray(out["position_ids"]).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
  assert np.asarray(out["padding_mask"]).tolist() == [[False] * 6 + [True] * 2]
  assert out["labels"].sharding.spec == P(None, "cp")


def test_rank_one_holds_its_slice():
  """cp=2 over 3 tokens: rank 1 holds the last real token and one pad."""
  mesh = cp_mesh(2)
  batch = {
    "input_ids": np.array([[5, 6, 7]], np.int32),
    "labels": np.array([[6, 7, 99]], np.int32),
    "position_ids": np.array([[0, 1, 3]], np.int32),
  }
  out, lay = cpjax.shard_batch(batch, mesh, layout="contiguous")
  shards = {k: [np.asarray(s.data).tolist() for s in v.addressable_shards] for k, v in out.items()}
  assert shards["labels"][1] == [[99, -100]]
  assert shards["position_ids"][1] == [[3, 4]]
  assert shards["input_ids"][1] == [[7, 0]]


def test_mrope_positions_sharded_on_dim_two():
  mesh = cp_mesh(2)
  pos = np.stack([np.arange(6), np.arange(6) * 2, np.arange(6) + 10]).astype(np.int32)[:, None]
  batch = {
    "input_ids": np.zeros((1, 6), np.int32),
    "labels": np.zeros((1, 6), np.int32),
    "position_ids": pos,
  }
  out, lay = cpjax.shard_batch(batch, mesh, layout="load_balanced")
  chex.assert_shape(out["position_ids"], (3, 1, 8))
  assert out["position_ids"].sharding.spec == P(None, None, "cp")
  np.testing.assert_array_equal(
    out["position_ids"], np_shard(pos, 2, 8, 2, "load_balanced", "count")
  )
  # Rank 1 holds chunks 1 and 2: global tokens 2..5.
  assert np.asarray(out["position_ids"])[1, 0, 4:].tolist() == [4, 6, 8, 10]


def test_labels_from_loss_mask():
  mesh = cp_mesh(2)
  batch = {"input_ids": np.zeros((1, 4), np.int32)}
  out, _ = cpjax.shard_batch(
    batch, mesh, layout="contiguous", loss_mask=np.array([[1, 1, 0, 1]], np.int32)
  )
  assert np.asarray(out["labels"]).tolist() == [[1, 1, 0, 1]]
  assert "loss_mask" not in out
  with pytest.raises(KeyError, match="no 'labels'"):
    cpjax.shard_batch(batch, mesh)


def test_four_d_attention_mask():
  mesh = cp_mesh(2)
  mask = np.tril(np.ones((4, 4), bool))
  mask[3] = False  # token 3 attends to nothing: a pad
  batch = {
    "input_ids": np.zeros((1, 4), np.int32),
    "labels": np.zeros((1, 4), np.int32),
    "attention_mask": mask[None, None],
  }
  out, _ = cpjax.shard_batch(batch, mesh, layout="contiguous")
  assert "attention_mask" not in out
  assert np.asarray(out["padding_mask"]).tolist() == [[False, False, False, True]]


def test_extra_keys_with_pad_minus_one():
  mesh = cp_mesh(2)
  batch = {
    "input_ids": np.zeros((1, 3), np.int32),
    "labels": np.zeros((1, 3), np.int32),
    "token_marks": np.array([[4, 5, 6]], np.int32),
    "untouched": "metadata",
  }
  out, lay = cpjax.shard_batch(
    batch,
    mesh,
    layout="contiguous",
    extra_seq_keys={"token_marks": 1},
    extra_pad_values={"token_marks": -1},
  )
  assert np.asarray(out["token_marks"]).tolist() == [[4, 5, 6, -1]]
  assert out["untouched"] == "metadata"
  back = cpjax.unshard_batch(out, lay, extra_seq_keys={"token_marks": 1})
  assert np.asarray(back["token_marks"]).tolist() == [[4, 5, 6]]


def test_gemma4_aux_only_contiguous():
  mesh = cp_mesh(2)
  batch = {
    "input_ids": np.arange(1, 7, dtype=np.int32)[None],
    "labels": np.arange(1, 7, dtype=np.int32)[None],
    "attention_mask": np.array([[1, 1, 1, 1, 0, 0]]),
    "mm_token_type_ids": np.array([[0, 1, 1, 0, 0, 0]], np.int32),
    "pixel_values": np.ones((1, 2, 2), np.float32),
  }
  out, lay = gemma4.make_contiguous_aux_only_shard_cp_batch(mesh, batch)
  assert lay == cpjax.ShardLayout(6, 8, 2, "contiguous")
  assert np.asarray(out["_packed_seq_ids"]).tolist() == [[1, 1, 1, 1, 0, 0, 0, 0]]
  assert np.asarray(out["padding_mask"]).tolist() == [[False] * 4 + [True] * 4]
  for key in ("input_ids", "mm_token_type_ids", "pixel_values"):
    chex.assert_trees_all_equal(out[key], batch[key])
    assert out[key].sharding.is_fully_replicated
  assert set(lay.replicated_keys) == {"input_ids", "mm_token_type_ids", "pixel_values"}


# ------------------------------------------------------------ property tests
batches = st.fixed_dictionaries(
  {
    "cp": st.sampled_from([1, 2, 3, 4, 8]),
    "kind": st.sampled_from(KINDS),
    "b": st.sampled_from([1, 2]),
    "s": st.sampled_from([5, 16, 23]),
    "pad_tail": st.sampled_from([0, 3]),
    "packed": st.booleans(),
    "embeds": st.booleans(),
    "mrope": st.booleans(),
    "extra": st.booleans(),
    "pad_multiple": st.sampled_from([1, 3]),
    "seed": st.integers(0, 2**16),
  }
)


def _draw(p):
  rng = np.random.default_rng(p["seed"])
  batch = make_batch(
    rng,
    p["b"],
    p["s"],
    packed=p["packed"],
    pad_tail=p["pad_tail"],
    embeds=p["embeds"],
    mrope=p["mrope"],
    extra=p["extra"],
  )
  extra = {"token_weights": 1} if p["extra"] else None
  kw = dict(layout=p["kind"], extra_seq_keys=extra, pad_multiple=p["pad_multiple"])
  return batch, cp_mesh(p["cp"]), kw


@given(p=batches)
def test_shard_matches_numpy_and_round_trips(p):
  batch, mesh, kw = _draw(p)
  extra = kw["extra_seq_keys"]
  pads = {"token_weights": -1.0} if extra else None
  out, lay = cpjax.shard_batch(batch, mesh, **kw, extra_pad_values=pads, padding_token_id=3)
  padded, s, cp, kind = lay.padded_seq_len, p["s"], p["cp"], p["kind"]
  # The original pads to a multiple of cp * max(pad_multiple, 2); the
  # load-balanced layout also needs 2 * cp chunks (they differ for odd
  # pad_multiple > 2: contiguous 5 tokens, cp 2, pad_multiple 3 -> 6).
  multiple = cp * max(p["pad_multiple"], 2)
  if kind == "load_balanced":
    multiple = np.lcm(multiple, 2 * cp)
  assert padded % multiple == 0 and s <= padded < s + multiple
  pad_values = {
    "labels": -100,
    "loss_mask": 0,
    "padding_mask": True,
    "_packed_seq_ids": 0,
    "input_ids": 3,
    "inputs_embeds": 0,
    "mm_token_type_ids": 0,
    "token_weights": -1.0,
  }
  for key, value in pad_values.items():
    if key in batch:
      np.testing.assert_array_equal(
        out[key], np_shard(batch[key], 1, padded, cp, kind, value), err_msg=key
      )
  pdim = 2 if p["mrope"] else 1
  np.testing.assert_array_equal(
    out["position_ids"], np_shard(batch["position_ids"], pdim, padded, cp, kind, "count")
  )
  # What each rank holds is a contiguous block of the rank-ordered array.
  for shard in out["labels"].addressable_shards:
    r = shard.device.id if cp > 1 else 0
    lo = shard.index[1].start or 0
    assert lo == r * lay.local_seq_len
  back = cpjax.unshard_batch(out, lay, extra_seq_keys=extra)
  chex.assert_trees_all_equal(back, cpjax.normalize_batch(batch), strict=True)


@given(p=batches)
def test_aux_only_plus_shard_sequence_equals_full_shard(p):
  batch, mesh, kw = _draw(p)
  full, lay = cpjax.shard_batch(batch, mesh, **kw)
  aux, lay_aux = cpjax.shard_batch(batch, mesh, aux_only=True, **kw)
  assert lay == lay_aux
  primary = "inputs_embeds" if p["embeds"] else "input_ids"
  for key in (primary, "mm_token_type_ids"):
    chex.assert_trees_all_equal(aux[key], batch[key])
    spec = P(None, "cp", None) if aux[key].ndim == 3 else P(None, "cp")
    sliced = jax.jit(
      jax.shard_map(lambda x: cpjax.shard_sequence(x, lay), mesh=mesh, in_specs=P(), out_specs=spec)
    )(aux[key])
    chex.assert_trees_all_equal(sliced, full[key], strict=True)
  for key in full:
    if key not in (primary, "mm_token_type_ids"):
      chex.assert_trees_all_equal(aux[key], full[key])


@given(p=batches)
def test_jit_equals_eager(p):
  batch, mesh, kw = _draw(p)
  extra = kw["extra_seq_keys"]
  eager, lay = cpjax.shard_batch(batch, mesh, **kw)
  jitted, lay_j = jax.jit(lambda b: cpjax.shard_batch(b, mesh, **kw))(batch)
  assert lay == lay_j
  chex.assert_trees_all_equal(eager, jitted, strict=True)
  back = jax.jit(lambda b: cpjax.unshard_batch(b, lay, extra_seq_keys=extra))(jitted)
  chex.assert_trees_all_equal(back, cpjax.normalize_batch(batch))


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", KINDS)
def test_shard_sequence_gradient_is_owned_indicator(cp, kind):
  mesh = cp_mesh(cp)
  s = 13
  lay = cpjax.ShardLayout(s, cpjax.padded_length(s, cp, kind=kind), cp, kind)
  weights = np.arange(1, 1 + 2 * lay.padded_seq_len, dtype=np.float32).reshape(2, -1)

  def loss(x):
    local = jax.shard_map(
      lambda x: cpjax.shard_sequence(x, lay), mesh=mesh, in_specs=P(), out_specs=P(None, "cp")
    )(x)
    # Weight every owned (rank-ordered) slot differently, so a gradient that
    # reached the wrong position would carry the wrong weight.
    return jnp.sum(local * weights)

  with jax.set_mesh(mesh):
    grad = jax.grad(loss)(jnp.ones((2, s), jnp.float32))
  order = np.concatenate([np_owned(lay.padded_seq_len, cp, kind, r) for r in range(cp)])
  expected = np.zeros((2, lay.padded_seq_len), np.float32)
  expected[:, order] = weights
  chex.assert_trees_all_close(grad, expected[:, :s], rtol=0, atol=0)


def test_shard_sequence_at_cp_one_only_pads():
  x = jnp.arange(16.0).reshape(2, 8)
  chex.assert_trees_all_equal(cpjax.shard_sequence(x, cpjax.ShardLayout(8, 8, 1)), x)
  chex.assert_trees_all_equal(
    cpjax.shard_sequence(jnp.ones((2, 7)), cpjax.ShardLayout(7, 8, 1)),
    jnp.array([[1.0] * 7 + [0.0]] * 2),
  )


@pytest.mark.parametrize("sharder", ["shard_batch", "aux_only"])
def test_loss_mask_with_labels_is_a_sharded_stream(sharder):
  """As the original: labels present and loss_mask= given -> a loss_mask stream,
  padded with 0 and sliced like labels."""
  mesh = cp_mesh(2)
  batch = {
    "input_ids": np.arange(1, 7, dtype=np.int32)[None],
    "labels": np.arange(11, 17, dtype=np.int32)[None],
  }
  m = np.array([[1, 1, 0, 1, 1, 0]], np.int32)
  if sharder == "aux_only":
    out, lay = gemma4.make_contiguous_aux_only_shard_cp_batch(mesh, batch, loss_mask=m)
  else:
    out, lay = cpjax.shard_batch(batch, mesh, layout="contiguous", loss_mask=m)
  assert np.asarray(out["loss_mask"]).tolist() == [[1, 1, 0, 1, 1, 0, 0, 0]]
  assert out["loss_mask"].sharding.spec == out["labels"].sharding.spec == P(None, "cp")
  assert np.asarray(out["labels"]).tolist() == [[11, 12, 13, 14, 15, 16, -100, -100]]
  # Without labels: labels = loss_mask and no loss_mask key, as before.
  out, _ = gemma4.make_contiguous_aux_only_shard_cp_batch(
    mesh, {"input_ids": batch["input_ids"]}, loss_mask=m
  )
  assert "loss_mask" not in out
  assert np.asarray(out["labels"]).tolist() == [[1, 1, 0, 1, 1, 0, -100, -100]]
  with pytest.raises(ValueError, match="has a 'loss_mask' key and a loss_mask argument"):
    cpjax.shard_batch({**batch, "loss_mask": m}, mesh, loss_mask=m)


@pytest.mark.parametrize("kind", KINDS)
def test_extra_key_with_batch_not_on_dim_zero(kind):
  """An extra key [2, B, S] with seq_dim=2, and one [S, 3] with seq_dim=0."""
  mesh = cp_mesh(2, ("dp", 2))
  rng = np.random.default_rng(0)
  batch = make_batch(rng, 2, 7)
  batch["pair"] = rng.integers(0, 9, (2, 2, 7)).astype(np.int32)
  batch["per_token"] = rng.standard_normal((7, 3)).astype(np.float32)
  extra = {"pair": 2, "per_token": 0}
  out, lay = cpjax.shard_batch(
    batch, mesh, layout=kind, extra_seq_keys=extra, extra_pad_values={"pair": -1}, batch_axis="dp"
  )
  np.testing.assert_array_equal(out["pair"], np_shard(batch["pair"], 2, 8, 2, kind, -1))
  np.testing.assert_array_equal(out["per_token"], np_shard(batch["per_token"], 0, 8, 2, kind, 0))
  assert out["pair"].sharding.spec == P(None, "dp", "cp")
  assert out["per_token"].sharding.spec == P("cp", None)
  back = cpjax.unshard_batch(out, lay, extra_seq_keys=extra)
  for key in extra:
    np.testing.assert_array_equal(back[key], batch[key], err_msg=key)
  aux, _ = gemma4.shard_aux_only_cp_batch(
    mesh, batch, layout=kind, extra_seq_keys=extra, batch_axis="dp"
  )
  np.testing.assert_array_equal(aux["pair"], np_shard(batch["pair"], 2, 8, 2, kind, 0))


def test_dp_cp_mesh_with_batch_axis():
  mesh = cp_mesh(4, ("dp", 2))
  batch = make_batch(np.random.default_rng(0), 4, 10)
  out, lay = cpjax.shard_batch(batch, mesh, batch_axis="dp", layout="load_balanced")
  assert out["labels"].sharding.spec == P("dp", "cp")
  np.testing.assert_array_equal(
    out["labels"], np_shard(batch["labels"], 1, 16, 4, "load_balanced", -100)
  )
  chex.assert_trees_all_equal(cpjax.unshard_batch(out, lay), cpjax.normalize_batch(batch))
  # Auto meshes (the pre-0.7 default) work the same way.
  auto = jax.make_mesh((2, 4), ("dp", "cp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  out_auto, _ = cpjax.shard_batch(batch, auto, batch_axis="dp", layout="load_balanced")
  chex.assert_trees_all_equal(out_auto, out)


def test_input_not_mutated():
  batch = make_batch(np.random.default_rng(1), 1, 6)
  batch["attention_mask"] = ~batch.pop("padding_mask")
  snapshot = {k: v.copy() for k, v in batch.items()}
  cpjax.shard_batch(batch, cp_mesh(2))
  assert batch.keys() == snapshot.keys()
  chex.assert_trees_all_equal(batch, snapshot)


# ----------------------------------------------------------------- bad input
def _ok():
  return {"input_ids": np.zeros((2, 6), np.int32), "labels": np.zeros((2, 6), np.int32)}


@pytest.mark.parametrize(
  "mutate, kwargs, err, match",
  [
    (lambda b: b, {"axis_name": "sp"}, ValueError, r"axis_name='sp' is not an axis of the mesh"),
    (lambda b: {**b, "inputs_embeds": np.zeros((2, 6, 3))}, {}, KeyError, "exactly one of"),
    (lambda b: {"labels": b["labels"]}, {}, KeyError, "exactly one of"),
    (
      lambda b: {**b, "labels": np.zeros((2, 5), np.int32)},
      {},
      ValueError,
      r"labels must have sequence length 6 .* got shape \(2, 5\)",
    ),
    (
      lambda b: {**b, "position_ids": np.zeros((3, 6), np.int32)},
      {},
      ValueError,
      r"position_ids must have batch size 2 .* got shape \(3, 6\)",
    ),
    (
      lambda b: {**b, "_packed_seq_ids": np.zeros((2, 6), np.float32)},
      {},
      TypeError,
      "_packed_seq_ids must have an integer dtype, got float32",
    ),
    (
      lambda b: {**b, "input_ids": np.zeros((2, 6), np.float32)},
      {},
      TypeError,
      "input_ids must have an integer dtype",
    ),
    (lambda b: b, {"pad_multiple": 0}, ValueError, "pad_multiple must be an int >= 1, got 0"),
    (lambda b: b, {"layout": "zigzag"}, ValueError, "layout must be one of"),
    (lambda b: b, {"extra_seq_keys": {"nope": 1}}, KeyError, "extra_seq_keys names 'nope'"),
    (
      lambda b: {**b, "w": np.zeros((2, 6))},
      {"extra_seq_keys": {"w": 2}},
      ValueError,
      r"extra_seq_keys\['w'\] = 2 is not a dimension of an array of shape \(2, 6\); "
      r"expected -2 <= dim < 2",
    ),
    (
      lambda b: {**b, "w": np.zeros((2, 5))},
      {"extra_seq_keys": {"w": 1}},
      ValueError,
      r"extra key 'w' must have the sequence length 6 on dim 1 \(extra_seq_keys\['w'\]\), "
      r"got shape \(2, 5\)",
    ),
    (
      lambda b: {k: v[:1] if k == "input_ids" else v for k, v in b.items()},
      {},
      ValueError,
      "labels must have batch size 1",
    ),
  ],
)
def test_bad_input(mutate, kwargs, err, match):
  with pytest.raises(err, match=match):
    cpjax.shard_batch(mutate(_ok()), cp_mesh(2), **kwargs)


def test_bad_batch_axis():
  mesh = cp_mesh(2, ("dp", 4))
  batch = {"input_ids": np.zeros((6, 6), np.int32), "labels": np.zeros((6, 6), np.int32)}
  with pytest.raises(
    ValueError, match="batch size 6 must be divisible by the size 4 of batch_axis='dp'"
  ):
    cpjax.shard_batch(batch, mesh, batch_axis="dp")
  with pytest.raises(ValueError, match="batch_axis='data' is not an axis"):
    cpjax.shard_batch(batch, mesh, batch_axis="data")


def test_unshard_wrong_length_and_shard_sequence_wrong_length():
  lay = cpjax.ShardLayout(6, 8, 2)
  with pytest.raises(
    ValueError, match=r"labels must have the padded length 8 on dim 1, got shape \(1, 6\)"
  ):
    cpjax.unshard_batch({"labels": np.zeros((1, 6), np.int32)}, lay)
  with pytest.raises(ValueError, match=r"x must have length 6 \(or the padded 8\) on seq_axis=1"):
    cpjax.shard_sequence(np.zeros((1, 5)), lay)


@pytest.mark.parametrize("kind", ["contiguous", "load_balanced"])
@pytest.mark.parametrize("seq_len", [6, 8])
def test_unshard_an_aux_only_batch(kind, seq_len):
  """The primary stream stays whole (layout.replicated_keys); unsharding
  leaves it as it is and puts every sharded stream back in natural order.
  With seq_len 8 (no padding) a wrong unshard of input_ids would not even
  change its shape, only scramble it."""
  mesh = cp_mesh(2)
  ids = np.arange(10, 10 + seq_len)[None].astype(np.int32)
  batch = {"input_ids": ids, "labels": ids + 1, "_packed_seq_ids": np.ones_like(ids)}
  sharded, layout = cpjax.shard_batch(batch, mesh, layout=kind, aux_only=True)
  assert layout.replicated_keys == ("input_ids",)
  back = cpjax.unshard_batch(sharded, layout)
  np.testing.assert_array_equal(np.asarray(back["input_ids"]), ids)
  np.testing.assert_array_equal(np.asarray(back["labels"]), ids + 1)
  np.testing.assert_array_equal(np.asarray(back["position_ids"]), np.arange(seq_len)[None])


# ------------------------------------------------------- a layout given whole
def _packed_rows(seed: int) -> dict:
  """Two rows of 70 tokens, each packed with documents of random lengths."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(1, 100, (2, 70)).astype(np.int32)
  cuts = np.sort(rng.choice(np.arange(1, 70), (2, 3), replace=False), axis=1)
  docs = 1 + (np.arange(70)[None, :, None] >= cuts[:, None, :]).sum(-1)
  return {"input_ids": ids, "labels": ids, "_packed_seq_ids": docs.astype(np.int32)}


@pytest.mark.parametrize("kind", ["contiguous", "load_balanced", "document_balanced"])
def test_a_layout_given_back_shards_rows_of_that_shape_the_same_way(kind):
  """The layout an earlier call returned, given back: rows of the same shape
  get that very layout (its stripes and padding, here neither the defaults'),
  and the arrays that naming its kind with the same settings gives."""
  mesh = cp_mesh(4)
  settings = dict(layout=kind, min_stripe_len=4, pad_multiple=5)
  _, lay = cpjax.shard_batch(_packed_rows(0), mesh, **settings)
  want, by_name = cpjax.shard_batch(_packed_rows(1), mesh, **settings)
  got, again = cpjax.shard_batch(_packed_rows(1), mesh, layout=lay)
  assert again == lay == by_name
  stripes = {"contiguous": 1, "load_balanced": 2, "document_balanced": 4}[kind]
  assert (again.padded_seq_len, again.stripes) == (80, stripes)
  assert cpjax.shard_batch(_packed_rows(1), mesh, layout=kind)[1] != lay  # the defaults differ
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want))


def test_a_layout_of_another_mesh_or_row_is_a_value_error():
  batch = {"input_ids": np.ones((1, 6), np.int32), "labels": np.ones((1, 6), np.int32)}
  mesh = cp_mesh(2)
  for fields, got in (
    ((6, 8, 4), "{'cp_size': 4, 'original_seq_len': 6}"),
    ((7, 8, 2), "{'cp_size': 2, 'original_seq_len': 7}"),
  ):
    with pytest.raises(
      ValueError,
      match=r"layout must fit the mesh's cp axis and the batch's length: expected "
      r"\{'cp_size': 2, 'original_seq_len': 6\}, got a ShardLayout with " + re.escape(got),
    ):
      cpjax.shard_batch(batch, mesh, layout=cpjax.ShardLayout(*fields))
  with pytest.raises(
    ValueError,
    match="layout's chunks must hold a multiple of 16 tokens .* got a ShardLayout with chunk_len 4",
  ):
    cpjax.shard_batch(batch, mesh, layout=cpjax.ShardLayout(6, 8, 2), implementation="pallas_gpu")
  with pytest.raises(
    TypeError,
    match=r"layout must be a layout kind \(contiguous, .*\) or a "
    "ShardLayout, got int",
  ):
    cpjax.shard_batch(batch, mesh, layout=2)


def test_gemma4s_sharder_shards_in_a_given_layout():
  """The model's aux-only sharder passes a ShardLayout through to shard_batch."""
  mesh = cp_mesh(4)
  settings = dict(layout="document_balanced", min_stripe_len=4)
  _, lay = gemma4.shard_aux_only_cp_batch(mesh, _packed_rows(0), **settings)
  _, again = gemma4.shard_aux_only_cp_batch(mesh, _packed_rows(1), layout=lay)
  assert again == lay and again.stripes == 4 and again.replicated_keys == ("input_ids",)


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("kind", KINDS)
def test_token_ranks_are_the_chunks_each_rank_owns(cp, kind):
  s = 20 * cp + 3  # padded to a multiple of the chunks
  ids = np.arange(2 * s).reshape(2, s)
  batch = {"input_ids": ids, "labels": cpjax.next_token_labels(ids)}
  sharded, layout = cpjax.shard_batch(batch, cp_mesh(cp), layout=kind)
  expected = np.empty(layout.padded_seq_len, np.int32)
  for rank in range(cp):
    expected[np_owned(layout.padded_seq_len, cp, kind, rank)] = rank
  chex.assert_trees_all_equal(cpjax.token_ranks(sharded, layout), np.stack([expected] * 2))


def test_token_ranks_follow_each_rows_documents_in_a_document_balanced_layout():
  """Each rank tags its own tokens with its rank (in rank order); unshard_batch
  brings the tags back to natural order, which token_ranks must equal."""
  cp, rng = 4, np.random.default_rng(3)
  docs = np.stack(
    [np.repeat([1, 2, 3, 4, 5], n) for n in ([60, 30, 20, 10, 8], [8, 10, 20, 30, 60])]
  )
  ids = rng.integers(1, 100, docs.shape)
  batch = {"input_ids": ids, "_packed_seq_ids": docs, "labels": cpjax.next_token_labels(ids, docs)}
  sharded, layout = cpjax.shard_batch(batch, cp_mesh(cp), layout="document_balanced")
  assert layout.kind == "document_balanced"
  ranks = cpjax.token_ranks(sharded, layout)
  tags = np.broadcast_to(
    np.arange(layout.padded_seq_len) // layout.local_seq_len,
    docs.shape[:1] + (layout.padded_seq_len,),
  )
  back = cpjax.unshard_batch({**sharded, "tags": tags}, layout, extra_seq_keys={"tags": 1})["tags"]
  chex.assert_trees_all_equal(ranks[:, : docs.shape[1]], np.asarray(back).astype(np.int32))
  assert not np.array_equal(ranks[0], ranks[1])  # the two rows were balanced differently


def test_token_ranks_need_a_sharded_batchs_layout():
  with pytest.raises(TypeError, match="layout must be a ShardLayout, got str"):
    cpjax.token_ranks({"input_ids": np.zeros((1, 8))}, "contiguous")
