"""One Gemma 4 attention layer's gradient per CP strategy, as the TPU and GPU
compilers build it: memory per device and bytes moved by collectives.

For each layer kind of Gemma 4 (E2B: 8 query heads on 1 K/V head; the full
layers at head dim 512, the sliding ones at 256 with a 512-token window),
sequence length and strategy (``ring``, ``all_gather``), the gradient of
``context_parallel_attention`` (causal, packed documents, bfloat16, the
chip's kernels) is compiled for a v5e slice (XLA:TPU and Mosaic) and for 8
H200s (XLA:GPU, Triton and ptxas), on compile-only devices: no chip needed
(``pip install 'cpjax[tpu]'`` and ``'cpjax[cuda]'``).

    python benchmarks/cp_strategies.py                       # S = 32768 and 131072, cp = 8
    python benchmarks/cp_strategies.py --seq-lens 32768 --chips v5e-8

Columns: GiB per device (arguments + outputs - aliases + temporaries, the
compiler's); MiB each device sends in a step (forward and backward), counted
from the programs' shapes (:func:`bytes_sent`: a compiled program's text
holds a loop's collectives once, not once a hop); the ring's hops; the
compile seconds. Writes results/cp_strategies.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# Compile-only devices: JAX itself runs on the CPU (the CUDA plugin's version
# check would otherwise look for a GPU).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import cpjax  # noqa: E402
from benchmarks.common import print_table, write_json  # noqa: E402
from cpjax import parallel  # noqa: E402
from cpjax.training import plan, targets  # noqa: E402

# Gemma 4 E2B's attention layers: (query heads, K/V heads, head dim, window).
KINDS = {
  "full_attention": (8, 1, 512, None),
  "sliding_attention": (8, 1, 256, 512),
}


def bytes_sent(kind: str, seq_len: int, cp: int, strategy: str) -> tuple[int, int]:
  """(bytes each device sends in one forward + backward, ring hops a pass).

  The ring sends its K/V chunk (bfloat16) and document ids (int32) once a
  hop in the forward, and with them the float32 dK/dV accumulators in the
  backward, then those home (one more send, unless the ring came full
  circle). The all-gather sends its share to each other rank in the forward
  and again in the backward (it recomputes rather than keeps the row), and
  reduce-scatters the row's float32 dK/dV.
  """
  hq, hkv, d, window = KINDS[kind]
  local = seq_len // cp
  kv, ids, grads = 2 * local * hkv * d * 2, local * 4, 2 * local * hkv * d * 4
  if strategy == "all_gather":
    return (cp - 1) * (2 * (kv + ids) + grads), 0
  layout = cpjax.ShardLayout(seq_len, seq_len, cp, "load_balanced")
  ring = cpjax.ring_plan(layout, sliding_window=window)
  hops = ring.forward_hops * (2 if ring.backward_hops else 1)
  home = (2 if ring.backward_hops else 1) * int(ring.forward_hops % cp != 0) * grads
  return hops * (kv + ids) + hops * (kv + ids + grads) + home, hops


def compile_layer(chip: str, kind: str, seq_len: int, cp: int, strategy: str):
  """The compiled gradient of one layer's attention on ``chip``'s devices."""
  hq, hkv, d, window = KINDS[kind]
  target = targets.parse_target(chip)
  mesh = parallel.make_mesh(cp=cp, devices=target.devices()[:cp])
  layout = cpjax.ShardLayout(seq_len, seq_len, cp, "load_balanced")
  rows = NamedSharding(mesh, P(None, "cp"))
  q = jax.ShapeDtypeStruct((1, seq_len, hq, d), jnp.bfloat16, sharding=rows)
  kv = jax.ShapeDtypeStruct((1, seq_len, hkv, d), jnp.bfloat16, sharding=rows)
  docs = jax.ShapeDtypeStruct((1, seq_len), jnp.int32, sharding=rows)

  def loss(q, k, v, docs):
    out = cpjax.context_parallel_attention(
      q,
      k,
      v,
      mesh=mesh,
      layout=layout,
      sliding_window=window,
      segment_ids=docs,
      strategy=strategy,
    )
    return jnp.sum(out.astype(jnp.float32))

  with jax.set_mesh(mesh):
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv, docs).lower().compile()


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seq-lens", type=int, nargs="+", default=[32768, 131072])
  parser.add_argument("--cp", type=int, nargs="+", default=[8])
  parser.add_argument("--chips", nargs="+", default=["v5e-8", "h200-8"])
  args = parser.parse_args(argv)
  rows = []
  for chip in args.chips:
    for seq_len in args.seq_lens:
      for cp in args.cp:
        for kind in KINDS:
          for strategy in cpjax.ring.STRATEGIES:
            start = time.perf_counter()
            row = {"chip": chip, "S": seq_len, "cp": cp, "layer": kind, "strategy": strategy}
            try:
              compiled = compile_layer(chip, kind, seq_len, cp, strategy)
            except Exception as err:  # a compiler's refusal is a result
              row["error"] = f"{type(err).__name__}: {str(err)[:160]}"
              rows.append(row)
              print(row, flush=True)
              continue
            sent, hops = bytes_sent(kind, seq_len, cp, strategy)
            row["GiB"] = plan.compiled_bytes(compiled) / plan.GiB
            row["MiB sent"] = sent / 2**20
            row["hops"] = hops
            row["compile s"] = time.perf_counter() - start
            rows.append(row)
            print(
              f"  {chip} S={seq_len} cp={cp} {kind} {strategy}: {row['GiB']:.2f} GiB, "
              f"{row['MiB sent']:.0f} MiB sent ({row['compile s']:.0f} s)",
              flush=True,
            )
  columns = ["chip", "S", "cp", "layer", "strategy", "GiB", "MiB sent", "hops"]
  print_table(rows, columns + ["compile s"])
  print(f"wrote {write_json('cp_strategies', {'kinds': KINDS, 'rows': rows})}")


if __name__ == "__main__":
  main()
