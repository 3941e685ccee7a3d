"""LoRA (cpjax.training.lora, with qwix) on Gemma 4, dense and MoE: fresh adapters
change nothing, adapter gradients equal a dense model whose weights hold ``W
+ B A * alpha / r``, and the CP step equals the single-device step on cp,
fsdp x cp x tp and expert-parallel meshes."""

import functools
import os
import re

import chex
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from cpjax import parallel, training
from cpjax.models import gemma4
from cpjax.models.gemma4.partitioning import partition_rule
from cpjax.training import lora
from tests.helpers import compiled
from tests.test_gemma4 import FIXTURES, assert_grads_close, training_batch

# Written by transformers: E2B-like (PLE, K/V sharing, a vision tower) and
# 26B-A4B-like (experts beside the dense MLP, k_eq_v, a vision tower).
NAME, MOE = "ple_kv_sharing", "moe_k_eq_v_vision"
BOTH = pytest.mark.parametrize("name", [NAME, MOE])
RANK, ALPHA = 4, 8.0


def randomize_adapters(model, seed=0, scale=0.05):
  """B (and A) to random values, so the adapters change the outputs."""
  for i, (path, var) in enumerate(nnx.iter_graph(model)):
    if isinstance(var, nnx.LoRAParam):
      var.set_value(jax.random.normal(jax.random.key(seed + i), var.shape) * scale)


@functools.cache
def adapted(remat="none", name=NAME):
  model, batch = training_batch(name)
  model = gemma4.Gemma4.from_pretrained(os.path.join(FIXTURES, name), remat=remat)
  model = lora.apply_lora(model, lora.LoraConfig(rank=RANK, alpha=ALPHA))
  randomize_adapters(model)
  return model, gemma4.prepare_batch(batch, model.cfg)


def mean_loss(loss_sums):
  return lambda p: (lambda s, n: s / n)(*loss_sums(p))


@functools.cache
def single_device(remat="none", name=NAME):
  model, batch = adapted(remat, name)
  graphdef, adapters, frozen = lora.split_lora(model)
  loss = training.make_loss_fn(graphdef, frozen=frozen)
  return jax.jit(jax.value_and_grad(mean_loss(lambda p: loss(p, batch))))(adapters)


@BOTH
def test_default_targets_are_the_decoder_projections_and_the_experts(name):
  """The attention and dense MLP projections, and on the MoE each expert
  tensor (gate_up_proj, down_proj: PEFT's target_parameters) with rank-r
  factors per expert."""
  model, _ = adapted(name=name)
  cfg = model.cfg.text
  want = set()
  for i in range(cfg.num_hidden_layers):
    prefix = f"model.language_model.layers.{i}."
    want |= {prefix + f"self_attn.{p}" for p in ("q_proj", "o_proj")}
    want |= {prefix + f"mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")}
    if cfg.kv_sharing_modes[i] != "reuse":  # a K/V-sharing layer has no k/v projection
      want |= {prefix + "self_attn.k_proj"}
      # k_eq_v: full-attention layers have no v projection (V is K).
      if not (cfg.attention_k_eq_v and cfg.layer_types[i] == "full_attention"):
        want |= {prefix + "self_attn.v_proj"}
    if cfg.enable_moe_block:
      want |= {prefix + "experts"}
  assert set(lora.adapted_modules(model)) == want
  a = model.model.language_model.layers[0].self_attn.q_proj.weight_lora_a
  b = model.model.language_model.layers[0].self_attn.q_proj.weight_lora_b
  chex.assert_shape(
    (a, b), [(cfg.hidden_size, RANK), (RANK, cfg.num_attention_heads * cfg.layer_head_dim(0))]
  )
  projections = sum(
    RANK * sum(m.weight.shape) for p, m in lora.adapted_modules(model).items() if "experts" not in p
  )
  if not cfg.enable_moe_block:
    assert lora.lora_param_count(model) == projections
    return
  e, d, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
  experts = model.model.language_model.layers[0].experts
  chex.assert_shape(
    [experts.gate_up_proj_lora_a, experts.gate_up_proj_lora_b],
    [(e, d, RANK), (e, RANK, 2 * i)],
  )
  chex.assert_shape(
    [experts.down_proj_lora_a, experts.down_proj_lora_b], [(e, i, RANK), (e, RANK, d)]
  )
  per_layer = e * RANK * ((d + 2 * i) + (i + d))
  assert lora.lora_param_count(model) == projections + cfg.num_hidden_layers * per_layer


