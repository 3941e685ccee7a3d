"""The prepared chip suite: one call on a lent GPU (or a TPU chip) that checks, times and trains.

Parts, in this order, each writing its rows to the JSON file as it ends (a
call cut short keeps what it finished):

1. ``check``: the chip's Pallas kernels against ``cpjax.reference_attention``
   (values and the three gradients) at head dims 128, 256 and 512, float32 and
   bfloat16, every mask kind (causal, GQA, window, documents, padding), S = 2048.
   A miss ends the run (exit 1): nothing after it would mean anything.
2. ``sweep`` (only with ``--sweep``, when the kernels changed): forward +
   backward time of each (rows, keys) tile the chip's Pallas implementation
   takes, per head dim.
3. ``hops``: one hop's forward + backward (cp = 1, B = 1, 16 query heads),
   bfloat16, S = 32768: causal at head dims 128, 256 and 512, and at 256 (Gemma
   4's sliding layers) a window of 1024 and 8 packed documents; cpjax's Pallas
   kernels beside the vendor's (cuDNN through ``jax.nn.dot_product_attention``
   on a GPU, head dims up to 256; splash on a TPU) and JAX's Hopper kernel
   (``attention_mgpu``, causal, head dims a multiple of 64), and cpjax's XLA
   tile loop at 8192 only (it is 40x slower).
4. ``step``: Gemma 4's training step on the one chip (cp = 1, bfloat16, full
   remat): the ``tiny`` preset, then an E2B-width slice (E2B's width,
   vocabulary and per-layer inputs, ``--e2b-layers`` layers) at S = 32768 and
   131072, LoRA r=16 and full fine-tuning: tokens/s, MFU (the closed form's
   FLOPs over the chip's peak), the compiled memory beside the measured peak
   (``memory_stats()``), and the step time ``cpjax plan --target`` would
   predict from the compiled program beside the measured one.

TFLOP/s in ``hops`` count only unmasked (query, key) pairs, 12·D FLOPs a pair
and head forward + backward, so a kernel that skips more empty tiles does not
look faster for it. ``--deadline`` (seconds, default 520) skips what would
start after it, so one call stays within a lent machine's 9 minutes.

    python benchmarks/accelerator.py                 # on the chip: every part
    python benchmarks/accelerator.py --parts check   # values and gradients only
    python benchmarks/accelerator.py --smoke --out /tmp/smoke.json   # any machine

``--smoke`` runs every part tiny, the Pallas GPU kernels in Pallas'
interpreter, on any machine (CI runs it). The lent machines run jax 0.11.2 of
their image; LoRA needs qwix there, carried as a wheel (``pip download qwix
--no-deps -d wheels``, then ``pip install wheels/*.whl`` in the call).

Writes ``results/accelerator.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import cpjax  # noqa: E402
from benchmarks.common import RESULTS, machine, median_time, print_table  # noqa: E402
from cpjax.attention.ring.kernels import (  # noqa: E402
  PALLAS_IMPLEMENTATIONS,
  resolve_implementation,
)
from cpjax.training.targets import CHIPS  # noqa: E402

HEADS = 16  # query heads in the check and the hops


def flops_per_pair(d: int) -> int:
  """Forward + backward FLOPs of one unmasked (query, key) pair and head."""
  return 12 * d


def allowed_pairs(s: int, *, window: int | None, docs: int) -> int:
  """Unmasked (query, key) pairs of one causal head (numpy, exact)."""
  q = np.arange(s)
  lo = np.zeros(s, np.int64)
  if docs > 1:
    lo = (q // (s // docs)) * (s // docs)
  if window is not None:
    lo = np.maximum(lo, q - window + 1)
  return int(np.sum(q - lo + 1))


def documents(s: int, docs: int):
  return jnp.asarray(1 + np.arange(s)[None] // (s // docs), jnp.int32)


# ------------------------------------------------------------------ check
# Relative error allowed against the float32 reference: on a GPU the kernels'
# float32 dots run as tf32 (5e-4 measured on an H200); bfloat16 operands keep
# 8 bits of mantissa (3e-3 measured).
CHECK_TOLERANCE = {jnp.float32: 2e-3, jnp.bfloat16: 3e-2}
MASKS = ("causal", "causal gqa", "window", "8 documents", "padding")


def check_case(name: str, s: int) -> dict:
  return {
    "causal": dict(name=name, s=s, hkv=16, window=None, docs=1, pad=0),
    "causal gqa": dict(name=name, s=s, hkv=4, window=None, docs=1, pad=0),
    "window": dict(name=name, s=s, hkv=16, window=s // 8, docs=1, pad=0),
    "8 documents": dict(name=name, s=s, hkv=4, window=None, docs=8, pad=0),
    "padding": dict(name=name, s=s, hkv=4, window=None, docs=1, pad=s // 3),
  }[name]


def check_grid(smoke: bool):
  """(D, dtype, mask) of the check: all of them on a chip; in a smoke run
  each head dim once, both dtypes and three mask kinds."""
  if smoke:
    return [
      (128, jnp.float32, "padding"),
      (256, jnp.bfloat16, "8 documents"),
      (512, jnp.float32, "window"),
    ]
  return [(d, t, m) for d in (128, 256, 512) for t in (jnp.float32, jnp.bfloat16) for m in MASKS]


def cpjax_attention(implementation: str, interpret: bool, case, padding_mask=None, **tiles):
  s = case["s"]
  lay = cpjax.ShardLayout(s, s, 1)
  doc_ids = documents(s, case["docs"]) if case["docs"] > 1 else None

  def attend(q, k, v):
    return cpjax.ring_attention(
      q,
      k,
      v,
      layout=lay,
      sliding_window=case["window"],
      document_ids=doc_ids,
      padding_mask=padding_mask,
      implementation=implementation,
      interpret=interpret,
      **tiles,
    )

  return attend


def check_one(implementation: str, interpret: bool, d: int, dtype, case) -> dict:
  """Values and gradients of the chip's kernels against the dense reference."""
  from cpjax.attention.reference import reference_attention

  s = case["s"]
  keys = jax.random.split(jax.random.key(d + case["hkv"] + s), 4)
  q = jax.random.normal(keys[0], (1, s, HEADS, d), dtype)
  k = jax.random.normal(keys[1], (1, s, case["hkv"], d), dtype)
  v = jax.random.normal(keys[2], (1, s, case["hkv"], d), dtype)
  w = jax.random.normal(keys[3], (1, s, HEADS, d), jnp.float32)
  doc_ids = documents(s, case["docs"]) if case["docs"] > 1 else None
  pad = jnp.arange(s)[None] >= s - case["pad"] if case["pad"] else None
  ours = cpjax_attention(implementation, interpret, case, padding_mask=pad)

  def theirs(q, k, v):
    return reference_attention(
      q, k, v, sliding_window=case["window"], document_ids=doc_ids, padding_mask=pad
    )

  def value_and_grads(attend, *args):
    loss = lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32) * w)  # noqa: E731
    return (attend(*args), *jax.grad(loss, argnums=(0, 1, 2))(*args))

  got = jax.jit(functools.partial(value_and_grads, ours))(q, k, v)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  with jax.default_matmul_precision("float32"):  # no tf32 in the reference
    want = jax.jit(functools.partial(value_and_grads, theirs))(*f32)
  errors = {
    name: float(jnp.linalg.norm((a.astype(jnp.float32) - b).ravel()) / jnp.linalg.norm(b.ravel()))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want)
  }
  finite = all(bool(jnp.all(jnp.isfinite(a))) for a in got)
  ok = finite and max(errors.values()) <= CHECK_TOLERANCE[dtype]
  return {"case": case["name"], "D": d, "dtype": jnp.dtype(dtype).name, **errors, "ok": ok}


