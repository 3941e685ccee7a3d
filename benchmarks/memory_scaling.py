"""Per-device memory of a Gemma 4 training step as cp grows: the compiled
program's activations and temporaries (everything but parameters and
optimizer state) for a slice of E2B, beside cpjax.training.plan's closed form.

    python benchmarks/memory_scaling.py                 # S = 16384 and 131072, cp = 2, 4, 8
    python benchmarks/memory_scaling.py --seq-lens 16384 --cps 8

The slice: E2B's vocabulary (262144), width (1536), per-layer inputs (256
per layer) and attention, with 5 layers (4 sliding + 1 full), remat
"full", a cp-only mesh, one row, float32 (the compiled plan's dtype, see
cpjax.training.plan). Each row compiles the real step abstractly on emulated CPU
devices (no weight is materialised); XLA:CPU's temporaries are a
liveness-based upper estimate of an accelerator compiler's. On a cp-only
mesh the float32 parameter gradients (mostly the two tables) are a floor
that only fsdp / tp remove: reported on their own. Writes
results/memory_scaling.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import print_table, setup_devices, write_json  # noqa: E402

# The measurements before local embeddings and the chunked loss
# (the same slice, S -> {cp: GiB}); S = 131072 was measured at cp = 8 only.
BEFORE = {16384: {2: 44.3, 4: 23.0, 8: 12.6}, 131072: {8: 90.3}}


def e2b_slice():
  from cpjax.models.gemma4 import Gemma4Config

  cfg = Gemma4Config.preset("e2b")
  types = ("sliding_attention",) * 4 + ("full_attention",)
  text = dataclasses.replace(cfg.text, num_hidden_layers=5, layer_types=types,
                             num_kv_shared_layers=0)
  return dataclasses.replace(cfg, text=text, vision=None)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq-lens", type=int, nargs="+", default=[16384, 131072])
  parser.add_argument("--cps", type=int, nargs="+", default=[2, 4, 8])
  args = parser.parse_args(argv)
  setup_devices(max(args.cps))
  from cpjax.training import plan

  cfg = e2b_slice()
  n = plan._count(cfg)[0]
  grads = 4 * n
  rows = []
  for seq_len in args.seq_lens:
    for cp in args.cps:
      start = time.perf_counter()
      compiled = plan.compiled_plan(cfg, model="e2b-slice", seq_len=seq_len, mesh={"cp": cp})
      closed = plan.estimate(cfg, model="e2b-slice", seq_len=seq_len, mesh={"cp": cp},
                             dtype="float32")
      row = {"S": seq_len, "cp": cp,
             "compiled GiB": compiled.activations / plan.GiB,
             "beyond grads GiB": (compiled.activations - grads) / plan.GiB,
             "closed form GiB": closed.activations / plan.GiB,
             "before GiB": BEFORE.get(seq_len, {}).get(cp),
             "param grads GiB": grads / plan.GiB,
             "compile s": round(time.perf_counter() - start, 1)}
      rows.append(row)
      print_table([row], list(row))
      sys.stdout.flush()
  print()
  print_table(rows, list(rows[0]))
  path = write_json("memory_scaling", {"model": "e2b slice: 5 layers (4 sliding + 1 full)",
                                       "parameters": n, "remat": "full", "dtype": "float32",
                                       "rows": rows})
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
