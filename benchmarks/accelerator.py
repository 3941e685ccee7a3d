"""Per-hop kernels on one accelerator chip: cpjax Pallas vs cpjax XLA vs the vendor kernel.

Runs unchanged on one GPU (vendor: ``jax.nn.dot_product_attention(
implementation="cudnn")``) or one TPU chip (vendor: splash attention). cp = 1,
B = 1, H = 16 query heads (and GQA 16/4), D = 128, bfloat16; causal at
S = 8k, 32k, 128k, then a sliding window (W = 1024) and packed documents
(8 equal documents) at 32k. Each cell is the median of ``--repeats`` timed
forward+backward calls (``jax.grad`` of ``sum(out * w)``), after a warm-up
that compiles.

TFLOP/s count only unmasked (query, key) pairs, 12·D FLOPs per pair per
head forward+backward (4·D forward), as ``benchmarks/ring_attention.py``
does, so a kernel that skips more empty tiles does not look faster for it.
"fraction of vendor" is cpjax Pallas' TFLOP/s over the vendor's in the same
case; "pallas / xla" the speed-up over cpjax's XLA tile loop.

    python benchmarks/accelerator.py            # on the accelerator
    python benchmarks/accelerator.py --check    # values and gradients only
    python benchmarks/accelerator.py --smoke    # tiny shapes, interpreter, any machine

``--check`` first compares the chip's kernels with ``cpjax.reference_attention``
(values and the three gradients, float32 and bfloat16, head dims 128 and 256,
every mask kind of the timed cases plus padding) and exits non-zero on a miss.

Writes ``results/accelerator.json``.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import cpjax  # noqa: E402
from benchmarks.common import median_time, print_table, write_json  # noqa: E402
from cpjax.ring.kernels import resolve_implementation  # noqa: E402

D = 128
FLOPS_PER_PAIR = 12 * D  # forward + backward, per head


def allowed_pairs(s: int, *, window: int | None, docs: int) -> int:
  """Unmasked (query, key) pairs of one causal head (numpy, exact)."""
  q = np.arange(s)
  lo = np.zeros(s, np.int64)
  if docs > 1:
    lo = (q // (s // docs)) * (s // docs)
  if window is not None:
    lo = np.maximum(lo, q - window + 1)
  return int(np.sum(q - lo + 1))


def cases(smoke: bool):
  if smoke:
    return [
      dict(name="causal", s=256, hkv=16, window=None, docs=1),
      dict(name="causal gqa", s=256, hkv=4, window=None, docs=1),
      dict(name="window 64", s=256, hkv=16, window=64, docs=1),
      dict(name="8 documents", s=256, hkv=16, window=None, docs=8),
    ]
  out = []
  for s in (8192, 32768, 131072):
    out += [
      dict(name="causal", s=s, hkv=16, window=None, docs=1),
      dict(name="causal gqa", s=s, hkv=4, window=None, docs=1),
    ]
  out += [
    dict(name="window 1024", s=32768, hkv=16, window=1024, docs=1),
    dict(name="8 documents", s=32768, hkv=16, window=None, docs=8),
  ]
  return out


def documents(s: int, docs: int):
  return jnp.asarray(1 + np.arange(s)[None] // (s // docs), jnp.int32)


def cpjax_attention(implementation: str, interpret: bool, case, padding_mask=None):
  s = case["s"]
  lay = cpjax.ShardLayout(s, s, 1)
  seg = documents(s, case["docs"]) if case["docs"] > 1 else None

  def attend(q, k, v):
    return cpjax.ring_attention(
      q,
      k,
      v,
      layout=lay,
      sliding_window=case["window"],
      segment_ids=seg,
      padding_mask=padding_mask,
      implementation=implementation,
      interpret=interpret,
    )

  return attend


def vendor_attention(platform: str, case, *, interpret: bool = False):
  """(the vendor kernel of this platform for the case or None, its name)."""
  s, window = case["s"], case["window"]
  if platform != "tpu":
    name = "cuDNN" if platform == "gpu" else "jax.nn (xla)"
    if case["docs"] > 1:
      return None, "n/a (no document mask)"  # jax.nn.dot_product_attention has none
    local = None if window is None else (window - 1, 0)
    return functools.partial(
      jax.nn.dot_product_attention,
      is_causal=True,
      local_window_size=local,
      implementation="cudnn" if platform == "gpu" else "xla",
    ), name
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

  hq, hkv = 16, case["hkv"]
  one = (
    masks.CausalMask((s, s))
    if window is None
    else masks.LocalMask((s, s), (window - 1, 0), offset=0)
  )
  kernel = splash.make_splash_mqa_single_device(
    masks.MultiHeadMask([one] * (hq // hkv)), interpret=interpret
  )
  seg = documents(s, case["docs"])[0] if case["docs"] > 1 else None

  def attend(q, k, v):  # [B, S, H, D] -> splash's [H, S, D] per row and KV head
    scale = D**-0.5
    qh = (q * scale).transpose(0, 2, 1, 3).reshape(q.shape[0], hkv, hq // hkv, s, D)
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    ids = None if seg is None else splash.SegmentIds(q=seg, kv=seg)
    run = lambda qg, kg, vg: kernel(qg, kg, vg, segment_ids=ids)  # noqa: E731
    out = jax.vmap(jax.vmap(run))(qh, kh, vh)
    return out.reshape(q.shape[0], hq, s, D).transpose(0, 2, 1, 3)

  return attend, "splash"


def time_fwd_bwd(attend, case, repeats: int) -> float:
  s, hkv = case["s"], case["hkv"]
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (1, s, 16, D), jnp.bfloat16)
  k = jax.random.normal(keys[1], (1, s, hkv, D), jnp.bfloat16)
  v = jax.random.normal(keys[2], (1, s, hkv, D), jnp.bfloat16)
  w = jax.random.normal(keys[3], (1, s, 16, D), jnp.float32)
  grad = jax.jit(
    jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32) * w), argnums=(0, 1, 2))
  )
  return median_time(lambda: jax.block_until_ready(grad(q, k, v)), repeats=repeats)


# Relative error allowed against the float32 reference: on a GPU the kernels'
# float32 dots run as tf32 (5e-4 measured on an H200); bfloat16 operands keep
# 8 bits of mantissa (3e-3 measured).
CHECK_TOLERANCE = {jnp.float32: 2e-3, jnp.bfloat16: 3e-2}


def check_cases(s: int):
  return [
    dict(name="causal", s=s, hkv=16, window=None, docs=1, pad=0),
    dict(name="causal gqa", s=s, hkv=4, window=None, docs=1, pad=0),
    dict(name="window", s=s, hkv=16, window=s // 8, docs=1, pad=0),
    dict(name="8 documents", s=s, hkv=4, window=None, docs=8, pad=0),
    dict(name="padding", s=s, hkv=4, window=None, docs=1, pad=s // 3),
  ]


def check_against_reference(implementation: str, interpret: bool, s: int) -> list[dict]:
  """Values and gradients of the chip's kernels against the dense reference."""
  from cpjax.reference import reference_attention

  rows = []
  for d in (128, 256):
    for dtype in (jnp.float32, jnp.bfloat16):
      for case in check_cases(s):
        keys = jax.random.split(jax.random.key(d + case["hkv"] + case["s"]), 4)
        q = jax.random.normal(keys[0], (1, s, 16, d), dtype)
        k = jax.random.normal(keys[1], (1, s, case["hkv"], d), dtype)
        v = jax.random.normal(keys[2], (1, s, case["hkv"], d), dtype)
        w = jax.random.normal(keys[3], (1, s, 16, d), jnp.float32)
        seg = documents(s, case["docs"]) if case["docs"] > 1 else None
        pad = jnp.arange(s)[None] >= s - case["pad"] if case["pad"] else None
        ours = cpjax_attention(implementation, interpret, case, padding_mask=pad)

        def theirs(q, k, v):
          return reference_attention(
            q, k, v, sliding_window=case["window"], segment_ids=seg, padding_mask=pad
          )

        def value_and_grads(attend, *args):
          loss = lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32) * w)  # noqa: E731
          out = attend(*args)
          return (out, *jax.grad(loss, argnums=(0, 1, 2))(*args))

        got = jax.jit(functools.partial(value_and_grads, ours))(q, k, v)
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        with jax.default_matmul_precision("float32"):  # no tf32 in the reference
          want = jax.jit(functools.partial(value_and_grads, theirs))(*f32)
        errors = {
          name: float(
            jnp.linalg.norm((a.astype(jnp.float32) - b).ravel()) / jnp.linalg.norm(b.ravel())
          )
          for name, a, b in zip(("out", "dq", "dk", "dv"), got, want)
        }
        finite = all(bool(jnp.all(jnp.isfinite(a))) for a in got)
        ok = finite and max(errors.values()) <= CHECK_TOLERANCE[dtype]
        row = {"case": case["name"], "D": d, "dtype": jnp.dtype(dtype).name, **errors}
        row["ok"] = ok
        rows.append(row)
        print(
          f"  check {case['name']} D={d} {row['dtype']}: "
          + " ".join(f"{n} {e:.1e}" for n, e in errors.items())
          + ("" if ok else "  MISS"),
          flush=True,
        )
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument(
    "--smoke",
    action="store_true",
    help="tiny shapes, Pallas GPU kernels in the interpreter (any machine)",
  )
  parser.add_argument(
    "--check",
    action="store_true",
    help="only compare the kernels' values and gradients with the dense reference",
  )
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument(
    "--max-xla-seq-len",
    type=int,
    default=32768,
    help="skip cpjax XLA above this length (its tile loop is sequential)",
  )
  args = parser.parse_args(argv)

  platform = jax.devices()[0].platform
  implementation = "pallas_gpu" if args.smoke else resolve_implementation(None)
  if implementation == "xla":
    parser.error(f"no Pallas target for platform {platform!r}: run on a GPU or TPU, or --smoke")
  checked = check_against_reference(implementation, args.smoke, 256 if args.smoke else 2048)
  print_table(checked, ["case", "D", "dtype", "out", "dq", "dk", "dv", "ok"])
  if not all(r["ok"] for r in checked):
    sys.exit("the kernels differ from the dense reference")
  if args.check:
    return
  rows = []
  for case in cases(args.smoke):
    pairs = allowed_pairs(case["s"], window=case["window"], docs=case["docs"])
    tflop = 16 * pairs * FLOPS_PER_PAIR / 1e12
    row = {"case": case["name"], "S": case["s"], "Hq/Hkv": f"16/{case['hkv']}"}
    runs = [("pallas", cpjax_attention(implementation, args.smoke, case))]
    if case["s"] <= args.max_xla_seq_len:
      runs.append(("xla", cpjax_attention("xla", False, case)))
    vendor, vendor_name = vendor_attention(platform, case)
    row["vendor"] = vendor_name
    if vendor is not None:
      runs.append(("vendor", vendor))
    for label, attend in runs:
      start = time.perf_counter()
      try:
        seconds = time_fwd_bwd(attend, case, args.repeats)
      except Exception as err:  # a failing peer is reported, not fatal
        row[f"{label} error"] = f"{type(err).__name__}: {str(err)[:200]}"
        continue
      row[f"{label} ms"] = seconds * 1e3
      row[f"{label} TFLOP/s"] = tflop / seconds
      print(
        f"  {case['name']} S={case['s']} {label}: {seconds * 1e3:.2f} ms "
        f"({time.perf_counter() - start:.0f} s with compile)",
        flush=True,
      )
    if "pallas ms" in row and "vendor ms" in row:
      row["fraction of vendor"] = row["vendor ms"] / row["pallas ms"]
    if "pallas ms" in row and "xla ms" in row:
      row["pallas / xla"] = row["xla ms"] / row["pallas ms"]
    rows.append(row)
  columns = [
    "case",
    "S",
    "Hq/Hkv",
    "pallas ms",
    "pallas TFLOP/s",
    "xla ms",
    "vendor",
    "vendor ms",
    "vendor TFLOP/s",
    "fraction of vendor",
    "pallas / xla",
  ]
  print_table(rows, columns)
  errors = [(r["case"], r["S"], k, v) for r in rows for k, v in r.items() if k.endswith("error")]
  for e in errors:
    print("error:", *e)
  if args.smoke:  # a check that the script runs, not a measurement
    return
  path = write_json(
    "accelerator",
    {"implementation": implementation, "D": D, "flops_per_pair": FLOPS_PER_PAIR, "rows": rows},
  )
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
