"""The smallest fsdp x cp mesh for each published Gemma 4 size, sequence length
and device memory (v5e 16 GiB, v5p 95 GiB, H200 141 GiB), from cpjax.training.plan's
closed form; optionally cross-checked by compiling named rows abstractly.

    python benchmarks/plan_table.py                       # closed form, every row
    python benchmarks/plan_table.py --compile e2b:32768:fsdp=4,cp=8

Compiling a row emulates its devices on this CPU (minutes per row at real
sizes); the closed form takes seconds for the whole table. Writes
results/plan_table.json.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import write_json  # noqa: E402

MODELS = ("e2b", "e4b", "a4b", "31b")
SEQ_LENS = (32768, 131072, 262144)
DEVICES = {"v5e": "16GiB", "v5p": "95GiB", "H200": "141GiB"}
LORA_RANK = 16
LORA_SEQ_LENS = (131072, 262144)
CAPACITY = 1.25  # expert parallelism's capacity factor in the ep rows


def search(plan, Gemma4Config, seq_lens, models=MODELS, **lora) -> list[dict]:
  """The smallest mesh of every (model, S, device), printed and as rows."""
  rows = []
  for model in models:
    cfg = Gemma4Config.preset(model)
    for seq_len in seq_lens:
      for device, memory in DEVICES.items():
        best = plan.smallest_mesh(
          cfg,
          model=model,
          seq_len=seq_len,
          device_memory=plan.parse_bytes(memory),
          remat="full",
          dtype="bfloat16",
          strategy="ring",
          **lora,
        )
        if best is None:
          print(f"{model:>5} {seq_len:>7} {device:>6}  no mesh up to 4096 devices")
          continue
        mesh = best.mesh
        devices = math.prod(v for k, v in mesh.items() if k != "ep")
        text = f"fsdp={mesh.get('fsdp', 1)},cp={mesh['cp']}"
        text += f",ep={mesh['ep']}" if "ep" in mesh else ""
        print(
          f"{model:>5} {seq_len:>7} {device:>6}  {text:<18} {devices:>7} "
          f"{best.params / plan.GiB:7.2f} {best.optimizer / plan.GiB:7.2f} "
          f"{best.activations / plan.GiB:7.2f} {best.total / plan.GiB:9.2f} "
          f"{best.flops / 1e12:9.1f}"
        )
        rows.append(
          {
            "model": model,
            "seq_len": seq_len,
            "device": device,
            "memory": memory,
            "mesh": mesh,
            "devices": devices,
            "params_gib": best.params / plan.GiB,
            "optimizer_gib": best.optimizer / plan.GiB,
            "activations_gib": best.activations / plan.GiB,
            "total_gib": best.total / plan.GiB,
            "tflop_per_device": best.flops / 1e12,
          }
        )
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--compile",
    action="append",
    default=[],
    metavar="MODEL:S:MESH",
    help="also compile this row (repeatable), e.g. e2b:32768:fsdp=4,cp=8",
  )
  args = parser.parse_args()
  compile_rows = [(m, int(s), mesh) for m, s, mesh in (c.split(":") for c in args.compile)]
  if compile_rows:
    import jax

    from cpjax.parallel import parse_mesh

    jax.config.update(
      "jax_num_cpu_devices",
      max(
        math.prod(v for k, v in parse_mesh(mesh).items() if k != "ep")
        for _, _, mesh in compile_rows
      ),
    )
  from cpjax.models.gemma4 import Gemma4Config
  from cpjax.training import plan

  print(
    f"{'model':>5} {'S':>7} {'device':>6}  {'mesh (fsdp x cp)':<18} {'devices':>7} "
    f"{'params':>7} {'optim':>7} {'activ':>7} {'total GiB':>9} {'TFLOP/dev':>9}"
  )
  rows = search(plan, Gemma4Config, SEQ_LENS)
  # LoRA beside full fine-tuning at long context: rank-16 adapters on the
  # default targets, the base frozen in bfloat16.
  print(f"\nLoRA r={LORA_RANK}, bfloat16 base:")
  lora_rows = search(plan, Gemma4Config, LORA_SEQ_LENS, lora_rank=LORA_RANK, base_dtype="bfloat16")
  for row in lora_rows:
    row["full_devices"] = next(
      r["devices"]
      for r in rows
      if (r["model"], r["seq_len"], r["device"]) == (row["model"], row["seq_len"], row["device"])
    )
    row["adapter_values"] = plan.lora_param_count(Gemma4Config.preset(row["model"]), rank=LORA_RANK)
  # 26B-A4B with its experts split over the token axes (cpjax.models.gemma4.experts).
  print(f"\n26B-A4B, expert parallelism (capacity factor {CAPACITY}):")
  ep_rows = search(
    plan, Gemma4Config, SEQ_LENS, models=("a4b",), expert_parallel=True, capacity_factor=CAPACITY
  )
  for row in ep_rows:
    row["capacity_factor"] = CAPACITY
  print("\n26B-A4B, expert parallelism, never dropping a token:")
  for row in search(plan, Gemma4Config, SEQ_LENS, models=("a4b",), expert_parallel=True):
    ep_rows.append({**row, "capacity_factor": None})
  for row in ep_rows:
    row["fsdp_devices"] = next(
      r["devices"]
      for r in rows
      if (r["model"], r["seq_len"], r["device"]) == (row["model"], row["seq_len"], row["device"])
    )
  checks = []
  for model, seq_len, mesh_text in compile_rows:
    from cpjax.parallel import parse_mesh

    cfg = Gemma4Config.preset(model)
    mesh = parse_mesh(mesh_text)
    shape = plan.StepShape(seq_len, mesh, remat="full", strategy="ring")
    got = plan.compiled_plan(cfg, shape, model=model)
    want = plan.estimate(cfg, shape, model=model)
    print("compiled:", got.row())
    print("estimate:", want.row())
    checks.append(
      {
        "model": model,
        "seq_len": seq_len,
        "mesh": mesh,
        "compiled_total_gib": got.total / plan.GiB,
        "estimate_total_gib_float32": want.total / plan.GiB,
        "compiled_params_gib": got.params / plan.GiB,
        "compiled_optimizer_gib": got.optimizer / plan.GiB,
        "compiled_activations_gib": got.activations / plan.GiB,
        "estimate_activations_gib_float32": want.activations / plan.GiB,
        "compiled_tflop": got.flops / 1e12,
        "estimate_tflop": want.flops / 1e12,
      }
    )
  write_json(
    "plan_table",
    {
      "rows": rows,
      "lora_rows": lora_rows,
      "lora_rank": LORA_RANK,
      "ep_rows": ep_rows,
      "compiled_checks": checks,
      "note": "closed form, bfloat16 activations, remat full, AdamW "
      "float32 state, one row per batch shard",
    },
  )


if __name__ == "__main__":
  main()
