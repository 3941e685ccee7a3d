"""LoRA (cpjax.lora, with qwix) on Gemma 4: fresh adapters change nothing,
adapter gradients equal a dense model whose weights hold ``W + B A * alpha / r``,
and the CP step equals the single-device step on cp and fsdp x cp x tp meshes."""

import functools
import os

import chex
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from cpjax import lora, parallel, train
from cpjax.models import gemma4
from cpjax.models.gemma4.partitioning import partition_rule
from tests.test_gemma4 import FIXTURES, assert_grads_close, training_batch

NAME = "ple_kv_sharing"      # written by transformers: PLE, K/V sharing, a vision tower
RANK, ALPHA = 4, 8.0


def randomize_adapters(model, seed=0, scale=0.05):
  """B (and A) to random values, so the adapters change the outputs."""
  for i, (path, var) in enumerate(nnx.iter_graph(model)):
    if isinstance(var, nnx.LoRAParam):
      var.set_value(jax.random.normal(jax.random.key(seed + i), var.shape) * scale)


@functools.cache
def adapted(remat="none"):
  model, batch = training_batch(NAME)
  model = gemma4.Gemma4.from_pretrained(os.path.join(FIXTURES, NAME), remat=remat)
  model = lora.apply_lora(model, rank=RANK, alpha=ALPHA)
  randomize_adapters(model)
  return model, gemma4.prepare_batch(batch, model.cfg)


def mean_loss(loss_sums):
  return lambda p: (lambda s, n: s / n)(*loss_sums(p))


@functools.cache
def single_device(remat="none"):
  model, batch = adapted(remat)
  graphdef, adapters, frozen = lora.split_lora(model)
  loss = train.make_loss_fn(graphdef, frozen=frozen)
  return jax.jit(jax.value_and_grad(mean_loss(lambda p: loss(p, batch))))(adapters)


def test_default_targets_are_the_decoder_projections():
  model, _ = adapted()
  cfg = model.cfg.text
  want = set()
  for i in range(cfg.num_hidden_layers):
    prefix = f"model.language_model.layers.{i}."
    want |= {prefix + f"self_attn.{p}" for p in ("q_proj", "o_proj")}
    want |= {prefix + f"mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")}
    if cfg.kv_sharing_modes[i] != "reuse":       # a K/V-sharing layer has no k/v projection
      want |= {prefix + "self_attn.k_proj", prefix + "self_attn.v_proj"}
  assert set(lora.adapted_modules(model)) == want
  a = model.model.language_model.layers[0].self_attn.q_proj.weight_lora_a
  b = model.model.language_model.layers[0].self_attn.q_proj.weight_lora_b
  chex.assert_shape((a, b), [(cfg.hidden_size, RANK), (RANK, cfg.num_attention_heads
                                                       * cfg.layer_head_dim(0))])
  assert lora.lora_param_count(model) == sum(
      RANK * sum(w.weight.shape) for w in lora.adapted_modules(model).values())


def test_fresh_adapters_leave_the_logits_exactly_unchanged():
  model, batch = training_batch(NAME)
  base = gemma4.Gemma4.from_pretrained(os.path.join(FIXTURES, NAME))
  batch = gemma4.prepare_batch(batch, base.cfg)
  fresh = lora.apply_lora(base, rank=RANK, alpha=ALPHA)
  a = fresh.model.language_model.layers[1].mlp.up_proj.weight_lora_a[...]
  assert float(jnp.abs(a).max()) > 0 and a.dtype == jnp.float32   # A is random, B zero
  chex.assert_trees_all_equal(fresh(batch), base(batch))


def dense_reference(model, batch):
  """Loss and {module: (dA, dB)} of the plain base model (no qwix) whose
  targeted weights are ``W + scale * (A B).T``."""
  scale = model.lora_settings.scale
  plain = gemma4.Gemma4.from_pretrained(os.path.join(FIXTURES, NAME))
  graphdef, params, buffers = nnx.split(plain, nnx.Param, ...)
  pairs = {p: (m.weight_lora_a[...], m.weight_lora_b[...])
           for p, m in lora.adapted_modules(model).items()}

  def objective(pairs, params):
    weights = nnx.to_pure_dict(params)
    for p, (a, b) in pairs.items():
      node = weights
      for part in p.split("."):
        node = node[int(part) if part.isdigit() else part]
      node["weight"] = node["weight"] + scale * (a @ b).T
    nnx.replace_by_pure_dict(params, weights)
    s, n = train.cross_entropy(nnx.merge(graphdef, params, buffers).hidden_states(batch),
                               batch["labels"])
    return s / n
  return jax.jit(jax.value_and_grad(objective))(pairs, params)


