"""Gemma 4 against transformers' own logits (committed fixtures), on one
device and with context parallelism; CP loss and gradients against the
single-device model.

The fixtures (tests/fixtures/gemma4/, made by make_fixtures.py with
transformers 5.24) hold transformers' logits in float64, float32 and
bfloat16 for tiny random models that cover every architectural feature.
"""

import functools
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import cpjax
from cpjax import training
from cpjax.models import gemma4
from tests import attention_harness as H
from tests.helpers import cp_mesh

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "gemma4")
MODELS = ("ple_kv_sharing", "moe_k_eq_v_vision", "bidirectional_all")
KINDS = cpjax.batch.layout.LAYOUT_KINDS
# float32: max |logit difference| on real tokens, logits ~8.5 std (the bound).
F32_TOL = 1e-4


@functools.cache
def fixture(name):
  model = gemma4.Gemma4.from_pretrained(os.path.join(FIXTURES, name))
  arrays = dict(np.load(os.path.join(FIXTURES, name, "batches.npz")))
  logits = dict(np.load(os.path.join(FIXTURES, name, "logits.npz")))
  batches = {}
  for key, value in arrays.items():
    kind, field = key.split("/")
    batches.setdefault(kind, {})[field] = value
  return model, batches, logits


def cases(kinds=("images", "packed", "text")):
  return [(m, k) for m in MODELS for k in kinds if k in fixture(m)[1]]


def real_tokens(inputs):
  ids = inputs["input_ids"]
  return np.asarray(inputs.get("attention_mask", np.ones(ids.shape))).astype(bool)


def max_error(got, want, inputs):
  return float(np.max(np.abs(np.asarray(got) - want)[real_tokens(inputs)]))


@pytest.mark.parametrize("name,kind", cases())
def test_single_device_logits_equal_transformers(name, kind):
  model, batches, logits = fixture(name)
  inputs = batches[kind]
  got = jax.jit(lambda b: model(b))(gemma4.prepare_batch(inputs, model.cfg))
  chex.assert_shape(got, logits[f"{kind}/float32"].shape)
  assert max_error(got, logits[f"{kind}/float64"], inputs) <= F32_TOL
  assert max_error(got, logits[f"{kind}/float32"], inputs) <= F32_TOL


def test_all_padding_image_slots_yield_no_soft_tokens():
  """A packed row carries a fixed number of image slots; the unused ones are
  all padding (pixels 0, positions -1). Put between and after the real
  images, they change nothing: transformers' logits of the real images."""
  model, batches, logits = fixture("moe_k_eq_v_vision")
  inputs = dict(batches["images"])
  n, p, f = inputs["pixel_values"].shape
  slots = [0, None, 1, None, 2, None]  # None: an unused slot
  inputs["pixel_values"] = np.stack(
    [inputs["pixel_values"][i] if i is not None else np.zeros((p, f), np.float32) for i in slots]
  )
  inputs["image_position_ids"] = np.stack(
    [inputs["image_position_ids"][i] if i is not None else np.full((p, 2), -1) for i in slots]
  )
  assert gemma4.vision.soft_token_counts(inputs["image_position_ids"], 3)[1::2].tolist() == [0] * 3
  got = jax.jit(lambda b: model(b))(gemma4.prepare_batch(inputs, model.cfg))
  assert max_error(got, logits["images/float64"], inputs) <= F32_TOL


