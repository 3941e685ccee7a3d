"""Expert parallelism (cpjax.models.gemma4.experts): the dispatch against a dense float32
reference, the capacity factor's drops against a numpy re-derivation, a
training step on ep meshes against the single-device step, the compiled
program (all-to-all, no all-gather of expert weights, 1/ep of the expert
bytes per device), and Gemma 4's ep forward against transformers."""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from cpjax import parallel, training
from cpjax.models import gemma4
from cpjax.models.gemma4.experts import routed_experts
from cpjax.models.gemma4.partitioning import check_mesh, partition_rule
from tests import test_parallel as tp
from tests.helpers import code_blocks, compiled, doc
from tests.test_gemma4 import F32_TOL, fixture, max_error

E, K, D, H = 8, 2, 6, 5


def expert_fn(rows, sizes, params):
  """A gated expert: ``(gelu(rows @ A_e) * (rows @ B_e)) @ C_e`` through ragged_dot."""
  a, b, c = params
  return jax.lax.ragged_dot(
    jax.nn.gelu(jax.lax.ragged_dot(rows, a, sizes)) * jax.lax.ragged_dot(rows, b, sizes), c, sizes
  )


def dense_reference(x, weights, ids, params, keep=None):
  """Every expert on every token, combined by one-hot router weights (float32)."""
  a, b, c = params
  w = weights if keep is None else jnp.where(keep, weights, 0.0)
  combine = jnp.einsum("...k,...ke->...e", w, jax.nn.one_hot(ids, E, dtype=jnp.float32))
  hidden = jax.nn.gelu(jnp.einsum("...d,edh->...eh", x, a)) * jnp.einsum("...d,edh->...eh", x, b)
  return jnp.einsum("...e,...eh,ehd->...d", combine, hidden, c)


@functools.cache
def inputs(rows=4, tokens=8, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(rows, tokens, D)).astype(np.float32)
  logits = rng.normal(size=(rows, tokens, E))
  ids = np.argsort(-logits, axis=-1)[..., :K].astype(np.int32)
  weights = rng.uniform(0.1, 1.0, size=(rows, tokens, K)).astype(np.float32)
  params = tuple(
    rng.normal(size=s).astype(np.float32) * 0.5 for s in ((E, D, H), (E, D, H), (E, H, D))
  )
  return x, weights, ids, params


def run_on_mesh(mesh, expert_axes, capacity_factor=None, batch_axis=None):
  """``routed_experts`` inside a shard_map manual over cp (the model's place),
  tokens split over the batch axis and cp, experts over ``expert_axes``;
  returns the output, stats and the gradients of ``sum(y * probe)``."""
  x, weights, ids, params = inputs()
  probe = np.random.default_rng(1).normal(size=x.shape).astype(np.float32)
  tokens = P(batch_axis, "cp")

  def local(x, weights, ids, params, probe):
    y, stats = routed_experts(
      x,
      weights,
      ids,
      params,
      expert_fn,
      num_experts=E,
      expert_axes=expert_axes,
      capacity_factor=capacity_factor,
    )
    return (
      jax.lax.psum(jnp.sum(y * probe), "cp"),
      (y, jax.tree.map(lambda s: jax.lax.psum(s, "cp"), stats)),
    )

  # The shard_map names cp only; the batch axis (Auto) stays the partitioner's.
  cp_tokens, cp_experts = P(None, "cp"), P("cp" if "cp" in expert_axes else None)

  def loss(x, weights, params, ids, probe):
    return jax.shard_map(
      local,
      mesh=mesh,
      axis_names={"cp"},
      in_specs=(cp_tokens, cp_tokens, cp_tokens, cp_experts, cp_tokens),
      out_specs=(P(), (cp_tokens, P())),
    )(x, weights, ids, params, probe)

  with jax.set_mesh(mesh):
    place = lambda v, s: jax.device_put(v, NamedSharding(mesh, s))
    args = (
      place(x, tokens),
      place(weights, tokens),
      tuple(place(p, P(expert_axes)) for p in params),
      place(ids, tokens),
      place(probe, tokens),
    )
    (_, (y, stats)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
      *args
    )
  return y, stats, grads, probe


def reference(probe, keep=None):
  x, weights, ids, params = inputs()
  f = lambda x, w, p: jnp.sum(dense_reference(x, w, ids, p, keep) * probe)
  return dense_reference(x, weights, ids, params, keep), jax.grad(f, argnums=(0, 1, 2))(
    x, weights, params
  )