def part_check(run) -> list[dict]:
  rows = []
  for d, dtype, mask in check_grid(run.smoke):
    if run.late():
      rows.append({"case": mask, "D": d, "dtype": jnp.dtype(dtype).name, "ok": "skipped: time"})
      continue
    row = check_one(run.implementation, run.smoke, d, dtype, check_case(mask, run.check_len))
    print(
      f"  check {mask} D={d} {row['dtype']}: "
      + " ".join(f"{n} {row[n]:.1e}" for n in ("out", "dq", "dk", "dv"))
      + ("" if row["ok"] else "  MISS"),
      flush=True,
    )
    rows.append(row)
  print_table(rows, ["case", "D", "dtype", "out", "dq", "dk", "dv", "ok"])
  return rows


# ------------------------------------------------------------- the timings
def time_fwd_bwd(attend, case, repeats: int) -> float:
  s, hkv, d = case["s"], case["hkv"], case["d"]
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (1, s, HEADS, d), jnp.bfloat16)
  k = jax.random.normal(keys[1], (1, s, hkv, d), jnp.bfloat16)
  v = jax.random.normal(keys[2], (1, s, hkv, d), jnp.bfloat16)
  w = jax.random.normal(keys[3], (1, s, HEADS, d), jnp.float32)
  grad = jax.jit(
    jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32) * w), argnums=(0, 1, 2))
  )
  return median_time(lambda: jax.block_until_ready(grad(q, k, v)), repeats=repeats)