# bfloat16 (weights and activations; softmax, norms and RoPE angles in
# float32 on both sides) has no single right answer: the tolerance is
# transformers' own bfloat16 error against the float64 logits. cpjax's
# bfloat16 logits must be as close to float64 as transformers' are: mean
# |error| within 1.3x of its mean (measured: 0.9x-1.1x), max |error| within
# 1.5x of its max (measured 0.7x-1.3x). The max leaves out the tokens an
# MoE routes to other experts in bfloat16 than in float32: a top-k near a
# tie flips either way in any bfloat16 run (here one token of the MoE's
# image rows flips in cpjax's run and none in transformers': an error of
# 4.9 where the other tokens' largest is 0.65, transformers' 0.70), and
# such tokens must stay rare (one in 32 at most).
#
# Compiled once, as eagerly: without XLA's excess precision every operation
# rounds to its bfloat16 result as torch's do (jit's default keeps float32
# between fused operations). Compiled so, the logits equal the eager run's bit
# for bit (measured).
@pytest.mark.parametrize("name", [pytest.param(MODELS[0], marks=pytest.mark.slow), *MODELS[1:]])
def test_bfloat16_logits_as_accurate_as_transformers_bfloat16(name, monkeypatch):
  _, batches, logits = fixture(name)
  model = gemma4.Gemma4.from_pretrained(os.path.join(FIXTURES, name), dtype=jnp.bfloat16)
  routes = spy_on_routing(monkeypatch)
  rounded = {"xla_allow_excess_precision": False}
  bf16 = jax.jit(lambda b: model(b), compiler_options=rounded)
  f32 = jax.jit(lambda b: fixture(name)[0](b))
  for kind in ("images", "text"):
    inputs = batches[kind]
    real = real_tokens(inputs)
    batch = gemma4.prepare_batch(inputs, model.cfg)
    got = np.asarray(bf16(batch))
    flipped = (
      routes(lambda: f32(batch), real.shape) != routes(lambda: bf16(batch), real.shape)
    ).any(-1)
    truth, theirs = logits[f"{kind}/float64"], logits[f"{kind}/bfloat16"]
    ours_err, their_err = np.abs(got - truth)[real], np.abs(theirs - truth)[real]
    assert ours_err.mean() <= 1.3 * their_err.mean(), (kind, ours_err.mean(), their_err.mean())
    assert flipped[real].sum() <= real.sum() // 32, (kind, flipped[real].sum())
    kept = np.abs(got - truth)[real & ~flipped]
    assert kept.max() <= 1.5 * their_err.max(), (kind, kept.max(), their_err.max())
    assert ours_err.mean() > 1e-3  # it really ran in bfloat16


def spy_on_routing(monkeypatch):
  """``routes(run, (B, S))``: each token's top-k experts on every MoE layer
  while ``run()`` runs, compiled or not: [B, S, layers x k] (no entry on a
  dense model)."""
  from cpjax.models.gemma4 import text

  seen = []
  route = text.Router.__call__

  def spy(self, r):
    weights, idx = route(self, r)
    jax.debug.callback(lambda i: seen.append(np.sort(np.asarray(i), -1)), idx, ordered=True)
    return weights, idx

  monkeypatch.setattr(text.Router, "__call__", spy)

  def routes(run, shape):
    seen.clear()
    jax.block_until_ready(run())
    jax.effects_barrier()
    return np.concatenate(
      [np.zeros((*shape, 0), np.int32), *(i.reshape(*shape, -1) for i in seen)], -1
    )

  return routes


# In CI six (model, cp, layout) triples, together every model, cp size and
# layout; the other 21 are marked slow (`make soak`).
IN_CI = {
  ("ple_kv_sharing", 2, "load_balanced"),
  ("ple_kv_sharing", 8, "contiguous"),
  ("moe_k_eq_v_vision", 4, "contiguous"),
  ("moe_k_eq_v_vision", 8, "load_balanced"),
  ("bidirectional_all", 4, "load_balanced"),
  ("moe_k_eq_v_vision", 2, "document_balanced"),
}


@pytest.mark.parametrize(
  "name,cp,layout",
  [
    pytest.param(name, cp, layout, marks=() if (name, cp, layout) in IN_CI else pytest.mark.slow)
    for name in MODELS
    for cp in (2, 4, 8)
    for layout in KINDS
  ],
)
def test_cp_logits_equal_transformers(name, cp, layout):
  model, batches, logits = fixture(name)
  inputs = batches["images"]
  got = gemma4.cp_logits(model, gemma4.prepare_batch(inputs, model.cfg), cp_mesh(cp), layout=layout)
  chex.assert_shape(got, logits["images/float64"].shape)
  assert max_error(got, logits["images/float64"], inputs) <= F32_TOL


