"""The loss against an independent reference: optax's integer-label cross
entropy and a float64 numpy formula, on random soft-capped logits with
ignored labels; and the CP reduction against the same numbers."""

import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from cpjax import training
from tests.helpers import cp_mesh

B, L, V, CAP = 2, 12, 37, 30.0


def soft_capped_logits(seed: int) -> np.ndarray:
  """Gemma's soft cap on wide random logits: cap * tanh(x / cap)."""
  x = np.random.default_rng(seed).normal(0.0, 20.0, (B, L, V)).astype(np.float32)
  return (CAP * np.tanh(x / CAP)).astype(np.float32)


def labels_with_ignored(seed: int) -> np.ndarray:
  rng = np.random.default_rng(seed + 1)
  labels = rng.integers(0, V, (B, L)).astype(np.int32)
  labels[rng.random((B, L)) < 0.3] = -100
  labels[0, 0], labels[1, -1] = -100, V - 1  # an ignored token and the last class
  return labels


def numpy_loss(logits: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
  """float64: sum over counted tokens of logsumexp(z) - z[label], and the count."""
  z = logits.astype(np.float64)
  top = z.max(-1, keepdims=True)
  lse = (top + np.log(np.exp(z - top).sum(-1, keepdims=True)))[..., 0]
  valid = labels != -100
  picked = np.take_along_axis(z, np.where(valid, labels, 0)[..., None], -1)[..., 0]
  return float(np.sum(np.where(valid, lse - picked, 0.0))), float(valid.sum())


@pytest.mark.parametrize("seed", [0, 1])
def test_token_cross_entropy_equals_optax_and_numpy(seed):
  logits, labels = soft_capped_logits(seed), labels_with_ignored(seed)
  ce_sum, count = training.token_cross_entropy(logits, labels)
  want_sum, want_count = numpy_loss(logits, labels)
  assert float(count) == want_count
  np.testing.assert_allclose(float(ce_sum), want_sum, rtol=2e-6)
  valid = labels != -100
  per_token = optax.softmax_cross_entropy_with_integer_labels(logits, np.where(valid, labels, 0))
  np.testing.assert_allclose(
    float(ce_sum), float(jnp.sum(jnp.where(valid, per_token, 0.0))), rtol=2e-6
  )

  # Gradient w.r.t. the logits: (softmax - one_hot) / count on counted tokens, 0 elsewhere.
  grad = jax.grad(lambda z: training.token_cross_entropy(z, labels)[0] / count)(logits)
  z = logits.astype(np.float64)
  soft = np.exp(z - z.max(-1, keepdims=True))
  soft /= soft.sum(-1, keepdims=True)
  want = (soft - np.eye(V)[np.where(valid, labels, 0)]) * valid[..., None] / want_count
  np.testing.assert_allclose(np.asarray(grad), want, atol=2e-7)
  assert np.all(np.asarray(grad)[~valid] == 0.0)


def test_ignore_index_is_honoured():
  logits, labels = soft_capped_logits(2), labels_with_ignored(2)
  other = np.where(labels == -100, 7, labels)  # 7 is a class id, -100 a real label now
  relabelled = np.where(labels == -100, -1, labels)
  got = training.token_cross_entropy(logits, relabelled, ignore_index=-1)
  chex.assert_trees_all_close(got, training.token_cross_entropy(logits, labels), rtol=1e-7)
  assert float(training.token_cross_entropy(logits, other)[1]) == B * L


@pytest.mark.parametrize("cp", [2, 4])
def test_cross_entropy_sums_over_cp_equal_the_whole_row(cp):
  """Each rank holds L/cp tokens; the psum-ed sums are the numpy sums of the row."""
  mesh = cp_mesh(cp)
  logits, labels = soft_capped_logits(3), labels_with_ignored(3)
  f = jax.jit(
    jax.shard_map(
      lambda z, y: training.cross_entropy_sums(z, y),
      mesh=mesh,
      in_specs=P(None, "cp"),
      out_specs=P(),
    )
  )
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P(None, "cp")))
  ce_sum, count = f(put(logits), put(labels))
  want_sum, want_count = numpy_loss(logits, labels)
  assert float(count) == want_count
  np.testing.assert_allclose(float(ce_sum), want_sum, rtol=2e-6)


def numpy_grads(hidden, head, labels, cap):
  """float64 gradients of the CE sum w.r.t. hidden [B, L, D] and head [V, D]:
  dz = (softmax - onehot) on counted tokens, times 1 - tanh^2 under the cap."""
  h, w = hidden.astype(np.float64), head.astype(np.float64)
  z = np.einsum("bld,vd->blv", h, w)
  capped = z if cap is None else cap * np.tanh(z / cap)
  soft = np.exp(capped - capped.max(-1, keepdims=True))
  soft /= soft.sum(-1, keepdims=True)
  valid = labels != -100
  dz = (soft - np.eye(w.shape[0])[np.where(valid, labels, 0)]) * valid[..., None]
  if cap is not None:
    dz *= 1.0 - np.tanh(z / cap) ** 2
  return np.einsum("blv,vd->bld", dz, w), np.einsum("blv,bld->vd", dz, h)