@pytest.mark.parametrize(
  "shape,ep",
  [
    (dict(cp=1), 1),
    (dict(cp=4), 4),
    (dict(fsdp=2, cp=2), 4),
    (dict(fsdp=4), 4),
    (dict(fsdp=2, cp=4), 2),
  ],
)
def test_dispatch_and_gradients_equal_the_dense_reference(shape, ep):
  mesh = parallel.make_mesh(**shape)
  axes = parallel.expert_axes(mesh, ep)
  y, stats, grads, probe = run_on_mesh(mesh, axes, batch_axis=parallel.batch_axis_of(mesh))
  want_y, want_grads = reference(probe)
  chex.assert_trees_all_close(np.asarray(y), np.asarray(want_y), atol=2e-5, rtol=2e-5)
  chex.assert_trees_all_close(
    jax.device_get(grads), jax.device_get(want_grads), atol=5e-5, rtol=5e-5
  )
  ids = inputs()[2]
  np.testing.assert_array_equal(np.asarray(stats.tokens), np.bincount(ids.ravel(), minlength=E))
  assert float(stats.dropped) == 0.0


def kept_by_capacity(ids, devices, capacity):
  """numpy: each device's first ``capacity`` (token, slot) pairs per expert,
  in token order, are kept; ``devices`` lists each device's token index
  arrays into the [rows, tokens] grid."""
  keep = np.zeros(ids.shape, bool)
  for rows, cols in devices:
    seen = np.zeros(E, int)
    for r in rows:
      for t in cols:
        for j in range(K):
          e = ids[r, t, j]
          keep[r, t, j] = seen[e] < capacity
          seen[e] += 1
  return keep


@pytest.mark.parametrize(
  "shape,ep", [(dict(cp=1), 1), (dict(fsdp=2, cp=2), 4), (dict(fsdp=2, cp=2), 2)]
)
def test_capacity_drops_exactly_the_counted_pairs(shape, ep):
  """Capacity factor 0.5: C = ceil(0.5 * pairs / E) pairs per expert from
  each device; the later ones are dropped, counted, and contribute zero."""
  mesh = parallel.make_mesh(**shape)
  batch = parallel.batch_axis_of(mesh)
  y, stats, grads, probe = run_on_mesh(
    mesh, parallel.expert_axes(mesh, ep), capacity_factor=0.5, batch_axis=batch
  )
  x, _, ids, _ = inputs()
  fsdp, cp = shape.get("fsdp", 1), shape["cp"]
  rows, tokens = x.shape[0] // fsdp, x.shape[1] // cp
  devices = [
    (range(f * rows, (f + 1) * rows), range(c * tokens, (c + 1) * tokens))
    for f in range(fsdp)
    for c in range(cp)
  ]
  capacity = int(np.ceil(0.5 * rows * tokens * K / E))
  keep = kept_by_capacity(ids, devices, capacity)
  assert 0 < (~keep).sum() < keep.size  # the case really drops some, not all
  assert float(stats.dropped) == float((~keep).sum())
  np.testing.assert_array_equal(np.asarray(stats.tokens), np.bincount(ids.ravel(), minlength=E))
  want_y, want_grads = reference(probe, keep)
  chex.assert_trees_all_close(np.asarray(y), np.asarray(want_y), atol=2e-5, rtol=2e-5)
  chex.assert_trees_all_close(
    jax.device_get(grads), jax.device_get(want_grads), atol=5e-5, rtol=5e-5
  )


# ---------------------------------------------------------------- training


def ep_step(shape, ep, layout, microbatches=1):
  """One SGD(1) step of tiny-moe with ``ep``-way expert parallelism (over
  ``microbatches`` accumulated microbatches of the same rows)."""
  cfg, model, graphdef, params, buffers, batch = tp.setup("tiny-moe")
  mesh = parallel.make_mesh(**shape)
  axes = parallel.expert_axes(mesh, ep)
  check_mesh(cfg, mesh, seq_len=tp.S, batch_size=tp.B, ep=ep)
  specs = parallel.param_specs(params, mesh, rule=partition_rule(cfg, tp=1, expert_axes=axes))
  placed = parallel.shard_params(tp.copy(params), mesh, specs)
  opt = optax.sgd(1.0)
  opt_state = parallel.shard_like_params(opt.init(placed), placed)
  sharder = model.prepare_model_inputs_for_cp(layout=layout)["cp_sharder"]
  batch_axis = parallel.batch_axis_of(mesh)
  rows = tp.B // microbatches
  parts = [
    sharder.shard_batch(tp._rows(batch, i * rows, (i + 1) * rows), mesh, batch_axis=batch_axis)
    for i in range(microbatches)
  ]
  sharded, shard_layout = parts[0] if microbatches == 1 else ([p[0] for p in parts], parts[0][1])
  step = training.make_train_step(
    graphdef, opt, mesh=mesh, layout=shard_layout, frozen=buffers, expert_axes=axes
  )
  step = step.compile(placed, opt_state, sharded)
  new, _, metrics = step(placed, opt_state, sharded)
  return new, metrics, step, placed