@pytest.mark.parametrize(
  "name,cp,layout,strategy",
  [
    # 26B-A4B-like: the full layers (K = V projection) all-gathered, the
    # sliding ones on the ring.
    ("moe_k_eq_v_vision", 4, "load_balanced", {"full_attention": "all_gather"}),
    ("ple_kv_sharing", 2, "document_balanced", "all_gather"),
    # Ulysses on the sliding layers (their vision groups over the whole row).
    (
      "moe_k_eq_v_vision",
      2,
      "document_balanced",
      {"full_attention": "all_gather", "sliding_attention": "ulysses"},
    ),
    # The hybrid on the sliding layers: Ulysses over pairs of ranks (their 2
    # K/V heads), the ring over the 2 pairs.
    ("moe_k_eq_v_vision", 4, "load_balanced", {"sliding_attention": "hybrid"}),
  ],
)
def test_cp_logits_with_another_strategy_equal_transformers(
  name, cp, layout, strategy, monkeypatch
):
  model, batches, logits = fixture(name)
  inputs = batches["images"]
  batch = gemma4.prepare_batch(inputs, model.cfg)
  calls = {"all_gather": H.count_gathers(monkeypatch), "ulysses": H.count_ulysses(monkeypatch)}
  got = gemma4.cp_logits(model, batch, cp_mesh(cp), layout=layout, strategy=strategy)
  assert max_error(got, logits["images/float64"], inputs) <= F32_TOL
  # One call of a strategy for each layer whose kind takes it (the hybrid's
  # all-to-alls are Ulysses').
  kinds = model.cfg.text.layer_types
  for name, seen in calls.items():
    chosen = [
      k
      for k in kinds
      if {"hybrid": "ulysses"}.get(
        s := strategy if isinstance(strategy, str) else strategy.get(k), s
      )
      == name
    ]
    assert len(seen) == len(chosen), (name, len(seen), kinds)


def test_a_strategy_for_a_layer_kind_the_model_lacks_is_refused():
  model, batches, _ = fixture("ple_kv_sharing")
  batch = gemma4.prepare_batch(batches["images"], model.cfg)
  with pytest.raises(ValueError, match="strategy names layer kind 'global_attention'"):
    gemma4.cp_logits(model, batch, cp_mesh(2), strategy={"global_attention": "all_gather"})


@pytest.mark.parametrize("name,kind", cases(("images", "packed")))
def test_cp_logits_on_a_dp_cp_mesh(name, kind):
  """The batch split over dp: each shard scatters ITS rows' images (row-major
  over the global batch)."""
  model, batches, logits = fixture(name)
  inputs = batches[kind]
  mesh = jax.make_mesh((2, 4), ("dp", "cp"), devices=jax.devices()[:8])
  got = gemma4.cp_logits(model, gemma4.prepare_batch(inputs, model.cfg), mesh, batch_axis="dp")
  assert max_error(got, logits[f"{kind}/float64"], inputs) <= F32_TOL


def training_batch(name, kind="images"):
  """A fixture batch with next-token labels (images and padding ignored)."""
  model, batches, _ = fixture(name)
  inputs = dict(batches[kind])
  ids = inputs["input_ids"]
  labels = np.where(np.roll(real_tokens(inputs), -1, axis=1), np.roll(ids, -1, axis=1), -100)
  labels[:, -1] = -100
  labels[np.roll(ids, -1, axis=1) == model.cfg.image_token_id] = -100
  inputs["labels"] = labels.astype(np.int32)
  return model, inputs


def assert_grads_close(got, want, rtol=1e-4):
  """Every leaf within ``rtol`` of the reference leaf's largest magnitude."""

  def close(path, a, b):
    scale = float(np.max(np.abs(b)))
    chex.assert_trees_all_close(
      a, b, rtol=0, atol=rtol * scale, custom_message=jax.tree_util.keystr(path)
    )

  jax.tree_util.tree_map_with_path(close, got, want)


@functools.cache
def single_device(name, kind="images"):
  model, batch = training_batch(name, kind)
  graphdef, params, buffers = nnx.split(model, nnx.Param, ...)
  loss = training.make_loss_fn(graphdef, frozen=buffers)
  objective = lambda p: (lambda s, n: s / n)(*loss(p, gemma4.prepare_batch(batch, model.cfg)))
  return jax.jit(jax.value_and_grad(objective))(params)