def float64_error(got, want):
  """Per leaf: max |got - want| over the float64 leaf's largest magnitude."""
  return [float(np.max(np.abs(np.asarray(g) - w)) / np.max(np.abs(w))) for g, w in zip(got, want)]


def dense_capped(hidden, head, labels, cap):
  z = jnp.einsum("bld,vd->blv", hidden, head, precision="highest")
  z = z if cap is None else cap * jnp.tanh(z / cap)
  return training.token_cross_entropy(z, labels)


@pytest.mark.parametrize("cap", [None, CAP])
@pytest.mark.parametrize("chunk", [5, 24, 1000])  # 5 and 1000 do not divide B * L = 24
def test_linear_cross_entropy_equals_the_dense_loss(cap, chunk, monkeypatch):
  """Values against numpy (float64) and token_cross_entropy on the dense
  logits; gradients of hidden and head against the dense loss's. The
  backward tiles the vocabulary: one tile at chunk 1000, 37 of one row else."""
  if chunk != 1000:
    monkeypatch.setattr("cpjax.training.loss.TILE_VALUES", 16)
  rng = np.random.default_rng(4)
  hidden = rng.normal(0.0, 1.0, (B, L, 16)).astype(np.float32)
  head = rng.normal(0.0, 2.0, (V, 16)).astype(np.float32)
  labels = labels_with_ignored(4)
  ce_sum, count = training.linear_cross_entropy(
    hidden, head, labels, chunk_size=chunk, logits_soft_cap=cap
  )
  z = np.einsum("bld,vd->blv", hidden.astype(np.float64), head.astype(np.float64))
  want_sum, want_count = numpy_loss(z if cap is None else cap * np.tanh(z / cap), labels)
  assert float(count) == want_count
  np.testing.assert_allclose(float(ce_sum), want_sum, rtol=2e-6)

  chunked = jax.grad(
    lambda h, w: training.linear_cross_entropy(h, w, labels, chunk_size=chunk, logits_soft_cap=cap)[
      0
    ],
    argnums=(0, 1),
  )(hidden, head)
  dense = jax.grad(lambda h, w: dense_capped(h, w, labels, cap)[0], argnums=(0, 1))(hidden, head)
  # Against float64, as a fraction of each gradient's largest magnitude.
  # Measured: the dense float32 loss 2e-7..4e-7; the chunked one 5e-7 with
  # one vocabulary tile and 1e-6..2.5e-6 with 37 one-row tiles (each tile
  # adds its float32 partial sum to dh). A wrong term would show as >= 1e-3.
  want = numpy_grads(hidden, head, labels, cap)
  assert max(float64_error(dense, want)) <= 1e-6
  assert max(float64_error(chunked, want)) <= 4e-6
  # Ignored tokens get no gradient.
  assert np.all(np.asarray(chunked[0])[labels == -100] == 0.0)


def test_linear_cross_entropy_bad_input():
  h, w, y = np.ones((1, 3, 2), np.float32), np.ones((4, 2), np.float32), np.zeros((1, 3), int)
  with pytest.raises(ValueError, match=r"hidden must be \[B, L, D\] and head \[V, D\]"):
    training.linear_cross_entropy(h, np.ones((4, 3), np.float32), y)
  with pytest.raises(ValueError, match=r"labels must be an integer \[B, L\] = \[1, 3\]"):
    training.linear_cross_entropy(h, w, y[:, :2])
  with pytest.raises(ValueError, match="chunk_size must be an int >= 1, got 0"):
    training.linear_cross_entropy(h, w, y, chunk_size=0)
  with pytest.raises(ValueError, match="logits_soft_cap must be > 0 or None, got -1"):
    training.linear_cross_entropy(h, w, y, logits_soft_cap=-1)


# The head split over its vocabulary as param_specs places it (fsdp and tp
# on V; with the state over fsdp x cp, cp too, as the head enters the ring's
# shard_map split: vocab_axis="cp"); rows over the batch axis; tokens over
# cp. The loss runs inside the ring's shard_map (manual over cp) and must
# equal the dense loss on one device, with the head's gradient left in its
# shards and no device holding the whole head.
@pytest.mark.parametrize(
  "shape,state_axes",
  [
    ({"fsdp": 2, "cp": 2, "tp": 2}, ("fsdp",)),
    ({"dp": 2, "cp": 2, "tp": 2}, ("fsdp",)),
    ({"fsdp": 4, "cp": 2}, ("fsdp",)),
    ({"cp": 8}, ("fsdp",)),
    ({"fsdp": 2, "cp": 2, "tp": 2}, ("fsdp", "cp")),
    ({"fsdp": 2, "cp": 4}, ("fsdp", "cp")),
    ({"dp": 2, "cp": 4}, ("fsdp", "cp")),
    ({"cp": 8}, ("fsdp", "cp")),
  ],
  ids=lambda v: "+".join(v) if isinstance(v, tuple) else "x".join(f"{k}{n}" for k, n in v.items()),
)
def test_linear_cross_entropy_is_vocabulary_parallel(shape, state_axes, monkeypatch):
  check_vocabulary_parallel(shape, state_axes, monkeypatch)