@functools.cache
def single_device():
  cfg, _, graphdef, params, buffers, batch = tp.setup("tiny-moe")
  opt = optax.sgd(1.0)
  step = training.make_train_step(graphdef, opt, frozen=buffers)
  new, _, metrics = step(tp.copy(params), opt.init(params), gemma4.prepare_batch(batch, cfg))
  return jax.device_get(new), jax.device_get(metrics)


# CI folds ep onto cp (beside fsdp), onto fsdp (beside cp), onto both, and
# accumulates; ep alone on one axis runs in `make soak`.
@pytest.mark.parametrize(
  "shape,ep,layout,microbatches",
  [
    pytest.param(dict(cp=2), 2, "contiguous", 1, marks=pytest.mark.slow),  # ep alone, on cp
    pytest.param(dict(fsdp=4), 4, "contiguous", 1, marks=pytest.mark.slow),  # on the batch axis
    pytest.param(dict(cp=4), 4, "load_balanced", 1, marks=pytest.mark.slow),  # cp, load-balanced
    (dict(fsdp=2, cp=2), 4, "contiguous", 1),  # with fsdp and cp
    (dict(fsdp=2, cp=2), 2, "load_balanced", 1),  # on cp; fsdp shards each group's experts
    (dict(cp=2), 2, "load_balanced", 2),  # accumulated over 2 microbatches
    (dict(fsdp=4, cp=2), 4, "contiguous", 1),  # on fsdp; cp splits each group's store
  ],
)
def test_ep_step_equals_the_single_device_step(shape, ep, layout, microbatches):
  want, want_metrics = single_device()
  params = tp.setup("tiny-moe")[3]
  new, metrics, _, _ = ep_step(shape, ep, layout, microbatches)
  np.testing.assert_allclose(float(metrics["loss"]), float(want_metrics["loss"]), rtol=1e-6)
  tp.assert_same_update(new, want, params, tol=1e-4)
  # The routers saw the same tokens: the same per-expert counts, no drops.
  np.testing.assert_array_equal(np.asarray(metrics["expert_tokens"]), want_metrics["expert_tokens"])
  np.testing.assert_array_equal(np.asarray(metrics["expert_dropped"]), 0.0)


def test_expert_token_counts_of_a_hand_worked_router():
  """A router with zero weights gives every expert the same probability, and
  top_k's ties go to the lowest indices: every token picks experts 0..k-1,
  on every MoE layer; the counts cover every position of the batch."""
  cfg, model, graphdef, params, buffers, batch = tp.setup("tiny-moe")
  zeroed = jax.tree_util.tree_map_with_path(
    lambda path, x: (
      jnp.zeros_like(x)
      if "router" in jax.tree_util.keystr(path) and "proj" in jax.tree_util.keystr(path)
      else x
    ),
    params,
  )
  from flax import nnx

  zero_router = nnx.merge(graphdef, zeroed, buffers)
  out = compiled(zero_router, "hidden_states")(gemma4.prepare_batch(batch, cfg))
  t = cfg.text
  want = np.zeros((t.num_hidden_layers, t.num_experts))
  want[:, : t.top_k_experts] = tp.B * tp.S
  np.testing.assert_array_equal(np.asarray(out.metrics["expert_tokens"]), want)
  # And the single-device step reports per-layer counts that add up to k per position.
  _, metrics = single_device()
  np.testing.assert_array_equal(metrics["expert_tokens"].sum(-1), tp.B * tp.S * t.top_k_experts)


def expert_leaves(tree):
  return [
    x
    for path, x in jax.tree_util.tree_leaves_with_path(tree)
    if "experts" in jax.tree_util.keystr(path)
  ]


def all_gathers_of_expert_weights(step, cfg):
  """The compiled program's all-gathers whose result is an expert tensor
  ([experts, 2I, D] or [experts, D, I])."""
  t = cfg.text
  i, d = t.moe_intermediate_size, t.hidden_size
  text = step._compiled().as_text()
  pattern = rf"\[\d+,({2 * i},{d}|{d},{2 * i}|{d},{i}|{i},{d})\]\S* all-gather"  # any layout
  return [ln for ln in text.splitlines() if re.search(pattern, ln)], text


