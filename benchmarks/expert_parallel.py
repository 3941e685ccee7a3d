"""Communication per training step of the 26B-A4B MoE: experts gathered by
FSDP (or replicated) against expert parallelism (tokens routed with
all_to_all), read from the compiled program.

Each row compiles one training step abstractly (no array is made) on
emulated CPU devices: the published 26B-A4B config cut to its first
``--layers`` decoder layers (one 5 : 1 period: 5 sliding, 1 full), at
S = 32768, float32 (XLA:CPU's partitioner aborts on bfloat16 weight
gradients over an Auto axis; bfloat16 activations halve the token traffic),
remat full. The collectives are summed from the compiled HLO text, bytes of
each op's result per device. Ops inside a loop body (the ring's K/V hops,
the loss's vocabulary chunks) are counted once, the same in both columns.

    python benchmarks/expert_parallel.py            # about 11 min on 2 cores
    python benchmarks/expert_parallel.py --layers 1 --seq-len 4096   # quick

Writes results/expert_parallel.json.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import machine, print_table, setup_devices, write_json  # noqa: E402

# (mesh without ep, ep): each mesh compiled with the experts FSDP-sharded or
# replicated (ep = 1), then with ep folded onto its token axes, never dropping
# a token and with capacity factor CAPACITY.
MESHES = (({"fsdp": 8}, 8), ({"fsdp": 2, "cp": 4}, 8), ({"cp": 8}, 8), ({"fsdp": 2, "cp": 8}, 16))
CAPACITY = 1.25
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "s16": 2,
  "u16": 2,
  "bf16": 2,
  "f16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
}
_OP = re.compile(r"= (.+?) (" + "|".join(KINDS) + r")(?:-start)?\(")
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")


def collective_bytes(hlo: str, expert_tails: tuple[str, ...]) -> dict:
  """Bytes of every collective's result in ``hlo``, by kind; and the
  all-gathers whose result is an expert tensor (``[n, *tail]``)."""
  out = {kind: 0 for kind in KINDS}
  out["expert all-gather"] = 0
  for line in hlo.splitlines():
    m = _OP.search(line)
    if not m:
      continue
    size = 0
    for dtype, dims in _ARRAY.findall(m.group(1)):
      n = 1
      for d in filter(None, dims.split(",")):
        n *= int(d)
      size += n * _BYTES[dtype]
    out[m.group(2)] += size
    if m.group(2) == "all-gather" and any(
      re.search(rf"\[\d+,{tail}\]", m.group(1)) for tail in expert_tails
    ):
      out["expert all-gather"] += size
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, default=6)
  parser.add_argument("--seq-len", type=int, default=32768)
  args = parser.parse_args()
  setup_devices(max(m[1] for m in MESHES))
  from cpjax.models.gemma4 import Gemma4Config
  from cpjax.training import plan

  cfg = Gemma4Config.preset("a4b", num_hidden_layers=args.layers, layer_types=None)
  t = cfg.text
  i, d = t.moe_intermediate_size, t.hidden_size
  tails = (f"{2 * i},{d}", f"{d},{2 * i}", f"{d},{i}", f"{i},{d}")  # either orientation
  rows = []
  for sizes, ep in MESHES:
    for mesh, capacity in (
      (sizes, None),
      ({**sizes, "ep": ep}, None),
      ({**sizes, "ep": ep}, CAPACITY),
    ):
      start = time.perf_counter()
      step, params, opt_state, _ = plan.compile_step(
        cfg,
        seq_len=args.seq_len,
        mesh=mesh,
        dtype="float32",
        remat="full",
        strategy="ring",
        capacity_factor=capacity,
      )
      seconds = time.perf_counter() - start
      found = collective_bytes(step._compiled().as_text(), tails)
      experts = sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
        for path, x in _leaves(params)
        if "experts" in path
      )
      total = sum(found[k] for k in KINDS)
      row = {
        "mesh": ",".join(f"{k}={v}" for k, v in mesh.items()),
        "capacity": "-" if capacity is None else capacity,
        "expert_GiB": experts / 2**30,
        **{k.replace(" ", "_").replace("-", "_") + "_GiB": v / 2**30 for k, v in found.items()},
        "total_GiB": total / 2**30,
        "compile_s": seconds,
      }
      rows.append(row)
      print_table([row], list(row))
  print()
  print_table(rows, list(rows[0]))
  write_json(
    "expert_parallel",
    {
      "machine": machine(),
      "layers": args.layers,
      "seq_len": args.seq_len,
      "model": "a4b",
      "dtype": "float32",
      "capacity_factor": CAPACITY,
      "rows": rows,
    },
  )


def _leaves(tree):
  import jax

  return [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_leaves_with_path(tree)]


if __name__ == "__main__":
  main()
