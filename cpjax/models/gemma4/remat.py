"""Rematerialisation for Gemma 4's decoder: the per-layer policies, a remat
whose recomputation waits for the backward pass, and a loop over tiles of
tokens whose backward recomputes one tile at a time.

>>> remat_policy(True), remat_policy("save_attention_out")
('full', 'save_attention_out')
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from cpjax.parallel import filled_after, vary_like, varying_axes

__all__ = ["REMAT_POLICIES", "remat_after_cotangent", "remat_tiles"]

# Per-layer rematerialisation: what a decoder layer keeps for the backward pass.
#   none: everything (no remat); full: only the layer's inputs (recompute all);
#   save_attention_out: the inputs and the attention output (named
#   "attention_out"), so the backward recomputes the layer but reuses it.
REMAT_POLICIES = ("none", "full", "save_attention_out")


def remat_policy(remat: bool | str) -> str:
  """Return the policy name ``remat`` stands for (``True`` is "full", ``False`` "none")."""
  if remat is True or remat is False:
    return "full" if remat else "none"
  if remat not in REMAT_POLICIES:
    raise ValueError(f"remat must be a bool or one of {REMAT_POLICIES}, got {remat!r}")
  return remat


def remat_after_cotangent(fn: Callable[..., Any]) -> Callable[..., Any]:
  """Wrap ``fn`` as a ``jax.checkpoint(fn)`` (save nothing) that recomputes only in the backward.

  Its recomputation cannot start before the backward pass reaches it;
  ``fn(state, x, *rest, masks)`` must close over no array (pass them as
  arguments); ``masks`` gets no gradient.

  With plain ``jax.checkpoint`` XLA is free to schedule a layer's
  recomputation as soon as its saved input exists, i.e. during the forward
  pass, and XLA:CPU does: it drops optimization barriers before scheduling,
  and then every layer's recomputed intermediates are alive at once, so
  remat saved nothing (measured on the E2B slice at S = 131072, cp = 8).
  Here the backward ties the layer's input ``x`` and its weights ``state``
  to the incoming cotangent by data (each is replaced by zeros only if the
  cotangent's first value is NaN, when every gradient is NaN anyway), which
  no scheduler can reorder.

  ``fn`` is traced once, when the forward runs, and the backward replays
  that trace: a backward traced later, outside the context the forward ran
  in, would otherwise recompute something else. qwix's LoRA is such a
  context (it intercepts ``jnp.einsum`` only while the model's method runs;
  a later re-trace recomputes the layer without its adapters, and their
  gradients come out zero).

  Args:
    fn: ``fn(state, x, *rest, masks)``, closing over no array.

  Returns:
    The rematerialised function, called as ``fn`` is.
  """

  def run(*args):
    flat, tree = jax.tree.flatten(args)
    traced, out_shape = jax.make_jaxpr(
      lambda *leaves: fn(*tree.unflatten(leaves)), return_shape=True
    )(*flat)
    out_tree = jax.tree.structure(out_shape)

    def replay(*args):
      out = jax.core.eval_jaxpr(traced.jaxpr, traced.consts, *jax.tree.leaves(args))
      return out_tree.unflatten(out)

    return _tied_remat(replay, *args)

  return run


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tied_remat(fn, *args):
  return fn(*args)


def _tied_remat_fwd(fn, *args):
  return fn(*args), args


def _tied_remat_bwd(fn, args, g):
  first = jax.tree.leaves(g)[0].reshape(-1)[0]
  state, x, *rest, masks = args
  # The layer's weights too: stored split over cp, they are gathered inside
  # the recomputation, and a gather that depends on the cotangent can be
  # neither merged with the forward's (keeping every layer's gathered weights
  # alive from the forward on) nor hoisted ahead of the backward.
  # (Only what already varies as the cotangent does: the replayed trace
  # keeps each value's type, and a leaf the same on every rank stays so.)
  # Through an optimization barrier: XLA:GPU's simplifier may take ``x != x``
  # for false (it folds filled_after's fill without one), dropping the tie.
  nan = lax.optimization_barrier(first != first)

  def tie(v):
    if not varying_axes(nan) <= varying_axes(v):
      return v
    return jnp.where(nan, jnp.zeros_like(v), v)

  x, state = tie(x), jax.tree.map(tie, state)
  # The masks (integer streams) get no cotangent.
  return (*jax.vjp(lambda *a: fn(*a, masks), state, x, *rest)[1](g), None)


_tied_remat.defvjp(_tied_remat_fwd, _tied_remat_bwd)


def remat_tiles(
  fn: Callable[[Any, jax.Array], jax.Array], state: Any, tiles: jax.Array
) -> jax.Array:
  """Compute ``out[i] = fn(state, tiles[i])`` for each tile, in a loop.

  The loop's backward recomputes one tile at a time: tiles [N, ...] -> [N, ...]
  (``fn`` keeps a tile's shape and dtype and closes over no array; ``state``
  is a pytree of the arrays it uses, differentiated).

  This is ``fori_loop`` over ``jax.checkpoint(fn)`` with the backward written
  out. JAX's own transpose of that loop starts the input's gradient and every
  weight's from zeros constants, which XLA:CPU builds when the step starts
  and keeps alive until the loop runs (eight [N, B, T, D] buffers through
  the E2B slice's step at S = 131072, cp = 8). Here they are made from the
  cotangent, where the backward's loop runs (that step's temporaries: 5.89
  GiB to 4.52). ``fn`` is traced once, here, and the backward replays that
  trace (as :func:`remat_after_cotangent` does, for qwix's LoRA). Inside
  ``shard_map`` the weights may vary over fewer mesh axes than the tiles,
  not more: they are made varying as the tiles are before the loop, so that
  their gradients add up over the tiles on each rank and are summed over the
  other ranks once, not once per tile.

  Args:
    fn: ``fn(state, tile)``, keeping a tile's shape and dtype.
    state: a pytree of the arrays ``fn`` uses, differentiated.
    tiles: [N, ...].

  Returns:
    [N, ...]: ``out[i] = fn(state, tiles[i])``.

  >>> remat_tiles(lambda w, t: t * w, jnp.float32(2), jnp.ones((3, 2)))
  Array([[2., 2.],
         [2., 2.],
         [2., 2.]], dtype=float32)
  """
  leaves, tree = jax.tree.flatten(state)
  leaves = [vary_like(leaf, tiles) for leaf in leaves]
  traced = jax.make_jaxpr(lambda leaves, tile: fn(tree.unflatten(leaves), tile))(leaves, tiles[0])

  def one_tile(leaves, tile):
    return jax.core.eval_jaxpr(traced.jaxpr, traced.consts, *leaves, tile)[0]

  return _remat_tiles(one_tile, leaves, tiles)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _remat_tiles(one_tile, leaves, tiles):
  def one(i, out):
    return lax.dynamic_update_index_in_dim(out, one_tile(leaves, tiles[i]), i, 0)

  return lax.fori_loop(0, tiles.shape[0], one, filled_after(tiles, tiles.shape, dtype=tiles.dtype))


def _remat_tiles_fwd(one_tile, leaves, tiles):
  return _remat_tiles(one_tile, leaves, tiles), (leaves, tiles)


def _remat_tiles_bwd(one_tile, residuals, g):
  leaves, tiles = residuals
  # Integer leaves (none in Gemma 4's MLP) take a float0 cotangent.
  grows = [i for i, leaf in enumerate(leaves) if jnp.issubdtype(leaf.dtype, jnp.inexact)]

  def one(i, carry):
    d_leaves, d_tiles = carry
    d_leaf, d_tile = jax.vjp(one_tile, leaves, tiles[i])[1](g[i])
    d_leaves = [d + d_leaf[j] for d, j in zip(d_leaves, grows)]
    return d_leaves, lax.dynamic_update_index_in_dim(d_tiles, d_tile, i, 0)

  init = (
    [filled_after(g, leaves[j].shape, dtype=leaves[j].dtype) for j in grows],
    filled_after(g, tiles.shape, dtype=tiles.dtype),
  )
  d_grown, d_tiles = lax.fori_loop(0, tiles.shape[0], one, init)
  d_leaves = [np.zeros(leaf.shape, jax.dtypes.float0) for leaf in leaves]
  for j, d in zip(grows, d_grown):
    d_leaves[j] = d
  return d_leaves, d_tiles


_remat_tiles.defvjp(_remat_tiles_fwd, _remat_tiles_bwd)