def test_compiled_program_routes_tokens_and_stores_one_ep_th_of_the_experts():
  cfg = tp.setup("tiny-moe")[0]
  params = tp.setup("tiny-moe")[3]
  whole = sum(x.size * x.dtype.itemsize for x in expert_leaves(params))
  # ep on cp with fsdp beside it: fsdp shards each group's experts and
  # gathers them where they are used (the check below can fail).
  _, _, step, _ = ep_step(dict(fsdp=2, cp=2), 2, "contiguous")
  gathers, text = all_gathers_of_expert_weights(step, cfg)
  assert gathers and "all-to-all" in text
  for shape, ep in ((dict(cp=2), 2), (dict(fsdp=2, cp=2), 4)):
    _, _, step, placed = ep_step(shape, ep, "contiguous")
    gathers, text = all_gathers_of_expert_weights(step, cfg)
    assert "all-to-all" in text
    assert not gathers, gathers[:2]
    shardings = jax.tree.leaves(step.input_shardings[0])
    leaves = jax.tree_util.tree_leaves_with_path(placed)
    here = sum(
      int(np.prod(s.shard_shape(x.shape))) * x.dtype.itemsize
      for (path, x), s in zip(leaves, shardings)
      if "experts" in jax.tree_util.keystr(path)
    )
    assert here * ep == whole, (shape, here, whole)


@pytest.mark.parametrize(
  "cp,layout,ep_on", [(4, "load_balanced", "cp"), (2, "contiguous", "cp"), (4, "contiguous", "dp")]
)
def test_ep_forward_equals_transformers(cp, layout, ep_on):
  """The tiny 26B-A4B-like model saved by transformers (4 experts, top-2, k_eq_v)."""
  model, batches, logits = fixture("moe_k_eq_v_vision")
  inputs = batches["images"]
  if ep_on == "cp":
    mesh, batch_axis = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp]), None
  else:
    mesh = jax.make_mesh((2, cp), ("dp", "cp"), devices=jax.devices()[: 2 * cp])
    batch_axis = "dp"
  got = gemma4.cp_logits(
    model,
    gemma4.prepare_batch(inputs, model.cfg),
    mesh,
    layout=layout,
    batch_axis=batch_axis,
    expert_axes=(ep_on,),
  )
  assert max_error(got, logits["images/float64"], inputs) <= F32_TOL


@pytest.mark.parametrize(
  "call,match",
  [
    (
      lambda: parallel.expert_axes(parallel.make_mesh(fsdp=2, cp=4), 16),
      r"ep=16 must equal the size of the token axes it folds onto \(cp = 4, fsdp = 2, "
      r"cp\*fsdp = 8\)",
    ),
    (
      lambda: parallel.expert_axes(parallel.make_mesh(cp=2, tp=2), 2),
      r"ep=2 does not combine with tp=2",
    ),
    (
      lambda: parallel.expert_axes(parallel.make_mesh(cp=2), 0),
      r"ep must be a positive int, got 0",
    ),
    (
      lambda: check_mesh(gemma4.Gemma4Config.preset("tiny"), parallel.make_mesh(cp=2), ep=2),
      r"ep=2 needs a mixture of experts",
    ),
    (
      lambda: check_mesh(gemma4.Gemma4Config.preset("tiny-moe"), parallel.make_mesh(cp=8), ep=8),
      r"ep=8 does not divide the 4 experts",
    ),
    # The Python API too: before any placement or compute.
    (
      lambda: gemma4.cp_logits(
        gemma4.Gemma4(gemma4.Gemma4Config.preset("tiny-moe"), rngs=nnx.Rngs(0)),
        {"input_ids": np.ones((1, 16), np.int32)},
        parallel.make_mesh(cp=8),
        expert_axes=parallel.expert_axes(parallel.make_mesh(cp=8), 8),
      ),
      r"ep=8 does not divide the 4 experts \(expert_axes \('cp',\)\)",
    ),
    (
      lambda: parallel.param_specs(
        nnx.state(
          gemma4.Gemma4(gemma4.Gemma4Config.preset("tiny-moe"), rngs=nnx.Rngs(0)), nnx.Param
        ),
        parallel.make_mesh(cp=8),
        rule=gemma4.partition_rule(
          gemma4.Gemma4Config.preset("tiny-moe"), tp=1, expert_axes=("cp",)
        ),
      ),
      r"partition rule for .*experts\.(gate_up|down)_proj.* splits its dimension 0 of size 4 "
      r"8 ways "
      r"\(over \('cp',\)\), which does not divide it",
    ),
    (
      lambda: routed_experts(
        *inputs()[:3], inputs()[3], expert_fn, num_experts=E, capacity_factor=0
      ),
      r"capacity_factor must be None .* got 0",
    ),
    (lambda: parallel.parse_mesh("cp=2,xp=2"), r"AXIS in \('dp', 'fsdp', 'cp', 'tp', 'ep'\)"),
  ],
)
def test_bad_expert_parallel_input(call, match):
  with pytest.raises(ValueError, match=match):
    call()


