"""Per-device memory of a Gemma 4 training step by four judges: the plan's closed
form, XLA:CPU, XLA:TPU (a v5e slice) and XLA:GPU (8 H200s), each compiling the
same step (cpjax.training.plan.compiled_plan, the chip's own kernels), on
this CPU machine with compile-only devices (no chip needed).

    python benchmarks/compile_targets.py                              # the default rows
    python benchmarks/compile_targets.py --seq-lens 16384 --meshes cp=8 --judges tpu gpu
    python benchmarks/compile_targets.py --judges gpu --keep   # rerun one judge's cells
    python benchmarks/compile_targets.py --judges tpu --keep --seq-lens 131072 --meshes cp=8
    python benchmarks/compile_targets.py --judges --keep       # the closed forms only
    python benchmarks/compile_targets.py --model a4b-slice --judges tpu gpu   # v5p-16, h200-8
    python benchmarks/compile_targets.py --strategy auto --judges tpu gpu  # train's default

The closed form is the TPU's and, beside it, the GPU's (platform="cuda").

Rows: the E2B slice of benchmarks/memory_scaling.py (real vocabulary, width,
per-layer inputs; 4 sliding + 1 full layer), remat full, one row per batch
shard, for each sequence length x mesh x training (full / LoRA r=16 on a
bfloat16 base) x activation dtype. XLA:CPU refuses bfloat16 activations on a
mesh with an fsdp axis (see cpjax.training.plan), so those cells stay empty.
Each cell is GiB per device (arguments + outputs - aliases + temporaries);
the compile seconds are the column beside. XLA:TPU refuses a program past
the chip's HBM (v5e: 16 GiB) and names what its temporaries alone need:
"> N (temporaries)". Needs pip install 'cpjax[tpu]'
and 'cpjax[cuda-compiler]' for the accelerator columns. Writes
results/compile_targets.json.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, print_table, setup_devices, write_json  # noqa: E402
from benchmarks.memory_scaling import e2b_slice  # noqa: E402

JUDGES = {"cpu": None, "tpu": "v5e-8", "gpu": "h200-8"}
JUDGE_CELLS = [c for j in JUDGES for c in (j, f"{j} s")]
# model -> (its TPU judge, its results' name, its default S and meshes)
MODELS = {
  "e2b-slice": ("v5e-8", "compile_targets", [16384, 131072], ["cp=8", "fsdp=2,cp=4"]),
  "a4b-slice": ("v5p-16", "compile_targets_a4b", [8192, 32768], ["fsdp=2,cp=4,ep=8"]),
}


def a4b_slice():
  """26B-A4B's first sliding layer and a full one (real width, experts,
  vocabulary), no vision tower."""
  import dataclasses

  from cpjax.models.gemma4 import Gemma4Config

  cfg = Gemma4Config.preset(
    "a4b", num_hidden_layers=2, layer_types=("sliding_attention", "full_attention")
  )
  return dataclasses.replace(cfg, vision=None)


def _refusal(error: Exception) -> str:
  """A compiler's refusal as a cell: XLA:TPU stops at the chip's HBM and says
  how much the temporaries alone needed ("> N (temporaries)")."""
  text = str(error)
  needed = re.search(r"required for HLO temporaries \(([0-9.]+)G\)", text)
  if needed:
    return f"> {float(needed.group(1)):.4g} (temporaries)"
  return f"fails: {type(error).__name__}: {text.splitlines()[0][:80]}"


def _saved_rows(name: str) -> dict:
  """{(S, mesh, training, dtype): the judges' cells} of the saved table, in its order."""
  path = RESULTS / f"{name}.json"
  if not path.exists():
    return {}
  return {
    (r["S"], r["mesh"], r["training"], r["dtype"]): {c: v for c, v in r.items() if c in JUDGE_CELLS}
    for r in json.loads(path.read_text())["rows"]
  }


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", choices=list(MODELS), default="e2b-slice")
  parser.add_argument("--seq-lens", type=int, nargs="+")
  parser.add_argument("--meshes", nargs="+")
  parser.add_argument("--trainings", nargs="+", default=["full", "lora"], choices=["full", "lora"])
  parser.add_argument(
    "--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"]
  )
  parser.add_argument(
    "--judges",
    nargs="*",
    default=list(JUDGES),
    choices=list(JUDGES),
    help="the compilers to run (none, with --keep: the closed forms "
    "recomputed beside the saved cells)",
  )
  parser.add_argument(
    "--strategy",
    choices=["ring", "auto"],
    default="ring",
    help="the CP strategy: the ring, or auto (cpjax train's default: the rule's "
    "choice per layer kind and the loss's auto); auto writes results/NAME_auto.json",
  )
  parser.add_argument(
    "--keep",
    action="store_true",
    help="keep the saved table (results/NAME.json): its rows and cells stay, "
    "the closed forms are recomputed, and only the judges given rerun, on the "
    "rows the S, mesh, training and dtype flags select",
  )
  args = parser.parse_args(argv)
  tpu, name, seq_lens, meshes = MODELS[args.model]
  name += "_auto" if args.strategy == "auto" else ""
  args.seq_lens, args.meshes = args.seq_lens or seq_lens, args.meshes or meshes
  judges = {**JUDGES, "tpu": tpu}
  saved = _saved_rows(name) if args.keep else {}
  setup_devices(8)
  from cpjax.parallel import parse_mesh
  from cpjax.training import cp_strategy, plan, targets

  cfg = e2b_slice() if args.model == "e2b-slice" else a4b_slice()
  selected = [
    (seq_len, mesh_text, training, dtype)
    for seq_len in args.seq_lens
    for mesh_text in args.meshes
    for training in args.trainings
    for dtype in args.dtypes
  ]
  # With --keep and no judge, the saved rows alone (their closed forms recomputed).
  new = [k for k in selected if k not in saved] if args.judges or not args.keep else []
  rows = []
  for key in [*saved, *new]:
    seq_len, mesh_text, training, dtype = key
    mesh = parse_mesh(mesh_text)
    # The settings these rows were measured with: full remat, the ring
    # unless --strategy auto.
    strategies, chosen = {"remat": "full", "strategy": "ring"}, "ring"
    if args.strategy == "auto":
      choices = cp_strategy.choose(
        cfg.text, seq_len=seq_len, cp=mesh.get("cp", 1), tp=mesh.get("tp", 1)
      )
      strategies = {
        "remat": "full",
        "strategy": cp_strategy.as_strategy(choices),
        "loss_strategy": "auto",
      }
      chosen = cp_strategy.describe(choices)
    lora = {"lora_rank": 16, "base_dtype": "bfloat16"} if training == "lora" else {}
    closed = {
      p: plan.estimate(
        cfg,
        model=args.model,
        seq_len=seq_len,
        mesh=mesh,
        dtype=dtype,
        platform=p,
        **lora,
        **strategies,
      ).total
      / plan.GiB
      for p in plan.PLATFORMS
    }
    row = {
      "S": seq_len,
      "mesh": mesh_text,
      "training": training,
      "dtype": dtype,
      # (the ring's table names none: tests/test_plan.py reads one as auto's)
      **({"strategy": chosen} if args.strategy == "auto" else {}),
      "closed form": closed["tpu"],
      "closed form gpu": closed["cuda"],
    }
    row.update(saved.get(key, {}))
    for judge in args.judges if key in selected else ():
      chips = judges[judge]
      if judge == "cpu" and dtype == "bfloat16" and "fsdp" in mesh:
        row[judge], row[f"{judge} s"] = None, None
        continue
      start = time.perf_counter()
      try:
        got = plan.compiled_plan(
          cfg,
          model=args.model,
          seq_len=seq_len,
          mesh=mesh,
          dtype=dtype,
          **lora,
          **strategies,
          target=None if chips is None else targets.parse_target(chips),
        )
        row[judge] = got.total / plan.GiB
      except Exception as e:  # a compiler's refusal is a result too
        row[judge] = _refusal(e)
      row[f"{judge} s"] = round(time.perf_counter() - start)
    rows.append(row)
    print_table([row], list(row))
    sys.stdout.flush()
  print()
  print_table(rows, list(rows[0]))
  what = {
    "e2b-slice": "e2b slice: 5 layers (4 sliding + 1 full)",
    "a4b-slice": "26B-A4B slice: 2 layers (1 sliding + 1 full), 128 experts",
  }
  path = write_json(
    name,
    {
      "model": what[args.model],
      "remat": "full",
      "unit": "GiB per device",
      "judges": judges,
      "rows": rows,
    },
  )
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
