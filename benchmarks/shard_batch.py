"""Time shard_batch / unshard_batch against a plain numpy pad-and-slice.

B=8, S=131072 with every auxiliary key (labels, position_ids, loss_mask,
padding_mask, _packed_seq_ids, mm_token_type_ids) and input_ids, cp=8 on
emulated CPU devices. The numpy baseline pads every key and slices each
rank's part (with the same load-balanced index map), with no devices at all:
it is the floor for "moving the same bytes on one host".

    python benchmarks/shard_batch.py [--seq-len 131072] [--batch 8] [--cp 8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def make_batch(b: int, s: int):
  import numpy as np

  rng = np.random.default_rng(0)
  pad = np.zeros((b, s), bool)
  pad[:, s - s // 16 :] = True
  docs = np.where(pad, 0, 1 + np.arange(s)[None] // (s // 7)).astype(np.int32)
  docs = np.broadcast_to(docs, (b, s)).copy()
  return {
    "input_ids": rng.integers(0, 32000, (b, s)).astype(np.int32),
    "labels": rng.integers(0, 32000, (b, s)).astype(np.int32),
    "position_ids": np.tile(np.arange(s, dtype=np.int32), (b, 1)),
    "loss_mask": (~pad).astype(np.int32),
    "padding_mask": pad,
    "_packed_seq_ids": docs,
    "mm_token_type_ids": (rng.random((b, s)) < 0.1).astype(np.int32),
  }


def numpy_shard(batch, layout):
  """Pad each key and cut every rank's tokens out: the host-only baseline."""
  import numpy as np

  import cpjax

  pad_values = {
    "input_ids": 0,
    "labels": -100,
    "loss_mask": 0,
    "padding_mask": True,
    "_packed_seq_ids": 0,
    "mm_token_type_ids": 0,
  }
  extra = layout.padded_seq_len - layout.original_seq_len
  order = cpjax.rank_order(layout)
  out = {}
  for k, x in batch.items():
    if k == "position_ids":
      x = np.concatenate([x, x[:, -1:] + np.arange(1, extra + 1)], axis=1)
    else:
      x = np.pad(x, ((0, 0), (0, extra)), constant_values=pad_values[k])
    out[k] = [
      x[:, order[r * layout.local_seq_len : (r + 1) * layout.local_seq_len]]
      for r in range(layout.cp_size)
    ]
  return out


def numpy_unshard(parts, layout):
  import numpy as np

  import cpjax

  inverse = np.argsort(cpjax.rank_order(layout))
  return {
    k: np.concatenate(v, axis=1)[:, inverse][:, : layout.original_seq_len] for k, v in parts.items()
  }


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq-len", type=int, default=131072)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--cp", type=int, default=8)
  parser.add_argument("--repeats", type=int, default=7)
  args = parser.parse_args(argv)
  common.setup_devices(max(args.cp, 8))
  import jax
  import numpy as np

  import cpjax

  mesh = jax.make_mesh((args.cp,), ("cp",), devices=jax.devices()[: args.cp])
  batch = make_batch(args.batch, args.seq_len)
  rows = []
  for kind in ("contiguous", "load_balanced"):
    sharded, layout = cpjax.shard_batch(batch, mesh, layout=kind)

    def shard():
      jax.block_until_ready(cpjax.shard_batch(batch, mesh, layout=kind)[0])

    def unshard():
      jax.block_until_ready(cpjax.unshard_batch(sharded, layout))

    parts = numpy_shard(batch, layout)
    np_shard_t = common.median_time(lambda: numpy_shard(batch, layout), repeats=args.repeats)
    np_unshard_t = common.median_time(lambda: numpy_unshard(parts, layout), repeats=args.repeats)
    shard_t = common.median_time(shard, repeats=args.repeats)
    unshard_t = common.median_time(unshard, repeats=args.repeats)
    # Same bytes as the baseline, or the timing means nothing.
    for k in batch:
      np.testing.assert_array_equal(np.asarray(sharded[k]), np.concatenate(parts[k], axis=1))
    rows.append(
      {
        "layout": kind,
        "op": "shard",
        "cpjax_s": shard_t,
        "numpy_s": np_shard_t,
        "cpjax/numpy": shard_t / np_shard_t,
      }
    )
    rows.append(
      {
        "layout": kind,
        "op": "unshard",
        "cpjax_s": unshard_t,
        "numpy_s": np_unshard_t,
        "cpjax/numpy": unshard_t / np_unshard_t,
      }
    )
  mb = sum(x.nbytes for x in batch.values()) / 2**20
  print(
    f"shard_batch: B={args.batch} S={args.seq_len} cp={args.cp}, {len(batch)} keys, "
    f"{mb:.0f} MiB, median of {args.repeats}"
  )
  common.print_table(rows, ["layout", "op", "cpjax_s", "numpy_s", "cpjax/numpy"])
  path = common.write_json(
    "shard_batch", {"config": vars(args) | {"keys": sorted(batch), "mib": mb}, "rows": rows}
  )
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
