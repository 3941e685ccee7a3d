"""A small packed, padded, multimodal batch and what each cp rank holds of it."""

from __future__ import annotations

import numpy as np


def demo_batch(seq_len: int = 22, seed: int = 0) -> dict:
  """Build one row: three packed documents, an image span, and a padded tail.

  Labels come from :func:`cpjax.next_token_labels`, so none crosses a
  document boundary.

  Args:
    seq_len: the row's length.
    seed: the random seed.

  Returns:
    The one-row batch.
  """
  import cpjax

  rng = np.random.default_rng(seed)
  n_pad = max(seq_len // 8, 1)
  real = seq_len - n_pad
  cuts = np.sort(rng.choice(np.arange(2, real - 1), 2, replace=False))
  docs = np.zeros(seq_len, np.int32)
  docs[:real] = 1 + (np.arange(real) >= cuts[0]) + (np.arange(real) >= cuts[1])
  types = np.zeros(seq_len, np.int32)
  start = int(rng.integers(1, max(real - 4, 2)))
  types[start : start + 3] = 1
  ids = np.where(docs > 0, rng.integers(2, 1000, seq_len), 0).astype(np.int32)
  batch = {
    "input_ids": ids[None],
    "_packed_seq_ids": docs[None],
    "mm_token_type_ids": types[None],
    "attention_mask": (docs > 0).astype(np.int32)[None],
    "pixel_values": np.zeros((1, 3, 4, 4), np.float32),
  }
  batch["labels"] = np.asarray(cpjax.next_token_labels(ids[None], docs[None]))
  return batch


def run_demo(cp_size: int = 8, seq_len: int = 22) -> str:
  """Shard :func:`demo_batch` in every layout over ``cp_size`` devices; return a report."""
  import jax

  import cpjax

  mesh = jax.make_mesh((cp_size,), ("cp",), devices=jax.devices()[:cp_size])
  batch = demo_batch(seq_len)
  lines = [
    f"cpjax demo: one packed multimodal row of {seq_len} tokens on "
    f"{cp_size} {jax.devices()[0].platform.upper()} devices"
  ]
  lines.append("  document ids : " + " ".join(f"{d:2d}" for d in batch["_packed_seq_ids"][0]))
  lines.append("  token types  : " + " ".join(f"{t:2d}" for t in batch["mm_token_type_ids"][0]))
  for kind in cpjax.batch.layout.LAYOUT_KINDS:
    out, layout = cpjax.shard_batch(batch, mesh, layout=kind)
    host = {k: np.asarray(out[k]) for k in ("_packed_seq_ids", "labels")}
    lines.append(
      f"\n{kind}: padded {layout.original_seq_len} -> {layout.padded_seq_len}, "
      f"{layout.local_seq_len} tokens per rank"
    )
    lines.append("  rank  global positions        doc ids        labels")
    for r in range(cp_size):
      sl = slice(r * layout.local_seq_len, (r + 1) * layout.local_seq_len)
      # document_balanced reorders whole documents: show where each token came from.
      pos = (
        np.asarray(out["_source_index"])[0, sl]
        if "_source_index" in out
        else np.asarray(cpjax.local_token_indices(layout, r))
      ).tolist()
      docs = host["_packed_seq_ids"][0, sl].tolist()
      labels = host["labels"][0, sl].tolist()
      lines.append(f"  {r:>4}  {str(pos):<22}  {str(docs):<13}  {labels}")
    back = cpjax.unshard_batch(out, layout)
    same = all(np.array_equal(back[k], v) for k, v in cpjax.normalize_batch(batch).items())
    lines.append(f"  unshard_batch restores the batch bit-exactly: {same}")
  return "\n".join(lines)
