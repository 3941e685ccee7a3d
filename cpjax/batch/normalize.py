"""Pure batch normalisation: masks, document ids, vision groups, labels.

Every function returns a new dict and never mutates its input; all of them
trace under ``jax.jit``. Batch conventions follow Hugging Face, and for
the document ids NeMo AutoModel, whose key ``_packed_seq_ids`` cpjax keeps:

==========================  ==================  =====================================
key                         shape               meaning
==========================  ==================  =====================================
``input_ids``               [B, S] int          tokens (primary stream)
``inputs_embeds``           [B, S, E]           alternative primary stream
``labels``                  [B, S] int          shifted targets, ``-100`` = ignored
``position_ids``            [B, S] / [1, S] /   RoPE positions (mRoPE: sequence is
                            [3, B, S] int       dim 2)
``attention_mask``          [B, S] / [B,1,S,S]  HF mask, replaced by ``padding_mask``
``padding_mask``            [B, S] bool         True = pad
``loss_mask``               [B, S]              1 = token counts in the loss
``_packed_seq_ids``         [B, S] int          document id 1..n, 0 = pad
``_source_index``           [B, S] int          written by ``shard_batch`` for a
                                                ``"document_balanced"`` layout
``_source_packed_seq_ids``  [B, S] int          the same: the row's own document
                                                ids (that layout renumbers
                                                ``_packed_seq_ids`` 1..n in order)
``mm_token_type_ids``       [B, S] int          1 image, 2 video (vision); else not
``pixel_values``            [N, ...]            images, never sequence-sharded
==========================  ==================  =====================================
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from cpjax import checks

__all__ = [
  "DOCUMENT_IDS_KEY",
  "IGNORE_INDEX",
  "SOURCE_DOCUMENT_IDS_KEY",
  "SOURCE_INDEX_KEY",
  "attention_mask_to_padding_mask",
  "next_token_labels",
  "normalize_batch",
  "primary_key",
  "primary_length",
  "synthesize_document_ids",
  "vision_group_ids",
]

DOCUMENT_IDS_KEY = "_packed_seq_ids"
# Under a "document_balanced" layout: for each token in rank order, its index
# in the padded original row (cpjax.batch.balance reorders whole documents).
SOURCE_INDEX_KEY = "_source_index"
# ... and the batch's own _packed_seq_ids, which that layout renumbers 1..n in
# the reordered row's order (so the ring's blocks see narrow id ranges).
SOURCE_DOCUMENT_IDS_KEY = "_source_packed_seq_ids"
IGNORE_INDEX = -100
PRIMARY_KEYS = ("input_ids", "inputs_embeds")
_INTEGER_KEYS = ("input_ids", "labels", "position_ids", DOCUMENT_IDS_KEY, "mm_token_type_ids")


def _is_integer(x) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.integer)


def primary_key(batch: Mapping) -> str:
  """Return the name of the batch's primary stream, ``input_ids`` or ``inputs_embeds``.

  Args:
    batch: the batch dict.

  Returns:
    ``"input_ids"`` or ``"inputs_embeds"``, whichever the batch holds.

  Raises:
    KeyError: when neither or both are present.
  """
  present = [k for k in PRIMARY_KEYS if k in batch]
  if len(present) != 1:
    raise KeyError(
      "batch must hold exactly one of 'input_ids' / 'inputs_embeds', got "
      f"{present or 'neither'} (keys: {sorted(batch)})"
    )
  return present[0]


def primary_length(batch: Mapping) -> int:
  """Return the sequence length ``S`` of the primary stream (dim 1).

  Args:
    batch: the batch dict.

  Returns:
    ``S``, the primary stream's dim 1.
  """
  return jnp.shape(batch[primary_key(batch)])[1]


def attention_mask_to_padding_mask(batch: Mapping) -> dict:
  """Replace a Hugging Face ``attention_mask`` by a bool ``padding_mask``.

  ``attention_mask`` is always removed. When ``padding_mask`` is absent it is
  derived as in the original: a 2-D mask [B, S] (1 = real, 0 = pad; other
  values are a ``ValueError`` when concrete) gives ``~mask``; a 4-D mask
  [B, H, S, S] gives the diagonal ``d`` of its first head ``mask[:, 0]``
  (as the original, whatever ``H``): ``~d`` when bool and ``d != 0`` when
  additive float (0 = allowed, -inf = masked).

  Example:
    >>> import numpy as np
    >>> out = attention_mask_to_padding_mask({"attention_mask": np.array([[1, 1, 0]])})
    >>> sorted(out), np.asarray(out["padding_mask"]).tolist()
    (['padding_mask'], [[False, False, True]])
  """
  out = checks.mapping("batch", batch)
  mask = out.pop("attention_mask", None)
  if mask is None:
    return out
  shape, dtype = tuple(jnp.shape(mask)), jnp.result_type(mask)
  if len(shape) == 2:
    if not jnp.issubdtype(dtype, jnp.number) and dtype != jnp.bool_:
      raise TypeError(f"a 2-D attention_mask must be bool or numeric (1 = real token), got {dtype}")
    if dtype != jnp.bool_ and not isinstance(mask, jax.core.Tracer):
      # An additive mask (0 / -inf) passed as 2-D would read inverted: refuse it.
      values = np.unique(np.asarray(mask))
      if not np.isin(values, (0, 1)).all():
        raise ValueError(
          f"a 2-D attention_mask holds 1 (real token) and 0 (pad), got values {values[:8].tolist()}"
        )
  elif len(shape) == 4:
    if shape[1] < 1 or shape[2] != shape[3]:
      raise ValueError(f"a 4-D attention_mask must be [B, H, S, S], got shape {shape}")
    if not (dtype == jnp.bool_ or jnp.issubdtype(dtype, jnp.floating)):
      raise TypeError(
        f"a 4-D attention_mask must be bool or additive float (0 = allowed), got {dtype}"
      )
  else:
    raise ValueError(f"attention_mask must be 2-D [B, S] or 4-D [B, H, S, S], got shape {shape}")
  if "padding_mask" in out:
    return out
  mask = jnp.asarray(mask)
  if mask.ndim == 2:
    out["padding_mask"] = ~mask.astype(bool)
  else:
    diag = jnp.diagonal(mask[:, 0], axis1=-2, axis2=-1)
    out["padding_mask"] = ~diag if mask.dtype == jnp.bool_ else diag != 0
  return out


def synthesize_document_ids(batch: Mapping, seq_len: int) -> dict:
  """Add the trivial single-document ids ``_packed_seq_ids`` (NeMo's name) when absent.

  As the original's ``_synthesize_single_document_seq_ids``: a no-op when
  ``_packed_seq_ids`` exists; else 1 where real and 0 where pad when
  ``padding_mask`` exists; else all ones [B, seq_len] (B from the primary
  stream, 1 without one). As in the original, ``seq_len`` is used only in
  that last case, whatever the lengths of the batch's streams.

  Example:
    >>> import numpy as np
    >>> pad = np.array([[0, 0, 0, 0, 1, 1]], bool)
    >>> ids = synthesize_document_ids({"padding_mask": pad}, 6)["_packed_seq_ids"]
    >>> np.asarray(ids).tolist()
    [[1, 1, 1, 1, 0, 0]]
  """
  out = checks.mapping("batch", batch)
  seq_len = checks.integer("seq_len", seq_len, minimum=1)
  for key in (*PRIMARY_KEYS, "padding_mask"):
    if key in out and jnp.ndim(out[key]) < 2:
      raise ValueError(
        f"the batch's {key} must be [B, S, ...], got shape {tuple(jnp.shape(out[key]))}"
      )
  if DOCUMENT_IDS_KEY in out:
    return out
  if "padding_mask" in out:
    pad = jnp.asarray(out["padding_mask"]).astype(bool)
    out[DOCUMENT_IDS_KEY] = jnp.where(pad, 0, 1).astype(jnp.int32)
    return out
  present = [k for k in PRIMARY_KEYS if k in out]
  batch_size = jnp.shape(out[present[0]])[0] if present else 1
  out[DOCUMENT_IDS_KEY] = jnp.ones((batch_size, seq_len), jnp.int32)
  return out


def vision_group_ids(mm_token_type_ids: ArrayLike) -> jax.Array:
  """Return the id of the contiguous vision span each token belongs to; -1 for text.

  A token is vision when its type is 1 (image) or 2 (video); a group
  starts where a vision token follows a non-vision one (or starts the row).
  Computed over the FULL row, so slice it afterwards.

  Args:
    mm_token_type_ids: int[B, S]: 1 (image) and 2 (video) are vision;
      every other code (0 text, 3 audio in transformers' processor, ...) is
      not, as in the original and transformers.

  Returns:
    int32[B, S].

  Example:
    >>> import numpy as np
    >>> np.asarray(vision_group_ids(np.array([[0, 1, 1, 0, 2, 2, 3]]))).tolist()
    [[-1, 0, 0, -1, 1, 1, -1]]
  """
  checks.token_stream("mm_token_type_ids", mm_token_type_ids, kind="int")
  types = jnp.asarray(mm_token_type_ids)
  vision = (types == 1) | (types == 2)
  prev = jnp.pad(vision[:, :-1], ((0, 0), (1, 0)))
  starts = vision & ~prev
  groups = jnp.cumsum(starts.astype(jnp.int32), axis=1) - 1
  return jnp.where(vision, groups, -1).astype(jnp.int32)


def next_token_labels(
  input_ids: ArrayLike, document_ids: ArrayLike | None = None, ignore_index: int = IGNORE_INDEX
) -> jax.Array:
  """Make shifted next-token labels, *before* sharding.

  ``labels[t] = input_ids[t + 1]`` when tokens t and t + 1 belong to the same
  (non-pad) document; the last token of every document, every pad token
  (document id 0) and the last position get ``ignore_index``. Since the shift
  happens on the full row, no label crosses a document or a shard boundary.

  Args:
    input_ids: int[B, S].
    document_ids: optional int[B, S], a batch's ``_packed_seq_ids`` (NeMo's
      name for the document ids; 0 = pad).
    ignore_index: label of positions that do not count.

  Returns:
    int32[B, S].

  Example:
    >>> import numpy as np
    >>> ids = np.array([[5, 6, 7, 8, 9, 0]])
    >>> docs = np.array([[1, 1, 2, 2, 2, 0]])
    >>> np.asarray(next_token_labels(ids, docs)).tolist()
    [[6, -100, 8, 9, -100, -100]]
  """
  checks.integer("ignore_index", ignore_index)
  checks.fits_int32("input_ids", input_ids)
  ids = jnp.asarray(input_ids)
  if ids.ndim != 2 or not _is_integer(ids):
    raise ValueError(f"input_ids must be an integer [B, S] array, got {ids.dtype}{list(ids.shape)}")
  nxt = jnp.pad(ids[:, 1:], ((0, 0), (0, 1)))
  valid = jnp.ones(ids.shape, bool).at[:, -1].set(False)
  if document_ids is not None:
    docs = jnp.asarray(document_ids)
    if docs.shape != ids.shape or not _is_integer(docs):
      raise ValueError(
        "document_ids must be an integer array shaped like input_ids "
        f"{list(ids.shape)}, got {docs.dtype}{list(docs.shape)}"
      )
    nxt_doc = jnp.pad(docs[:, 1:], ((0, 0), (0, 1)))
    valid &= (docs > 0) & (docs == nxt_doc)
  return jnp.where(valid, nxt, ignore_index).astype(jnp.int32)


def _seq_dim(key: str, x) -> int:
  return 2 if key == "position_ids" and jnp.ndim(x) == 3 else 1


def normalize_batch(
  batch: Mapping, *, loss_mask: ArrayLike | None = None, require_labels: bool = True
) -> dict:
  """Bring a batch to the canonical form every cpjax sharder works on.

  * exactly one primary stream (``input_ids`` or ``inputs_embeds``);
  * ``attention_mask`` converted to a bool ``padding_mask``
    (:func:`attention_mask_to_padding_mask`); without either, an all-False
    ``padding_mask`` is added so padding added later is always marked;
  * ``position_ids`` defaulted to ``arange(S)`` and broadcast to [B, S]
    (a [1, S] or [3, 1, S] input is broadcast over the batch);
  * ``labels`` taken from ``loss_mask`` when missing (as the original; the
    ``loss_mask`` key is then not emitted); still none is a ``KeyError``
    unless ``require_labels=False`` (an evaluation batch).
    With labels present, ``loss_mask`` becomes the batch's ``loss_mask``
    stream (a batch that already has one and the argument is a ``ValueError``).

  Shapes and dtypes are validated here, before any compute. Keys it does not
  know are passed through untouched.

  Example:
    >>> import numpy as np
    >>> out = normalize_batch({"input_ids": np.zeros((2, 3), np.int32)},
    ...                       loss_mask=np.ones((2, 3), bool))
    >>> sorted(out), out["position_ids"].tolist()
    (['input_ids', 'labels', 'padding_mask', 'position_ids'], [[0, 1, 2], [0, 1, 2]])

  Raises:
    KeyError: no primary stream / both, or no labels.
    ValueError: sequence lengths or batch sizes that disagree, bad ranks.
    TypeError: non-integer ids, labels or positions.
  """
  batch = checks.mapping("batch", batch)
  key = primary_key(batch)
  primary = batch[key]
  want_ndim = 2 if key == "input_ids" else 3
  if jnp.ndim(primary) != want_ndim:
    raise ValueError(
      f"{key} must be {want_ndim}-D ([B, S{', E' if want_ndim == 3 else ''}]), "
      f"got shape {tuple(jnp.shape(primary))}"
    )
  batch_size, seq_len = jnp.shape(primary)[:2]

  if "attention_mask" in batch:
    mask_shape = tuple(jnp.shape(batch["attention_mask"]))
    four_d = (
      len(mask_shape) == 4
      and mask_shape[0] == batch_size
      and mask_shape[1] >= 1
      and mask_shape[2:] == (seq_len, seq_len)
    )
    if mask_shape != (batch_size, seq_len) and not four_d:
      raise ValueError(
        f"attention_mask must be [B, S] = {[batch_size, seq_len]} or [B, H, S, S] = "
        f"{[batch_size, 'H', seq_len, seq_len]} (from {key}), got {list(mask_shape)}"
      )
  out = attention_mask_to_padding_mask(batch)
  for k in _INTEGER_KEYS:
    if k in out and not _is_integer(out[k]):
      raise TypeError(f"{k} must have an integer dtype, got {jnp.result_type(out[k])}")
    if k in out:
      checks.fits_int32(k, out[k])
  if "padding_mask" in out:
    checks.token_stream("padding_mask", out["padding_mask"], kind="bool_or_int")
  for k in (*PRIMARY_KEYS, *_INTEGER_KEYS, "loss_mask", "padding_mask"):
    if k in out:
      out[k] = jnp.asarray(out[k])

  if "labels" in out and loss_mask is not None:
    # As the original: with labels present, loss_mask= becomes the loss_mask stream.
    if "loss_mask" in out:
      raise ValueError(
        "the batch has a 'loss_mask' key and a loss_mask argument was given; pass one of them"
      )
    out["loss_mask"] = jnp.asarray(loss_mask)
  if "labels" not in out and (loss_mask is not None or require_labels):
    if loss_mask is None:
      raise KeyError(
        "batch has no 'labels' and no loss_mask argument was given; make labels"
        " with cpjax.next_token_labels or pass loss_mask="
      )
    labels = jnp.asarray(loss_mask)
    out["labels"] = labels.astype(jnp.int32) if labels.dtype == jnp.bool_ else labels
    out.pop("loss_mask", None)
    if not _is_integer(out["labels"]):
      raise TypeError(f"labels (from loss_mask) must be integer or bool, got {labels.dtype}")

  if "padding_mask" not in out:
    out["padding_mask"] = jnp.zeros((batch_size, seq_len), bool)
  else:
    out["padding_mask"] = jnp.asarray(out["padding_mask"]).astype(bool)

  pos = out.get("position_ids")
  if pos is None:
    pos = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch_size, seq_len))
  else:
    pos = jnp.asarray(pos)
    if pos.ndim == 2 and pos.shape[0] == 1 and batch_size != 1:
      pos = jnp.broadcast_to(pos, (batch_size, seq_len))
    elif pos.ndim == 3 and pos.shape[1] == 1 and batch_size != 1:
      pos = jnp.broadcast_to(pos, (pos.shape[0], batch_size, seq_len))
    elif pos.ndim not in (2, 3):
      raise ValueError(
        f"position_ids must be [B, S], [1, S] or mRoPE [3, B, S], got shape {tuple(pos.shape)}"
      )
  out["position_ids"] = pos

  for k in (
    "labels",
    "loss_mask",
    "padding_mask",
    DOCUMENT_IDS_KEY,
    "mm_token_type_ids",
    "position_ids",
  ):
    if k not in out:
      continue
    shape = jnp.shape(out[k])
    if k != "position_ids" and len(shape) != 2:
      raise ValueError(
        f"{k} must be 2-D [B, S] = {[batch_size, seq_len]}, got shape {tuple(shape)}"
      )
    dim = _seq_dim(k, out[k])
    bdim = dim - 1
    if len(shape) <= dim or shape[dim] != seq_len:
      raise ValueError(
        f"{k} must have sequence length {seq_len} (that of {key}) on dim {dim}, "
        f"got shape {tuple(shape)}"
      )
    if shape[bdim] != batch_size:
      raise ValueError(
        f"{k} must have batch size {batch_size} (that of {key}) on dim {bdim}, "
        f"got shape {tuple(shape)}"
      )
  return out
