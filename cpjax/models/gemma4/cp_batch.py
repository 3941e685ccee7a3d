"""Gemma4's aux-only contiguous CP batch preparation, under the seed's names.

Gemma4 embeds, splices vision features, builds per-layer inputs and vision
group ids on the FULL row inside its forward and slices them there with
:func:`cpjax.shard_sequence`; the dispatch-time sharder therefore touches only
the auxiliary streams. The one Gemma4-specific piece is the document map
``_packed_seq_ids``: its pad zeros depend on the global pad tail, which a rank
holding only its slice cannot reconstruct, so it is synthesized on the full
pre-pad batch and sharded here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax.numpy as jnp

from cpjax import batch as batch_lib
from cpjax.layout import ShardLayout
from cpjax.sharding import shard_batch

__all__ = ["IMAGE_OFFSET_KEY", "image_token_offsets", "make_contiguous_aux_only_shard_cp_batch",
           "prepare_batch", "shard_aux_only_cp_batch", "synthesize_single_document_seq_ids"]

# Per-row count of image tokens in the global rows before it (see
# image_token_offsets): how a data-parallel shard finds its images.
IMAGE_OFFSET_KEY = "_image_token_offset"


def image_token_offsets(mm_token_type_ids) -> jax.Array:
  """int32[B]: image tokens (type 1) in the rows before each row.

  >>> import numpy as np
  >>> image_token_offsets(np.array([[1, 1, 0], [0, 0, 0], [0, 1, 0]])).tolist()
  [0, 2, 2]
  """
  counts = jnp.sum(jnp.asarray(mm_token_type_ids) == 1, axis=1, dtype=jnp.int32)
  return jnp.cumsum(counts) - counts


def synthesize_single_document_seq_ids(batch: Mapping, seq_len: int) -> dict:
  """The original's ``_synthesize_single_document_seq_ids``, returning a new dict.

  See :func:`cpjax.synthesize_document_ids`.

  >>> import numpy as np
  >>> out = synthesize_single_document_seq_ids({"input_ids": np.zeros((2, 3), int)}, 3)
  >>> np.asarray(out["_packed_seq_ids"]).tolist()
  [[1, 1, 1], [1, 1, 1]]
  """
  return batch_lib.synthesize_document_ids(batch, seq_len)


def shard_aux_only_cp_batch(
    mesh: Mesh,
    batch: Mapping[str, Any],
    *,
    layout: str = "contiguous",
    axis_name: str = "cp",
    loss_mask=None,
    padding_token_id: int = 0,
    extra_seq_keys: Mapping[str, int] | None = None,
    extra_pad_values: Mapping[str, Any] | None = None,
    pad_multiple: int = 1,
    batch_axis: str | None = None,
) -> tuple[dict, ShardLayout]:
  """Gemma4's aux-only CP shard in either layout.

  Converts ``attention_mask``, synthesizes ``_packed_seq_ids`` from the full
  pre-pad ``padding_mask`` (its pad zeros depend on the global pad tail,
  which a rank holding only its slice cannot reconstruct), then shards
  ``labels`` / ``position_ids`` / ``loss_mask`` / ``padding_mask`` /
  ``_packed_seq_ids`` (padded with 0) and the extra keys over ``axis_name``,
  leaving ``input_ids`` / ``inputs_embeds``, ``mm_token_type_ids`` and
  ``pixel_values`` full length and replicated for the model to slice.

  Returns:
    ``(sharded_batch, layout)`` as :func:`cpjax.shard_batch`.

  Example:
    >>> import jax, numpy as np
    >>> mesh = jax.make_mesh((2,), ("cp",), devices=jax.devices()[:2])
    >>> batch = {"input_ids": np.arange(6)[None], "labels": np.arange(6)[None]}
    >>> out, lay = shard_aux_only_cp_batch(mesh, batch, layout="load_balanced")
    >>> lay.kind, np.asarray(out["position_ids"]).tolist(), out["input_ids"].shape
    ('load_balanced', [[0, 1, 6, 7, 2, 3, 4, 5]], (1, 6))
  """
  batch = batch_lib.attention_mask_to_padding_mask(batch)
  seq_len = batch_lib.primary_length(batch)
  batch = synthesize_single_document_seq_ids(batch, seq_len)
  out, shard_layout = shard_batch(
      batch, mesh, axis_name=axis_name, layout=layout, aux_only=True,
      loss_mask=loss_mask, padding_token_id=padding_token_id,
      extra_seq_keys=extra_seq_keys, extra_pad_values=extra_pad_values,
      pad_multiple=pad_multiple, batch_axis=batch_axis)
  if "mm_token_type_ids" in batch:
    # A data-parallel shard sees only its rows but must know which images are
    # theirs: record each row's first image-token slot over the global batch.
    offsets = image_token_offsets(batch["mm_token_type_ids"])
    out[IMAGE_OFFSET_KEY] = jax.device_put(offsets, NamedSharding(mesh, P(batch_axis)))
  return out, shard_layout


def make_contiguous_aux_only_shard_cp_batch(
    mesh: Mesh,
    batch: Mapping[str, Any],
    *,
    axis_name: str = "cp",
    loss_mask=None,
    padding_token_id: int = 0,
    extra_seq_keys: Mapping[str, int] | None = None,
    extra_pad_values: Mapping[str, Any] | None = None,
) -> tuple[dict, ShardLayout]:
  """Aux-only contiguous CP shard for Gemma4's in-forward ("sunk") pre-embed.

  The seed's function under its familiar name:
  :func:`shard_aux_only_cp_batch` with ``layout="contiguous"``.

  Example:
    >>> import jax, numpy as np
    >>> mesh = jax.make_mesh((2,), ("cp",), devices=jax.devices()[:2])
    >>> batch = {"input_ids": np.arange(6)[None], "labels": np.arange(6)[None],
    ...          "attention_mask": np.array([[1, 1, 1, 1, 0, 0]])}
    >>> out, lay = make_contiguous_aux_only_shard_cp_batch(mesh, batch)
    >>> np.asarray(out["_packed_seq_ids"]).tolist(), out["input_ids"].shape
    ([[1, 1, 1, 1, 0, 0, 0, 0]], (1, 6))
  """
  return shard_aux_only_cp_batch(
      mesh, batch, layout="contiguous", axis_name=axis_name, loss_mask=loss_mask,
      padding_token_id=padding_token_id, extra_seq_keys=extra_seq_keys,
      extra_pad_values=extra_pad_values)


def prepare_batch(batch: Mapping[str, Any], *, loss_mask=None) -> dict:
  """The single-device counterpart: the same normalisation, no padding, no sharding.

  >>> import numpy as np
  >>> out = prepare_batch({"input_ids": np.ones((1, 3), np.int32), "labels": np.ones((1, 3), np.int32)})
  >>> sorted(out)
  ['_packed_seq_ids', 'input_ids', 'labels', 'padding_mask', 'position_ids']
  """
  batch = batch_lib.attention_mask_to_padding_mask(batch)
  batch = synthesize_single_document_seq_ids(batch, batch_lib.primary_length(batch))
  return batch_lib.normalize_batch(batch, loss_mask=loss_mask)
