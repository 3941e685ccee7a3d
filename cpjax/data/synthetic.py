"""Synthetic packed, padded, multimodal batches for ``cpjax train``'s default run and tests.

Each row packs documents of random lengths; every document is an arithmetic
sequence of token ids (a learnable signal: the next token is the previous one
plus a per-document stride), every row carries image spans whose placeholders
the vision tower's soft tokens replace, and the row ends in padding.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cpjax.batch.normalize import next_token_labels

__all__ = ["synthetic_batch"]


def synthetic_batch(
  rng: np.random.Generator,
  *,
  batch_size: int,
  seq_len: int,
  vocab_size: int,
  image_token_id: int,
  patch_size: int,
  pooling_kernel_size: int,
  image_grid: tuple[int, int] = (6, 6),
  images_per_row: int = 1,
  max_docs: int = 4,
  pad_fraction: float = 0.1,
  reserved_ids: Sequence[int] = (0,),
) -> dict:
  """Make a dict of numpy arrays as Gemma 4's processor and a packing collator make them.

  Keys: ``input_ids`` (image placeholders are ``image_token_id``),
  ``labels`` (next token within a document, -100 on the last token of each
  document, on image tokens and on padding), ``position_ids`` (restarting
  in every document), ``_packed_seq_ids`` (the document ids, under NeMo's
  name), ``attention_mask``,
  ``mm_token_type_ids`` (1 on image tokens), ``pixel_values`` [N, P, 3 p^2]
  and ``image_position_ids`` int[N, P, 2] with ``N = batch_size *
  images_per_row`` images of ``image_grid = (columns, rows)`` patches, each
  yielding ``columns * rows / k^2`` soft tokens.

  Text ids never take a value of ``reserved_ids`` (the pad id by default; a
  model passes its placeholders and control ids too, so that random text
  never forges an image token): document ``d``'s ``k``-th id is the
  ``(start_d + stride_d * k)``-th id of the vocabulary without them.

  Args:
    rng: the numpy random generator.
    batch_size: rows (B).
    seq_len: tokens per row (S).
    vocab_size: the vocabulary's size.
    image_token_id: the image placeholder id.
    patch_size: ``p``, an image patch's side in pixels.
    pooling_kernel_size: ``k``, the soft tokens' pooling kernel.
    image_grid: ``(columns, rows)`` patches per image.
    images_per_row: images in each row.
    max_docs: the most documents in a row.
    pad_fraction: the largest fraction of the row that is padding.
    reserved_ids: ids text never takes.

  Returns:
    The dict of numpy arrays, with the keys above.

  >>> b = synthetic_batch(np.random.default_rng(0), batch_size=2, seq_len=32, vocab_size=50,
  ...                     image_token_id=99, patch_size=4, pooling_kernel_size=3)
  >>> b["input_ids"].shape, b["pixel_values"].shape, int((b["input_ids"] == 99).sum())
  ((2, 32), (2, 36, 48), 8)
  """
  cols, rows = image_grid
  k = pooling_kernel_size
  if cols % k or rows % k:
    raise ValueError(f"image_grid {image_grid} must be multiples of pooling_kernel_size {k}")
  tokens_per_image = cols * rows // (k * k)
  b, s = batch_size, seq_len
  allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(reserved_ids, np.int64))
  if allowed.size < 2:
    raise ValueError(f"reserved_ids leave {allowed.size} of the {vocab_size} ids for text")
  pad = int(rng.integers(0, max(int(s * pad_fraction), 0) + 1))
  real = s - pad
  ids = np.zeros((b, s), np.int32)
  docs = np.zeros((b, s), np.int32)
  pos = np.zeros((b, s), np.int32)
  types = np.zeros((b, s), np.int32)
  for r in range(b):
    n_docs = int(rng.integers(1, max_docs + 1))
    n_docs = min(n_docs, max(real // 4, 1))
    cuts = np.sort(rng.choice(np.arange(1, real), n_docs - 1, replace=False)) if n_docs > 1 else []
    bounds = [0, *cuts, real]
    for d, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:]), start=1):
      docs[r, lo:hi] = d
      pos[r, lo:hi] = np.arange(hi - lo)
      start, stride = rng.integers(0, allowed.size), rng.integers(1, 4)
      ids[r, lo:hi] = allowed[(start + stride * np.arange(hi - lo)) % allowed.size]
    free = real - tokens_per_image * images_per_row
    if free < 0:
      raise ValueError(
        f"seq_len {s} with {pad} padding cannot hold {images_per_row} image(s) "
        f"of {tokens_per_image} tokens"
      )
    starts = np.sort(rng.choice(np.arange(free + 1), images_per_row, replace=False))
    for i, st in enumerate(starts):
      st = st + i * tokens_per_image
      types[r, st : st + tokens_per_image] = 1
  labels = np.array(next_token_labels(ids, docs))
  ids[types == 1] = image_token_id
  labels[types == 1] = -100
  n_images = b * images_per_row
  grid = np.array([(x, y) for y in range(rows) for x in range(cols)], np.int32)
  return {
    "input_ids": ids,
    "labels": labels,
    "position_ids": pos,
    "_packed_seq_ids": docs,
    "attention_mask": (docs > 0).astype(np.int32),
    "mm_token_type_ids": types,
    "pixel_values": rng.random((n_images, cols * rows, 3 * patch_size**2), np.float32),
    "image_position_ids": np.broadcast_to(grid, (n_images, *grid.shape)).copy(),
  }
