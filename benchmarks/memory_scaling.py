"""Per-device memory of a Gemma 4 training step as cp grows, with the training
state split over fsdp x cp (the default) and whole over cp (``--shard-state
fsdp``): the compiled program's parameters + optimizer state, activations and
temporaries, total, and the bytes its collectives move, for a slice of E2B,
beside cpjax.training.plan's closed form.

    python benchmarks/memory_scaling.py                 # S = 16384 and 131072, cp = 2, 4, 8
    python benchmarks/memory_scaling.py --seq-lens 16384 --cps 8 --shard-states fsdp+cp

The slice: E2B's vocabulary (262144), width (1536), per-layer inputs (256
per layer) and attention, with 5 layers (4 sliding + 1 full), remat
"full", a cp-only mesh, one row, float32 (the compiled plan's dtype, see
cpjax.training.plan), AdamW. Each row compiles the real step abstractly on
emulated CPU devices (no weight is materialised); XLA:CPU's temporaries are
a liveness-based upper estimate of an accelerator compiler's. The state of
fsdp = 8 (the same 8 devices splitting rows instead of the sequence) is the
reference a cp rank's state should match. Collective bytes are the output
bytes of every collective in the compiled program's text: a loop's body
(the ring's hops over K/V, the loss's chunks) counts once, so they are a
floor on what moves, comparable between the two forms. Writes
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
  text = dataclasses.replace(
    cfg.text, num_hidden_layers=5, layer_types=types, num_kv_shared_layers=0
  )
  return dataclasses.replace(cfg, text=text, vision=None)


def measure(cfg, *, seq_len: int, mesh: dict, shard_state: str) -> dict:
  """GiB per device of the compiled step, and its collective bytes."""
  from cpjax import parallel
  from cpjax.training import plan

  compiled, params, opt_state, _ = plan.compile_step(
    cfg, seq_len=seq_len, mesh=mesh, shard_state=shard_state, remat="full", strategy="ring"
  )
  state = parallel.bytes_per_device(params) + parallel.bytes_per_device(opt_state)
  total = plan.compiled_bytes(compiled)
  moved = plan.collective_bytes(compiled.as_text())
  return {
    "state": state / plan.GiB,
    "activations": (total - state) / plan.GiB,
    "total": total / plan.GiB,
    "collective": sum(moved.values()) / plan.GiB,
    "collectives": {k: v / plan.GiB for k, v in sorted(moved.items())},
  }


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq-lens", type=int, nargs="+", default=[16384, 131072])
  parser.add_argument("--cps", type=int, nargs="+", default=[2, 4, 8])
  parser.add_argument(
    "--shard-states", nargs="+", default=["fsdp+cp", "fsdp"], choices=["fsdp+cp", "fsdp"]
  )
  args = parser.parse_args(argv)
  setup_devices(max(max(args.cps), 8))
  from cpjax.training import plan

  cfg = e2b_slice()
  n = plan.closed_form._count(cfg)[0]
  # The reference: fsdp = 8 splits the same state over 8 devices (its batch
  # rows are 8, the state does not depend on S).
  fsdp8 = measure(cfg, seq_len=1024, mesh={"fsdp": 8}, shard_state="fsdp")["state"]
  print(f"fsdp=8: parameters + optimizer state {fsdp8:.3f} GiB per device")
  rows = []
  for seq_len in args.seq_lens:
    for cp in args.cps:
      for shard_state in args.shard_states:
        start = time.perf_counter()
        got = measure(cfg, seq_len=seq_len, mesh={"cp": cp}, shard_state=shard_state)
        closed = plan.estimate(
          cfg,
          model="e2b-slice",
          seq_len=seq_len,
          mesh={"cp": cp},
          dtype="float32",
          remat="full",
          strategy="ring",
          shard_state=shard_state,
        )
        row = {
          "S": seq_len,
          "cp": cp,
          "state over": shard_state,
          "params+opt GiB": got["state"],
          "/ fsdp=8's": got["state"] / fsdp8,
          "act+temp GiB": got["activations"],
          "total GiB": got["total"],
          "closed form total GiB": closed.total / plan.GiB,
          "collective GiB": got["collective"],
          "before act GiB": BEFORE.get(seq_len, {}).get(cp) if shard_state == "fsdp" else None,
          "compile s": round(time.perf_counter() - start, 1),
        }
        rows.append({**row, "collectives GiB": got["collectives"]})
        print_table([row], list(row))
        sys.stdout.flush()
  print()
  columns = [c for c in rows[0] if c != "collectives GiB"]
  print_table(rows, columns)
  path = write_json(
    "memory_scaling",
    {
      "model": "e2b slice: 5 layers (4 sliding + 1 full)",
      "parameters": n,
      "remat": "full",
      "dtype": "float32",
      "fsdp8 params+opt GiB": fsdp8,
      "rows": rows,
    },
  )
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