@BOTH
def test_fresh_adapters_leave_the_logits_exactly_unchanged(name):
  model, batch = training_batch(name)
  base = gemma4.Gemma4.from_pretrained(os.path.join(FIXTURES, name))
  batch = gemma4.prepare_batch(batch, base.cfg)
  fresh = lora.apply_lora(base, lora.LoraConfig(rank=RANK, alpha=ALPHA))
  a = fresh.model.language_model.layers[1].mlp.up_proj.weight_lora_a[...]
  assert float(jnp.abs(a).max()) > 0 and a.dtype == jnp.float32  # A is random, B zero
  chex.assert_trees_all_equal(fresh(batch), base(batch))


def dense_reference(model, batch, name=NAME):
  """Loss and {adapted tensor: (dA, dB)} of the plain base model (no qwix)
  whose targeted weights are ``W + scale * (A B).T`` and whose expert
  tensors are ``W[e] + scale * (A[e] B[e]).T``."""
  scale = model.lora_config.scale
  plain = gemma4.Gemma4.from_pretrained(os.path.join(FIXTURES, name))
  graphdef, params, buffers = nnx.split(plain, nnx.Param, ...)
  pairs = {
    f"{p}.{n}": (a[...], b[...])
    for p, m in lora.adapted_modules(model).items()
    for n, (a, b) in lora.adapters.adapter_pairs(m).items()
  }

  def objective(pairs, params):
    weights = nnx.to_pure_dict(params)
    for p, (a, b) in pairs.items():
      node = weights
      *path, tensor = p.split(".")
      for part in path:
        node = node[int(part) if part.isdigit() else part]
      delta = jnp.einsum("...ir,...ro->...oi", a, b, precision=jax.lax.Precision.HIGHEST)
      node[tensor] = node[tensor] + scale * delta
    nnx.replace_by_pure_dict(params, weights)
    s, n = training.cross_entropy(
      nnx.merge(graphdef, params, buffers).hidden_states(batch), batch["labels"]
    )
    return s / n

  return jax.jit(jax.value_and_grad(objective))(pairs, params)


def get_module(model, path):
  for part in path.split("."):
    model = model[int(part)] if part.isdigit() else getattr(model, part)
  return model


def as_pairs(grads):
  """{adapted tensor path: (dA, dB)} of an adapters' State."""
  flat = {".".join(map(str, k)): v for k, v in nnx.to_flat_state(grads)}
  return {
    p[: -len("_lora_a")]: (flat[p][...], flat[p[:-1] + "b"][...])
    for p in flat
    if p.endswith("_lora_a")
  }


@pytest.mark.parametrize("remat,name", [("none", NAME), ("full", NAME), ("full", MOE)])
def test_adapter_gradients_equal_the_dense_reference(remat, name):
  """``full`` remat replays the forward's trace in the backward: a re-trace
  would recompute the layers without their adapters (zero gradients)."""
  model, batch = adapted(remat, name)
  ref_loss, ref_grads = dense_reference(model, batch, name)
  got_loss, got_grads = single_device(remat, name)
  assert abs(float(got_loss) - float(ref_loss)) <= 1e-6 * abs(float(ref_loss))
  assert_grads_close(as_pairs(got_grads), ref_grads)
  assert all(float(jnp.abs(g).max()) > 0 for pair in ref_grads.values() for g in pair)


def test_adapter_gradients_with_the_mlp_in_tiles(monkeypatch):
  """A long row's MLP goes in rematerialised tiles of tokens: the adapters
  inside it (gate, up, down) still get the dense reference's gradients."""
  from cpjax.models.gemma4 import text

  model, batch = adapted("full", NAME)
  ref_loss, ref_grads = dense_reference(model, batch, NAME)  # the row in one piece
  monkeypatch.setattr(text, "MLP_TILE_VALUES", 1)  # a tile per token
  graphdef, adapters, frozen = lora.split_lora(model)
  loss = training.make_loss_fn(graphdef, frozen=frozen)
  got_loss, got_grads = jax.jit(jax.value_and_grad(mean_loss(lambda p: loss(p, batch))))(adapters)
  assert abs(float(got_loss) - float(ref_loss)) <= 1e-6 * abs(float(ref_loss))
  got = as_pairs(got_grads)
  assert any("mlp" in path for path in got)
  assert_grads_close(got, ref_grads)