def sweep_cases(smoke: bool):
  s = 128 if smoke else 32768
  dims = (128,) if smoke else (128, 256, 512)
  return [dict(name="causal", s=s, d=d, hkv=16, window=None, docs=1) for d in dims]


def tile_options(implementation: str, d: int, smoke: bool):
  """(rows, keys) tiles to time at head dim ``d``: powers of two from 16
  (GPU) or 128 (TPU) to 256 rows and keys, plus the record's own."""
  lo = 16 if implementation == "pallas_gpu" else 128
  record = PALLAS_IMPLEMENTATIONS[implementation].default_tile(d, jnp.bfloat16)
  if smoke:
    return [record, (lo, lo)]
  sizes = [n for n in (16, 32, 64, 128, 256) if n >= lo]
  return sorted({record, *((r, k) for r in sizes for k in sizes)})


def part_sweep(run) -> list[dict]:
  rows = []
  for case in sweep_cases(run.smoke):
    tflop = HEADS * allowed_pairs(case["s"], window=None, docs=1) * flops_per_pair(case["d"]) / 1e12
    for rows_, keys in tile_options(run.implementation, case["d"], run.smoke):
      row = {"D": case["d"], "S": case["s"], "rows": rows_, "keys": keys}
      if run.late():
        rows.append({**row, "error": "skipped: time"})
        continue
      # 16 K/V heads: one query head each, so a tile's rows are its tokens.
      attend = cpjax_attention(run.implementation, run.smoke, case, block_q=rows_, block_kv=keys)
      try:
        seconds = time_fwd_bwd(attend, case, run.repeats)
        row.update({"ms": seconds * 1e3, "TFLOP/s": tflop / seconds})
      except Exception as err:  # a tile the compiler refuses is a row, not the end
        row["error"] = f"{type(err).__name__}: {str(err)[:160]}"
      rows.append(row)
  print_table(rows, ["D", "S", "rows", "keys", "ms", "TFLOP/s", "error"])
  return rows


def hop_cases(smoke: bool):
  if smoke:  # Gemma 4's full layers' head dim, and documents on its sliding ones'
    return [
      dict(name="causal", s=128, d=512, hkv=16, window=None, docs=1),
      dict(name="8 documents", s=128, d=256, hkv=16, window=None, docs=8),
    ]
  s = 32768
  cases = [dict(name="causal", s=s, d=d, hkv=16, window=None, docs=1) for d in (128, 256, 512)]
  return cases + [
    dict(name="window 1024", s=s, d=256, hkv=16, window=1024, docs=1),
    dict(name="8 documents", s=s, d=256, hkv=16, window=None, docs=8),
    dict(name="causal", s=8192, d=128, hkv=16, window=None, docs=1),
  ]


