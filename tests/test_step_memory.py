"""What a long row's step keeps alive, from the compiled program: Gemma 4's
MLP in tiles of tokens (equal to the MLP on the whole row, with a smaller
backward), and accumulators made when their loop runs rather than from a
constant the whole program shares."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend.core import Jaxpr
from jax.sharding import PartitionSpec as P

from cpjax import parallel
from cpjax.attention.ring import _passes as ring_passes
from cpjax.models.gemma4 import remat, text
from cpjax.training import loss
from tests import test_parallel as tp


def _mlp_loss_and_grads(mlp, x):
  def objective(mlp, x):
    return jnp.sum(jnp.tanh(mlp(x)))

  return nnx.value_and_grad(objective, argnums=(0, 1))(mlp, x)


def test_the_mlp_in_tiles_equals_the_whole_row(monkeypatch):
  """Tiles of 8 tokens over a row of 37 (the last tile padded): the same
  outputs and gradients as the whole row in one piece."""
  mlp = text.TextMLP(16, 48, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 37, 16))
  want_loss, (want_mlp, want_x) = _mlp_loss_and_grads(mlp, x)
  monkeypatch.setattr(text, "MLP_TILE_VALUES", 2 * 8 * 48)
  got_loss, (got_mlp, got_x) = _mlp_loss_and_grads(mlp, x)
  np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-6)
  chex.assert_trees_all_close(nnx.state(got_mlp), nnx.state(want_mlp), rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(got_x, want_x, rtol=1e-5, atol=1e-6)


def _compiled_temp(fn, *args) -> int:
  return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_the_mlp_in_tiles_keeps_one_tile_of_intermediates(monkeypatch):
  """The backward of a 4096-token row through 1024 hidden units: whole, its
  [S, I] intermediates (16 MiB each) are alive together; in tiles of 256
  tokens, one tile's. The compiled temporaries fall by more than four whole
  intermediates (measured: 98 MiB to 9)."""
  mlp = text.TextMLP(64, 1024, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(mlp)
  x = jnp.ones((1, 4096, 64))

  def temp():  # traced afresh: the tile size is read when tracing
    def grads(state, x):
      return jax.grad(lambda s: jnp.sum(nnx.merge(graphdef, s)(x) ** 2))(state)

    return _compiled_temp(grads, state, x)

  whole = temp()
  monkeypatch.setattr(text, "MLP_TILE_VALUES", 256 * 1024)
  tiled = temp()
  intermediate = 4096 * 1024 * 4
  assert whole - tiled > 4 * intermediate, (whole, tiled)


def test_the_mlp_tiles_backward_makes_its_buffers_where_it_runs(monkeypatch):
  """Four tiled MLPs in a row, each under jax.checkpoint: the loop's
  tile-shaped buffers (its output, the input's gradient) and the weights'
  gradient accumulators are made from values the loop starts from. Either
  started from zeros constants (as JAX's own transpose of the loop starts
  the gradients), XLA:CPU builds them when the program starts and keeps them
  alive until their loop runs (measured: 8.0 MiB of temporaries, 11.0 with
  constant tile buffers, 11.1 with constant weight accumulators)."""
  monkeypatch.setattr(text, "MLP_TILE_VALUES", 128 * 1024)  # 16 tiles of 128 tokens
  layers = [text.TextMLP(128, 1024, rngs=nnx.Rngs(i)) for i in range(4)]
  graphdef = nnx.split(layers[0])[0]
  states = [nnx.split(layer)[1] for layer in layers]  # 1.5 MiB each
  x = jnp.ones((1, 2048, 128))  # 1 MiB

  def temp():
    def objective(states, x):
      for state in states:
        x = x + jax.checkpoint(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)
      return jnp.sum(x**2)

    return _compiled_temp(jax.grad(objective, argnums=(0, 1)), states, x)

  tied = temp()

  def constant_where(weights: bool):
    def fill(ref, shape, fill=0.0, dtype=jnp.float32):
      if (len(shape) == 2) == weights:  # the weights are [out, in]; tiles [N, B, T, D]
        return parallel.vary_like(jnp.full(shape, fill, dtype), ref)
      return parallel.filled_after(ref, shape, fill, dtype)

    return fill

  for weights in (True, False):
    monkeypatch.setattr(remat, "filled_after", constant_where(weights))
    assert tied < 0.85 * temp(), (weights, tied)


def _sums(jaxpr, in_loop=False):
  """(primitive, inside a loop) for every psum in ``jaxpr`` and its sub-jaxprs."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name.startswith("psum"):
      found.append((eqn.primitive.name, in_loop))
    for param in eqn.params.values():
      sub = getattr(param, "jaxpr", param)
      if isinstance(sub, Jaxpr):  # (fori_loop with a fixed trip count is a scan)
        found += _sums(sub, in_loop or eqn.primitive.name in ("while", "scan"))
  return found


def test_tiles_sum_a_weight_shared_by_the_ranks_once():
  """Inside shard_map, a weight the same on every cp rank against tiles
  split over cp: its gradient adds up over the tiles on each rank and is
  summed over the ranks once, after the loop (one psum per tile otherwise),
  and equals the gradient of the untiled computation."""
  mesh = jax.make_mesh(
    (2,), ("cp",), devices=jax.devices()[:2], axis_types=(jax.sharding.AxisType.Auto,)
  )
  w = jax.random.normal(jax.random.key(0), (4, 4))
  tiles = jax.random.normal(jax.random.key(1), (3, 8, 4))  # 3 tiles of [8, 4]

  def objective(w, tiles):
    return jnp.sum(remat.remat_tiles(lambda w, t: jnp.tanh(t @ w), w, tiles) ** 2)

  grad = jax.shard_map(jax.grad(objective), mesh=mesh, in_specs=(P(), P(None, "cp")), out_specs=P())
  assert _sums(jax.make_jaxpr(grad)(w, tiles).jaxpr) == [("psum_invariant", False)]
  want = jax.grad(lambda w: jnp.sum(jnp.tanh(tiles @ w) ** 2))(w)
  chex.assert_trees_all_close(jax.jit(grad)(w, tiles), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
  "shape,state_axes",
  [
    # weights gathered in the layer's remat; the same on every cp rank. Both
    # in `make soak`: CI has the tiles against the whole row
    # (test_the_mlp_in_tiles_equals_the_whole_row), a weight shared by the
    # ranks summed once (test_tiles_sum_a_weight_shared_by_the_ranks_once),
    # and the remat-gathered step on cp = 8 (test_state_sharding).
    pytest.param({"fsdp": 2, "cp": 2, "tp": 2}, parallel.STATE_AXES, marks=pytest.mark.slow),
    pytest.param({"cp": 4}, ("fsdp",), marks=pytest.mark.slow),
  ],
  ids=["fsdp2xcp2xtp2", "cp4-state-over-fsdp"],
)
def test_the_step_with_the_mlp_in_tiles_equals_the_single_device_step(
  monkeypatch, shape, state_axes
):
  """One-token tiles inside the ring's shard_map: the weights' gradients add
  up over the tiles on each rank and over the mesh once, as the whole row's
  do (loss within 1e-6, every leaf's update as the parity tests hold it)."""
  want_loss, want = tp.single_device_step("tiny")  # the row in one piece
  monkeypatch.setattr(text, "MLP_TILE_VALUES", 1)
  loss, new, *_ = tp.mesh_step("tiny", shape, remat="full", state_axes=state_axes)
  assert abs(loss - want_loss) <= 1e-6 * want_loss
  tp.assert_same_update(new, want, tp.setup("tiny")[3])


def test_filled_after_is_the_fill_and_follows_its_reference():
  x = jnp.array([np.nan, 1.0])  # NaN in the reference still gives the fill
  np.testing.assert_array_equal(parallel.filled_after(x, (2, 3)), np.zeros((2, 3)))
  np.testing.assert_array_equal(parallel.filled_after(x, (2,), -np.inf), [-np.inf, -np.inf])
  assert parallel.filled_after(x, (1,), dtype=jnp.bfloat16).dtype == jnp.bfloat16
  np.testing.assert_array_equal(parallel.filled_after(jnp.zeros((0,)), (2,)), [0.0, 0.0])


# Suite budget (62 s: two compiles of the step on cp = 8): `make soak`, with its mutant.
@pytest.mark.slow
def test_accumulators_are_made_where_their_loops_run(monkeypatch):
  """The step on cp=8 with every layer rematerialised: with each
  accumulator (the ring's, the loss's, the lookups') made from the values
  its loop starts from, the compiled temporaries are more than 10% below
  those of constant fills, which XLA shares and builds when the step
  starts (measured: 18% on the tiny model)."""
  tied = tp.mesh_step("tiny", {"cp": 8}, remat="full")[2].memory_analysis().temp_size_in_bytes

  def constant(ref, shape, fill=0.0, dtype=jnp.float32):
    return parallel.vary_like(jnp.full(shape, fill, dtype), ref)

  for module in (ring_passes, loss, parallel, remat):
    monkeypatch.setattr(module, "filled_after", constant)
  shared = tp.mesh_step("tiny", {"cp": 8}, remat="full")[2].memory_analysis().temp_size_in_bytes
  assert tied < 0.9 * shared, (tied, shared)
