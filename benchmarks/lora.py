"""LoRA on this machine: a published-size Gemma 4 step, and how long a row
the tiny real-architecture model takes with LoRA against full fine-tuning.

1. E2B at its published config (tests/fixtures/gemma4/published/e2b), its
   base frozen in bfloat16 (random values, made leaf by leaf in bfloat16:
   no float32 copy of the 10 GB ever exists), rank-16 adapters on the
   default targets, bfloat16 activations, full remat, one device: adapter
   creation time, compile time, median step time and the process's peak
   RSS. Full fine-tuning of E2B needs about 16 bytes a parameter (82 GB;
   ``cpjax plan``), more than this machine has.
2. A 26B-A4B slice: the published config's real vocabulary, width and 128
   experts (top-8), its first ``--a4b-layers`` layers (5 sliding and the
   first full one at 6), base frozen in bfloat16, rank-16 adapters, bfloat16
   activations, full remat, on an fsdp=2 x cp=2 mesh with the experts split
   ep=4 over both and the recommended capacity factor 1.25: the compiled
   step's per-device memory (XLA's memory_analysis), compile time, and the
   step time when the 4 emulated devices' memory fits this host (they share
   its RAM; otherwise the step is not run and the JSON says why).
3. The tiny real-architecture model ("tiny") on a cp=8 mesh of emulated
   devices: for each S, the compiled step's per-device memory (arguments,
   outputs and temporaries, XLA's memory_analysis) with LoRA and with full
   fine-tuning, and the longest S whose step fits ``--budget`` per device;
   one step at that S runs for each.

    python benchmarks/lora.py [--seq-len 256] [--budget 512MiB] [--skip-e2b] [--skip-a4b]
                              [--skip-tiny]

Writes results/lora.json (a part skipped keeps its earlier result there).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED = ROOT / "tests" / "fixtures" / "gemma4" / "published" / "e2b"
PUBLISHED_A4B = ROOT / "tests" / "fixtures" / "gemma4" / "published" / "a4b"
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

  model = nnx.eval_shape(
    lambda: Gemma4(
      cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, remat="full"
    )
  )
  for i, (path, var) in enumerate(nnx.iter_graph(model)):
    if not isinstance(var, nnx.Variable):
      continue
    name, shape, dtype = str(path[-1]), var.shape, var.dtype
    if isinstance(var, Buffer):
      fill = {
        "input_min": -jnp.inf,
        "output_min": -jnp.inf,
        "input_max": jnp.inf,
        "output_max": jnp.inf,
        "std_bias": 0.0,
      }.get(name, 1.0)
      var.set_value(jnp.full(shape, fill, dtype))
    elif len(shape) < 2:
      var.set_value(jnp.ones(shape, dtype))  # norm scales, per-expert scales
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
    rows = flat[start : start + chunk]
    rows[...] = (rng.standard_normal(rows.shape, np.float32) * scale).astype(ml_dtypes.bfloat16)
  return jax.device_put(out)


def e2b_step(seq_len: int, steps: int) -> dict:
  import numpy as np
  import optax

  from cpjax import training
  from cpjax.models import gemma4
  from cpjax.training import lora

  cfg = gemma4.Gemma4Config.from_hf(str(PUBLISHED))
  start = time.perf_counter()
  model = random_bfloat16_model(cfg)
  made = time.perf_counter() - start
  base_gb = sum(int(np.prod(v.shape)) * v.dtype.itemsize for _, v in nnx_leaves(model)) / 1e9
  start = time.perf_counter()
  model = lora.apply_lora(model, lora.LoraConfig(rank=RANK, alpha=2.0 * RANK))
  adapters_s = time.perf_counter() - start
  graphdef, adapters, frozen = lora.split_lora(model)
  optimizer = optax.adamw(1e-4)
  step = training.make_train_step(graphdef, optimizer, frozen=frozen)
  rng = np.random.default_rng(0)
  batch = gemma4.prepare_batch(
    gemma4.synthetic_batch(rng, cfg, batch_size=1, seq_len=seq_len, max_docs=2, images_per_row=0),
    cfg,
  )
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
  return {
    "model": "e2b",
    "seq_len": seq_len,
    "rank": RANK,
    "adapter_values": lora.lora_param_count(model),
    "base_gb": base_gb,
    "make_base_s": made,
    "make_adapters_s": adapters_s,
    "compile_s": compile_s,
    "step_s": float(np.median(times[1:] or times)),
    "losses": losses,
    "peak_rss_gb": peak_rss_gb(),
  }


def a4b_slice(seq_len: int, layers: int, steps: int) -> dict:
  import dataclasses

  import numpy as np
  import optax

  from cpjax import parallel, training
  from cpjax.models import gemma4
  from cpjax.training import lora

  cfg = gemma4.Gemma4Config.from_hf(str(PUBLISHED_A4B))
  text = cfg.text
  cfg = dataclasses.replace(
    cfg,
    text=dataclasses.replace(
      text, num_hidden_layers=layers, layer_types=tuple(text.layer_types[:layers])
    ),
  )
  model = random_bfloat16_model(cfg)
  start = time.perf_counter()
  model = lora.apply_lora(model, lora.LoraConfig(rank=RANK, alpha=2.0 * RANK))
  adapters_s = time.perf_counter() - start
  adapter_values = lora.lora_param_count(model)
  mesh = parallel.make_mesh(fsdp=2, cp=2)
  experts = parallel.expert_axes(mesh, 4)
  rule = gemma4.partition_rule(cfg, tp=1, expert_axes=experts)
  graphdef, adapters, frozen = lora.split_lora(model)
  sharder = model.prepare_model_inputs_for_cp(layout="load_balanced")["cp_sharder"]
  del model  # the one-device copy: only the mesh's shards stay
  adapters = parallel.shard_params(adapters, mesh, parallel.param_specs(adapters, mesh, rule=rule))
  frozen = parallel.shard_params(frozen, mesh, parallel.param_specs(frozen, mesh, rule=rule))
  optimizer = optax.adamw(1e-4)
  opt_state = parallel.shard_like_params(optimizer.init(adapters), adapters)
  raw = gemma4.synthetic_batch(
    np.random.default_rng(0), cfg, batch_size=2, seq_len=seq_len, max_docs=2, images_per_row=0
  )
  batch, layout = sharder.shard_batch(raw, mesh, batch_axis="fsdp")
  step = training.make_train_step(
    graphdef,
    optimizer,
    mesh=mesh,
    layout=layout,
    frozen=frozen,
    expert_axes=experts,
    capacity_factor=1.25,
  )
  start = time.perf_counter()
  compiled = step.compile(adapters, opt_state, batch)
  compile_s = time.perf_counter() - start
  m = compiled.memory_analysis()
  per_device = m.argument_size_in_bytes + m.temp_size_in_bytes
  # The emulated devices share this host's RAM: every one holds its
  # arguments and temporaries at once.
  available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  times, losses, skipped = [], [], None
  if mesh.size * m.temp_size_in_bytes > available:
    skipped = (
      f"the step's temporaries on {mesh.size} emulated devices "
      f"({mesh.size * m.temp_size_in_bytes / 1e9:.1f} GB) exceed this host's available "
      f"{available / 1e9:.1f} GB"
    )
    steps = 0
  for _ in range(steps):
    start = time.perf_counter()
    adapters, opt_state, metrics = compiled(adapters, opt_state, batch)
    losses.append(float(metrics["loss"]))
    times.append(time.perf_counter() - start)
  gib = 2**30
  return {
    "model": "a4b",
    "layers": layers,
    "seq_len": seq_len,
    "batch_size": 2,
    "mesh": "fsdp=2,cp=2,ep=4",
    "capacity_factor": 1.25,
    "rank": RANK,
    "adapter_values": adapter_values,
    "arguments_gib": m.argument_size_in_bytes / gib,
    "temporaries_gib": m.temp_size_in_bytes / gib,
    "per_device_gib": per_device / gib,
    "make_adapters_s": adapters_s,
    "compile_s": compile_s,
    "step_s": float(np.median(times[1:] or times)) if times else None,
    "step_skipped": skipped,
    "losses": losses,
    "peak_rss_gb": peak_rss_gb(),
  }


def nnx_leaves(model):
  from flax import nnx

  return [(p, v) for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)]


def tiny_sweep(budget: int, seq_lens: list[int]) -> dict:
  import numpy as np
  import optax
  from flax import nnx

  from cpjax import parallel, training
  from cpjax.models import gemma4
  from cpjax.training import lora, plan

  cfg = gemma4.Gemma4Config.preset("tiny")
  mesh = parallel.make_mesh(cp=8)
  rows, best = [], {}
  for kind in ("full", "lora"):
    model = gemma4.Gemma4(cfg, rngs=nnx.Rngs(0), remat="full")
    if kind == "lora":
      model = lora.apply_lora(model, lora.LoraConfig(rank=RANK, alpha=2.0 * RANK))
      graphdef, params, frozen = lora.split_lora(model)
    else:
      graphdef, params, frozen = nnx.split(model, nnx.Param, ...)
    optimizer = optax.adamw(1e-4)
    sharder = model.prepare_model_inputs_for_cp(layout="load_balanced")["cp_sharder"]
    rng = np.random.default_rng(0)
    for seq_len in seq_lens:
      raw = gemma4.synthetic_batch(
        rng, cfg, batch_size=1, seq_len=seq_len, max_docs=4, images_per_row=0
      )
      batch, layout = sharder.shard_batch(raw, mesh)
      step = training.make_train_step(graphdef, optimizer, mesh=mesh, layout=layout, frozen=frozen)
      compiled = step.compile(params, optimizer.init(params), batch)
      total = plan.compiled_bytes(compiled)
      rows.append(
        {
          "training": kind,
          "seq_len": seq_len,
          "per_device_mib": total / 2**20,
          "fits": total <= budget,
        }
      )
      print(
        f"  {kind:>4} S={seq_len:<7d} per device {total / 2**20:8.1f} MiB "
        f"{'fits' if total <= budget else 'over'} {plan.format_bytes(budget)}",
        flush=True,
      )
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
  parser.add_argument("--skip-a4b", action="store_true")
  parser.add_argument("--skip-tiny", action="store_true")
  parser.add_argument("--a4b-layers", type=int, default=2)
  parser.add_argument("--a4b-seq-len", type=int, default=2048)
  args = parser.parse_args()
  common.setup_devices(8)
  import json

  from cpjax.training import plan

  previous = common.RESULTS / "lora.json"
  out = json.loads(previous.read_text()) if previous.exists() else {}
  out.pop("machine", None)
  if not args.skip_e2b:
    e2b = e2b_step(args.seq_len, args.steps)
    out["e2b"] = e2b
    print(
      f"E2B LoRA r={RANK} (bfloat16 base {e2b['base_gb']:.2f} GB, "
      f"{e2b['adapter_values']:,} adapter values), S={args.seq_len}, one CPU device:"
    )
    print(
      f"  base made in {e2b['make_base_s']:.1f} s, adapters in {e2b['make_adapters_s']:.1f} s,"
      f" compiled in {e2b['compile_s']:.1f} s; step {e2b['step_s']:.2f} s "
      f"(losses {', '.join(f'{x:.3f}' for x in e2b['losses'])}); "
      f"peak RSS {e2b['peak_rss_gb']:.2f} GB"
    )
  if not args.skip_a4b:
    a4b = a4b_slice(args.a4b_seq_len, args.a4b_layers, args.steps)
    out["a4b_slice"] = a4b
    ran = (
      f"step {a4b['step_s']:.2f} s (losses {', '.join(f'{x:.3f}' for x in a4b['losses'])})"
      if a4b["step_s"] is not None
      else f"step not run: {a4b['step_skipped']}"
    )
    print(
      f"26B-A4B slice ({a4b['layers']} layers, 128 experts) LoRA r={RANK}, bfloat16 base, "
      f"S={a4b['seq_len']} B=2, mesh {a4b['mesh']}, capacity 1.25: per device arguments "
      f"{a4b['arguments_gib']:.2f} GiB, temporaries {a4b['temporaries_gib']:.2f} GiB; "
      f"adapters in {a4b['make_adapters_s']:.1f} s, compiled in {a4b['compile_s']:.1f} s; "
      f"{ran}; peak RSS {a4b['peak_rss_gb']:.2f} GB"
    )
  if not args.skip_tiny:
    budget = plan.parse_bytes(args.budget)
    print(f"tiny, cp=8, remat full: compiled per-device memory (budget {args.budget})")
    out["tiny"] = tiny_sweep(budget, [2**k for k in range(13, 19)])
    for kind, r in out["tiny"]["longest"].items():
      print(
        f"  longest S within the budget, {kind}: {r['seq_len']} (one step "
        f"{r['step_s']:.1f} s, loss {r['loss']:.3f})"
      )
  common.write_json("lora", out)


if __name__ == "__main__":
  main()