# CI trains the command on the transformers-saved checkpoint; as written
# (--model tiny-moe, the tiny-moe-ep recipe's run) it is in `make soak`.
@pytest.mark.parametrize("checkpoint", [pytest.param(None, marks=pytest.mark.slow), "moe"])
def test_readme_ep_command_runs_and_reports_the_routing(tmp_path, checkpoint, hf_checkpoint):
  """The docs' expert-parallel command (concepts/meshes.md), as written (plus a metrics file),
  and on a 26B-A4B-like checkpoint transformers saved (``--checkpoint`` for
  ``--model tiny-moe``): the step-1 parity check passes inside it, and every
  MoE layer's counts add up to batch x seq_len x k (pairs per position,
  padding included), none dropped."""
  import json
  import shlex

  from cpjax import cli

  section = doc("concepts/meshes.md").split("**Expert parallelism** (Gemma 4's MoE)", 1)[1]
  command = code_blocks(section, "bash")[0].strip()
  cfg = gemma4.Gemma4Config.preset("tiny-moe").text
  if checkpoint:
    base = hf_checkpoint(checkpoint)
    assert "--model tiny-moe" in command
    command = command.replace("--model tiny-moe", f"--checkpoint {base}")
    cfg = gemma4.Gemma4Config.from_hf(base).text
  args = shlex.split(command)
  assert args[:2] == ["cpjax", "train"]
  metrics = tmp_path / "metrics.jsonl"
  assert cli.main(args[1:] + ["--metrics", str(metrics)]) == 0
  lines = [json.loads(x) for x in metrics.read_text().splitlines()]
  assert len(lines) == 3
  for line in lines:
    counts = np.asarray(line["expert_tokens"])
    chex.assert_shape(counts, (cfg.num_hidden_layers, cfg.num_experts))
    np.testing.assert_array_equal(counts.sum(-1), 2 * 1024 * cfg.top_k_experts)
    assert line["expert_dropped"] == [0] * cfg.num_hidden_layers


@pytest.mark.parametrize(
  "command,message",
  [
    (
      "plan --model a4b --seq-len 32768 --mesh fsdp=2,cp=4,ep=3 --estimate-only",
      "ep=3 does not divide the 128 experts",
    ),
    (
      "plan --model a4b --seq-len 32768 --mesh fsdp=2,cp=4,ep=16 --estimate-only",
      "ep=16 must equal the size of the token axes it folds onto: cp = 4, the batch axis = 2 "
      "or both = 8",
    ),
    ("train --model tiny --mesh cp=2,ep=2 --steps 1", "ep=2 needs a mixture of experts"),
    ("train --model tiny-moe --mesh cp=2,tp=2,ep=2 --steps 1", "ep=2 does not combine with tp=2"),
  ],
)
def test_cli_refuses_an_ep_that_does_not_fold(command, message, capsys):
  from cpjax import cli

  with pytest.raises(SystemExit) as exit_:
    cli.main(command.split())
  assert exit_.value.code == 2
  assert message in capsys.readouterr().err


# (M rows, group sizes, tile): one tile; tiles that split groups, with empty
# groups before, between and after; one group taking every row; rows past
# the last group; no row in any group; a tile that does not divide M.
GROUPED_CASES = [
  (3, (1, 1), 512),
  (64, (10, 0, 30, 3, 12), 8),
  (64, (0, 0, 0, 5), 4),
  (64, (64, 0, 0, 0), 16),
  (60, (7, 20, 1), 512),
  (32, (0,) * 6, 8),
  (48, (5, 17, 9, 0, 11), 32),
]