@pytest.mark.parametrize(
  "shape",
  [{"fsdp": 2, "cp": 2, "tp": 2}, {"fsdp": 2, "cp": 4}, {"dp": 2, "cp": 4}, {"cp": 8}],
  ids=lambda v: "x".join(f"{k}{n}" for k, n in v.items()),
)
def test_the_losss_all_gather_over_cp_equals_the_dense_loss(shape, monkeypatch):
  """strategy="all_gather": every cp rank gathers the row's hidden states
  and labels instead of sending them round the ring: the same loss and
  gradients, and the ring never runs."""
  from cpjax.training import loss
  from tests.attention_harness import spy

  rings = spy(monkeypatch, loss, "_ring")
  text = check_vocabulary_parallel(shape, ("fsdp", "cp"), monkeypatch, strategy="all_gather")
  assert not rings and "all-gather" in text


def check_vocabulary_parallel(shape, state_axes, monkeypatch, strategy="ring"):
  """Compare the vocabulary-parallel loss on ``shape`` with the dense one;
  return the compiled gradient program's text."""
  from cpjax import parallel

  rng = np.random.default_rng(5)
  rows, length, vocab, width = 4, 16, 40, 8
  hidden = rng.normal(0.0, 1.0, (rows, length, width)).astype(np.float32)
  head = rng.normal(0.0, 2.0, (vocab, width)).astype(np.float32)
  labels = rng.integers(0, vocab, (rows, length)).astype(np.int32)
  labels[rng.random((rows, length)) < 0.3] = -100
  mesh = parallel.make_mesh(**shape)
  batch_axis = parallel.batch_axis_of(mesh)
  head_spec = parallel.param_specs(head, mesh, state_axes=state_axes)
  over_cp = "cp" in jax.tree.leaves(tuple(head_spec))
  assert over_cp == ("cp" in state_axes)

  monkeypatch.setattr("cpjax.training.loss.TILE_VALUES", 5 * width)  # 2+ tiles a block

  def objective(h, w, y):
    def local(h, w, y):
      s, n = training.linear_cross_entropy(
        h,
        w,
        y,
        chunk_size=5,
        logits_soft_cap=CAP,
        vocab_axis="cp" if over_cp else None,
        strategy=strategy,
      )
      return jax.lax.psum(s, "cp") / jax.lax.psum(n, "cp")

    return jax.shard_map(
      local,
      in_specs=(P(None, "cp"), P("cp") if over_cp else P(), P(None, "cp")),
      out_specs=P(),
      axis_names={"cp"},
    )(h, w, y)

  with jax.set_mesh(mesh):
    args = (
      jax.device_put(hidden, NamedSharding(mesh, P(batch_axis, "cp"))),
      jax.device_put(head, NamedSharding(mesh, head_spec)),
      jax.device_put(labels, NamedSharding(mesh, P(batch_axis, "cp"))),
    )
    loss, grads = jax.jit(jax.value_and_grad(objective, argnums=(0, 1)))(*args)
    text = jax.jit(jax.grad(objective, argnums=(0, 1))).lower(*args).compile().as_text()
  dense = lambda h, w: (lambda s, n: s / n)(*dense_capped(h, w, labels, CAP))
  want_loss, want_grads = jax.value_and_grad(dense, argnums=(0, 1))(hidden, head)
  np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
  chex.assert_trees_all_close(grads, want_grads, rtol=1e-5, atol=1e-7)
  assert grads[1].sharding.is_equivalent_to(NamedSharding(mesh, head_spec), 2)
  if len(head_spec):  # split over the vocabulary: never whole on a device
    assert f"f32[{vocab},{width}]" not in text
  if over_cp and strategy == "ring":  # the tokens travel the ring: never a whole row's on a device
    split = jax.tree.leaves(tuple(head_spec))
    rows_here = rows if batch_axis in split else rows // mesh.shape.get(batch_axis, 1)
    held = [
      math.prod(map(int, dims.split(","))) for dims in re.findall(rf"f32\[([\d,]+),{width}\]", text)
    ]
    assert max(held) < rows_here * length, (max(held), rows_here * length)
  return text