def vendor_attention(platform: str, case, *, interpret: bool = False):
  """(the vendor kernel of this platform for the case or None, its name)."""
  s, window, d = case["s"], case["window"], case["d"]
  if platform != "tpu":
    name = "cuDNN" if platform == "gpu" else "jax.nn (xla)"
    if case["docs"] > 1:
      return None, "n/a (no document mask)"  # jax.nn.dot_product_attention has none
    if platform == "gpu" and d > 256:
      return None, "n/a (cuDNN: head dim <= 256)"
    local = None if window is None else (window - 1, 0)
    return functools.partial(
      jax.nn.dot_product_attention,
      is_causal=True,
      local_window_size=local,
      implementation="cudnn" if platform == "gpu" else "xla",
    ), name
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

  hkv = case["hkv"]
  one = (
    masks.CausalMask((s, s))
    if window is None
    else masks.LocalMask((s, s), (window - 1, 0), offset=0)
  )
  kernel = splash.make_splash_mqa_single_device(
    masks.MultiHeadMask([one] * (HEADS // hkv)), interpret=interpret
  )
  doc_ids = documents(s, case["docs"])[0] if case["docs"] > 1 else None

  def attend(q, k, v):  # [B, S, H, D] -> splash's [H, S, D] per row and KV head
    qh = (q * d**-0.5).transpose(0, 2, 1, 3).reshape(q.shape[0], hkv, HEADS // hkv, s, d)
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    # (splash names document ids "segment ids".)
    ids = None if doc_ids is None else splash.SegmentIds(q=doc_ids, kv=doc_ids)
    run = lambda qg, kg, vg: kernel(qg, kg, vg, segment_ids=ids)  # noqa: E731
    out = jax.vmap(jax.vmap(run))(qh, kh, vh)
    return out.reshape(q.shape[0], HEADS, s, d).transpose(0, 2, 1, 3)

  return attend, "splash"


def mgpu_attention(platform: str, case):
  """JAX's Hopper flash attention (Pallas' Mosaic GPU) for a causal case, or None."""
  if platform != "gpu" or case["window"] is not None or case["docs"] > 1:
    return None
  from jax.experimental.pallas.ops.gpu import attention_mgpu as mgpu

  config = mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=True)
  return functools.partial(mgpu.attention, config=config)


def part_hops(run) -> list[dict]:
  rows = []
  for case in hop_cases(run.smoke):
    pairs = allowed_pairs(case["s"], window=case["window"], docs=case["docs"])
    tflop = HEADS * pairs * flops_per_pair(case["d"]) / 1e12
    row = {"case": case["name"], "S": case["s"], "D": case["d"]}
    runs = [("pallas", cpjax_attention(run.implementation, run.smoke, case))]
    if run.smoke or case["s"] <= 8192:
      runs.append(("xla", cpjax_attention("xla", False, case)))
    vendor, row["vendor"] = vendor_attention(run.platform, case)
    if vendor is not None:
      runs.append(("vendor", vendor))
    mgpu = mgpu_attention(run.platform, case)
    if mgpu is not None:
      runs.append(("mgpu", mgpu))
    for label, attend in runs:
      if run.late():
        row[f"{label} error"] = "skipped: time"
        continue
      start = time.perf_counter()
      try:
        seconds = time_fwd_bwd(attend, case, run.repeats)
      except Exception as err:  # a failing peer is reported, not fatal
        row[f"{label} error"] = f"{type(err).__name__}: {str(err)[:200]}"
        continue
      row[f"{label} ms"] = seconds * 1e3
      row[f"{label} TFLOP/s"] = tflop / seconds
      print(
        f"  {case['name']} S={case['s']} D={case['d']} {label}: {seconds * 1e3:.2f} ms "
        f"({time.perf_counter() - start:.0f} s with compile)",
        flush=True,
      )
    for peer in ("vendor", "mgpu", "xla"):
      if "pallas ms" in row and f"{peer} ms" in row:
        row[f"pallas / {peer}"] = row[f"{peer} ms"] / row["pallas ms"]
    rows.append(row)
  print_table(
    rows,
    [
      "case",
      "S",
      "D",
      "pallas ms",
      "pallas TFLOP/s",
      "vendor",
      "vendor TFLOP/s",
      "pallas / vendor",
      "mgpu TFLOP/s",
      "pallas / mgpu",
      "pallas / xla",
    ],
  )
  for r in rows:
    for key, value in r.items():
      if key.endswith("error"):
        print("error:", r["case"], r["S"], r["D"], key, value)
  return rows


# ------------------------------------------------------------- the step
def step_cases(smoke: bool, e2b_layers: int):
  """(name, config, S, LoRA rank) of the training steps, most wanted first."""
  from cpjax.models.gemma4.config import FULL, SLIDING, Gemma4Config

  tiny = Gemma4Config.preset("tiny")
  if smoke:  # one sliding layer and one full one
    two = Gemma4Config.preset(
      "tiny", num_hidden_layers=2, num_kv_shared_layers=0, layer_types=(SLIDING, FULL)
    )
    return [("tiny, 2 layers", two, 256, 4)]
  e2b = Gemma4Config.preset("e2b").text
  slice_ = Gemma4Config.preset(  # E2B's first layers (the last of them made full)
    "e2b",
    num_hidden_layers=e2b_layers,
    num_kv_shared_layers=0,
    layer_types=e2b.layer_types[:e2b_layers],
  )
  # Text rows: the audio tower (0.31 B parameters, loaded since the preset
  # carries it) would add only its optimizer update; the slice stays the one
  # the first chip run timed.
  slice_ = dataclasses.replace(slice_, audio=None)
  name = f"e2b-width {e2b_layers} layers"
  return [
    ("tiny", tiny, 4096, None),
    (name, slice_, 32768, 16),
    (name, slice_, 32768, None),
    (name, slice_, 131072, 16),
    (name, slice_, 131072, None),
  ]


def _filled(infos, shardings):
  """Arrays of ``infos``' shapes and dtypes on ``shardings``, made in one
  program: small normal values for floats (weights, moments), ones for
  integers (token ids), False for booleans."""

  def fill(info):
    shape, dtype = info.shape, info.dtype
    if jnp.issubdtype(dtype, jnp.floating):
      return (0.02 * jax.random.normal(jax.random.key(0), shape, jnp.float32)).astype(dtype)
    if dtype == jnp.bool_:
      return jnp.zeros(shape, bool)
    return jnp.ones(shape, dtype)

  return jax.jit(lambda: jax.tree.map(fill, infos), out_shardings=shardings)()


def step_row(run, name, cfg, seq_len: int, lora: int | None) -> dict:
  """Compile, run and time one training step on this process's first device."""
  from cpjax.training import hlo, plan, step_time

  row = {"model": name, "S": seq_len, "training": "full" if lora is None else f"LoRA r={lora}"}
  # The run's shape, one for the compile and the closed form alike.
  shape = dict(
    seq_len=seq_len,
    mesh={"cp": 1},
    remat="full",
    strategy="ring",
    batch_size=1,
    dtype="bfloat16",
    lora_rank=lora,
    base_dtype="bfloat16" if lora is not None else "float32",
  )
  start = time.perf_counter()
  compiled, *_ = plan.compile_step(cfg, **shape)
  row["compile s"] = time.perf_counter() - start
  params, opt_state, batch, compiled.frozen = _filled(compiled.args_info, compiled.input_shardings)

  def one():
    nonlocal params, opt_state
    out = compiled(params, opt_state, batch)
    params, opt_state = out[0], out[1]
    jax.block_until_ready(out)

  seconds = median_time(one, repeats=run.step_repeats)
  tokens = seq_len
  row.update({"step ms": seconds * 1e3, "tokens/s": tokens / seconds})
  row["compiled GiB"] = plan.compiled_bytes(compiled) / 2**30
  stats = jax.devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    row["peak GiB"] = stats["peak_bytes_in_use"] / 2**30
  chip = run.chip
  if chip is not None:
    row["figures of"] = chip.name
    closed = plan.estimate(cfg, model=name, platform=chip.platform, **shape)
    row["MFU"] = closed.flops / seconds / chip.peak_flops
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
    program = hlo.Program.parse(compiled.as_text())
    predicted = step_time.step_time(program, chip, tokens=tokens, devices=1, cost=cost)
    row["plan ms"] = predicted.seconds * 1e3
    row["measured / plan"] = seconds / predicted.seconds
  return row


def part_step(run) -> list[dict]:
  rows = []
  for name, cfg, seq_len, lora in step_cases(run.smoke, run.e2b_layers):
    if run.late():
      rows.append({"model": name, "S": seq_len, "error": "skipped: time"})
      continue
    try:
      row = step_row(run, name, cfg, seq_len, lora)
    except Exception as err:  # out of memory, a missing package: a row, and on
      row = {"model": name, "S": seq_len, "training": "full" if lora is None else f"LoRA r={lora}"}
      row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
      traceback.print_exc(limit=2)
    print(f"  step {row}", flush=True)
    rows.append(row)
  print_table(
    rows,
    [
      "model",
      "S",
      "training",
      "compile s",
      "step ms",
      "tokens/s",
      "MFU",
      "compiled GiB",
      "peak GiB",
      "plan ms",
      "measured / plan",
      "error",
    ],
  )
  return rows


# ------------------------------------------------------------- the run
PARTS = {"check": part_check, "sweep": part_sweep, "hops": part_hops, "step": part_step}


class Run:
  """One call's settings, its clock and its results file."""

  def __init__(self, args, platform: str, implementation: str):
    self.smoke, self.platform, self.implementation = args.smoke, platform, implementation
    self.repeats, self.step_repeats = (1, 1) if args.smoke else (args.repeats, 3)
    self.check_len = 128 if args.smoke else 2048
    self.e2b_layers = args.e2b_layers
    self.deadline = time.perf_counter() + args.deadline
    self.out = args.out
    # The chip's figures (MFU, the plan's step time): this device's, or
    # --chip's where its kind has none (a smoke run on a CPU).
    self.chip = chip_of(jax.devices()[0].device_kind) or CHIPS.get(args.chip)
    self.results = {"machine": machine(), "implementation": implementation, "parts": {}}

  def late(self) -> bool:
    return time.perf_counter() > self.deadline

  def write(self, part: str, rows: list[dict]) -> None:
    self.results["parts"][part] = rows
    self.out.parent.mkdir(parents=True, exist_ok=True)
    self.out.write_text(json.dumps(self.results, indent=2, default=str) + "\n")


def chip_of(device_kind: str):
  """The :class:`cpjax.training.targets.Chip` of a device kind, or None."""
  return next((c for c in CHIPS.values() if c.kind == device_kind), None)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument(
    "--smoke",
    action="store_true",
    help="every part tiny, the GPU kernels interpreted (any machine)",
  )
  parser.add_argument(
    "--parts",
    default="check,hops,step",
    help="comma-separated parts to run, of check, sweep, hops, step (default: check,hops,step)",
  )
  parser.add_argument("--check", action="store_true", help="only the check (--parts check)")
  parser.add_argument("--sweep", action="store_true", help="add the tile sweep (kernels changed)")
  parser.add_argument("--repeats", type=int, default=5, help="timed calls a cell (median)")
  parser.add_argument("--e2b-layers", type=int, default=4, help="layers of the E2B-width slice")
  parser.add_argument("--deadline", type=float, default=520, help="seconds; later items skip")
  parser.add_argument("--out", type=Path, default=RESULTS / "accelerator.json")
  parser.add_argument(
    "--chip",
    choices=sorted(CHIPS),
    default=None,
    help="whose figures give MFU and the plan's step time where the device's kind has none",
  )
  args = parser.parse_args(argv)
  parts = ["check"] if args.check else [p.strip() for p in args.parts.split(",") if p.strip()]
  if args.sweep and "sweep" not in parts:
    parts.insert(1 if "check" in parts else 0, "sweep")
  unknown = [p for p in parts if p not in PARTS]
  if unknown:
    parser.error(f"--parts takes {', '.join(PARTS)}, got {', '.join(unknown)}")
  if args.repeats < 1 or args.e2b_layers < 1:
    parser.error(
      f"--repeats and --e2b-layers must be >= 1, got {args.repeats} and {args.e2b_layers}"
    )

  platform = jax.devices()[0].platform
  implementation = "pallas_gpu" if args.smoke else resolve_implementation(None)
  if implementation == "xla":
    parser.error(
      f"no accelerator here (JAX's devices are {platform!r}): run on a GPU or a TPU, or "
      "--smoke to run every part tiny in Pallas' interpreter"
    )
  run = Run(args, platform, implementation)
  for part in parts:
    print(f"== {part}", flush=True)
    start = time.perf_counter()
    rows = PARTS[part](run)
    print(f"== {part}: {time.perf_counter() - start:.0f} s", flush=True)
    run.write(part, rows)
    if part == "check" and not all(r["ok"] is True for r in rows if r["ok"] != "skipped: time"):
      print("the kernels differ from the dense reference", file=sys.stderr)
      return 1
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
