"""Shard a batch's sequence streams over the named ``cp`` mesh axis, and back.

* :func:`shard_batch` normalises a batch, pads every sequence stream on the
  right and returns global ``jax.Array`` s sharded on the sequence dimension
  over ``axis_name`` (through ``jax.shard_map``), in **rank order**:
  ``out[k][:, r*L:(r+1)*L]`` is what rank r holds.
* :func:`unshard_batch` is its exact inverse.
* Under a ``"document_balanced"`` layout, :func:`shard_batch` first reorders
  each row's whole documents (:func:`cpjax.batch.balance.balance_documents`, on the
  host) and records the order as the ``_source_index`` stream; everything
  that cuts or restores a row (:func:`shard_sequence`,
  :func:`unshard_batch`, :func:`cpjax.to_rank_order`) reads it. It also
  renumbers the document ids (``_packed_seq_ids``, NeMo's name for them)
  1..n in the reordered row's order, so that
  the ring's id-range tile skipping stays as sharp as on the original row,
  and keeps the batch's own ids as ``_source_packed_seq_ids`` for
  :func:`unshard_batch`.
* :func:`shard_sequence` is the in-forward half: inside ``shard_map`` a model
  that holds a full-length stream (embeddings, vision group ids, ...) takes
  this rank's part of it, differentiably.

Shape letters: ``B`` batch, ``S`` original length, ``Sp`` padded length,
``L`` local length, ``E`` embedding width.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.typing import ArrayLike

from cpjax import checks
from cpjax.batch import _streams, balance
from cpjax.batch import normalize as batch_lib
from cpjax.batch.layout import (
  MIN_STRIPE_LEN,
  LayoutKind,
  ShardLayout,
  default_stripes,
  layout_kind,
  local_token_indices,
  padded_length,
  rank_order,
  take_rows,
)
from cpjax.parallel import chunk_multiple as backend_chunk
from cpjax.parallel import (
  gather_dim,
  mesh_platform,
  place,
  required_axis_size,
  resolve_implementation,
)

__all__ = [
  "shard_batch",
  "shard_sequence",
  "token_ranks",
  "unshard_batch",
]


@functools.partial(
  jax.jit,
  static_argnames=("mesh", "layout", "axis_name", "batch_axis", "dims", "batch_dims", "pad_values"),
)
def _pad_and_shard(
  streams, order, *, mesh, layout, axis_name, batch_axis, dims, batch_dims, pad_values
):
  """Pad every stream and keep each rank's tokens, as one compiled program.

  ``order`` is None, or ``{_source_index: int32[B, Sp]}`` in slot order
  (each slot's index in the padded row), plus the renumbered document ids
  under ``_packed_seq_ids`` (NeMo's name for them) when the batch has them:
  each row is reordered before the cut, ``_source_index`` comes back as a
  stream, and the batch's own ids come back as ``_source_packed_seq_ids``."""
  dims, batch_dims, pad_values = dict(dims), dict(batch_dims), dict(pad_values)
  padded = {
    k: _streams.pad_stream(k, x, dims[k], layout.pad_len, pad_values[k]) for k, x in streams.items()
  }
  in_specs = {
    k: _streams.stream_spec(
      x.ndim, seq_dim=None, axis_name=None, batch_dim=batch_dims[k], batch_axis=batch_axis
    )
    for k, x in padded.items()
  }
  out_specs = {
    k: _streams.stream_spec(
      x.ndim, seq_dim=dims[k], axis_name=axis_name, batch_dim=batch_dims[k], batch_axis=batch_axis
    )
    for k, x in padded.items()
  }
  row_in = _streams.stream_spec(2, seq_dim=None, axis_name=None, batch_dim=0, batch_axis=batch_axis)
  row_out = _streams.stream_spec(
    2, seq_dim=1, axis_name=axis_name, batch_dim=0, batch_axis=batch_axis
  )
  if order is not None:
    out_specs.update({k: row_out for k in order})
    if batch_lib.DOCUMENT_IDS_KEY in order:
      out_specs[batch_lib.SOURCE_DOCUMENT_IDS_KEY] = row_out

  def take_local(full, order):
    idx = local_token_indices(layout, jax.lax.axis_index(axis_name))
    if order is None:
      return {k: jnp.take(x, idx, axis=dims[k]) for k, x in full.items()}
    order = {k: jnp.take(x, idx, axis=1) for k, x in order.items()}  # [B, L]
    rows = order[batch_lib.SOURCE_INDEX_KEY]
    local = {
      k: take_rows(x, rows, seq_dim=dims[k], batch_dim=batch_dims[k]) for k, x in full.items()
    }
    if batch_lib.DOCUMENT_IDS_KEY in order:
      local[batch_lib.SOURCE_DOCUMENT_IDS_KEY] = local[batch_lib.DOCUMENT_IDS_KEY]
    return {**local, **order}

  placed = {k: place(x, mesh, in_specs[k]) for k, x in padded.items()}
  if order is not None:
    order = {k: place(x, mesh, row_in) for k, x in order.items()}
  order_spec = None if order is None else {k: row_in for k in order}
  return jax.shard_map(take_local, mesh=mesh, in_specs=(in_specs, order_spec), out_specs=out_specs)(
    placed, order
  )


def shard_batch(
  batch: Mapping[str, Any],
  mesh: Mesh,
  *,
  axis_name: str = "cp",
  layout: LayoutKind | ShardLayout = "load_balanced",
  aux_only: bool = False,
  loss_mask: ArrayLike | None = None,
  padding_token_id: int = 0,
  extra_seq_keys: Mapping[str, int] | None = None,
  extra_pad_values: Mapping[str, Any] | None = None,
  pad_multiple: int = 1,
  batch_axis: str | None = None,
  implementation: str | None = None,
  min_stripe_len: int = MIN_STRIPE_LEN,
  layer_windows: Sequence[int | None] | None = None,
) -> tuple[dict, ShardLayout]:
  """Normalise, pad and shard a batch's sequence streams over ``axis_name``.

  The batch is normalised (:func:`cpjax.normalize_batch`), every sequence
  stream is right-padded to a multiple of ``cp * max(pad_multiple, 2)`` with
  its pad value (``labels`` -100, ``loss_mask`` 0, ``padding_mask`` True,
  the document ids ``_packed_seq_ids`` (NeMo's name) 0, ``input_ids`` ``padding_token_id``,
  ``inputs_embeds`` / ``mm_token_type_ids`` 0, extra keys
  ``extra_pad_values.get(key, 0)``; ``position_ids`` continue counting) and
  sharded on its sequence dimension (dim 2 for mRoPE [3, B, S] positions).

  Args:
    batch: dict of [B, S, ...] arrays (see :mod:`cpjax.batch`).
    mesh: a mesh with an ``axis_name`` axis (other axes are allowed).
    axis_name: the context-parallel mesh axis.
    layout: a :data:`~cpjax.batch.LayoutKind`, ``"load_balanced"``
      (default), ``"contiguous"`` or ``"document_balanced"`` (reorders each
      row's whole documents so that every rank gets the same attention work,
      and adds ``_source_index``; renumbers ``_packed_seq_ids`` 1..n in the
      new order and keeps the batch's own as ``_source_packed_seq_ids``;
      needs concrete, not traced, document ids; the attention must mask by
      ``_packed_seq_ids``, as every cpjax mask built from the batch does);
      or a :class:`cpjax.ShardLayout` (one an earlier call returned, say):
      shard exactly that way, its kind, stripes and padded length
      (``pad_multiple`` and ``min_stripe_len`` then play no part). Its
      ``cp_size`` and ``original_seq_len`` must be the mesh's and the
      batch's, and its chunks a multiple of what ``implementation`` tiles.
    aux_only: shard only the auxiliary streams; ``input_ids`` /
      ``inputs_embeds``, ``mm_token_type_ids`` and ``pixel_values`` are
      returned full length, unpadded and replicated, for a model that slices
      them itself with :func:`shard_sequence`.
    loss_mask: [B, S]; labels to use when the batch has none (as the
      original: no ``loss_mask`` key is then emitted); with labels, it is
      sharded as the ``loss_mask`` stream (padded with 0).
    padding_token_id: pad value of ``input_ids``.
    extra_seq_keys: ``{key: seq_dim}`` of further streams to shard: dimension
      ``seq_dim`` of ``batch[key]`` must have the sequence length S, any
      other dimension may have any size (e.g. [2, B, S] with ``seq_dim=2``).
      With ``batch_axis``, the dimension before ``seq_dim`` is sharded over
      it when it has the batch size; otherwise the key is replicated there.
    extra_pad_values: ``{key: pad_value}`` for those (default 0).
    pad_multiple: extra padding granularity (>= 1).
    batch_axis: optional mesh axis to shard the batch dimension over.
    implementation: the ring's per-hop backend the batch is for (as
      :func:`cpjax.ring_attention`; None: the mesh's platform's default).
      With the default ``pad_multiple``, rows are padded so that every layout
      chunk is a multiple of what a Pallas implementation tiles (128 tokens on TPU,
      16 on GPU), so any length runs; padding stays masked.
    min_stripe_len: a ``"document_balanced"`` layout's stripes hold at least
      this many tokens (and at least a Pallas tile), as many per rank as
      that allows up to 16 (:func:`cpjax.default_stripes`). Give the
      model's longest sliding window: a stripe that long keeps the window's
      ring at one hop each way. Without windows, shorter stripes (256)
      balance packed rows better. The default, 1024, is Gemma 4's longest.
    layer_windows: the window of each of the model's attention layers (None:
      a full causal layer), so that a ``"document_balanced"`` layout evens
      out the model's own work (:func:`cpjax.batch.balance.token_work`); default:
      one full causal layer.

  Returns:
    ``(sharded_batch, layout)``: global arrays in rank order, and the
    :class:`cpjax.ShardLayout` they follow. Unknown keys pass through.

  Example:
    >>> import jax, numpy as np, cpjax
    >>> mesh = jax.make_mesh((2,), ("cp",), devices=jax.devices()[:2])
    >>> batch = {"input_ids": np.arange(6)[None], "labels": np.arange(6)[None]}
    >>> out, lay = cpjax.shard_batch(batch, mesh, layout="contiguous")
    >>> lay.padded_seq_len, np.asarray(out["labels"]).tolist()
    (8, [[0, 1, 2, 3, 4, 5, -100, -100]])
  """
  cp_size = required_axis_size(mesh, axis_name, "axis_name")
  dp_size = 1  # without a batch axis the batch stays whole
  if batch_axis is not None:
    if batch_axis == axis_name:
      raise ValueError(f"batch_axis must differ from axis_name, both are {axis_name!r}")
    dp_size = required_axis_size(mesh, batch_axis, "batch_axis")
  kind = layout_kind(layout)
  if isinstance(pad_multiple, bool) or not isinstance(pad_multiple, int) or pad_multiple < 1:
    raise ValueError(f"pad_multiple must be an int >= 1, got {pad_multiple!r}")
  checks.integer("padding_token_id", padding_token_id)
  if not isinstance(aux_only, (bool, np.bool_)):
    raise TypeError(f"aux_only must be a bool, got {type(aux_only).__name__} ({aux_only!r})")
  checks.fits_int32("padding_token_id", np.asarray(padding_token_id))

  norm = batch_lib.normalize_batch(batch, loss_mask=loss_mask)
  extra = _streams.check_extra_keys(norm, extra_seq_keys, extra_pad_values)
  primary = batch_lib.primary_key(norm)
  batch_size, seq_len = jnp.shape(norm[primary])[:2]
  for key, dim in extra.items():
    if jnp.shape(norm[key])[dim] != seq_len:
      raise ValueError(
        f"extra key {key!r} must have the sequence length {seq_len} on dim {dim} "
        f"(extra_seq_keys[{key!r}]), got shape {tuple(jnp.shape(norm[key]))}"
      )
  if batch_axis is not None and batch_size % dp_size:
    raise ValueError(
      f"batch size {batch_size} must be divisible by the size {dp_size} of "
      f"batch_axis={batch_axis!r}"
    )

  chunk_multiple = 1
  if pad_multiple == 1:  # the caller's own pad_multiple wins
    chunk_multiple = backend_chunk(
      resolve_implementation(implementation, platform=mesh_platform(mesh))
    )
  checks.integer("min_stripe_len", min_stripe_len, minimum=1)
  if isinstance(layout, ShardLayout):
    _check_given_layout(layout, cp_size=cp_size, seq_len=seq_len, chunk_multiple=chunk_multiple)
    stripes, padded = layout.stripes, layout.padded_seq_len
  else:
    stripes = None
    if kind == "document_balanced":
      stripes = default_stripes(
        seq_len, cp_size, min_stripe_len=max(min_stripe_len, chunk_multiple)
      )
    padded = padded_length(
      seq_len,
      cp_size,
      kind=kind,
      pad_multiple=pad_multiple,
      chunk_multiple=chunk_multiple,
      stripes=stripes,
    )
  streams = _streams.sequence_streams(norm, aux_only=aux_only, extra=extra)
  replicated = tuple(
    k
    for k in (*_streams.PRIMARY_STREAMS, *_streams.REPLICATED_ALWAYS)
    if k in norm and k not in streams
  )
  shard_layout = ShardLayout(
    seq_len, padded, cp_size, kind, replicated_keys=replicated, stripes=stripes
  )

  pad_values = {
    **_streams.AUX_PAD_VALUES,
    "input_ids": padding_token_id,
    "inputs_embeds": 0,
    "mm_token_type_ids": 0,
    "position_ids": None,
  }
  pad_values.update({k: (extra_pad_values or {}).get(k, 0) for k in extra})
  batch_dims = _streams.batch_dims(norm, streams, extra, batch_size)
  order = None
  if kind == "document_balanced":
    order = _document_order(
      norm,
      shard_layout,
      batch_dims,
      layer_windows=layer_windows,
      renumber=batch_lib.DOCUMENT_IDS_KEY in streams,
    )
  sharded = _pad_and_shard(
    {k: jnp.asarray(norm[k]) for k in streams},
    order,
    mesh=mesh,
    layout=shard_layout,
    axis_name=axis_name,
    batch_axis=batch_axis,
    dims=tuple(streams.items()),
    batch_dims=tuple(batch_dims.items()),
    pad_values=tuple((k, pad_values[k]) for k in streams),
  )

  out = dict(norm)
  out.update(sharded)
  for key in replicated:
    x = jnp.asarray(norm[key])
    bdim = 0 if key in _streams.PRIMARY_STREAMS else None
    out[key] = place(
      x,
      mesh,
      _streams.stream_spec(
        x.ndim, seq_dim=None, axis_name=None, batch_dim=bdim, batch_axis=batch_axis
      ),
    )
  return out, shard_layout


def _check_given_layout(
  layout: ShardLayout, *, cp_size: int, seq_len: int, chunk_multiple: int
) -> None:
  """Check that a :class:`ShardLayout` given to :func:`shard_batch` fits the
  batch and mesh it shards."""
  expected = {"cp_size": cp_size, "original_seq_len": seq_len}
  given = {"cp_size": layout.cp_size, "original_seq_len": layout.original_seq_len}
  if given != expected:
    raise ValueError(
      f"layout must fit the mesh's cp axis and the batch's length: expected {expected}, "
      f"got a ShardLayout with {given}"
    )
  if layout.chunk_len % chunk_multiple:
    raise ValueError(
      f"layout's chunks must hold a multiple of {chunk_multiple} tokens (what the "
      f"implementation's tiles need), got a ShardLayout with chunk_len {layout.chunk_len}"
    )


def _document_order(
  norm: Mapping, layout: ShardLayout, batch_dims: Mapping, *, layer_windows, renumber: bool
) -> dict:
  """Each row's balanced document order, computed on the host:
  ``{_source_index: int32[B, Sp]}`` in slot order, and with ``renumber`` the
  reordered row's document ids renumbered in slot order under
  ``_packed_seq_ids`` (NeMo's name for them)."""
  ids = batch_lib.synthesize_document_ids(norm, layout.original_seq_len)[batch_lib.DOCUMENT_IDS_KEY]
  if isinstance(ids, jax.core.Tracer):
    raise TypeError(
      "a 'document_balanced' layout orders each row's documents on the host from "
      f"{batch_lib.DOCUMENT_IDS_KEY}: call shard_batch outside jit, with concrete arrays"
    )
  ids = np.pad(np.asarray(ids), ((0, 0), (0, layout.pad_len)))
  source = balance.balance_documents(ids, layout, layer_windows=layer_windows)
  shared = [k for k, d in batch_dims.items() if d is None]
  if shared and (source != source[:1]).any():
    raise ValueError(
      f"stream(s) {shared} have no batch dimension, but a 'document_balanced' layout "
      "reorders each row differently; give them a batch dimension (e.g. "
      "[B, S] rather than [S])"
    )
  order = {batch_lib.SOURCE_INDEX_KEY: jnp.asarray(source)}
  if renumber:
    order[batch_lib.DOCUMENT_IDS_KEY] = jnp.asarray(
      balance.renumber_documents(np.take_along_axis(ids, source, 1))
    )
  return order


def unshard_batch(
  batch: Mapping[str, Any], layout: ShardLayout, *, extra_seq_keys: Mapping[str, int] | None = None
) -> dict:
  """Invert :func:`shard_batch`: restore global token order, strip padding.

  Every sharded stream (the known keys not in ``layout.replicated_keys``, plus
  ``extra_seq_keys``) must have ``layout.padded_seq_len`` on its sequence
  dimension; the result has ``layout.original_seq_len`` there. Other keys are
  returned as they are.

  Pass the very ``layout`` :func:`shard_batch` returned with the batch. A
  layout of the other kind with the same padded length cannot be told apart
  from the arrays (both layouts hold the same number of tokens per rank, and
  a stream's values say nothing about the order they were cut in), so it
  would return the tokens scrambled without an error.

  Args:
    batch: the sharded batch.
    layout: the :class:`ShardLayout` :func:`shard_batch` returned with it.
    extra_seq_keys: ``{key: seq_dim}`` of further sharded streams, as
      :func:`shard_batch` took them.

  Returns:
    A new dict: the streams in global token order, without padding.

  Example:
    >>> import jax, numpy as np, cpjax
    >>> mesh = jax.make_mesh((2,), ("cp",), devices=jax.devices()[:2])
    >>> batch = {"input_ids": np.arange(6)[None], "labels": np.arange(6)[None]}
    >>> back = cpjax.unshard_batch(*cpjax.shard_batch(batch, mesh))
    >>> np.asarray(back["labels"]).tolist()
    [[0, 1, 2, 3, 4, 5]]
  """
  batch = checks.mapping("batch", batch)
  if not isinstance(layout, ShardLayout):
    raise TypeError(f"layout must be a ShardLayout, got {type(layout).__name__}")
  extra = _streams.check_extra_keys(batch, extra_seq_keys, None)
  streams = _streams.sequence_streams(batch, aux_only=False, extra=extra)
  streams = {k: d for k, d in streams.items() if k not in layout.replicated_keys}
  for key, dim in streams.items():
    if jnp.shape(batch[key])[dim] != layout.padded_seq_len:
      raise ValueError(
        f"{key} must have the padded length {layout.padded_seq_len} on dim {dim}, "
        f"got shape {tuple(jnp.shape(batch[key]))}"
      )
  source = source_index(batch, layout)
  arrays = {k: jnp.asarray(batch[k]) for k in streams}
  if source is not None and batch_lib.DOCUMENT_IDS_KEY in arrays:
    if batch_lib.SOURCE_DOCUMENT_IDS_KEY not in batch:
      raise KeyError(
        f"a 'document_balanced' layout renumbers {batch_lib.DOCUMENT_IDS_KEY}: the batch must "
        f"carry the {batch_lib.SOURCE_DOCUMENT_IDS_KEY!r} stream shard_batch wrote "
        f"(keys: {sorted(batch)})"
      )
    arrays[batch_lib.DOCUMENT_IDS_KEY] = jnp.asarray(batch[batch_lib.SOURCE_DOCUMENT_IDS_KEY])
  out = {
    k: v
    for k, v in batch.items()
    if k not in (batch_lib.SOURCE_INDEX_KEY, batch_lib.SOURCE_DOCUMENT_IDS_KEY)
  }
  out.update(
    _restore_order(
      arrays,
      source,
      layout=layout,
      dims=tuple(streams.items()),
      batch_dims=tuple(
        _streams.batch_dims(
          batch, streams, extra, 0 if source is None else jnp.shape(source)[0]
        ).items()
      ),
    )
  )
  return out


def token_ranks(batch: Mapping[str, Any], layout: ShardLayout) -> np.ndarray:
  """Return the ``cp`` rank that holds each token of a sharded batch, in natural order.

  What a layout means, token by token: rank r holds natural token t of row b
  where ``ranks[b, t] == r`` (padding included, at the end of the padded
  row). A ``"document_balanced"`` layout answers per row, from the
  ``_source_index`` stream :func:`shard_batch` wrote; the other kinds lay out
  every row alike. Reads the arrays to the host (a debugging and drawing aid,
  not for a jitted step).

  Args:
    batch: the sharded batch :func:`shard_batch` returned.
    layout: the :class:`ShardLayout` returned with it.

  Returns:
    [B, layout.padded_seq_len] int32 ranks.

  Example:
    >>> import jax, numpy as np, cpjax
    >>> mesh = jax.make_mesh((2,), ("cp",), devices=jax.devices()[:2])
    >>> ids = np.arange(8)[None]
    >>> rows = {"input_ids": ids, "labels": cpjax.next_token_labels(ids)}
    >>> sharded, layout = cpjax.shard_batch(rows, mesh)
    >>> cpjax.token_ranks(sharded, layout).tolist()   # load-balanced: chunks 0, 3 | 1, 2
    [[0, 0, 1, 1, 1, 1, 0, 0]]
  """
  batch = checks.mapping("batch", batch)
  if not isinstance(layout, ShardLayout):
    raise TypeError(f"layout must be a ShardLayout, got {type(layout).__name__}")
  source = source_index(batch, layout)
  padded = layout.padded_seq_len
  rows = np.shape(batch[batch_lib.primary_key(batch)])[0]
  # Position j of the rank-ordered row holds natural token source[b, j], and
  # belongs to rank j // L.
  if source is None:
    source = np.broadcast_to(rank_order(layout), (rows, padded))
  ranks = np.empty((rows, padded), np.int32)
  np.put_along_axis(ranks, np.asarray(source), np.arange(padded) // layout.local_seq_len, axis=1)
  return ranks


def source_index(batch: Mapping[str, Any], layout: ShardLayout) -> jax.Array | None:
  """Return the ``_source_index`` stream a ``"document_balanced"`` layout needs.

  Args:
    batch: the batch, carrying the stream :func:`shard_batch` wrote.
    layout: its :class:`ShardLayout`.

  Returns:
    The stream, checked: [B, padded_seq_len] integers; None for the other
    kinds.
  """
  if layout.kind != "document_balanced":
    return None
  if batch_lib.SOURCE_INDEX_KEY not in batch:
    raise KeyError(
      f"a 'document_balanced' layout reorders each row: the batch must carry the "
      f"{batch_lib.SOURCE_INDEX_KEY!r} stream shard_batch wrote (keys: {sorted(batch)})"
    )
  src = batch[batch_lib.SOURCE_INDEX_KEY]
  if jnp.ndim(src) != 2 or jnp.shape(src)[1] != layout.padded_seq_len:
    raise ValueError(
      f"{batch_lib.SOURCE_INDEX_KEY} must be [B, {layout.padded_seq_len}], got "
      f"shape {tuple(jnp.shape(src))}"
    )
  return jnp.asarray(src)


@functools.partial(jax.jit, static_argnames=("layout", "dims", "batch_dims"))
def _restore_order(streams, source, *, layout, dims, batch_dims):
  """Global token order and original length for every stream, compiled once."""
  dims, batch_dims = dict(dims), dict(batch_dims)
  out = {}
  if source is not None:
    source = gather_dim(source, 1)
    inverse = jnp.argsort(source, axis=1).astype(jnp.int32)  # a permutation: exact
  else:
    inverse = jnp.asarray(np.argsort(rank_order(layout)), jnp.int32)[None]
  for key, x in streams.items():
    x = gather_dim(x, dims[key])
    if layout.kind != "contiguous":
      x = take_rows(
        x, inverse, seq_dim=dims[key], batch_dim=None if source is None else batch_dims[key]
      )
    out[key] = jax.lax.slice_in_dim(x, 0, layout.original_seq_len, axis=dims[key])
  return out


def shard_sequence(
  x: ArrayLike,
  layout: ShardLayout,
  *,
  axis_name: str = "cp",
  seq_axis: int = 1,
  pad_value: ArrayLike = 0,
  source_index: ArrayLike | None = None,
) -> jax.Array:
  """Return this rank's part of a full-length stream, called inside ``shard_map``.

  Pads ``x`` on the right along ``seq_axis`` to ``layout.padded_seq_len`` with
  ``pad_value`` and takes the positions ``local_token_indices(layout, rank)``
  (under a ``"document_balanced"`` layout, each row's positions
  ``source_index``). Differentiable: the gradient reaches exactly the owned
  positions. At ``cp_size == 1`` no collective or axis is needed and it only
  pads (the identity when ``x`` is already ``padded_seq_len`` long).

  Args:
    x: [..., S or Sp, ...] full-length stream (``S`` on ``seq_axis``).
    layout: the :class:`ShardLayout` the batch was sharded with.
    axis_name: the context-parallel mesh axis.
    seq_axis: the sequence dimension of ``x``; its batch dimension, when
      ``source_index`` is used, is the one before.
    pad_value: value of padded positions.
    source_index: int[B, L], this rank's part of the batch's
      ``_source_index`` stream; required by a ``"document_balanced"``
      layout, ignored by the others.

  Returns:
    [..., L, ...], same dtype.

  Example:
    >>> import jax, numpy as np, cpjax
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((2,), ("cp",), devices=jax.devices()[:2])
    >>> lay = cpjax.ShardLayout(6, 8, 2, "load_balanced")
    >>> f = jax.shard_map(lambda x: cpjax.shard_sequence(x, lay), mesh=mesh,
    ...                   in_specs=P(), out_specs=P(None, "cp"))
    >>> np.asarray(f(np.arange(1, 7)[None])).tolist()
    [[1, 2, 0, 0, 3, 4, 5, 6]]
  """
  if not isinstance(layout, ShardLayout):
    raise TypeError(f"layout must be a ShardLayout, got {type(layout).__name__}")
  checks.integer("seq_axis", seq_axis)
  x = jnp.asarray(x)
  if not -max(x.ndim, 1) <= seq_axis < max(x.ndim, 1):
    raise ValueError(f"seq_axis={seq_axis} is not a dimension of x, shape {tuple(x.shape)}")
  seq_axis = seq_axis % max(x.ndim, 1)
  length = x.shape[seq_axis] if x.ndim else None
  if length not in (layout.original_seq_len, layout.padded_seq_len):
    raise ValueError(
      f"x must have length {layout.original_seq_len} (or the padded "
      f"{layout.padded_seq_len}) on seq_axis={seq_axis}, got shape {tuple(x.shape)}"
    )
  assert length is not None  # a 0-d x has none, refused above
  checks.cp_axis("shard_sequence", axis_name, layout.cp_size)
  widths = [(0, 0)] * x.ndim
  widths[seq_axis] = (0, layout.padded_seq_len - length)
  x = jnp.pad(x, widths, constant_values=jnp.asarray(pad_value, x.dtype))
  if layout.kind == "document_balanced":
    index = checks.source_index(source_index, x, seq_axis, layout.local_seq_len, arg="seq_axis")
    return take_rows(x, index, seq_dim=seq_axis, batch_dim=seq_axis - 1)
  if layout.cp_size == 1:
    return x
  idx = local_token_indices(layout, jax.lax.axis_index(axis_name))
  return jnp.take(x, idx, axis=seq_axis)
