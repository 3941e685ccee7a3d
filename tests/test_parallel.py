"""FSDP x CP x TP training meshes (cpjax.parallel) and gradient accumulation,
against the single-device step of the same model and batch.

Every mesh step must give the single-device loss (relative 1e-6) and the
single-device update. The update is SGD with learning rate 1 (the update IS
the gradient), held to 1e-4 of each leaf's largest update: float32's own
floor here, where the single-device gradients themselves differ from a
float64-parameter computation by up to 5e-5 of the leaf scale (measured on
these models), so no reduction order does better.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from cpjax import parallel, training
from cpjax.models import gemma4
from cpjax.models.gemma4.partitioning import check_mesh, partition_rule
from cpjax.training import loss as loss_module
from tests import attention_harness as H
from tests.helpers import fewest_layers

B, S = 4, 64


@functools.lru_cache(maxsize=None)
def setup(preset):
  """The preset's config, a model, its split and a batch of B rows of S tokens.

  tiny-moe is cut to its fewest layers (tests.helpers.fewest_layers). The
  dense tiny keeps its six: on four, its vision projection's update is so
  small that float32 reordering alone (two microbatches against the whole
  batch, one device) moves it by 3.2e-4 of itself, past assert_same_update's
  tolerance."""
  cfg = gemma4.Gemma4Config.preset(preset)
  if preset == "tiny-moe":
    cfg = fewest_layers(cfg)
  model = gemma4.Gemma4(cfg, rngs=nnx.Rngs(0))
  graphdef, params, buffers = nnx.split(model, nnx.Param, ...)
  batch = gemma4.synthetic_batch(np.random.default_rng(1), cfg, batch_size=B, seq_len=S, max_docs=3)
  return cfg, model, graphdef, params, buffers, batch


def copy(tree):
  return jax.tree.map(jnp.copy, tree)


@functools.lru_cache(maxsize=None)
def single_device_step(preset):
  """(loss, updated params) of one SGD(1) step on one device."""
  cfg, _, graphdef, params, buffers, batch = setup(preset)
  opt = optax.sgd(1.0)
  step = training.make_train_step(graphdef, opt, frozen=buffers)
  new, _, metrics = step(copy(params), opt.init(params), gemma4.prepare_batch(batch, cfg))
  return float(metrics["loss"]), jax.device_get(new)


def mesh_step(
  preset,
  shape,
  *,
  microbatches=1,
  optimizer=None,
  state_axes=parallel.STATE_AXES,
  remat=None,
  implementation=None,
  interpret=False,
  strategy="ring",
  loss_strategy="ring",
):
  """Shard the model over make_mesh(**shape) (its state over ``state_axes``),
  run one step (the ring's hops on ``implementation``, attention's CP
  ``strategy``, the loss's ``loss_strategy``); also return the compiled step."""
  cfg, model, graphdef, params, buffers, batch = setup(preset)
  if remat is not None:
    model = gemma4.Gemma4(cfg, rngs=nnx.Rngs(0), remat=remat)
    graphdef, _, _ = nnx.split(model, nnx.Param, ...)
  mesh = parallel.make_mesh(**shape)
  check_mesh(cfg, mesh, seq_len=S, batch_size=B)
  specs = parallel.param_specs(
    params, mesh, rule=partition_rule(cfg, tp=shape.get("tp", 1)), state_axes=state_axes
  )
  placed = parallel.shard_params(copy(params), mesh, specs)
  opt = optimizer or optax.sgd(1.0)
  opt_state = parallel.shard_like_params(opt.init(placed), placed)
  sharder = model.prepare_model_inputs_for_cp(layout="load_balanced")["cp_sharder"]
  batch_axis = parallel.batch_axis_of(mesh)
  if microbatches == 1:
    sharded, layout = sharder.shard_batch(
      batch, mesh, batch_axis=batch_axis, implementation=implementation
    )
  else:
    rows = B // microbatches
    parts = [
      sharder.shard_batch(_rows(batch, i * rows, (i + 1) * rows), mesh, batch_axis=batch_axis)
      for i in range(microbatches)
    ]
    sharded, layout = [p[0] for p in parts], parts[0][1]
  step = training.make_train_step(
    graphdef,
    opt,
    mesh=mesh,
    layout=layout,
    frozen=buffers,
    implementation=implementation,
    interpret=interpret,
    strategy=strategy,
    loss_strategy=loss_strategy,
  )
  step = step.compile(placed, opt_state, sharded)
  new, _, metrics = step(placed, opt_state, sharded)
  return float(metrics["loss"]), new, step, placed, sharded


def _rows(batch, start, stop):
  """Rows [start, stop) of a processor-style batch; images stay with their rows."""
  out = {
    k: v[start:stop] for k, v in batch.items() if k not in ("pixel_values", "image_position_ids")
  }
  if "pixel_values" in batch:
    per_row = len(batch["pixel_values"]) // B  # synthetic_batch: images_per_row per row
    out["pixel_values"] = batch["pixel_values"][start * per_row : stop * per_row]
    out["image_position_ids"] = batch["image_position_ids"][start * per_row : stop * per_row]
  return out


def assert_same_update(got, want, params, *, tol=3e-4):
  """Every leaf's update (params - new) within ``tol`` of that leaf's largest update.

  Float32 reordering alone moves the worst leaf (the vision embedder's
  projection, a sum over soft tokens with much cancellation) by 1.2e-4 of
  its largest update on some CPUs: measured with the single-device step on
  two microbatches against the whole batch, no mesh involved (3e-5 on
  others). A missing or doubled term moves a leaf by its whole scale."""
  for (path, g), w, p in zip(
    jax.tree_util.tree_leaves_with_path(jax.device_get(got)),
    jax.tree.leaves(want),
    jax.tree.leaves(jax.device_get(params)),
  ):
    update_got, update_want = np.asarray(p) - np.asarray(g), np.asarray(p) - np.asarray(w)
    scale = float(np.max(np.abs(update_want)))
    err = float(np.max(np.abs(update_got - update_want)))
    # Updates are read back as differences of stored parameters: 2 ulp of
    # the parameters is the finest difference float32 can show.
    ulp = float(np.spacing(np.max(np.abs(np.asarray(p))).astype(np.float32)))
    assert err <= tol * scale + 2 * ulp, (jax.tree_util.keystr(path), err, scale)


def shardings(tree):
  return [x.sharding for x in jax.tree.leaves(tree)]


def global_relative_error(got, want, params):
  """|update_got - update_want| / |update_want| over the whole tree."""
  num = den = 0.0
  for g, w, p in zip(
    jax.tree.leaves(jax.device_get(got)),
    jax.tree.leaves(want),
    jax.tree.leaves(jax.device_get(params)),
  ):
    num += float(np.sum((np.asarray(w) - np.asarray(g)) ** 2))
    den += float(np.sum((np.asarray(p) - np.asarray(w)) ** 2))
  return (num / den) ** 0.5


# (fsdp 2, cp 4) runs as two accumulated microbatches: against the whole-batch
# single-device step it checks the mesh and accumulation on it at once.
# CI runs (fsdp 2, cp 2, tp 2) on the MoE model (experts split over tp); the
# rest are in `make soak`: CI has fsdp 2 x cp 4 in the hybrid strategy's step
# below, accumulation on one device below and on an ep mesh in
# tests/test_experts.py, and the state's per-device bytes in
# tests/test_state_sharding.py.
MESHES = [
  pytest.param("tiny", {"fsdp": 2, "cp": 4}, 2, marks=pytest.mark.slow),
  pytest.param("tiny", {"fsdp": 4, "cp": 2}, 1, marks=pytest.mark.slow),
  pytest.param("tiny", {"fsdp": 2, "cp": 2, "tp": 2}, 1, marks=pytest.mark.slow),
  ("tiny-moe", {"fsdp": 2, "cp": 2, "tp": 2}, 1),
]


@pytest.mark.parametrize(
  "preset,shape,microbatches",
  MESHES,
  ids=lambda v: (
    v
    if isinstance(v, str)
    else f"microbatches{v}"
    if isinstance(v, int)
    else "x".join(f"{k}{n}" for k, n in v.items())
  ),
)
def test_mesh_step_equals_single_device_step(preset, shape, microbatches):
  _, _, _, params, buffers, _ = setup(preset)
  want_loss, want = single_device_step(preset)
  loss, new, step, placed, sharded = mesh_step(preset, shape, microbatches=microbatches)
  assert abs(loss - want_loss) <= 1e-6 * want_loss
  assert_same_update(new, want, params)
  # The update keeps every leaf's sharding (step 2 reuses step 1's program).
  assert shardings(new) == shardings(placed)
  # Per-device parameter bytes shrink by fsdp x cp x tp (the state split over
  # every device): the shards the compiled program takes its parameters in
  # (SGD keeps no optimizer state).
  compiled_params = step.input_shardings[0]
  per_device = sum(
    int(np.prod(sharding.shard_shape(x.shape))) * x.dtype.itemsize
    for x, sharding in zip(jax.tree.leaves(params), jax.tree.leaves(compiled_params))
  )
  assert per_device == parallel.bytes_per_device(placed)
  factor = shape.get("fsdp", 1) * shape.get("cp", 1) * shape.get("tp", 1)
  full = parallel.bytes_per_device(params)
  assert full / per_device == pytest.approx(factor, rel=0.02), (full, per_device)
  # The rest is (at most) the batch's shard and the buffers (frozen state:
  # layer scalars, clip bounds), an argument of the step too.
  assert step.memory_analysis().argument_size_in_bytes <= (
    per_device + parallel.bytes_per_device(sharded) + parallel.bytes_per_device(buffers)
  )
  # The embedding tables (and the tied head) stay split over fsdp x tp (their
  # split over cp is gathered when the step starts): no buffer of the compiled
  # step has a whole table's shape.
  cfg = setup(preset)[0]
  t = cfg.text
  tables = [(t.vocab_size, t.hidden_size)]
  if t.hidden_size_per_layer_input:
    tables.append(
      (t.vocab_size_per_layer_input, t.num_hidden_layers * t.hidden_size_per_layer_input)
    )
  text = step.as_text()
  for rows, cols in tables:
    assert f"f32[{rows},{cols}]" not in text, (rows, cols)


def test_kernels_split_over_the_axes_the_partitioner_shards():
  """The Pallas kernels run in a shard_map manual over fsdp and tp too (Mosaic
  cannot be partitioned automatically): batch rows over fsdp, KV heads over
  tp. Run in Pallas' interpreter, the step equals the single-device step, so
  each device got its own rows and heads."""
  want_loss, want = single_device_step("tiny")
  loss, new, step, _, _ = mesh_step(
    "tiny", {"fsdp": 2, "cp": 2, "tp": 2}, implementation="pallas_gpu", interpret=True
  )
  assert abs(loss - want_loss) <= 1e-6 * want_loss
  assert_same_update(new, want, setup("tiny")[3])


@pytest.mark.parametrize(
  "shape, strategy",
  [
    # CI: fsdp, cp and tp at once, with the full layers gathered and the
    # sliding ones on Ulysses (2 query heads a tp rank over cp = 2); `make
    # soak`: the rest.
    pytest.param({"cp": 8}, "all_gather", marks=pytest.mark.slow),
    (
      {"fsdp": 2, "cp": 2, "tp": 2},
      {"full_attention": "all_gather", "sliding_attention": "ulysses"},
    ),
    pytest.param({"fsdp": 2, "cp": 4}, "all_gather", marks=pytest.mark.slow),
    pytest.param({"fsdp": 2, "cp": 4}, "ulysses", marks=pytest.mark.slow),
    # The hybrid on the full layers: Ulysses over pairs of ranks (tiny's 2
    # K/V heads), the ring over the 2 pairs.
    ({"fsdp": 2, "cp": 4}, {"full_attention": "hybrid", "sliding_attention": "ring"}),
    pytest.param({"cp": 8}, "hybrid", marks=pytest.mark.slow),
  ],
  ids=[
    "cp8-all_gather",
    "fsdp2xcp2xtp2-mixed",
    "fsdp2xcp4-all_gather",
    "fsdp2xcp4-ulysses",
    "fsdp2xcp4-hybrid",
    "cp8-hybrid",
  ],
)
def test_the_step_with_another_cp_strategy_equals_the_single_device_step(
  shape, strategy, monkeypatch
):
  """attention's K/V all-gathered over cp, or its heads split over cp
  (Ulysses), for every layer or per layer kind: the same step as the single
  device's."""
  want_loss, want = single_device_step("tiny")
  kinds = {strategy} if isinstance(strategy, str) else set(strategy.values())
  kinds = {{"hybrid": "ulysses"}.get(k, k) for k in kinds}  # its all-to-alls are Ulysses'
  calls = {"all_gather": H.count_gathers(monkeypatch), "ulysses": H.count_ulysses(monkeypatch)}
  # The loss's tokens gathered over cp too (the state, head included, is
  # split over fsdp x cp): the ring of tests/test_loss.py never runs.
  rings = H.spy(monkeypatch, loss_module, "_ring")
  loss, new, _, _, _ = mesh_step("tiny", shape, strategy=strategy, loss_strategy="all_gather")
  assert not rings
  for name, seen in calls.items():
    assert bool(seen) == (name in kinds), f"{name} reached attention {len(seen)} times"
  assert abs(loss - want_loss) <= 1e-6 * want_loss
  assert_same_update(new, want, setup("tiny")[3])


def test_gradient_accumulation_equals_whole_batch_step():
  """Two microbatches of 2 rows on one device = one step on the 4 rows."""
  cfg, model, graphdef, params, buffers, batch = setup("tiny")
  opt = optax.sgd(1.0)
  step = training.make_train_step(graphdef, opt, frozen=buffers)
  whole, _, m_whole = step(copy(params), opt.init(params), gemma4.prepare_batch(batch, cfg))
  micro = [gemma4.prepare_batch(_rows(batch, i, i + 2), cfg) for i in (0, 2)]
  accum, _, m_accum = step(copy(params), opt.init(params), micro)
  assert float(m_accum["tokens"]) == float(m_whole["tokens"])
  assert abs(float(m_accum["loss"]) - float(m_whole["loss"])) <= 1e-6 * float(m_whole["loss"])
  # The microbatches run matmuls of half the rows, which XLA blocks and sums
  # differently: float32 then moves the gradient by ~1e-5 (measured 7e-6
  # over the whole tree and 3e-5 in the worst vision-tower leaf on one CPU,
  # 4.1e-5 and 1.2e-4 on another; a wrong microbatch term moves it by ~1).
  assert_same_update(accum, whole, params)
  assert global_relative_error(accum, whole, params) <= 1e-4


def test_microbatches_must_share_one_shape():
  cfg, _, graphdef, params, buffers, batch = setup("tiny")
  a = gemma4.prepare_batch(_rows(batch, 0, 2), cfg)
  b = gemma4.prepare_batch(_rows(batch, 2, 3), cfg)
  with pytest.raises(ValueError, match="microbatch 1 key 'input_ids' has shape"):
    training.stack_microbatches([a, b])
  with pytest.raises(TypeError, match="non-empty sequence of batch dicts"):
    training.stack_microbatches([])


def test_optimizer_state_follows_parameter_shardings():
  _, _, _, params, _, _ = setup("tiny")
  mesh = parallel.make_mesh(fsdp=4, cp=2)
  placed = parallel.shard_params(copy(params), mesh, parallel.param_specs(params, mesh))
  state = parallel.shard_like_params(optax.adamw(1e-3).init(placed), placed)
  assert shardings(state[0].mu) == shardings(placed) == shardings(state[0].nu)
  # Both moments split over fsdp x cp = 8 (the odd-sized leaves stay whole).
  assert parallel.bytes_per_device(state) <= parallel.bytes_per_device(params) * 2 / 8 + 64


def test_tp_splits_heads_and_hidden_units():
  cfg = gemma4.Gemma4Config.preset("tiny-moe")
  mesh = parallel.make_mesh(fsdp=2, cp=2, tp=2)
  _, _, _, params, _, _ = setup("tiny-moe")
  specs = parallel.param_specs(params, mesh, rule=partition_rule(cfg, tp=2))
  layer = specs["model"]["language_model"]["layers"][0]
  # tp splits the computation; the state is stored split over fsdp x cp too,
  # cp major, on a dimension tp left free.
  token = ("cp", "fsdp")
  assert layer["self_attn"]["q_proj"]["weight"].get_value() == jax.P("tp", token)
  assert layer["self_attn"]["o_proj"]["weight"].get_value() == jax.P(token, "tp")
  assert layer["mlp"]["down_proj"]["weight"].get_value() == jax.P(token, "tp")
  assert layer["experts"]["gate_up_proj"].get_value() == jax.P("tp", None, token)
  # A full layer has one KV head here: tp cannot split its K projection, so
  # the rule leaves it whole (storage still splits over fsdp, cp and tp).
  full = cfg.text.layer_types.index("full_attention")
  path = ("model", "language_model", "layers", str(full), "self_attn", "k_proj", "weight")
  assert partition_rule(cfg, tp=2)(path, (cfg.text.global_head_dim, 64)) == jax.P()
  k_proj = specs["model"]["language_model"]["layers"][full]["self_attn"]["k_proj"]["weight"]
  stored = jax.tree.leaves(tuple(k_proj.get_value()))
  assert sorted(stored) == ["cp", "fsdp", "tp"], k_proj.get_value()


@pytest.mark.parametrize(
  "preset,shape,match",
  [
    ("tiny", {"tp": 8}, "mesh axis 'tp' of size 8 does not divide the 4 attention heads"),
    ("tiny-moe", {"tp": 8}, "mesh axis 'tp' of size 8 does not divide the 4 attention heads"),
    ("tiny", {"cp": 8}, "mesh axis 'cp' of size 8 does not divide the sequence length 60"),
    ("tiny", {"fsdp": 8}, "mesh axis 'fsdp' of size 8 does not divide the batch size 4"),
  ],
)
def test_check_mesh_names_the_axis(preset, shape, match):
  cfg = gemma4.Gemma4Config.preset(preset)
  with pytest.raises(ValueError, match=match):
    check_mesh(cfg, parallel.make_mesh(**shape), seq_len=60, batch_size=4)


def test_check_mesh_experts():
  import dataclasses

  cfg = gemma4.Gemma4Config.preset("tiny-moe")
  cfg = dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, num_experts=3))
  with pytest.raises(ValueError, match="mesh axis 'tp' of size 2 does not divide the 3 experts"):
    check_mesh(cfg, parallel.make_mesh(tp=2))


