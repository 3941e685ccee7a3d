"""One Gemma 4 attention layer's gradient per CP strategy, as the TPU and GPU
compilers build it (memory per device, bytes moved by collectives) and as
this CPU runs it (step time).

For each layer kind of Gemma 4 (E2B: 8 query heads on 1 K/V head; the full
layers at head dim 512, the sliding ones at 256 with a 512-token window),
sequence length and strategy (``ring``, ``all_gather`` with a window's halo,
``ulysses``, and ``hybrid`` where K/V heads make its groups: 26B-A4B's full
layers, ``--kinds``), the gradient of ``context_parallel_attention`` (causal, packed
documents, bfloat16, the chip's kernels) is compiled for a v5e slice (XLA:TPU
and Mosaic) and for 8 H200s (XLA:GPU, Triton and ptxas), on compile-only
devices: no chip needed (``pip install 'cpjax[tpu]'`` and ``'cpjax[cuda-compiler]'``).
``--cpu-seq-lens`` times the same gradients (float32, the XLA tile loop) on
this machine's 8 emulated CPU devices, at lengths a CPU runs.

    python benchmarks/cp_strategies.py --cp 2 4 8          # S = 32768 and 131072
    python benchmarks/cp_strategies.py --seq-lens 32768 --chips v5e-8 --cpu-seq-lens
    python benchmarks/cp_strategies.py --kinds a4b_full_attention --out cp_strategies_a4b

Columns: GiB per device (arguments + outputs - aliases + temporaries, the
compiler's); MiB each device sends in a step (forward and backward), counted
from the programs' shapes (:func:`bytes_sent`: a compiled program's text
holds a loop's collectives once, not once a hop); the ring's hops; the
compile seconds; on the CPU, the median step seconds and the ratio to the
ring's in the same run. Writes results/cp_strategies.json.
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
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import cpjax  # noqa: E402
from benchmarks.common import median_time, print_table, setup_devices, write_json  # noqa: E402
from cpjax import parallel  # noqa: E402
from cpjax.training import cp_strategy, plan, targets  # noqa: E402

# Gemma 4 E2B's attention layers, and 26B-A4B's full ones (2 K/V heads: the
# hybrid's groups of 2): (query heads, K/V heads, head dim, window).
KINDS = {
  "full_attention": (8, 1, 512, None),
  "sliding_attention": (8, 1, 256, 512),
  "a4b_full_attention": (16, 2, 512, None),
}
E2B_KINDS = ("full_attention", "sliding_attention")


def applies(kind: str, cp: int, strategy: str) -> bool:
  """Whether ``strategy`` is its own program for ``kind`` at ``cp``: the
  hybrid needs K/V heads sharing a factor with cp, and one group of the
  whole axis is Ulysses."""
  if strategy != "hybrid":
    return True
  hq, hkv, _, _ = KINDS[kind]
  try:
    return cpjax.attention.ring.hybrid_ulysses_size(hq, hkv, cp) < cp
  except ValueError:
    return False


def bytes_sent(kind: str, seq_len: int, cp: int, strategy: str) -> tuple[int, int]:
  """(bytes each device sends in one forward + backward, ring hops a pass):
  :func:`cpjax.training.cp_strategy.bytes_sent`, the count the rule compares."""
  hq, hkv, d, window = KINDS[kind]
  shape = dict(seq_len=seq_len, cp=cp, q_heads=hq, kv_heads=hkv, head_dim=d, window=window)
  return cp_strategy.bytes_sent(strategy, **shape)


def layer_gradient(kind: str, seq_len: int, cp: int, strategy: str, devices, dtype):
  """(jitted gradient of one layer's attention, its abstract arguments, mesh)."""
  hq, hkv, d, window = KINDS[kind]
  mesh = parallel.make_mesh(cp=cp, devices=devices[:cp])
  layout = cpjax.ShardLayout(seq_len, seq_len, cp, "load_balanced")
  rows = NamedSharding(mesh, P(None, "cp"))
  q = jax.ShapeDtypeStruct((1, seq_len, hq, d), dtype, sharding=rows)
  kv = jax.ShapeDtypeStruct((1, seq_len, hkv, d), dtype, sharding=rows)
  docs = jax.ShapeDtypeStruct((1, seq_len), jnp.int32, sharding=rows)

  def loss(q, k, v, docs):
    out = cpjax.context_parallel_attention(
      q,
      k,
      v,
      mesh=mesh,
      layout=layout,
      sliding_window=window,
      document_ids=docs,
      strategy=strategy,
    )
    return jnp.sum(out.astype(jnp.float32))

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2))), (q, kv, kv, docs), mesh


