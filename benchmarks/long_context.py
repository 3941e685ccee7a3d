"""The longest sequence whose training step runs on this machine, with and without CP.

For each S (doubling), one training step of the tiny real-architecture
Gemma 4 (``cpjax train``'s default model: PLE, K/V sharing, vision tower;
B=1) runs in a child process: with cp=8 on 8 emulated devices (ring
attention, load-balanced, per-layer remat), and on one device with dense
attention. Recorded per run: per-device scratch memory from
``memory_analysis()``, the child's peak RSS, and the step time. A run is
skipped (not attempted) when its compiled scratch memory alone would exceed
the machine's RAM; a mode stops at its first failure.

    python benchmarks/long_context.py [--max-seq-len 262144] [--timeout 1800]
    python benchmarks/long_context.py --modes cp8 --min-seq-len 262144 --max-seq-len 524288 \
        --out long_context_262k
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

CHILD = r"""
import json, os, resource, sys, time
mode, s, limit = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
remat = mode == "cp8"
import jax
jax.config.update("jax_num_cpu_devices", 8)
import numpy as np, optax
from flax import nnx
from cpjax import training
from cpjax.models import gemma4

cfg = gemma4.Gemma4Config.preset("tiny")
model = gemma4.Gemma4(cfg, rngs=nnx.Rngs(0), remat=remat)
sharder = model.prepare_model_inputs_for_cp(layout="load_balanced")["cp_sharder"]
graphdef, params, buffers = nnx.split(model, nnx.Param, ...)
opt = optax.adamw(1e-3)
state = opt.init(params)
batch = gemma4.synthetic_batch(np.random.default_rng(0), cfg, batch_size=1, seq_len=s,
                               max_docs=4)
if mode == "cp8":
  mesh = jax.make_mesh((8,), ("cp",))
  batch, layout = sharder.shard_batch(batch, mesh)
  step = training.make_train_step(graphdef, opt, mesh=mesh, layout=layout, frozen=buffers)
  ctx = jax.set_mesh(mesh)
else:
  batch = gemma4.prepare_batch(batch, cfg)
  step = training.make_train_step(graphdef, opt, frozen=buffers)
  import contextlib
  ctx = contextlib.nullcontext()
with ctx:
  t0 = time.perf_counter()
  compiled = step.compile(params, state, batch)
  compile_s = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  out = {"scratch_mib": mem.temp_size_in_bytes / 2**20, "compile_s": compile_s}
  if mem.temp_size_in_bytes > limit:
    out["status"] = "skipped: scratch exceeds RAM"
  else:
    t0 = time.perf_counter()
    params, state, metrics = compiled(params, state, batch)
    loss = float(metrics["loss"])
    status = "ok" if np.isfinite(loss) else "nan"
    out.update(step_s=time.perf_counter() - t0, loss=loss, status=status)
out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print("RESULT " + json.dumps(out), flush=True)
"""


def run_child(mode: str, s: int, limit_bytes: float, timeout: int) -> dict:
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  try:
    proc = subprocess.run(
      [sys.executable, "-c", CHILD, mode, str(s), str(limit_bytes)],
      capture_output=True,
      text=True,
      timeout=timeout,
      env=env,
    )
  except subprocess.TimeoutExpired:
    return {"status": f"timeout after {timeout} s"}
  for line in proc.stdout.splitlines():
    if line.startswith("RESULT "):
      return json.loads(line[7:])
  tail = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
  return {"status": f"failed (exit {proc.returncode}): {tail[:160]}"}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--min-seq-len", type=int, default=4096)
  parser.add_argument("--max-seq-len", type=int, default=262144)
  parser.add_argument("--timeout", type=int, default=1800, help="seconds per child run")
  parser.add_argument("--modes", nargs="+", choices=("cp8", "dense"), default=["cp8", "dense"])
  parser.add_argument("--out", default="long_context", help="results/OUT.json")
  args = parser.parse_args(argv)
  ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  rows = []
  for mode in args.modes:
    s = args.min_seq_len
    while s <= args.max_seq_len:
      print(f"{mode} S={s} ...", flush=True)
      res = run_child(mode, s, 0.9 * ram, args.timeout)
      rows.append(
        {"mode": "cp=8 ring, remat" if mode == "cp8" else "1 device dense", "S": s, **res}
      )
      print("  ", res, flush=True)
      if res.get("status") != "ok":
        break
      s *= 2
  print(
    f"\nlong context: one training step, tiny Gemma 4, B=1, "
    f"{ram / 2**30:.0f} GiB RAM, {os.cpu_count()} cores"
  )
  common.print_table(
    rows, ["mode", "S", "status", "scratch_mib", "peak_rss_mib", "step_s", "compile_s"]
  )
  longest = {
    m: max([r["S"] for r in rows if r["mode"] == m and r.get("status") == "ok"], default=None)
    for m in ("cp=8 ring, remat", "1 device dense")
  }
  print("longest S that trains:", longest)
  print(
    "wrote", common.write_json(args.out, {"config": vars(args), "rows": rows, "longest": longest})
  )


if __name__ == "__main__":
  main()
