"""Packed rows over the cp ranks: balance, ring work and time per layout.

1. **Balance** (S = 131072, cp = 8, 6 rows per distribution): the busiest
   rank's attention work over the mean, read from ``shard_batch``'s own
   rank-order output (a real token at position p of its document attends
   p + 1 keys), for log-normal documents of median 4k and 16k (sigma 1.0)
   and for one 64k document followed by median-2k documents (sigma 0.8).
2. **The ring on packed rows** (S = 32768, cp = 8, median-4k documents, GQA
   8/2 heads, D = 64, causal, no window: ``min_stripe_len=256``): per layout,
   * the ring's critical path in tiles: the tiles each rank's kernel visits
     at each hop (the mask's own block map at the kernel's tile size, the
     loop the kernels run), scheduled as the ring runs them (a rank waits
     only for the chunk its neighbour sends on), against the balance bound
     (all tiles / cp);
   * wall-clock forward + backward on 8 emulated CPU devices. On this
     2-core machine the 8 devices share the cores, so wall time follows the
     TOTAL work, not the busiest rank's: the critical path is the speed-up a
     machine with one core per device would see, the wall time is measured
     honestly here and on an accelerator (``benchmarks/accelerator.py``).
   * the same for one unpacked causal document (no reordering possible: the
     layouts differ only in stripes);
   * for a Gemma-4-like mix (five 1024-window layers per full one, the
     layout its sharder builds: ``min_stripe_len=1024``,
     ``layer_windows=GEMMA_MIX``): the window's hops and the critical path
     of each layer kind, in tiles.

    python benchmarks/document_balance.py             # ~10 min on 2 cores
    python benchmarks/document_balance.py --quick     # small sizes
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import median_time, print_table, setup_devices, write_json  # noqa: E402

KINDS = ("contiguous", "load_balanced", "document_balanced")
GEMMA_MIX = (1024,) * 5 + (None,)  # layer windows: five sliding layers per full one
DISTRIBUTIONS = {  # name: (median, sigma, first document)
  "log-normal median 4k, sigma 1.0": (4096, 1.0, 0),
  "log-normal median 16k, sigma 1.0": (16384, 1.0, 0),
  "one 64k document, then median 2k, sigma 0.8": (2048, 0.8, 65536),
}


def packed_row(rng, s: int, median: float, sigma: float, first: int = 0):
  """int32[S] document ids 1..n of log-normal lengths packed until the row is full."""
  import numpy as np

  lengths = [first] if first else []
  while sum(lengths) < s:
    lengths.append(max(1, int(rng.lognormal(np.log(median), sigma))))
  lengths[-1] -= sum(lengths) - s
  return np.repeat(np.arange(1, len(lengths) + 1), lengths).astype(np.int32)


def balance_table(s: int, cp: int, rows: int, mesh) -> list[dict]:
  import numpy as np

  import cpjax
  from cpjax.batch import balance

  out = []
  for name, (median, sigma, first) in DISTRIBUTIONS.items():
    rng = np.random.default_rng(0)
    ids = np.stack(
      [packed_row(rng, s, median * s // 131072, sigma, first * s // 131072) for _ in range(rows)]
    )
    batch = {"input_ids": np.zeros_like(ids), "labels": np.zeros_like(ids), "_packed_seq_ids": ids}
    row = {"documents": name}
    for kind in KINDS:
      start = time.perf_counter()
      sharded, lay = cpjax.shard_batch(batch, mesh, layout=kind)
      seconds = time.perf_counter() - start
      # The work each token carries, in the order shard_batch put the tokens.
      source = np.asarray(
        sharded.get("_source_index", np.broadcast_to(cpjax.rank_order(lay), ids.shape))
      )
      work = balance.rank_work(np.take_along_axis(balance.token_work(ids), source, 1), lay)
      row[kind] = float((work.max(1) / work.mean(1)).max())
      if kind == "document_balanced":
        row["shard_batch s/row"] = seconds / rows
    out.append(row)
  return out


def tile_counts(lay, ids_rank_order, block: int, window: int | None = None):
  """int[cp, cp]: tiles rank r's kernel visits against rank s's keys, causal
  (within ``window``) and by document, from the mask's block map (as the
  kernels schedule them)."""
  import numpy as np

  import cpjax
  from cpjax.masks import Tokens

  rule = cpjax.AttentionMask.create(
    causal=True, sliding_window=window, document_ids=ids_rank_order
  ).rule
  cp, n = lay.cp_size, lay.local_seq_len
  info = [
    Tokens(
      cpjax.local_token_indices(lay, r), {"document_ids": ids_rank_order[:, r * n : (r + 1) * n]}
    )
    for r in range(cp)
  ]
  counts = np.zeros((cp, cp), np.int64)
  for r in range(cp):
    for s in range(cp):
      visit = np.asarray(rule.classify(info[r], info[s], block, block).any).any(0)
      counts[r, s] = int(visit.sum())
  return counts


def critical_path(counts) -> tuple[int, int]:
  """(the ring's makespan in tiles, all tiles) for a full one-way ring.

  Each step sends the K/V it holds on before computing on it, and a rank
  waits only for its own receive: rank r starts hop h when it has finished
  hop h - 1 and rank r - 1 has started hop h - 1 (which is when it sent the
  chunk on; transfers counted as free). A rank's hop costs the tiles it
  visits there."""
  cp = counts.shape[0]
  start, end = [0] * cp, [0] * cp
  for h in range(cp):
    if h:
      start = [max(end[r], start[(r - 1) % cp]) for r in range(cp)]
    end = [start[r] + int(counts[r, (r - h) % cp]) for r in range(cp)]
  return max(end), int(counts.sum())


def ring_rows(s: int, cp: int, mesh, *, repeats: int) -> list[dict]:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import cpjax
  from cpjax.attention.ring import default_block_size

  rng = np.random.default_rng(1)
  cases = {
    "packed, median 4k": packed_row(rng, s, 4096 * s // 32768, 1.0)[None],
    "one document": np.ones((1, s), np.int32),
  }
  q = rng.standard_normal((1, s, 8, 64), np.float32)
  k, v = (rng.standard_normal((1, s, 2, 64), np.float32) for _ in range(2))
  out = []
  for case, ids in cases.items():
    batch = {"input_ids": np.zeros_like(ids), "labels": np.zeros_like(ids), "_packed_seq_ids": ids}
    for kind in ("load_balanced", "document_balanced"):
      # Causal without a window: stripes of 256 tokens balance finest.
      sharded, lay = cpjax.shard_batch(batch, mesh, layout=kind, min_stripe_len=256)
      src = sharded.get("_source_index")
      to = lambda x: cpjax.to_rank_order(x, lay, source_index=src)  # noqa: E731
      doc_ids = sharded["_packed_seq_ids"]
      block = default_block_size(lay.chunk_len)  # the XLA tiles' default
      path, total = critical_path(tile_counts(lay, np.asarray(doc_ids), block))

      def loss(q, k, v, doc_ids=doc_ids, lay=lay):
        o = cpjax.context_parallel_attention(q, k, v, mesh=mesh, layout=lay, document_ids=doc_ids)
        return jnp.sum(o)

      grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
      spec = NamedSharding(mesh, P(None, "cp"))
      args = [jax.device_put(to(x), spec) for x in (q, k, v)]
      with jax.set_mesh(mesh):
        compiled = grad.lower(*args).compile()
        seconds = median_time(lambda: jax.block_until_ready(compiled(*args)), repeats=repeats)
      # A Gemma-4-like model: five 1024-window layers per full one; its sharder
      # deals stripes at least a window long and balances the layers' mix.
      w_batch, windowed = cpjax.shard_batch(
        batch, mesh, layout=kind, min_stripe_len=1024, layer_windows=GEMMA_MIX
      )
      w_doc_ids, w_block = (
        np.asarray(w_batch["_packed_seq_ids"]),
        default_block_size(windowed.chunk_len),
      )
      w_path = critical_path(tile_counts(windowed, w_doc_ids, w_block, window=1024))[0]
      f_path = critical_path(tile_counts(windowed, w_doc_ids, w_block))[0]
      out.append(
        {
          "rows": case,
          "layout": kind,
          "stripes/rank": lay.stripes,
          "critical path tiles": path,
          "balance bound tiles": total / cp,
          "path / bound": path / (total / cp),
          "fwd+bwd s (8 dev on 2 cores)": seconds,
          "mix: stripes/rank": windowed.stripes,
          "mix: window hops": tuple(cpjax.ring_plan(windowed, sliding_window=1024)),
          "mix: window layer tiles": w_path,
          "mix: full layer tiles": f_path,
          "mix: 5 x window + full": 5 * w_path + f_path,
        }
      )
  return out


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small sizes, one repeat")
  args = parser.parse_args(argv)
  setup_devices(8)
  import jax

  cp = 8
  mesh = jax.make_mesh((cp,), ("cp",))
  s_balance, s_ring, rows, repeats = (16384, 8192, 2, 1) if args.quick else (131072, 32768, 6, 3)

  balance = balance_table(s_balance, cp, rows, mesh)
  print(
    f"\nBusiest rank's work / mean, S = {s_balance}, cp = {cp}, {rows} rows each (max over rows)"
  )
  print_table(balance, ["documents", *KINDS, "shard_batch s/row"])

  ring = ring_rows(s_ring, cp, mesh, repeats=repeats)
  print(f"\nRing attention fwd+bwd, S = {s_ring}, cp = {cp}, H 8 / Hkv 2, D 64, causal")
  print_table(
    ring,
    [
      "rows",
      "layout",
      "stripes/rank",
      "critical path tiles",
      "balance bound tiles",
      "path / bound",
      "fwd+bwd s (8 dev on 2 cores)",
      "mix: stripes/rank",
      "mix: window hops",
      "mix: window layer tiles",
      "mix: full layer tiles",
      "mix: 5 x window + full",
    ],
  )
  by = {(r["rows"], r["layout"]): r for r in ring}
  for case in ("packed, median 4k", "one document"):
    lb, db = by[(case, "load_balanced")], by[(case, "document_balanced")]
    print(
      f"{case}: critical path load_balanced / document_balanced = "
      f"{lb['critical path tiles'] / db['critical path tiles']:.2f}x; wall "
      f"{lb['fwd+bwd s (8 dev on 2 cores)'] / db['fwd+bwd s (8 dev on 2 cores)']:.2f}x; "
      f"Gemma mix {lb['mix: 5 x window + full'] / db['mix: 5 x window + full']:.2f}x"
    )
  path = write_json(
    "document_balance_quick" if args.quick else "document_balance",
    {"balance": balance, "ring": ring, "S_balance": s_balance, "S_ring": s_ring, "cp": cp},
  )
  print(f"\nwrote {path}")


if __name__ == "__main__":
  main()