def get_module(model, path):
  for part in path.split("."):
    model = model[int(part)] if part.isdigit() else getattr(model, part)
  return model


def as_pairs(grads):
  """{module path: (dA, dB)} of an adapters' State."""
  flat = {".".join(map(str, k)): v for k, v in nnx.to_flat_state(grads)}
  return {p[:-len(".weight_lora_a")]: (flat[p][...], flat[p[:-1] + "b"][...])
          for p in flat if p.endswith("weight_lora_a")}


@pytest.mark.parametrize("remat", ["none", "full"])
def test_adapter_gradients_equal_the_dense_reference(remat):
  """``full`` remat replays the forward's trace in the backward: a re-trace
  would recompute the layers without their adapters (zero gradients)."""
  model, batch = adapted(remat)
  ref_loss, ref_grads = dense_reference(model, batch)
  got_loss, got_grads = single_device(remat)
  assert abs(float(got_loss) - float(ref_loss)) <= 1e-6 * abs(float(ref_loss))
  assert_grads_close(as_pairs(got_grads), ref_grads)
  assert all(float(jnp.abs(g).max()) > 0 for pair in ref_grads.values() for g in pair)


# Both layouts in CI (load_balanced on the 3-axis mesh); cp alone
# load-balanced in `make soak`.
@pytest.mark.parametrize("mesh_sizes,layout", [
    pytest.param({"cp": 4}, "load_balanced", marks=pytest.mark.slow),
    ({"cp": 4}, "contiguous"),
    ({"fsdp": 2, "cp": 2, "tp": 2}, "load_balanced")])
def test_lora_cp_gradients_equal_single_device(mesh_sizes, layout):
  model, batch = adapted()
  ref_loss, ref_grads = single_device()
  mesh = parallel.make_mesh(**mesh_sizes)
  sharder = model.prepare_model_inputs_for_cp(layout=layout)["cp_sharder"]
  sharded, shard_layout = sharder.shard_batch(batch, mesh,
                                              batch_axis=parallel.batch_axis_of(mesh))
  graphdef, adapters, frozen = lora.split_lora(model)
  rule = partition_rule(model.cfg, tp=mesh_sizes.get("tp", 1))
  adapters = parallel.shard_params(adapters, mesh, parallel.param_specs(adapters, mesh, rule=rule))
  frozen = parallel.shard_params(frozen, mesh, parallel.param_specs(frozen, mesh, rule=rule))
  loss = train.make_loss_fn(graphdef, mesh=mesh, layout=shard_layout,
                            batch_axis=parallel.batch_axis_of(mesh))
  objective = lambda p, f: mean_loss(lambda q: loss(q, sharded, f))(p)
  with jax.set_mesh(mesh):
    got_loss, got_grads = jax.jit(jax.value_and_grad(objective))(adapters, frozen)
  assert abs(float(got_loss) - float(ref_loss)) <= 1e-6 * abs(float(ref_loss))
  assert_grads_close(jax.device_get(got_grads), ref_grads)


def test_lora_partition_rule_follows_the_weight():
  """tp splits A of a column-split projection by its input rows and B of a
  row-split one by its output columns; the other factor stays whole."""
  from jax.sharding import PartitionSpec as P

  rule = partition_rule(gemma4.Gemma4Config.preset("tiny"), tp=2)
  at = lambda block, name, leaf: rule(("model", "language_model", "layers", "0", block, name,
                                       leaf), (8, 8))
  assert [at("self_attn", "q_proj", leaf) for leaf in ("weight", "weight_lora_a",
                                                       "weight_lora_b")] == [
      P("tp", None), P(), P(None, "tp")]
  assert [at("mlp", "down_proj", leaf) for leaf in ("weight", "weight_lora_a",
                                                    "weight_lora_b")] == [
      P(None, "tp"), P("tp", None), P()]


def test_bfloat16_base_keeps_the_activation_dtype():
  """As PEFT: float32 adapters on a bfloat16 base, their term added in
  float32 and each projection's output cast back to the activations' dtype."""
  import jax.numpy as jnp

  base = gemma4.Gemma4.from_pretrained(os.path.join(FIXTURES, NAME), dtype=jnp.bfloat16)
  model = lora.apply_lora(base, rank=RANK)
  randomize_adapters(model)
  proj = model.model.language_model.layers[0].self_attn.q_proj
  assert proj.weight[...].dtype == jnp.bfloat16 and proj.weight_lora_a[...].dtype == jnp.float32
  _, batch = adapted()
  out = model.hidden_states(batch)
  assert out.hidden.dtype == jnp.bfloat16
  assert float(jnp.abs(out.hidden.astype(jnp.float32) - base.hidden_states(batch).hidden).max()) > 0
