"""Input checks shared by every public function, one per concept.

* attention inputs (:func:`attention_inputs`, :func:`attention_options`): q, k,
  v and the scalar options of every attention entry point;
* per-token streams (:func:`token_stream`): [B, S] id, mask and label arrays;
* integer ids that must survive the int32 conversion (:func:`fits_int32`);
* scalar arguments (:func:`integer`, :func:`mapping`), and the mesh axis a
  function must run inside (:func:`cp_axis`);
* the per-row token order a ``"document_balanced"`` layout needs
  (:func:`source_index`).

Each raises before any compute, at trace time, with ``TypeError`` for a
wrong kind of value and ``ValueError`` for a wrong shape or range; messages
name the argument, what was expected and what was given. Values are checked
only where they are concrete: a traced array's contents cannot be seen at
trace time (see the README's limits).

>>> attention_inputs(np.zeros((1, 4, 2, 8)), np.zeros((1, 4, 1, 8)), np.zeros((1, 4, 1, 8)))
(1, 4, 2, 1, 8)
>>> kv = np.zeros((1, 4, 1, 8))
>>> attention_inputs(np.zeros((1, 4, 2, 8), np.int32), kv, kv)
Traceback (most recent call last):
...
TypeError: q must have a floating-point dtype (attention inputs), got int32
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

__all__ = [
  "attention_inputs",
  "attention_options",
  "cp_axis",
  "fits_int32",
  "integer",
  "mapping",
  "source_index",
  "token_stream",
]

_INT32 = np.iinfo(np.int32)


def _shape(x) -> tuple[int, ...]:
  return tuple(jnp.shape(x))


def _dtype(x):
  return jnp.result_type(x)


def attention_inputs(
  q: ArrayLike, k: ArrayLike, v: ArrayLike, *, length: str = "L"
) -> tuple[int, int, int, int, int]:
  """Check q [B, T, Hq, D] and k, v [B, T, Hkv, D]; return (B, T, Hq, Hkv, D).

  ``length`` names T in messages (``"L"`` local tokens, ``"S"`` a sequence).
  """
  for name, x in (("q", q), ("k", k), ("v", v)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if jnp.ndim(x) != 4:
      raise ValueError(f"{name} must be 4-D [B, {length}, H, D], got shape {_shape(x)}")
    if not jnp.issubdtype(_dtype(x), jnp.floating):
      raise TypeError(
        f"{name} must have a floating-point dtype (attention inputs), got {_dtype(x)}"
      )
  b, t, hq, d = _shape(q)
  if _shape(k) != _shape(v):
    raise ValueError(f"k and v must have the same shape, got {_shape(k)} and {_shape(v)}")
  if _shape(k)[:2] != (b, t) or _shape(k)[3] != d:
    raise ValueError(
      f"k/v must have shape [B, {length}, Hkv, D] = [{b}, {t}, Hkv, {d}] to "
      f"match q, got {list(_shape(k))}"
    )
  hkv = _shape(k)[2]
  if hkv == 0 or hq % hkv:
    raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
  return b, t, hq, hkv, d


def _real(name: str, value) -> float:
  if isinstance(value, (bool, np.bool_)) or not isinstance(
    value, (int, float, np.integer, np.floating)
  ):
    raise TypeError(f"{name} must be a real number or None, got {type(value).__name__} ({value!r})")
  value = float(value)
  if not np.isfinite(value):
    raise ValueError(f"{name} must be finite, got {value}")
  return value


def attention_options(
  *, scale: float | None = None, logits_soft_cap: float | None = None
) -> tuple[float | None, float | None]:
  """Check the scalar options; return them as floats (None stays None).

  ``scale`` is any finite number (default ``1/sqrt(D)`` is applied by the
  caller), ``logits_soft_cap`` a finite number > 0.
  """
  scale = None if scale is None else _real("scale", scale)
  if logits_soft_cap is not None:
    logits_soft_cap = _real("logits_soft_cap", logits_soft_cap)
    if not logits_soft_cap > 0:
      raise ValueError(f"logits_soft_cap must be > 0 or None, got {logits_soft_cap!r}")
  return scale, logits_soft_cap


def fits_int32(name: str, x: ArrayLike) -> None:
  """Check that a concrete integer array's values fit int32.

  A concrete integer array whose values int32 cannot hold is a ValueError
  (JAX would wrap them silently); traced arrays pass unchecked.

  Args:
    name: the argument's name, for the error message.
    x: the array.

  Raises:
    ValueError: when ``x`` is concrete and holds values outside int32.
  """
  if isinstance(x, jax.core.Tracer):
    return
  # The array's own dtype: jnp.result_type would report int64 as int32 already.
  dtype = np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype
  if not np.issubdtype(dtype, np.integer) or np.can_cast(dtype, np.int32):
    return
  values = np.asarray(x)
  if values.size and (values.min() < _INT32.min or values.max() > _INT32.max):
    raise ValueError(
      f"{name} holds values outside int32 [{_INT32.min}, {_INT32.max}] "
      f"(min {values.min()}, max {values.max()}); cpjax computes in int32"
    )


def token_stream(
  name: str,
  x: ArrayLike,
  *,
  kind: str,
  shape: tuple[int, ...] | None = None,
  where: str = "[B, S]",
) -> None:
  """Check a per-token stream: 2-D (``shape`` if given), of ``kind``.

  ``kind``: ``"int"`` (integer dtype), ``"bool"`` (bool), ``"bool_or_int"``
  (a 0/1 mask), or ``"any"``.
  """
  if not hasattr(x, "shape") and not isinstance(x, (list, tuple)):
    raise TypeError(f"{name} must be an array {where}, got {type(x).__name__}")
  got = _shape(x)
  if len(got) != 2 or (shape is not None and got != tuple(shape)):
    want = list(shape) if shape is not None else where
    raise ValueError(
      f"{name} must have shape {where} = {want}, got {list(got)}"
      if shape is not None
      else f"{name} must be 2-D {where}, got shape {list(got)}"
    )
  dtype = _dtype(x)
  ok = {
    "int": jnp.issubdtype(dtype, jnp.integer),
    "bool": dtype == jnp.bool_,
    "bool_or_int": dtype == jnp.bool_ or jnp.issubdtype(dtype, jnp.integer),
    "any": True,
  }[kind]
  if not ok:
    want = {"int": "an integer", "bool": "a bool", "bool_or_int": "a bool or integer"}[kind]
    raise TypeError(f"{name} must have {want} dtype, got {dtype}")
  if kind in ("int", "bool_or_int"):
    fits_int32(name, x)


def bound_axis_size(axis_name: str | tuple[str, ...]) -> int | None:
  """Return the size of mesh axis ``axis_name`` (or a tuple of axes) where it
  is bound (inside ``shard_map``), else None."""
  try:
    return jax.lax.axis_size(axis_name)
  except (NameError, ValueError, KeyError):
    return None


def cp_axis(caller: str, axis_name: str | tuple[str, ...], cp_size: int) -> None:
  """Check that ``caller`` runs where a layout of ``cp_size`` ranks can.

  ``caller`` runs with a layout of ``cp_size`` ranks: inside ``shard_map``
  over ``axis_name`` of that size (or anywhere when ``cp_size`` is 1).

  Args:
    caller: the calling function's name, for the error message.
    axis_name: the CP mesh axis (or a tuple of axes, split over together).
    cp_size: the layout's number of ranks.
  """
  size = bound_axis_size(axis_name)
  if size is None and cp_size != 1:
    raise ValueError(
      f"{caller} with layout.cp_size={cp_size} must run inside shard_map over "
      f"a mesh axis {axis_name!r}; that axis is not bound"
    )
  if size is not None and size != cp_size:
    raise ValueError(
      f"layout.cp_size ({cp_size}) must equal the size of mesh axis {axis_name!r} ({size})"
    )


def source_index(
  index: ArrayLike | None, x: jax.Array | np.ndarray, axis: int, length: int, *, arg: str = "axis"
) -> jax.Array:
  """Check the ``source_index`` that a ``"document_balanced"`` move of ``x`` needs.

  Args:
    index: int[B, ``length``], the batch's ``_source_index`` (or the part of it
      the caller holds); None is refused: the layout reorders each row.
    x: the array moved along ``axis``; ``B`` is its dimension before ``axis``.
    axis: the (non-negative) dimension of ``x`` that is moved.
    length: the tokens per row ``index`` must give.
    arg: the caller's name for ``axis``, for the error message.

  Returns:
    ``index`` as a jax array.
  """
  if index is None:
    raise ValueError(
      "a 'document_balanced' layout reorders each row: pass "
      f"source_index=batch['_source_index'] ([B, {length}])"
    )
  index = jnp.asarray(index)
  if axis == 0 or index.shape != (x.shape[axis - 1], length):
    raise ValueError(
      f"source_index must be [B, {length}] (B = dim {axis - 1} of x, the dimension before "
      f"{arg}={axis}), got shape {tuple(index.shape)} for x of shape {tuple(x.shape)}"
    )
  return index


def integer(name: str, value: object, *, minimum: int | None = None) -> int:
  """Check that ``value`` is a Python or numpy int (not bool) >= ``minimum``.

  Args:
    name: the argument's name, for the error message.
    value: the value to check.
    minimum: the smallest allowed value, or None for no bound.

  Returns:
    ``value`` as a Python int.
  """
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
  if minimum is not None and value < minimum:
    raise ValueError(f"{name} must be >= {minimum}, got {value}")
  return int(value)


def mapping(name: str, value: object) -> dict:
  """Copy a mapping (e.g. a batch dict) into a new dict.

  List and tuple values become numpy arrays, as ``np.asarray`` takes them (a
  ragged one is a ``TypeError`` naming its key).

  Args:
    name: the argument's name, for the error message.
    value: the mapping.

  Returns:
    A new dict of ``value``'s items.
  """
  if not isinstance(value, Mapping):
    raise TypeError(f"{name} must be a mapping of names to arrays, got {type(value).__name__}")
  out = dict(value)
  for key, x in out.items():
    if isinstance(x, (list, tuple)):
      try:
        array = np.asarray(x)
      except ValueError as e:
        raise TypeError(
          f"{name}[{key!r}] is a list that is not a rectangular array of numbers: {e}"
        ) from None
      if array.dtype == object or not (
        np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_
      ):
        raise TypeError(
          f"{name}[{key!r}] is a list that is not a rectangular array of "
          f"numbers (numpy reads it as {array.dtype})"
        )
      out[key] = array
  return out


def __getattr__(name: str):
  # Names that left this module in 0.2, for one release (cpjax/_deprecations.py).
  from cpjax import _deprecations

  return _deprecations.moved_attribute(__name__, name)