@pytest.mark.parametrize("m, sizes, tile", GROUPED_CASES)
def test_grouped_matmul_off_tpu_equals_each_groups_product(m, sizes, tile):
  """The loop over (tile, group) pairs that runs off TPU against numpy's
  per-group products, and its gradients against JAX's own ``ragged_dot``
  (the dense expansion), in float32."""
  from cpjax.models.gemma4.experts import grouped_matmul

  rng = np.random.default_rng(m + tile)
  x = rng.normal(size=(m, 6)).astype(np.float32)
  w = rng.normal(size=(len(sizes), 6, 5)).astype(np.float32)
  s = jnp.array(sizes, jnp.int32)
  want = np.zeros((m, 5), np.float32)
  starts = np.cumsum((0,) + sizes)
  for g, (a, b) in enumerate(zip(starts[:-1], starts[1:])):
    want[a:b] = x[a:b].astype(np.float64) @ w[g].astype(np.float64)
  got = jax.jit(lambda x, w: grouped_matmul(x, w, s, tile=tile))(x, w)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)

  def grads(fn):
    return jax.jit(
      jax.grad(lambda x, w: jnp.sum(jnp.sin(fn(x, w)) * jnp.arange(5.0)), argnums=(0, 1))
    )(x, w)

  chex.assert_trees_all_close(
    grads(lambda x, w: grouped_matmul(x, w, s, tile=tile)),
    grads(lambda x, w: jax.lax.ragged_dot(x, w, s)),
    rtol=1e-5,
    atol=1e-5,
  )


@pytest.mark.parametrize("m, sizes", [case[:2] for case in GROUPED_CASES[:3]])
def test_grouped_matmul_on_tpu_has_ragged_dots_gradients(m, sizes):
  """The TPU branch (``ragged_dot`` whose two gradients leave its backward
  through one barrier, so XLA:TPU makes the weights' where the rows' is),
  run here on CPU: its values and gradients against ``ragged_dot``'s own."""
  from cpjax.models.gemma4.experts import _ragged_dot

  rng = np.random.default_rng(m)
  x = rng.normal(size=(m, 6)).astype(np.float32)
  w = rng.normal(size=(len(sizes), 6, 5)).astype(np.float32)
  s = jnp.array(sizes, jnp.int32)

  def grads(fn):
    loss = lambda x, w: jnp.sum(jnp.sin(fn(x, w, s)) * jnp.arange(5.0))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)

  chex.assert_trees_all_close(grads(_ragged_dot), grads(jax.lax.ragged_dot), rtol=1e-6, atol=1e-6)


def test_grouped_matmul_takes_group_sizes_varying_over_a_mesh_axis():
  """Inside a shard_map manual over cp only (the model's place), each cp
  device routes its own rows: sizes vary over cp, the weights do not. Every
  device's product against numpy's."""
  from cpjax.models.gemma4.experts import grouped_matmul

  mesh = parallel.make_mesh(fsdp=2, cp=4)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(4, 8, 3)).astype(np.float32)
  w = rng.normal(size=(3, 3, 2)).astype(np.float32)
  sizes = np.array([[8, 0, 0], [0, 3, 5], [2, 2, 2], [1, 0, 6]], np.int32)

  def local(x, s):
    return grouped_matmul(x[0], jnp.asarray(w), s[0], tile=4)[None]

  got = jax.jit(
    jax.shard_map(
      local, mesh=mesh, axis_names={"cp"}, in_specs=(P("cp"), P("cp")), out_specs=P("cp")
    )
  )(*jax.device_put((x, sizes), NamedSharding(mesh, P("cp"))))
  got = np.asarray(got)
  for d in range(4):
    group = np.repeat(np.arange(4), np.append(sizes[d], 8 - sizes[d].sum()))
    want = np.stack([x[d, i] @ w[g] if g < 3 else np.zeros(2) for i, g in enumerate(group)])
    chex.assert_trees_all_close(got[d], want, rtol=1e-5, atol=1e-5)


def test_grouped_matmul_keeps_bfloat16_and_accumulates_in_float32():
  from cpjax.models.gemma4.experts import grouped_matmul

  x = jnp.full((16, 64), 1.0 + 2.0**-7, jnp.bfloat16)
  w = jnp.ones((2, 64, 3), jnp.bfloat16)
  got = grouped_matmul(x, w, jnp.array([8, 8], jnp.int32), tile=4)
  assert got.dtype == jnp.bfloat16
  # 64 * (1 + 2^-7) = 64.5, which bfloat16 holds.
  chex.assert_trees_all_equal(got, jnp.full((16, 3), 64.5, jnp.bfloat16))
