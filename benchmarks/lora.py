"""LoRA on this machine: a published-size Gemma 4 step, and how long a row
the tiny real-architecture model takes with LoRA against full fine-tuning.

1. E2B at its published config (tests/fixtures/gemma4/published/e2b), its
   base frozen in bfloat16 (random values, made leaf by leaf in bfloat16:
   no float32 copy of the 10 GB ever exists), rank-16 adapters on the
   default targets, bfloat16 activations, full remat, one device: adapter
   creation time, compile time, median step time and the process's peak
   RSS. Full fine-tuning of E2B needs about 16 bytes a parameter (82 GB;
   ``cpjax plan``), more than this machine has.
2. The tiny real-architecture model ("tiny") on a cp=8 mesh of emulated
   devices: for each S, the compiled step's per-device memory (arguments,
   outputs and temporaries, XLA's memory_analysis) with LoRA and with full
   fine-tuning, and the longest S whose step fits ``--budget`` per device;
   one step at that S runs for each.

    python benchmarks/lora.py [--seq-len 256] [--budget 512MiB] [--skip-e2b]

Writes results/lora.json.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED = ROOT / "tests" / "fixtures" / "gemma4" / "published" / "e2b"
RANK = 16


def peak_rss_gb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def random_bfloat16_model(cfg):
  """A Gemma 4 whose parameters are random bfloat16 values made one leaf at a
  time (norm scales 1, buffers at their neutral values)."""
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from cpjax.models.gemma4 import Gemma4
  from cpjax.models.gemma4.layers import Buffer

  model = nnx.eval_shape(lambda: Gemma4(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16,
                                        param_dtype=jnp.bfloat16, remat="full"))
  for i, (path, var) in enumerate(nnx.iter_graph(model)):
    if not isinstance(var, nnx.Variable):
      continue
    name, shape, dtype = str(path[-1]), var.shape, var.dtype
    if isinstance(var, Buffer):
      fill = {"input_min": -jnp.inf, "output_min": -jnp.inf, "input_max": jnp.inf,
              "output_max": jnp.inf, "std_bias": 0.0}.get(name, 1.0)
      var.set_value(jnp.full(shape, fill, dtype))
    elif len(shape) < 2:
      var.set_value(jnp.ones(shape, dtype))          # norm scales, per-expert scales
    else:
      var.set_value(_normal_rows(np.random.default_rng(i), shape, shape[-1] ** -0.5))
  return model


def _normal_rows(rng, shape, scale, chunk=8192):
  """Normal values in bfloat16, drawn in row chunks on the host (no float32
  copy of a whole table), in the default row-major layout. (A large
  ``jax.random.normal`` on CPU came back column-major here, and a jitted
  step that took it as an argument failed to dispatch, allocating 37.6 GB.)"""
  import jax
  import ml_dtypes
  import numpy as np

  out = np.empty(shape, ml_dtypes.bfloat16)
  flat = out.reshape(shape[0], -1)
  for start in range(0, shape[0], chunk):
    rows = flat[start:start + chunk]
    rows[...] = (rng.standard_normal(rows.shape, np.float32) * scale).astype(ml_dtypes.bfloat16)
  return jax.device_put(out)


def e2b_step(seq_len: int, steps: int) -> dict:
  import numpy as np
  import optax

  from cpjax import lora, train
  from cpjax.models import gemma4

  cfg = gemma4.Gemma4Config.from_hf(str(PUBLISHED))
  start = time.perf_counter()
  model = random_bfloat16_model(cfg)
  made = time.perf_counter() - start
  base_gb = sum(int(np.prod(v.shape)) * v.dtype.itemsize for _, v in nnx_leaves(model)) / 1e9
  start = time.perf_counter()
  model = lora.apply_lora(model, rank=RANK, alpha=2.0 * RANK)
  adapters_s = time.perf_counter() - start
  graphdef, adapters, frozen = lora.split_lora(model)
  optimizer = optax.adamw(1e-4)
  step = train.make_train_step(graphdef, optimizer, frozen=frozen)
  rng = np.random.default_rng(0)
  batch = gemma4.prepare_batch(gemma4.synthetic_batch(rng, cfg, batch_size=1, seq_len=seq_len,
                                                      max_docs=2, images_per_row=0), cfg)
  opt_state = optimizer.init(adapters)
  start = time.perf_counter()
  compiled = step.compile(adapters, opt_state, batch)
  compile_s = time.perf_counter() - start
  times, losses = [], []
  for _ in range(steps):
    start = time.perf_counter()
    adapters, opt_state, metrics = compiled(adapters, opt_state, batch)
    losses.append(float(metrics["loss"]))
    times.append(time.perf_counter() - start)
  return {"model": "e2b", "seq_len": seq_len, "rank": RANK,
          "adapter_values": lora.lora_param_count(model), "base_gb": base_gb,
          "make_base_s": made, "make_adapters_s": adapters_s, "compile_s": compile_s,
          "step_s": float(np.median(times[1:] or times)), "losses": losses,
          "peak_rss_gb": peak_rss_gb()}


def nnx_leaves(model):
  from flax import nnx

  return [(p, v) for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)]


def tiny_sweep(budget: int, seq_lens: list[int]) -> dict:
  import numpy as np
  import optax
  from flax import nnx

  from cpjax import lora, parallel, plan, train
  from cpjax.models import gemma4

  cfg = gemma4.Gemma4Config.preset("tiny")
  mesh = parallel.make_mesh(cp=8)
  rows, best = [], {}
  for kind in ("full", "lora"):
    model = gemma4.Gemma4(cfg, rngs=nnx.Rngs(0), remat="full")
    if kind == "lora":
      model = lora.apply_lora(model, rank=RANK, alpha=2.0 * RANK)
      graphdef, params, frozen = lora.split_lora(model)
    else:
      graphdef, params, frozen = nnx.split(model, nnx.Param, ...)
    optimizer = optax.adamw(1e-4)
    sharder = model.prepare_model_inputs_for_cp(layout="load_balanced")["cp_sharder"]
    rng = np.random.default_rng(0)
    for seq_len in seq_lens:
      raw = gemma4.synthetic_batch(rng, cfg, batch_size=1, seq_len=seq_len, max_docs=4,
                                   images_per_row=0)
      batch, layout = sharder.shard_batch(raw, mesh)
      step = train.make_train_step(graphdef, optimizer, mesh=mesh, layout=layout, frozen=frozen)
      compiled = step.compile(params, optimizer.init(params), batch)
      m = compiled.memory_analysis()
      total = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
               + m.temp_size_in_bytes)
      rows.append({"training": kind, "seq_len": seq_len, "per_device_mib": total / 2**20,
                   "fits": total <= budget})
      print(f"  {kind:>4} S={seq_len:<7d} per device {total / 2**20:8.1f} MiB "
            f"{'fits' if total <= budget else 'over'} {plan.format_bytes(budget)}", flush=True)
      if total <= budget:
        best[kind] = (seq_len, compiled, params, optimizer, batch)
  ran = {}
  for kind, (seq_len, compiled, params, optimizer, batch) in best.items():
    start = time.perf_counter()
    _, _, metrics = compiled(params, optimizer.init(params), batch)
    loss = float(metrics["loss"])
    ran[kind] = {"seq_len": seq_len, "step_s": time.perf_counter() - start, "loss": loss}
  return {"budget_bytes": budget, "rows": rows, "longest": ran}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq-len", type=int, default=256, help="E2B's row length")
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--budget", default="512MiB", help="per-device memory for the tiny sweep")
  parser.add_argument("--skip-e2b", action="store_true")
  args = parser.parse_args()
  common.setup_devices(8)
  from cpjax import plan

  out = {}
  if not args.skip_e2b:
    e2b = e2b_step(args.seq_len, args.steps)
    out["e2b"] = e2b
    print(f"E2B LoRA r={RANK} (bfloat16 base {e2b['base_gb']:.2f} GB, "
          f"{e2b['adapter_values']:,} adapter values), S={args.seq_len}, one CPU device:")
    print(f"  base made in {e2b['make_base_s']:.1f} s, adapters in {e2b['make_adapters_s']:.1f} s,"
          f" compiled in {e2b['compile_s']:.1f} s; step {e2b['step_s']:.2f} s "
          f"(losses {', '.join(f'{x:.3f}' for x in e2b['losses'])}); "
          f"peak RSS {e2b['peak_rss_gb']:.2f} GB")
  budget = plan.parse_bytes(args.budget)
  print(f"tiny, cp=8, remat full: compiled per-device memory (budget {args.budget})")
  out["tiny"] = tiny_sweep(budget, [2 ** k for k in range(13, 19)])
  for kind, r in out["tiny"]["longest"].items():
    print(f"  longest S within the budget, {kind}: {r['seq_len']} (one step {r['step_s']:.1f} s,"
          f" loss {r['loss']:.3f})")
  common.write_json("lora", out)


if __name__ == "__main__":
  main()