def compile_layer(chip: str, kind: str, seq_len: int, cp: int, strategy: str):
  """The compiled gradient of one layer's attention on ``chip``'s devices."""
  devices = targets.parse_target(chip).devices()
  grad, args, mesh = layer_gradient(kind, seq_len, cp, strategy, devices, jnp.bfloat16)
  with jax.set_mesh(mesh):
    return grad.trace(*args).lower().compile()


def cpu_seconds(kind: str, seq_len: int, cp: int, strategy: str) -> float:
  """Median seconds of one layer's gradient on this machine's CPU devices (float32)."""
  grad, args, mesh = layer_gradient(kind, seq_len, cp, strategy, jax.devices(), jnp.float32)
  rng = np.random.default_rng(0)
  real = [
    jax.device_put(rng.standard_normal(a.shape).astype(np.float32), a.sharding) for a in args[:3]
  ]
  docs = jax.device_put(
    np.repeat([[1, 2]], seq_len // 2, axis=1).astype(np.int32), args[3].sharding
  )
  with jax.set_mesh(mesh):
    compiled = grad.trace(*real, docs).lower().compile()
    return median_time(lambda: jax.block_until_ready(compiled(*real, docs)), repeats=3)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seq-lens", type=int, nargs="+", default=[32768, 131072])
  parser.add_argument("--cp", type=int, nargs="+", default=[8])
  parser.add_argument("--chips", nargs="*", default=["v5e-8", "h200-8"])
  parser.add_argument(
    "--cpu-seq-lens", type=int, nargs="*", default=[], help="also time on this CPU (e.g. 4096)"
  )
  parser.add_argument(
    "--kinds",
    nargs="+",
    choices=list(KINDS),
    default=list(E2B_KINDS),
    help="layers to measure (default: E2B's two kinds)",
  )
  parser.add_argument("--out", default="cp_strategies", help="results/NAME.json")
  args = parser.parse_args(argv)
  setup_devices(8)
  rows = []
  for chip in args.chips:
    for seq_len in args.seq_lens:
      for cp in args.cp:
        for kind in args.kinds:
          for strategy in filter(lambda x: applies(kind, cp, x), cpjax.attention.ring.STRATEGIES):
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
  timed = []
  for seq_len in args.cpu_seq_lens:
    for cp in args.cp:
      for kind in args.kinds:
        base = None
        # The ring first: the ratios' base.
        for strategy in filter(lambda x: applies(kind, cp, x), cpjax.attention.ring.STRATEGIES):
          seconds = cpu_seconds(kind, seq_len, cp, strategy)
          base = seconds if strategy == "ring" else base
          row = {"S": seq_len, "cp": cp, "layer": kind, "strategy": strategy}
          row.update({"CPU s": seconds, "vs ring": seconds / base})
          timed.append(row)
          print(f"  cpu S={seq_len} cp={cp} {kind} {strategy}: {seconds:.2f} s", flush=True)
  columns = ["chip", "S", "cp", "layer", "strategy", "GiB", "MiB sent", "hops"]
  if rows:
    print_table(rows, columns + ["compile s"])
  if timed:
    print_table(timed, ["S", "cp", "layer", "strategy", "CPU s", "vs ring"])
  kinds = {k: KINDS[k] for k in args.kinds}
  path = write_json(args.out, {"kinds": kinds, "rows": rows, "cpu": timed})
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