# Both layouts in CI (load_balanced on the 3-axis mesh, contiguous on the
# MoE's fsdp x cp); the dense model on cp alone in `make soak`. The MoE:
# experts split over cp (ep=4, load-balanced), over fsdp x cp (ep=4,
# contiguous), and (`make soak`) replicated beside tp.
@pytest.mark.parametrize(
  "name,mesh_sizes,layout",
  [
    pytest.param(NAME, {"cp": 4}, "load_balanced", marks=pytest.mark.slow),
    pytest.param(NAME, {"cp": 4}, "contiguous", marks=pytest.mark.slow),
    (NAME, {"fsdp": 2, "cp": 2, "tp": 2}, "load_balanced"),
    (MOE, {"cp": 4, "ep": 4}, "load_balanced"),
    (MOE, {"fsdp": 2, "cp": 2, "ep": 4}, "contiguous"),
    pytest.param(MOE, {"fsdp": 2, "cp": 2, "tp": 2}, "load_balanced", marks=pytest.mark.slow),
  ],
)
def test_lora_cp_gradients_equal_single_device(name, mesh_sizes, layout):
  model, batch = adapted(name=name)
  ref_loss, ref_grads = single_device(name=name)
  sizes = dict(mesh_sizes)
  ep = sizes.pop("ep", 1)
  mesh = parallel.make_mesh(**sizes)
  experts = parallel.expert_axes(mesh, ep)
  sharder = model.prepare_model_inputs_for_cp(layout=layout)["cp_sharder"]
  sharded, shard_layout = sharder.shard_batch(batch, mesh, batch_axis=parallel.batch_axis_of(mesh))
  graphdef, adapters, frozen = lora.split_lora(model)
  rule = partition_rule(model.cfg, tp=sizes.get("tp", 1), expert_axes=experts)
  adapters = parallel.shard_params(adapters, mesh, parallel.param_specs(adapters, mesh, rule=rule))
  frozen = parallel.shard_params(frozen, mesh, parallel.param_specs(frozen, mesh, rule=rule))
  loss = training.make_loss_fn(
    graphdef,
    mesh=mesh,
    layout=shard_layout,
    batch_axis=parallel.batch_axis_of(mesh),
    expert_axes=experts,
  )
  objective = lambda p, f: mean_loss(lambda q: loss(q, sharded, f))(p)
  with jax.set_mesh(mesh):
    got_loss, got_grads = jax.jit(jax.value_and_grad(objective))(adapters, frozen)
  assert abs(float(got_loss) - float(ref_loss)) <= 1e-6 * abs(float(ref_loss))
  assert_grads_close(jax.device_get(got_grads), ref_grads)


def test_adapters_made_on_a_mesh_equal_those_made_on_one_device():
  """apply_lora on an MoE checkpoint loaded onto an Explicit training mesh
  (its creation pass runs the experts' ragged_dot, which has no Explicit
  typing rule): the same adapters as on one device, and the base left
  where it was."""
  from cpjax.models.gemma4.checkpoint import checkpoint_keys

  mesh = parallel.make_mesh(fsdp=2, cp=2)
  path = os.path.join(FIXTURES, MOE)
  base = gemma4.Gemma4.from_pretrained(path, mesh=mesh)
  placed = {k: v.get_value().sharding for k, v in checkpoint_keys(base).items()}
  on_mesh = lora.apply_lora(base, lora.LoraConfig(rank=RANK, alpha=ALPHA))
  one = lora.apply_lora(
    gemma4.Gemma4.from_pretrained(path), lora.LoraConfig(rank=RANK, alpha=ALPHA)
  )
  assert {k: v.get_value().sharding for k, v in checkpoint_keys(base).items()} == placed
  for key, var in checkpoint_keys(on_mesh).items():
    if key in placed:
      assert var.get_value().sharding == placed[key], key
  chex.assert_trees_all_equal(
    jax.device_get(nnx.state(on_mesh, nnx.LoRAParam)), jax.device_get(nnx.state(one, nnx.LoRAParam))
  )
  # The adapters on the base's mesh (the compiled creation pass's too: its
  # program keeps the base as inputs, though its outputs need none of it).
  for leaf in jax.tree.leaves(nnx.state(on_mesh, nnx.LoRAParam)):
    assert leaf.sharding.device_set == set(mesh.devices.flat), leaf.sharding


