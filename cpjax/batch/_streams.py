"""A batch's sequence streams: which keys are cut along the sequence, on which
dimension and how they are padded: the batch package's own helpers for
:mod:`cpjax.batch.sharding` (package-private).
Shape letters: ``B`` batch, ``S`` original length, ``Sp`` padded length,
``T`` positions taken per row.

>>> import numpy as np
>>> sorted(sequence_streams({"input_ids": np.zeros((1, 4)), "labels": np.zeros((1, 4)),
...                           "pixel_values": np.zeros((1, 3))}, aux_only=False, extra={}).items())
[('input_ids', 1), ('labels', 1)]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jax.typing import ArrayLike

from cpjax.batch import normalize as batch_lib

# Auxiliary (no-grad) streams and their right-pad values; the primary
# streams follow. ``position_ids`` is special: it keeps counting.
AUX_PAD_VALUES = {
  "labels": batch_lib.IGNORE_INDEX,
  "loss_mask": 0,
  "padding_mask": True,
  batch_lib.DOCUMENT_IDS_KEY: 0,
}
PRIMARY_STREAMS = ("input_ids", "inputs_embeds", "mm_token_type_ids")
REPLICATED_ALWAYS = ("pixel_values", "image_position_ids")


def stream_spec(
  ndim: int,
  *,
  seq_dim: int | None,
  axis_name: str | None,
  batch_dim: int | None,
  batch_axis: str | None,
) -> P:
  parts: list[str | None] = [None] * ndim
  if batch_axis is not None and batch_dim is not None:
    parts[batch_dim] = batch_axis
  if seq_dim is not None and axis_name is not None:
    parts[seq_dim] = axis_name
  return P(*parts)


def pad_stream(
  key: str, x: jax.Array, seq_dim: int, pad_len: int, pad_value: ArrayLike | None
) -> jax.Array:
  if pad_len == 0:
    return x
  if key == "position_ids":
    # Positions keep counting past the last real token of every row.
    last = jax.lax.index_in_dim(x, -1, axis=seq_dim, keepdims=True)
    shape = [1] * x.ndim
    shape[seq_dim] = pad_len
    step = jnp.arange(1, pad_len + 1, dtype=x.dtype).reshape(shape)
    return jnp.concatenate([x, last + step], axis=seq_dim)
  widths = [(0, 0)] * x.ndim
  widths[seq_dim] = (0, pad_len)
  return jnp.pad(x, widths, constant_values=jnp.asarray(pad_value, x.dtype))


def check_extra_keys(
  batch: Mapping,
  extra_seq_keys: Mapping[str, int] | None,
  extra_pad_values: Mapping[str, Any] | None,
) -> dict[str, int]:
  extra = dict(extra_seq_keys or {})
  for key, dim in extra.items():
    if key not in batch:
      raise KeyError(
        f"extra_seq_keys names {key!r}, which is not in the batch (keys: {sorted(batch)})"
      )
    if isinstance(dim, bool) or not isinstance(dim, int):
      raise TypeError(f"extra_seq_keys[{key!r}] must be an int dimension, got {dim!r}")
    ndim = jnp.ndim(batch[key])
    if not -ndim <= dim < ndim:
      raise ValueError(
        f"extra_seq_keys[{key!r}] = {dim} is not a dimension of an array of shape "
        f"{tuple(jnp.shape(batch[key]))}; expected {-ndim} <= dim < {ndim}"
      )
    extra[key] = dim % ndim
  unknown = set(extra_pad_values or {}) - set(extra)
  if unknown:
    raise KeyError(
      f"extra_pad_values names {sorted(unknown)}, which are not in extra_seq_keys {sorted(extra)}"
    )
  return extra


def batch_dims(
  batch: Mapping, streams: Mapping[str, int], extra: Mapping[str, int], batch_size: int
) -> dict:
  """{key: batch dim or None} of the sharded streams.

  A known stream has its batch just before its sequence dimension. An extra
  key has one there only when that dimension has the batch size; otherwise it
  holds no batch dimension and is replicated over ``batch_axis``.
  """
  dims = {}
  for key, seq_dim in streams.items():
    bdim = seq_dim - 1 if seq_dim >= 1 else None
    if key in extra and bdim is not None and jnp.shape(batch[key])[bdim] != batch_size:
      bdim = None
    dims[key] = bdim
  return dims


def sequence_streams(batch: Mapping, *, aux_only: bool, extra: Mapping[str, int]) -> dict[str, int]:
  """{key: seq_dim} of every stream that is padded and sharded."""
  streams = {}
  for key in (*AUX_PAD_VALUES, "position_ids"):
    if key in batch:
      streams[key] = 2 if key == "position_ids" and jnp.ndim(batch[key]) == 3 else 1
  if not aux_only:
    for key in PRIMARY_STREAMS:
      if key in batch:
        streams[key] = 1
  streams.update(extra)
  return streams
