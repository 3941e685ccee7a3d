"""What a long row's step keeps alive, from the compiled program: Gemma 4's
MLP in tiles of tokens (equal to the MLP on the whole row, with a smaller
backward), and accumulators made when their loop runs rather than from a
constant the whole program shares."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cpjax import parallel, ring_passes
from cpjax.kernels import common
from cpjax.models.gemma4 import text
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

  def temp():          # traced afresh: the tile size is read when tracing
    def grads(state, x):
      return jax.grad(lambda s: jnp.sum(nnx.merge(graphdef, s)(x) ** 2))(state)
    return _compiled_temp(grads, state, x)
  whole = temp()
  monkeypatch.setattr(text, "MLP_TILE_VALUES", 256 * 1024)
  tiled = temp()
  intermediate = 4096 * 1024 * 4
  assert whole - tiled > 4 * intermediate, (whole, tiled)


def test_filled_after_is_the_fill_and_follows_its_reference():
  x = jnp.array([np.nan, 1.0])         # NaN in the reference still gives the fill
  np.testing.assert_array_equal(common.filled_after(x, (2, 3)), np.zeros((2, 3)))
  np.testing.assert_array_equal(common.filled_after(x, (2,), -np.inf), [-np.inf, -np.inf])
  assert common.filled_after(x, (1,), dtype=jnp.bfloat16).dtype == jnp.bfloat16
  np.testing.assert_array_equal(common.filled_after(jnp.zeros((0,)), (2,)), [0.0, 0.0])


def test_accumulators_are_made_where_their_loops_run(monkeypatch):
  """The step on cp=8 with every layer rematerialised: with each
  accumulator (the ring's, the loss's, the lookups') made from the values
  its loop starts from, the compiled temporaries are more than 10% below
  those of constant fills, which XLA shares and builds when the step
  starts (measured: 18% on the tiny model)."""
  tied = tp.mesh_step("tiny", {"cp": 8}, remat="full")[2].memory_analysis().temp_size_in_bytes

  def constant(ref, shape, fill=0.0, dtype=jnp.float32):
    return common.vary_like(jnp.full(shape, fill, dtype), ref)
  for module in (ring_passes, loss, parallel, text):
    monkeypatch.setattr(module, "filled_after", constant)
  shared = tp.mesh_step("tiny", {"cp": 8}, remat="full")[2].memory_analysis().temp_size_in_bytes
  assert tied < 0.9 * shared, (tied, shared)