def test_the_creation_pass_is_one_cached_program_equal_to_qwixs_eager_pass():
  """apply_lora runs qwix's creation pass compiled (one program, cached with
  the model's structure): the adapters, the base and the forward equal the
  eager pass's bit for bit on the MoE checkpoint; the base arrays are the
  model's own, not copies; a second call makes no new program; a forward
  that reads its values in Python falls back to the eager pass."""
  from cpjax.training.lora import adapters

  settings = lora.LoraConfig(rank=RANK, alpha=ALPHA)
  base = gemma4.Gemma4.from_pretrained(os.path.join(FIXTURES, MOE))
  programs = adapters._creation_program._cache_size()
  fast = lora.apply_lora(base, settings, seed=3)
  assert adapters._creation_program._cache_size() == programs + 1
  again = lora.apply_lora(base, settings, seed=3)
  assert adapters._creation_program._cache_size() == programs + 1  # a cache hit
  chex.assert_trees_all_equal(nnx.state(again), nnx.state(fast))

  matched = sorted(p for p in adapters.module_paths(base) if settings.matches(p))
  key = (settings, tuple(matched), (), "hidden_states", 3)
  eager = adapters._creation_pass(base, key, *base.example_inputs())
  adapters._adapt_parameters(eager, settings, adapters.parameter_targets(eager, settings), 3)
  chex.assert_trees_all_equal(nnx.state(fast), nnx.state(eager))
  ((batch,), _) = base.example_inputs()
  chex.assert_trees_all_equal(fast.hidden_states(batch), eager.hidden_states(batch))
  kept = jax.tree.leaves(nnx.state(fast, nnx.Not(nnx.LoRAParam)))
  assert all(a is b for a, b in zip(kept, jax.tree.leaves(nnx.state(base)), strict=True))

  class ReadsValues(nnx.Module):
    def __init__(self, rngs):
      self.up = nnx.Linear(4, 8, rngs=rngs)

    def __call__(self, x):
      return self.up(x) * (2.0 if float(x.sum()) > 0 else 1.0)  # no tracer allowed

  x = jnp.ones((2, 4))
  tiny = lora.apply_lora(
    ReadsValues(nnx.Rngs(0)), lora.LoraConfig(rank=2, alpha=2.0, targets=("up",)), x
  )
  assert tiny.up.kernel_lora_a.shape == (4, 2)
  chex.assert_trees_all_equal(tiny(x), ReadsValues(nnx.Rngs(0))(x))


def test_lora_partition_rule_follows_the_weight():
  """tp splits A of a column-split projection by its input rows and B of a
  row-split one by its output columns; the other factor stays whole."""
  from jax.sharding import PartitionSpec as P

  rule = partition_rule(gemma4.Gemma4Config.preset("tiny"), tp=2)
  at = lambda block, name, leaf: rule(
    ("model", "language_model", "layers", "0", block, name, leaf), (8, 8)
  )
  assert [
    at("self_attn", "q_proj", leaf) for leaf in ("weight", "weight_lora_a", "weight_lora_b")
  ] == [P("tp", None), P(), P(None, "tp")]
  assert [
    at("mlp", "down_proj", leaf) for leaf in ("weight", "weight_lora_a", "weight_lora_b")
  ] == [P(None, "tp"), P("tp", None), P()]


def test_bfloat16_base_keeps_the_activation_dtype():
  """As PEFT: float32 adapters on a bfloat16 base, their term added in
  float32 and each projection's output cast back to the activations' dtype."""
  import jax.numpy as jnp

  base = gemma4.Gemma4.from_pretrained(os.path.join(FIXTURES, NAME), dtype=jnp.bfloat16)
  model = lora.apply_lora(base, lora.LoraConfig(rank=RANK))
  randomize_adapters(model)
  proj = model.model.language_model.layers[0].self_attn.q_proj
  assert proj.weight[...].dtype == jnp.bfloat16 and proj.weight_lora_a[...].dtype == jnp.float32
  _, batch = adapted()
  out = compiled(model, "hidden_states")(batch)
  assert out.hidden.dtype == jnp.bfloat16
  plain = compiled(base, "hidden_states")(batch).hidden
  assert float(jnp.abs(out.hidden.astype(jnp.float32) - plain).max()) > 0


