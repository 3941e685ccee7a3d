"""A user's own Flax NNX transformer (not the bundled model) trained with CP.

The CP run uses ``nnx.MultiHeadAttention(attention_fn=cpjax.ring_attention_fn())``
and cpjax's model-agnostic training step; the reference is the SAME model with
flax's own dense ``dot_product_attention`` and a mask written out here, on one
device.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import cpjax
from cpjax import training
from tests.helpers import cp_mesh


class Block(nnx.Module):
  def __init__(self, d, heads, attention_fn, rngs):
    self.norm1, self.norm2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(heads, d, decode=False, attention_fn=attention_fn, rngs=rngs)
    self.up, self.down = nnx.Linear(d, 2 * d, rngs=rngs), nnx.Linear(2 * d, d, rngs=rngs)

  def __call__(self, x, mask):
    x = x + self.attn(self.norm1(x), mask=mask)
    return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class TinyLM(nnx.Module):
  def __init__(
    self, attention_fn, *, vocab=50, d=16, heads=2, layers=2, max_len=64, rngs: nnx.Rngs
  ):
    self.tok, self.pos = nnx.Embed(vocab, d, rngs=rngs), nnx.Embed(max_len, d, rngs=rngs)
    self.blocks = nnx.List([Block(d, heads, attention_fn, rngs) for _ in range(layers)])
    self.head = nnx.Linear(d, vocab, rngs=rngs)

  def __call__(self, ids, positions, mask):
    x = self.tok(ids) + self.pos(positions)
    for block in self.blocks:
      x = block(x, mask)
    return self.head(x)


def cp_forward(model, batch, cp):
  """The user's forward: the same code on one device (cp=None) and under CP."""
  mask = cpjax.AttentionMask.create(
    document_ids=batch["_packed_seq_ids"], padding_mask=batch["padding_mask"]
  )
  with cpjax.use_cp(cp):
    return model(batch["input_ids"], batch["position_ids"], mask)


def dense_forward(model, batch, cp):
  """flax's dense attention with the causal, per-document, key-padding mask."""
  assert cp is None
  doc_ids, pad = batch["_packed_seq_ids"], batch["padding_mask"]
  i = jnp.arange(doc_ids.shape[1])
  allowed = (
    (i[None, :] <= i[:, None])[None]
    & (doc_ids[:, :, None] == doc_ids[:, None, :])
    & (doc_ids[:, :, None] > 0)
    & ~pad[:, None, :]
  )
  return model(batch["input_ids"], batch["position_ids"], allowed[:, None])


def packed_batch(seed, b=4, s=45, vocab=50):
  rng = np.random.default_rng(seed)
  docs = np.zeros((b, s), np.int32)
  pos = np.zeros((b, s), np.int32)
  real = s - 6
  for r in range(b):
    cuts = np.sort(rng.choice(np.arange(2, real - 2), 2, replace=False))
    docs[r, :real] = 1 + np.searchsorted(cuts, np.arange(real), side="right")
    for d in (1, 2, 3):
      pos[r, docs[r] == d] = np.arange(np.sum(docs[r] == d))
  ids = np.where(docs > 0, rng.integers(1, vocab, (b, s)), 0).astype(np.int32)
  return {
    "input_ids": ids,
    "labels": np.asarray(cpjax.next_token_labels(ids, docs)),
    "position_ids": pos,
    "_packed_seq_ids": docs,
    "padding_mask": docs == 0,
  }


def models():
  ring = TinyLM(cpjax.ring_attention_fn(), rngs=nnx.Rngs(0))
  dense = TinyLM(nnx.dot_product_attention, rngs=nnx.Rngs(0))
  graph_ring, params = nnx.split(ring)
  graph_dense, params_dense = nnx.split(dense)
  chex.assert_trees_all_equal(params, params_dense)  # one set of weights, two attentions
  return graph_ring, graph_dense, params


def close_per_leaf(got, want, rtol=1e-4):
  """Every leaf within ``rtol`` of the reference leaf's largest magnitude.

  Float32 sums in another order (ring vs dense, psum over ranks) leave ~1e-6
  of a leaf's scale on every element. Leaves whose true gradient is exactly
  zero (the key bias: softmax ignores a per-row constant) hold only that
  noise, so they are judged against the largest gradient of all leaves.
  """
  floor = 1e-6 * max(float(np.max(np.abs(x))) for x in jax.tree.leaves(want))

  def close(path, a, b):
    atol = max(rtol * float(np.max(np.abs(b))), floor)
    chex.assert_trees_all_close(a, b, rtol=0, atol=atol, custom_message=jax.tree_util.keystr(path))

  jax.tree_util.tree_map_with_path(close, got, want)