def test_make_mesh_errors():
  with pytest.raises(ValueError, match="one axis: got dp=2 and fsdp=2"):
    parallel.make_mesh(dp=2, fsdp=2)
  with pytest.raises(ValueError, match="needs 16 devices, 8 available"):
    parallel.make_mesh(fsdp=4, cp=4)
  with pytest.raises(ValueError, match="'tp' must be a positive int, got 0"):
    parallel.make_mesh(tp=0)


def check_lookup(mesh, rows: int, table_spec, lookup, *, over_cp: bool, seed: int):
  """``lookup(table, ids)`` inside a shard_map manual over cp (as in the model,
  each cp rank with its own ids; the table entering split over cp or whole)
  equals ``table[ids]`` and its scatter-add gradient, the gradient placed as
  the table, and no device of the compiled program holds the whole table."""
  rng = np.random.default_rng(seed)
  table = rng.normal(size=(rows, 3)).astype(np.float32)
  ids = rng.integers(0, rows, size=(4, 8)).astype(np.int32)
  weights = rng.normal(size=(4, 8, 3)).astype(np.float32)
  batch_axis = parallel.batch_axis_of(mesh)

  def objective(table, ids, weights):
    def local(table, ids, weights):
      return jax.lax.psum(jnp.sum(lookup(table, ids) * weights), "cp")

    return jax.shard_map(
      local,
      in_specs=(P("cp") if over_cp else P(), P(None, "cp"), P(None, "cp")),
      out_specs=P(),
      axis_names={"cp"},
    )(table, ids, weights)

  with jax.set_mesh(mesh):
    put = lambda x, spec: jax.device_put(x, jax.NamedSharding(mesh, spec))
    args = (
      put(table, table_spec),
      put(ids, P(batch_axis, "cp")),
      put(weights, P(batch_axis, "cp")),
    )
    value, grad = jax.jit(jax.value_and_grad(objective))(*args)
    text = jax.jit(jax.grad(objective)).lower(*args).compile().as_text()
  want_grad = np.zeros_like(table)
  np.add.at(want_grad, ids, weights)
  np.testing.assert_allclose(value, np.sum(table[ids] * weights), rtol=1e-6)
  chex.assert_trees_all_close(grad, want_grad, atol=1e-6, rtol=0)
  assert grad.sharding.is_equivalent_to(jax.NamedSharding(mesh, table_spec), 2)
  assert f"f32[{rows},3]" not in text


