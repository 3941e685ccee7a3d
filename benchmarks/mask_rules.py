"""Mask rules and entry points: what the mask object and the global entry point cost.

B1 H8 D64 float32, S=4096 on 8 emulated CPU devices (or whatever devices are
present), forward+backward medians, for four masks:

* causal, load-balanced;
* 16 packed documents with key padding, load-balanced;
* a 256-token window over packed documents, contiguous (a shortened ring);
* Gemma 4's sliding-layer vision rule (a window behind, all later tokens of the
  same image), built from rule objects, load-balanced.

Each mask runs three ways in the same run: ``ring_attention`` inside a
hand-written ``shard_map`` with the mask keywords, the same with an
``AttentionMask`` object, and ``context_parallel_attention`` on global arrays.
Run it on two checkouts to compare them (same machine, back to back).

    python benchmarks/mask_rules.py [--seq-len 4096] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq-len", type=int, default=4096)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args(argv)
  common.setup_devices(8)
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import cpjax

  n = min(8, len(jax.devices()))
  mesh = jax.make_mesh((n,), ("cp",), devices=jax.devices()[:n])
  s = args.seq_len
  rng = np.random.default_rng(0)
  cuts = np.sort(rng.choice(np.arange(1, s), 15, replace=False))
  docs = (1 + np.searchsorted(cuts, np.arange(s), side="right")).astype(np.int32)[None]
  types = np.zeros((1, s), np.int32)
  types[:, s // 4 : s // 4 + s // 16] = 1
  types[:, 3 * s // 4 : 3 * s // 4 + s // 32] = 1
  groups = np.asarray(cpjax.vision_group_ids(types))
  gemma_rule = (
    cpjax.LocalWindow(255, None)
    & (cpjax.LocalWindow(None, 0) | cpjax.SameVisionGroup())
    & cpjax.SameDocument()
  )
  cases = [
    ("causal", "load_balanced", {}, None),
    (
      "16 documents + padding",
      "load_balanced",
      {"document_ids": docs, "padding_mask": docs == 0},
      None,
    ),
    ("window 256 + documents", "contiguous", {"document_ids": docs, "sliding_window": 256}, None),
    (
      "Gemma 4 vision rule",
      "load_balanced",
      {"document_ids": docs, "vision_group_ids": groups},
      gemma_rule,
    ),
  ]
  rows = []
  for name, kind, keywords, rule in cases:
    layout = cpjax.ShardLayout(s, s, n, kind)
    order = cpjax.rank_order(layout)
    spec = NamedSharding(mesh, P(None, "cp"))
    put = lambda x: jax.device_put(jnp.asarray(np.asarray(x)[:, order]), spec)  # noqa: E731
    q, k, v = (put(rng.standard_normal((1, s, 8, 64), np.float32)) for _ in range(3))
    arrays = {key: put(x) for key, x in keywords.items() if key != "sliding_window"}
    window = keywords.get("sliding_window")
    if rule is None:
      mask = cpjax.AttentionMask.create(sliding_window=window, **arrays)
    else:
      mask = cpjax.AttentionMask(rule, arrays)

    def manual(mask_obj):
      def local(q, k, v, m):
        if mask_obj:
          return cpjax.ring_attention(q, k, v, layout=layout, mask=m)
        return cpjax.ring_attention(q, k, v, layout=layout, sliding_window=window, **m)

      return jax.shard_map(local, mesh=mesh, in_specs=P(None, "cp"), out_specs=P(None, "cp"))

    def global_(q, k, v, m):
      return cpjax.context_parallel_attention(q, k, v, mesh=mesh, layout=layout, mask=m)

    forms = {
      "context_parallel_attention": (global_, mask),
      "shard_map + mask=": (manual(True), mask),
    }
    if rule is None:
      forms["shard_map + keywords"] = (manual(False), arrays)
    row = {"mask": name, "layout": kind, "hops": str(tuple(cpjax.ring_plan(layout, mask=mask)))}
    for form, (fn, m) in forms.items():
      loss = lambda q, k, v, m, fn=fn: jnp.sum(fn(q, k, v, m))
      grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
      print(f"  {name}: {form} ...", flush=True)
      row[form] = common.median_time(
        lambda: jax.block_until_ready(grad(q, k, v, m)),  # noqa: B023
        repeats=args.repeats,
      )
    rows.append(row)
  columns = [
    "mask",
    "layout",
    "hops",
    "shard_map + keywords",
    "shard_map + mask=",
    "context_parallel_attention",
  ]
  print(f"\nfwd+bwd seconds, S={s}, B1 H8 D64 fp32, {n} devices, median of {args.repeats}")
  common.print_table(rows, columns)
  path = common.write_json("mask_rules", {"seq_len": s, "repeats": args.repeats, "rows": rows})
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
