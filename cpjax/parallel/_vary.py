"""Values inside ``shard_map``: the manual axes they vary over, and how to match them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import DTypeLike


def varying_axes(x: jax.Array) -> frozenset:
  """Return the mesh axes ``x`` varies over inside ``shard_map`` (empty outside).

  Args:
    x: an array.

  Returns:
    The axes' names.
  """
  mat = getattr(jax.typeof(x), "manual_axis_type", None)
  return getattr(mat, "varying", frozenset())


def vary_like(x: jax.Array, ref: jax.Array) -> jax.Array:
  """Make ``x`` varying over the mesh axes ``ref`` varies over (check_vma).

  Args:
    x: an array.
    ref: the array whose varying axes ``x`` takes.

  Returns:
    ``x``, varying over those axes too.
  """
  missing = tuple(sorted(varying_axes(ref) - varying_axes(x)))
  return lax.pcast(x, missing, to="varying") if missing else x


def vary_over(x: jax.Array, axes: frozenset) -> jax.Array:
  """Make ``x`` varying over ``axes`` too (check_vma).

  Args:
    x: an array.
    axes: the mesh axes.

  Returns:
    ``x``, varying over ``axes`` too.
  """
  missing = tuple(sorted(axes - varying_axes(x)))
  return lax.pcast(x, missing, to="varying") if missing else x


def filled_after(
  ref: jax.Array, shape: tuple[int, ...], fill: float = 0.0, dtype: DTypeLike = jnp.float32
) -> jax.Array:
  """Return ``fill`` everywhere in ``shape``, varying as ``ref`` does, and computed from ``ref``.

  It is an accumulator's initial value that no schedule can build before
  ``ref`` exists.

  A constant fill (``jnp.zeros``) is one broadcast, which XLA shares between
  every layer's loops; XLA:CPU builds it when the program starts and copies
  it for each loop there, so every copy stays alive until its loop runs
  (1.5 GiB of zeros through the step on the E2B slice at S = 131072, cp = 8).
  A zero made from ``ref``'s first value (0 whatever it is, even NaN) ties
  the fill to ``ref`` by data. It passes an optimization barrier with that
  value: XLA:GPU's simplifier otherwise folds ``convert(pred) * 0`` to a
  constant and fuses every such fill into one operandless fusion, all of
  them alive from the step's start.

  Args:
    ref: the array the fill is computed from.
    shape: the result's shape.
    fill: the value.
    dtype: the result's dtype.

  Returns:
    The filled array.

  >>> filled_after(jnp.ones(3), (2,), -jnp.inf)
  Array([-inf, -inf], dtype=float32)
  """
  out = jnp.full(shape, fill, dtype)
  if ref.size:  # (an empty ref has nothing to wait for)
    first = ref.reshape(-1)[0]
    zero, _ = lax.optimization_barrier(((first != first).astype(dtype) * 0, first))
    out = out + zero  # 0 or 0 * 1: never NaN
  return vary_like(out, ref)