@pytest.mark.parametrize(
  "alpha,rslora,targets",
  [
    (16.0, False, lora.DEFAULT_LORA_TARGETS),
    (16.0, True, lora.DEFAULT_LORA_TARGETS),
    (
      3.0,
      False,
      ("language_model.layers.0.self_attn.o_proj", "language_model.layers.1.mlp.down_proj"),
    ),
    (5.0, True, r".*language_model\.layers\.[02]\.self_attn\.q_proj"),
  ],
)
def test_merged_model_equals_the_adapted_model_for_every_option(alpha, rslora, targets):
  """merge_lora(model)'s logits are the adapted model's for each LoRA option
  (alpha, rsLoRA's 1 / sqrt(r), targets as names or a regex), and only the
  targeted weights move."""
  from cpjax.models.gemma4.checkpoint import checkpoint_keys

  _, batch = adapted()
  base = gemma4.Gemma4.from_pretrained(os.path.join(FIXTURES, NAME))
  config = lora.LoraConfig(rank=RANK, alpha=alpha, use_rslora=rslora, targets=targets)
  model = lora.apply_lora(base, config)
  randomize_adapters(model, scale=0.2)
  merged = lora.merge_lora(model)
  assert type(merged) is gemma4.Gemma4 and not lora.adapted_modules(merged)
  want = compiled(model)(batch)
  chex.assert_trees_all_close(
    compiled(merged)(batch), want, rtol=0, atol=2e-5 * float(jnp.abs(want).max())
  )
  assert float(jnp.abs(want - compiled(base)(batch)).max()) > 0.1  # the adapters matter
  moved = {
    k
    for k, v in checkpoint_keys(merged).items()
    if not jnp.array_equal(v.get_value(), checkpoint_keys(base)[k].get_value())
  }
  assert moved == {p + ".weight" for p in lora.adapted_modules(model)}


@pytest.mark.parametrize(
  "config, error, message",
  [
    ({"rank": 4}, TypeError, "apply_lora's config must be a LoraConfig"),
    (lora.LoraConfig(), ValueError, "LoRA rank must be an integer >= 1, got None"),
    (lora.LoraConfig(rank=0), ValueError, "LoRA rank must be an integer >= 1, got 0"),
    (
      lora.LoraConfig(rank=2, alpha=float("nan")),
      ValueError,
      "LoRA alpha must be a positive number, got nan",
    ),
    (lora.LoraConfig(rank=2, targets="(q"), ValueError, "is not a regular expression"),
    (
      lora.LoraConfig(rank=2, targets=("q_proj", "")),
      TypeError,
      "LoRA targets must be a regex string or a tuple of names ((): none)",
    ),
  ],
)
def test_a_bad_lora_config_is_refused_before_the_model_runs(config, error, message):
  """apply_lora checks its one config (the run config's lora section, the
  same class) before qwix runs the model."""
  base = gemma4.Gemma4.from_pretrained(os.path.join(FIXTURES, NAME))
  with pytest.raises(error, match=re.escape(message)):
    lora.apply_lora(base, config)