# Every cp size and layout, each model at least twice, and (dp, cp) meshes;
# in CI every cp size and layout, a (dp, cp) mesh and each model at least once
# (the rest: make soak).
@pytest.mark.parametrize(
  "name,cp,layout,dp",
  [
    ("ple_kv_sharing", 2, "load_balanced", 1),
    pytest.param("ple_kv_sharing", 8, "contiguous", 1, marks=pytest.mark.slow),
    pytest.param("ple_kv_sharing", 4, "contiguous", 2, marks=pytest.mark.slow),
    pytest.param("moe_k_eq_v_vision", 2, "contiguous", 1, marks=pytest.mark.slow),
    ("moe_k_eq_v_vision", 8, "load_balanced", 1),
    pytest.param("moe_k_eq_v_vision", 4, "load_balanced", 2, marks=pytest.mark.slow),
    ("bidirectional_all", 4, "contiguous", 1),
    pytest.param("bidirectional_all", 4, "load_balanced", 1, marks=pytest.mark.slow),
    # Packed documents (and a padded image row, slow) reordered per row.
    ("ple_kv_sharing", 4, "document_balanced", 2),
    pytest.param("moe_k_eq_v_vision", 8, "document_balanced", 1, marks=pytest.mark.slow),
  ],
)
def test_cp_loss_and_gradients_equal_single_device(name, cp, layout, dp):
  kind = "packed" if (name, layout) == ("ple_kv_sharing", "document_balanced") else "images"
  model, batch = training_batch(name, kind)
  ref_loss, ref_grads = single_device(name, kind)
  if dp == 1:
    mesh, batch_axis = cp_mesh(cp), None
  else:
    mesh = jax.make_mesh((dp, cp), ("dp", "cp"), devices=jax.devices()[: dp * cp])
    batch_axis = "dp"
  sharder = model.prepare_model_inputs_for_cp(layout=layout)["cp_sharder"]
  # prepare_batch reads the packed documents from the position resets.
  sharded, shard_layout = sharder.shard_batch(
    gemma4.prepare_batch(batch, model.cfg), mesh, batch_axis=batch_axis
  )
  graphdef, params, buffers = nnx.split(model, nnx.Param, ...)
  loss = training.make_loss_fn(
    graphdef, mesh=mesh, layout=shard_layout, batch_axis=batch_axis, frozen=buffers
  )
  objective = lambda p: (lambda s, n: s / n)(*loss(p, sharded))
  with jax.set_mesh(mesh):
    params = jax.device_put(params, jax.NamedSharding(mesh, jax.P()))
    got_loss, got_grads = jax.jit(jax.value_and_grad(objective))(params)
  assert abs(float(got_loss) - float(ref_loss)) <= 1e-6 * abs(float(ref_loss))
  assert_grads_close(got_grads, ref_grads)


@pytest.mark.parametrize("policy", ["full", "save_attention_out"])
def test_remat_policies_give_the_same_gradients(policy):
  model, batch = training_batch("ple_kv_sharing")
  ref_loss, ref_grads = single_device("ple_kv_sharing")
  model = gemma4.Gemma4.from_pretrained(os.path.join(FIXTURES, "ple_kv_sharing"), remat=policy)
  graphdef, params, buffers = nnx.split(model, nnx.Param, ...)
  loss = training.make_loss_fn(graphdef, frozen=buffers)
  objective = lambda p: (lambda s, n: s / n)(*loss(p, gemma4.prepare_batch(batch, model.cfg)))
  got_loss, got_grads = jax.jit(jax.value_and_grad(objective))(params)
  assert abs(float(got_loss) - float(ref_loss)) <= 1e-6 * abs(float(ref_loss))
  assert_grads_close(got_grads, ref_grads)


def test_remat_policy_is_checked():
  with pytest.raises(ValueError, match="remat must be a bool or one of"):
    gemma4.Gemma4(gemma4.Gemma4Config.preset("tiny"), rngs=None, remat="selective")


def test_buffers_are_not_trained():
  """layer_scalar and the clip bounds are transformers buffers: not in params."""
  model, _, _ = fixture("ple_kv_sharing")
  _, params, buffers = nnx.split(model, nnx.Param, ...)
  keys = lambda state: {
    jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state)
  }
  assert any("layer_scalar" in k for k in keys(buffers))
  assert any("input_min" in k for k in keys(buffers))
  assert not any("layer_scalar" in k or "input_min" in k for k in keys(params))


def test_training_never_forms_the_logits_and_equals_the_dense_loss():
  """make_loss_fn trains Gemma 4 through hidden_states (the chunked loss):
  loss and gradients equal those of the dense logits from model(batch)."""
  model, batch = training_batch("moe_k_eq_v_vision")
  graphdef, params, buffers = nnx.split(model, nnx.Param, ...)
  batch = gemma4.prepare_batch(batch, model.cfg)
  mean = lambda s, n: s / n
  chunked = training.make_loss_fn(graphdef, frozen=buffers)
  dense = training.make_loss_fn(graphdef, frozen=buffers, forward=lambda m, b, cp: m(b))
  out = jax.eval_shape(lambda: training.default_forward(model, batch, None))
  assert isinstance(out, training.HiddenStates)
  got = jax.jit(jax.value_and_grad(lambda p: mean(*chunked(p, batch))))(params)
  want = jax.jit(jax.value_and_grad(lambda p: mean(*dense(p, batch))))(params)
  assert abs(float(got[0]) - float(want[0])) <= 1e-6 * abs(float(want[0]))
  assert_grads_close(got[1], want[1], rtol=1e-5)