@pytest.mark.parametrize(
  "mesh_axes, kind", [((("cp", 4),), "load_balanced"), ((("dp", 2), ("cp", 4)), "contiguous")]
)
def test_loss_and_gradients_equal_the_single_device_model(mesh_axes, kind):
  graph_ring, graph_dense, params = models()
  batch = packed_batch(0)
  mesh = jax.make_mesh(tuple(n for _, n in mesh_axes), tuple(a for a, _ in mesh_axes))
  batch_axis = "dp" if len(mesh_axes) == 2 else None
  sharded, layout = cpjax.shard_batch(batch, mesh, layout=kind, batch_axis=batch_axis)

  def value_and_grad(loss_sums, b):
    objective = lambda p: (lambda s, n: s / n)(*loss_sums(p, b))  # noqa: E731
    with jax.set_mesh(mesh):
      return jax.jit(jax.value_and_grad(objective))(params)

  want = value_and_grad(training.make_loss_fn(graph_dense, forward=dense_forward), batch)
  single = value_and_grad(training.make_loss_fn(graph_ring, forward=cp_forward), batch)
  got = value_and_grad(
    training.make_loss_fn(
      graph_ring, mesh=mesh, layout=layout, batch_axis=batch_axis, forward=cp_forward
    ),
    sharded,
  )
  for loss, grads in (single, got):
    chex.assert_tree_all_finite(grads)
    chex.assert_trees_all_close(loss, want[0], rtol=1e-5)
    close_per_leaf(grads, want[1])


def test_three_training_steps_and_one_compile():
  graph_ring, graph_dense, params = models()
  opt = optax.sgd(0.2, momentum=0.9)
  batches = [packed_batch(10 + i) for i in range(3)]
  mesh = cp_mesh(8)

  ref = training.make_train_step(graph_dense, opt, forward=dense_forward)
  p_ref, s_ref, ref_losses = jax.tree.map(jnp.copy, params), opt.init(params), []
  for b in batches:
    p_ref, s_ref, m = ref(p_ref, s_ref, b)
    ref_losses.append(float(m["loss"]))

  _, layout = cpjax.shard_batch(batches[0], mesh)
  step = training.make_train_step(graph_ring, opt, mesh=mesh, layout=layout, forward=cp_forward)
  counted = training.TrainStep(chex.assert_max_traces(step.step, n=1), mesh)
  p, s, losses = jax.tree.map(jnp.copy, params), opt.init(params), []
  for b in batches:
    sharded, lay = cpjax.shard_batch(b, mesh)
    assert lay == layout
    p, s, m = counted(p, s, sharded)
    losses.append(float(m["loss"]))
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert losses[-1] < losses[0]
  close_per_leaf(p, p_ref)


def test_attention_fn_rejects_what_the_ring_cannot_do():
  attn = nnx.MultiHeadAttention(
    2, 8, decode=False, attention_fn=cpjax.ring_attention_fn(), rngs=nnx.Rngs(0)
  )
  x = jnp.ones((1, 4, 8))
  with pytest.raises(TypeError, match="mask must be a cpjax.AttentionMask .* got ArrayImpl"):
    attn(x, mask=jnp.ones((1, 1, 4, 4), bool))
  with pytest.raises(ValueError, match="takes no bias"):
    cpjax.ring_attention_fn()(x[..., None], x[..., None], x[..., None], bias=x)
  with pytest.raises(ValueError, match="has no attention dropout"):
    cpjax.ring_attention_fn()(
      x[..., None], x[..., None], x[..., None], dropout_rate=0.1, deterministic=False
    )
  with pytest.raises(ValueError, match="sow_weights=True is not supported"):
    attn_sow = nnx.MultiHeadAttention(
      2, 8, decode=False, attention_fn=cpjax.ring_attention_fn(), rngs=nnx.Rngs(0)
    )
    attn_sow(x, sow_weights=True)
  with pytest.raises(TypeError, match=r"cp must be a cpjax.CPContext or None, got ShardLayout"):
    with cpjax.use_cp(cpjax.ShardLayout(4, 4, 1)):
      pass