# The table split over its rows as param_specs places it whole over cp (as
# the step gathers a split over cp before a plain lookup); the ids' rows over
# the batch axis.
@pytest.mark.parametrize(
  "shape",
  [
    {"fsdp": 2, "cp": 2, "tp": 2},
    {"fsdp": 4, "cp": 2},
    {"dp": 2, "cp": 2, "tp": 2},
    {"cp": 2, "tp": 4},
  ],
  ids=lambda s: "x".join(f"{k}{n}" for k, n in s.items()),
)
def test_lookup_keeps_the_table_sharded(shape):
  mesh = parallel.make_mesh(**shape)
  table_spec = parallel.param_specs(np.zeros((16, 3)), mesh, state_axes=("fsdp",))
  assert table_spec[0] is not None and len(table_spec) == 1  # rows split, as lookup assumes
  check_lookup(mesh, 16, table_spec, parallel.lookup, over_cp=False, seed=0)


# The table stored over fsdp x cp (the default state), entering the ring's
# shard_map split over cp as the step hands it in: ring_lookup.
@pytest.mark.parametrize(
  "shape",
  [{"cp": 4}, {"fsdp": 2, "cp": 2, "tp": 2}, {"fsdp": 2, "cp": 4}],
  ids=lambda s: "x".join(f"{k}{n}" for k, n in s.items()),
)
def test_ring_lookup_keeps_the_table_split_over_cp(shape):
  mesh = parallel.make_mesh(**shape)
  table_spec = parallel.param_specs(np.zeros((64, 3)), mesh)
  rows = table_spec[0] if isinstance(table_spec[0], tuple) else (table_spec[0],)
  assert rows[0] == "cp" and len(table_spec) == 1  # rows split, cp major
  check_lookup(
    mesh,
    64,
    table_spec,
    functools.partial(parallel.ring_lookup, axis_name="cp"),
    over_cp=True,
    seed=1,
  )


def test_lookup_without_a_mesh_is_indexing():
  table = np.arange(12.0, dtype=np.float32).reshape(6, 2)
  ids = np.array([[5, 0, 5]])
  chex.assert_trees_all_equal(parallel.lookup(table, ids), table[ids])
