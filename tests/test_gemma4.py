"""The Gemma4-style model: CP parity with the single-device model, end to end."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import cpjax
from cpjax import train
from cpjax.models import gemma4
from tests.helpers import cp_mesh

KINDS = ("contiguous", "load_balanced")
CFG = gemma4.Gemma4Config(num_layers=2, full_every=2, sliding_window=6, num_experts=4,
                          experts_top_k=2, vocab_size=97, d_model=32, mlp_hidden=48)


def multimodal_batch(seed: int, *, b=2, s=45, pad=5, cfg=CFG):
  """Packed documents with per-document positions, one image per row (inside a
  document), a padded tail."""
  rng = np.random.default_rng(seed)
  real = s - pad
  docs = np.zeros((b, s), np.int32)
  pos = np.zeros((b, s), np.int32)
  types = np.zeros((b, s), np.int32)
  for r in range(b):
    cuts = np.sort(rng.choice(np.arange(3, real - 3), 2, replace=False))
    docs[r, :real] = 1 + np.searchsorted(cuts, np.arange(real), side="right")
    for d in (1, 2, 3):
      idx = np.flatnonzero(docs[r] == d)
      pos[r, idx] = np.arange(idx.size)
    # The image lies inside the row's longest document (documents cut attention).
    longest = np.flatnonzero(docs[r] == np.bincount(docs[r, :real]).argmax())
    start = int(rng.integers(longest[0], longest[-1] - cfg.tokens_per_image + 2))
    types[r, start:start + cfg.tokens_per_image] = 1
  ids = np.where(docs > 0, rng.integers(1, cfg.vocab_size, (b, s)), 0).astype(np.int32)
  labels = np.array(cpjax.next_token_labels(ids, docs))
  labels[types == 1] = -100
  return {
      "input_ids": ids, "labels": labels, "position_ids": pos, "_packed_seq_ids": docs,
      "attention_mask": (docs > 0).astype(np.int32), "mm_token_type_ids": types,
      "pixel_values": rng.standard_normal((b, cfg.num_channels, cfg.image_size,
                                           cfg.image_size)).astype(np.float32),
  }


@pytest.fixture(scope="module")
def split_model():
  return nnx.split(gemma4.Gemma4(CFG, rngs=nnx.Rngs(0)))


def sharder_for(graphdef, kind):
  model = nnx.merge(graphdef, nnx.split(gemma4.Gemma4(CFG, rngs=nnx.Rngs(0)))[1])
  return model.prepare_model_inputs_for_cp(layout=kind)["cp_sharder"]


def assert_grads_close(got, want, rtol=1e-4):
  """Every leaf within ``rtol`` of the reference leaf's largest magnitude.

  Float32 sums in a different order (ring vs dense, psum over ranks) leave
  ~1e-6 of the leaf's scale on every element; an elementwise relative test
  would instead judge the near-zero elements by their own tiny size.
  """
  def close(path, a, b):
    scale = float(np.max(np.abs(b)))
    chex.assert_trees_all_close(a, b, rtol=0, atol=rtol * scale,
                                custom_message=jax.tree_util.keystr(path))
  jax.tree_util.tree_map_with_path(close, got, want)


def single_device(graphdef, params, batch):
  loss = train.make_loss_fn(graphdef)
  objective = lambda p: (lambda s, n: s / n)(*loss(p, gemma4.prepare_batch(batch)))
  return jax.jit(jax.value_and_grad(objective))(params)


def context_parallel(graphdef, params, batch, cp, kind):
  mesh = cp_mesh(cp)
  sharder = sharder_for(graphdef, kind)
  sharded, layout = sharder.shard_batch(batch, mesh)
  loss = train.make_loss_fn(graphdef, mesh=mesh, layout=layout)
  objective = lambda p: (lambda s, n: s / n)(*loss(p, sharded))
  with jax.set_mesh(mesh):
    return jax.jit(jax.value_and_grad(objective))(params)


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", KINDS)
def test_loss_and_gradients_match_single_device(split_model, cp, kind):
  """cp=1 runs the CP path too: a one-device cp axis, where the activations the
  model slices stay replicated and their gradients must still come home."""
  graphdef, params = split_model
  batch = multimodal_batch(cp)
  ref_loss, ref_grads = single_device(graphdef, params, batch)
  loss, grads = context_parallel(graphdef, params, batch, cp, kind)
  chex.assert_tree_all_finite((loss, grads))
  chex.assert_trees_all_close(loss, ref_loss, rtol=1e-5)
  assert_grads_close(grads, ref_grads)


@pytest.mark.parametrize("kind", KINDS)
def test_whole_rank_of_padding(split_model, kind):
  """45 tokens of which 25 real at cp=8 (L=6): ranks 4..7 hold only padding."""
  graphdef, params = split_model
  batch = multimodal_batch(11, b=1, s=45, pad=20)
  ref_loss, ref_grads = single_device(graphdef, params, batch)
  loss, grads = context_parallel(graphdef, params, batch, 8, kind)
  chex.assert_tree_all_finite((loss, grads))
  chex.assert_trees_all_close(loss, ref_loss, rtol=1e-5)
  assert_grads_close(grads, ref_grads)


def test_three_optimizer_steps_stay_together():
  cfg = gemma4.Gemma4Config(num_layers=2, full_every=2, sliding_window=5, vocab_size=61,
                            d_model=32, vision_bidirectional="all", final_logit_soft_cap=None)
  model = gemma4.Gemma4(cfg, rngs=nnx.Rngs(1))
  sharder = model.prepare_model_inputs_for_cp(layout="load_balanced")["cp_sharder"]
  graphdef, params = nnx.split(model)
  # SGD with momentum keeps the update linear in the gradient. (Adam divides by
  # sqrt(v): on near-zero gradients float32 summation noise becomes a full-size
  # update difference, which says nothing about CP.)
  opt = optax.sgd(0.1, momentum=0.9)
  batches = [multimodal_batch(20 + i, cfg=cfg) for i in range(3)]

  single = train.make_train_step(graphdef, opt)  # donates its inputs: give each run a copy
  p_ref, s_ref = jax.tree.map(jnp.copy, params), opt.init(params)
  ref_losses = []
  for b in batches:
    p_ref, s_ref, m = single(p_ref, s_ref, gemma4.prepare_batch(b))
    ref_losses.append(float(m["loss"]))

  mesh = cp_mesh(4, ("dp", 2))
  _, layout = sharder.shard_batch(batches[0], mesh, batch_axis="dp")
  step = train.make_train_step(graphdef, opt, mesh=mesh, layout=layout, batch_axis="dp")
  step = train.TrainStep(chex.assert_max_traces(step.step, n=1), mesh)  # one compile for all
  p, s = jax.tree.map(jnp.copy, params), opt.init(params)
  losses = []
  for b in batches:
    sharded, lay = sharder.shard_batch(b, mesh, batch_axis="dp")
    assert lay == layout
    p, s, m = step(p, s, sharded)
    losses.append(float(m["loss"]))
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert_grads_close(p, p_ref)


@pytest.mark.parametrize("mode, sees_later_image_token", [("all", True), ("sliding", False)])
def test_vision_tokens_are_spliced_and_bidirectional(mode, sees_later_image_token):
  """One full-attention layer: with vision_bidirectional="all" an image token
  sees a later token of its image; with "sliding" (the original) full layers
  stay causal. Text before the image never sees it."""
  cfg = gemma4.Gemma4Config(num_layers=1, vocab_size=31, d_model=16, per_layer_dim=0,
                            vision_bidirectional=mode)
  model = gemma4.Gemma4(cfg, rngs=nnx.Rngs(2))
  batch = gemma4.prepare_batch(multimodal_batch(3, b=1, s=20, pad=0, cfg=cfg))
  first = int(np.flatnonzero(np.asarray(batch["mm_token_type_ids"])[0] == 1)[0])
  pixels = batch["pixel_values"]
  changed = pixels.copy()
  changed[0, :, -4:, -4:] += 1.0          # only the last patch: the image's last soft token
  diff = np.abs(np.asarray(model({**batch, "pixel_values": changed}))
                - np.asarray(model(batch))).max(-1)[0]
  assert (diff[first] > 0) == sees_later_image_token
  assert diff[first + cfg.tokens_per_image - 1] > 0   # the spliced token itself changed
  assert np.all(diff[:first] == 0)


def test_config_validation():
  with pytest.raises(ValueError, match=r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"):
    gemma4.Gemma4Config(num_kv_heads=3)
  with pytest.raises(ValueError, match="vision_bidirectional must be one of"):
    gemma4.Gemma4Config(vision_bidirectional="full")
  assert [gemma4.Gemma4Config(num_layers=7).is_full(i) for i in range(7)] == [
      False] * 5 + [True, True]