def test_peft_list_targets_become_a_tuple():
  """PEFT's target_modules may be a JSON list; the config keeps it as a
  (hashable) tuple of names, matched as PEFT matches them."""
  config = lora.LoraConfig(rank=2, targets=["q_proj", "layers.1.mlp.down_proj"])
  assert config.targets == ("q_proj", "layers.1.mlp.down_proj")
  assert config.matches("model.language_model.layers.0.self_attn.q_proj")
  assert config.matches("model.language_model.layers.1.mlp.down_proj")
  assert not config.matches("model.language_model.layers.0.self_attn.k_proj")
  assert not config.matches("model.language_model.layers.0.self_attn.xq_proj")


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_expert_adapters_equal_experts_with_the_merged_tensors(capacity_factor):
  """The experts' forward with per-expert adapters is the plain experts'
  forward on ``W_e + scale * (A_e B_e).T``, with or without a capacity
  factor dropping pairs (0.5: half of them), and so are the gradients."""
  model, _ = adapted(name=MOE)
  experts = model.model.language_model.layers[1].experts
  cfg = model.cfg.text
  key = jax.random.key(7)
  x = jax.random.normal(key, (24, cfg.hidden_size))
  ids = jax.random.randint(jax.random.fold_in(key, 1), (24, 2), 0, cfg.num_experts)
  w = jax.random.uniform(jax.random.fold_in(key, 2), (24, 2))
  scale = model.lora_config.scale
  graphdef, factors, base = nnx.split(experts, nnx.LoRAParam, ...)
  assert sorted(lora.adapters.adapter_pairs(experts)) == ["down_proj", "gate_up_proj"]
  plain_def, plain_state = nnx.split(gemma4.text.Experts(cfg, rngs=None))

  def merged(factors, x):
    f, tensors = nnx.to_pure_dict(factors), nnx.to_pure_dict(plain_state)
    for name in ("gate_up_proj", "down_proj"):
      delta = jnp.einsum(
        "eir,ero->eoi",
        f[name + "_lora_a"],
        f[name + "_lora_b"],
        precision=jax.lax.Precision.HIGHEST,
      )
      tensors[name] = getattr(experts, name)[...] + scale * delta
    state = nnx.clone(plain_state)
    nnx.replace_by_pure_dict(state, tensors)
    return nnx.merge(plain_def, state)(x, w, ids, capacity_factor=capacity_factor)

  def ours(factors, x):
    return nnx.merge(graphdef, factors, base)(x, w, ids, capacity_factor=capacity_factor)

  probe = jax.random.normal(jax.random.fold_in(key, 3), x.shape)
  want, want_stats = jax.jit(merged)(factors, x)
  got, stats = jax.jit(ours)(factors, x)
  assert (float(stats.dropped) > 0) == (capacity_factor is not None)
  chex.assert_trees_all_equal(stats, want_stats)
  chex.assert_trees_all_close(got, want, rtol=0, atol=2e-5 * float(jnp.abs(want).max()))
  objective = lambda run: lambda f, x: jnp.sum(run(f, x)[0] * probe)
  want_grads = jax.jit(jax.grad(objective(merged), argnums=(0, 1)))(factors, x)
  got_grads = jax.jit(jax.grad(objective(ours), argnums=(0, 1)))(factors, x)
  assert_grads_close(got_grads, want_grads)


@pytest.mark.parametrize(
  "tensors,message",
  [
    (("router.scale",), "name tensors cpjax cannot adapt: ['model.language_model.layers.0.router"),
    (("experts.up_proj",), "match no tensor of the Gemma4 (those it can adapt: ['model."),
    (r".*\.experts\.down", "match no tensor of the Gemma4"),
  ],
)
def test_target_parameters_naming_what_cannot_be_adapted_are_refused(tensors, message):
  """PEFT's target_parameters naming a tensor no module adapts (the router's
  scale), or, given by the user, nothing at all: a ValueError naming them,
  before the model runs."""
  base = gemma4.Gemma4.from_pretrained(os.path.join(FIXTURES, MOE))
  with pytest.raises(ValueError, match=re.escape(message)):
    lora.apply_lora(base, lora.LoraConfig(rank=RANK, target_parameters=tensors))


def test_empty_targets_adapt_the_experts_alone():
  """``targets=()`` (the README's ``--lora.targets '[]'``): per-expert
  adapters and no projection's; the model keeps its class, and merging
  folds them into the expert tensors alone."""
  from cpjax.models.gemma4.checkpoint import checkpoint_keys

  base = gemma4.Gemma4.from_pretrained(os.path.join(FIXTURES, MOE))
  model = lora.apply_lora(base, lora.LoraConfig(rank=RANK, targets=()))
  layers = base.cfg.text.num_hidden_layers
  assert sorted(lora.adapted_modules(model)) == [
    f"model.language_model.layers.{i}.experts" for i in range(layers)
  ]
  randomize_adapters(model, scale=0.2)
  merged = lora.merge_lora(model)
  assert type(merged) is gemma4.Gemma4
  moved = {
    k
    for k, v in checkpoint_keys(merged).items()
    if not jnp.array_equal(v.get_value(), checkpoint_keys(base)[k].get_value())
  }
  assert moved == {
    f"model.language_model.layers.{i}.experts.{n}"
    for i in range(layers)
    for n in ("gate_up_proj", "down_proj")
  }
