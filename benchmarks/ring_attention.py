"""Ring attention against its peers: time, memory, achieved FLOP/s.

B1 H8 D64 float32 on 8 emulated CPU devices (or whatever accelerators are
present), forward and forward+backward medians:

* causal S=8192, contiguous and load-balanced layouts;
* sliding window 512 at S=32768, against the same call without a window;
* 16 packed documents at S=16384;
* GQA with Hkv=2 at S=8192;

compared in the same run with the dense single-device
``jax.nn.dot_product_attention`` (S <= 8192, in a child process so its ~22 GB
cannot starve the rest), an all-gather-KV baseline (Llama-3 style, written
here) and the ``ringattention`` package (``pip install -e .[peers]``).
Per-device scratch memory comes from ``memory_analysis()``; achieved FLOP/s
count only unmasked (query, key) pairs: 4*D per pair forward, 12*D forward +
backward (recomputation not counted), against a 2048^3 matmul in this run.

    python benchmarks/ring_attention.py            # the full table (~15 min on 2 cores)
    python benchmarks/ring_attention.py --quick    # small sizes, a smoke run
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

B, H, D = 1, 8, 64


# ------------------------------------------------------------------ inputs
def make_qkv(s: int, hkv: int, seed: int = 0):
  import jax.numpy as jnp
  import numpy as np

  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, s, H, D), np.float32)
  k = rng.standard_normal((B, s, hkv, D), np.float32)
  v = rng.standard_normal((B, s, hkv, D), np.float32)
  return tuple(jnp.asarray(x) for x in (q, k, v))


def packed_doc_ids(s: int, n_docs: int, seed: int = 0):
  """int32[1, S] ids 1..n_docs of random-length documents covering the row."""
  import numpy as np

  rng = np.random.default_rng(seed)
  cuts = np.sort(rng.choice(np.arange(1, s), n_docs - 1, replace=False))
  return (1 + np.searchsorted(cuts, np.arange(s), side="right")).astype(np.int32)[None]


def allowed_pairs(s: int, *, causal=True, window=None, docs=None) -> int:
  """Exact count of unmasked (query, key) pairs per head, in O(S) numpy."""
  import numpy as np

  q = np.arange(s)
  lo = np.zeros(s, np.int64)
  hi = q.copy() if causal else np.full(s, s - 1)
  if window is not None:
    lo = np.maximum(lo, q - window + 1)
    if not causal:
      hi = np.minimum(hi, q + window - 1)
  if docs is not None:
    d = docs[0]
    starts = np.searchsorted(d, d, side="left")
    ends = np.searchsorted(d, d, side="right") - 1
    lo, hi = np.maximum(lo, starts), np.minimum(hi, ends)
  return int(np.maximum(hi - lo + 1, 0).sum())


# ---------------------------------------------------------------- methods
def sharded(mesh, x, order):
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  return jax.device_put(x[:, order], NamedSharding(mesh, P(None, "cp")))


def cpjax_fn(mesh, layout, **kw):
  import jax
  from jax.sharding import PartitionSpec as P

  import cpjax

  def local(q, k, v, doc_ids):
    return cpjax.ring_attention(q, k, v, layout=layout, document_ids=doc_ids, **kw)

  return jax.shard_map(local, mesh=mesh, in_specs=P(None, "cp"), out_specs=P(None, "cp"))


def allgather_fn(mesh, layout, *, causal=True, **_):
  """Llama-3 style: gather all K/V (Hkv heads), attend local queries densely."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  import cpjax

  def local(q, k, v, doc_ids):
    rank = jax.lax.axis_index("cp")
    qpos = cpjax.local_token_indices(layout, rank)
    kpos = jax.lax.all_gather(cpjax.local_token_indices(layout, rank), "cp", tiled=True)
    k_all = jax.lax.all_gather(k, "cp", axis=1, tiled=True)
    v_all = jax.lax.all_gather(v, "cp", axis=1, tiled=True)
    mask = (
      (kpos[None, :] <= qpos[:, None]) if causal else jnp.ones((q.shape[1], k_all.shape[1]), bool)
    )
    mask = mask[None, None]
    if doc_ids is not None:
      doc_ids_all = jax.lax.all_gather(doc_ids, "cp", axis=1, tiled=True)
      mask = mask & (doc_ids[:, None, :, None] == doc_ids_all[:, None, None, :])
    return jax.nn.dot_product_attention(q, k_all, v_all, mask=mask)

  return jax.shard_map(local, mesh=mesh, in_specs=P(None, "cp"), out_specs=P(None, "cp"))


def peer_fn(mesh, layout, *, causal=True, chunk=256, **_):
  """haoliuhl/ringattention's pure-JAX ring (contiguous layout, no GQA)."""
  import jax
  import jax._src.xla_bridge as xb
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  jax.lib.xla_bridge = xb  # the package still imports a removed module path
  from ringattention import ringattention_jax

  chunk = min(chunk, layout.local_seq_len)
  kw = dict(
    causal_block_size=1 if causal else None,
    deterministic=True,
    dropout_rng=None,
    attn_pdrop=0.0,
    query_chunk_size=chunk,
    key_chunk_size=chunk,
    policy=jax.checkpoint_policies.nothing_saveable,
    dtype=jnp.float32,
    precision=None,
    prevent_cse=True,
  )

  def local(q, k, v, doc_ids):
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)  # no GQA: all heads travel
    return ringattention_jax(q, k, v, None, doc_ids, None, "cp", True, kw)

  return jax.shard_map(
    local, mesh=mesh, in_specs=P(None, "cp"), out_specs=P(None, "cp"), check_vma=False
  )


def peer_available() -> bool:
  try:
    import importlib.util

    return importlib.util.find_spec("ringattention") is not None
  except ImportError:
    return False


# ------------------------------------------------------------------ timing
def measure(mesh, fn, args, *, repeats, fwd_only=False):
  """Median forward and forward+backward seconds, and fwd+bwd scratch bytes."""
  import jax
  import jax.numpy as jnp

  q, k, v, doc_ids = args
  fwd = jax.jit(fn)
  loss = lambda q, k, v: jnp.sum(fn(q, k, v, doc_ids))
  both = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  out = {}
  with jax.set_mesh(mesh):
    compiled = fwd.lower(q, k, v, doc_ids).compile()
    out["fwd_s"] = common.median_time(
      lambda: jax.block_until_ready(compiled(q, k, v, doc_ids)), repeats=repeats, warmup=1
    )
    if not fwd_only:
      compiled_b = both.lower(q, k, v).compile()
      out["fwd_bwd_s"] = common.median_time(
        lambda: jax.block_until_ready(compiled_b(q, k, v)), repeats=repeats, warmup=1
      )
      out["scratch_mib"] = compiled_b.memory_analysis().temp_size_in_bytes / 2**20
  return out


def scratch_mib(mesh, fn, args) -> float:
  """Per-device scratch of the fwd+bwd program, compile only."""
  import jax
  import jax.numpy as jnp

  q, k, v, doc_ids = args
  both = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, doc_ids)), argnums=(0, 1, 2)))
  with jax.set_mesh(mesh):
    return both.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes / 2**20


def matmul_flops(repeats: int) -> float:
  import jax
  import jax.numpy as jnp
  import numpy as np

  a = jnp.asarray(np.random.default_rng(0).standard_normal((2048, 2048), np.float32))
  mm = jax.jit(lambda a: a @ a)
  t = common.median_time(lambda: jax.block_until_ready(mm(a)), repeats=repeats, warmup=2)
  return 2 * 2048**3 / t


def dense_child(s: int, repeats: int) -> dict:
  """Single-device jax.nn.dot_product_attention, run in a child process."""
  code = f"""
import json, sys, jax, jax.numpy as jnp
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
import common
q, k, v = [jnp.ones((1, {s}, 8, 64), jnp.float32) * (i + 1) * 0.01 for i in range(3)]
f = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))
g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v)), argnums=(0, 1, 2)))
out = {{"fwd_s": common.median_time(lambda: jax.block_until_ready(f(q, k, v)), repeats={repeats}),
       "fwd_bwd_s": common.median_time(lambda: jax.block_until_ready(g(q, k, v)),
                                       repeats={repeats}),
       "scratch_mib": g.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes / 2**20}}
print("RESULT", json.dumps(out))
"""
  proc = subprocess.run(
    [sys.executable, "-c", code],
    capture_output=True,
    text=True,
    env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"},
  )
  for line in proc.stdout.splitlines():
    if line.startswith("RESULT "):
      return json.loads(line[7:])
  return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:200]}


# -------------------------------------------------------------------- main
def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--no-dense", action="store_true", help="skip the dense child process")
  args = parser.parse_args(argv)
  scale = 8 if args.quick else 1
  s_causal, s_window, s_docs = 8192 // scale, 32768 // scale, 16384 // scale
  window = 512 // scale

  dense = None
  if not args.no_dense:
    print(f"dense single-device attention at S={s_causal} (child process) ...", flush=True)
    dense = dense_child(s_causal, args.repeats)

  common.setup_devices(8)
  import jax
  import numpy as np

  import cpjax

  n = min(8, len(jax.devices()))
  mesh = jax.make_mesh((n,), ("cp",), devices=jax.devices()[:n])
  peak = matmul_flops(max(args.repeats, 5))
  have_peer = peer_available()
  rows = []

  def run(case, method, kind, s, *, hkv=H, window_=None, docs=None, fwd_only=False, **kw):
    layout = cpjax.ShardLayout(s, s, n, kind)
    order = cpjax.rank_order(layout)
    q, k, v = make_qkv(s, hkv)
    doc_ids = None if docs is None else sharded(mesh, docs, order)
    fargs = (sharded(mesh, q, order), sharded(mesh, k, order), sharded(mesh, v, order), doc_ids)
    build = {"cpjax": cpjax_fn, "all-gather KV": allgather_fn, "ringattention": peer_fn}[method]
    if method == "cpjax":
      fn = build(mesh, layout, sliding_window=window_, **kw)
    else:
      fn = build(mesh, layout, **kw)
    print(f"  {case}: {method} ({kind}) ...", flush=True)
    res = measure(mesh, fn, fargs, repeats=args.repeats, fwd_only=fwd_only)
    pairs = allowed_pairs(s, window=window_, docs=None if docs is None else np.asarray(docs))
    row = {
      "case": case,
      "method": method,
      "layout": kind,
      "S": s,
      "Hkv": hkv,
      **res,
      "fwd_gflops": 4 * D * H * B * pairs / res["fwd_s"] / 1e9,
    }
    if "fwd_bwd_s" in res:
      row["fwd_bwd_gflops"] = 12 * D * H * B * pairs / res["fwd_bwd_s"] / 1e9
    rows.append(row)
    return row

  print(f"matmul 2048^3 fp32: {peak / 1e9:.0f} GFLOP/s")
  # 1. causal
  for kind in ("contiguous", "load_balanced"):
    run("causal", "cpjax", kind, s_causal)
  run("causal", "all-gather KV", "contiguous", s_causal)
  if have_peer:
    run("causal", "ringattention", "contiguous", s_causal)
  # 2. sliding window against the same call without one
  for kind in ("contiguous", "load_balanced"):
    run(f"window {window}", "cpjax", kind, s_window, window_=window)
    run("no window", "cpjax", kind, s_window)
  # 3. packed documents
  docs = packed_doc_ids(s_docs, 16)
  for kind in ("contiguous", "load_balanced"):
    run("16 docs", "cpjax", kind, s_docs, docs=docs)
  if have_peer:
    run("16 docs", "ringattention", "contiguous", s_docs, docs=docs)
  # 4. GQA
  run("GQA Hkv=2", "cpjax", "load_balanced", s_causal, hkv=2)
  run("GQA Hkv=2", "all-gather KV", "contiguous", s_causal, hkv=2)
  if have_peer:
    run("GQA Hkv=2", "ringattention", "contiguous", s_causal, hkv=2)

  # Scratch memory against sequence length (compile only).
  memory = []
  for s in (8192 // scale, 16384 // scale, 32768 // scale):
    lay = cpjax.ShardLayout(s, s, n, "load_balanced")
    order = cpjax.rank_order(lay)
    fargs = tuple(sharded(mesh, x, order) for x in make_qkv(s, H)) + (None,)
    entry = {"S": s, "cpjax_mib": scratch_mib(mesh, cpjax_fn(mesh, lay), fargs)}
    lay_c = cpjax.ShardLayout(s, s, n, "contiguous")
    order_c = cpjax.rank_order(lay_c)
    fargs_c = tuple(sharded(mesh, x, order_c) for x in make_qkv(s, H)) + (None,)
    entry["allgather_mib"] = scratch_mib(mesh, allgather_fn(mesh, lay_c), fargs_c)
    if have_peer:
      entry["ringattention_mib"] = scratch_mib(mesh, peer_fn(mesh, lay_c), fargs_c)
    memory.append(entry)

  if dense is not None:
    rows.append(
      {
        "case": "causal",
        "method": "dense 1 device",
        "layout": "-",
        "S": s_causal,
        "Hkv": H,
        **dense,
      }
    )

  def get(case, method, kind):
    for r in rows:
      if r["case"] == case and r["method"] == method and r["layout"] == kind:
        return r
    return None

  summary = {}
  lb = get("causal", "cpjax", "load_balanced")
  co = get("causal", "cpjax", "contiguous")
  peer = get("causal", "ringattention", "contiguous")
  if peer:
    summary["causal fwd+bwd: ringattention / cpjax (load_balanced)"] = (
      peer["fwd_bwd_s"] / lb["fwd_bwd_s"]
    )
    summary["causal fwd+bwd: ringattention / cpjax (contiguous)"] = (
      peer["fwd_bwd_s"] / co["fwd_bwd_s"]
    )
  for kind in ("contiguous", "load_balanced"):
    w, nw = get(f"window {window}", "cpjax", kind), get("no window", "cpjax", kind)
    summary[f"window speedup fwd+bwd ({kind})"] = nw["fwd_bwd_s"] / w["fwd_bwd_s"]
    summary[f"window speedup fwd ({kind})"] = nw["fwd_s"] / w["fwd_s"]
  summary["scratch growth S x4 (cpjax)"] = memory[-1]["cpjax_mib"] / memory[0]["cpjax_mib"]
  summary["matmul_gflops"] = peak / 1e9

  print(
    f"\nring attention, B{B} H{H} D{D} fp32, {n} {jax.devices()[0].platform} devices, "
    f"median of {args.repeats}"
  )
  common.print_table(
    rows,
    [
      "case",
      "method",
      "layout",
      "S",
      "Hkv",
      "fwd_s",
      "fwd_bwd_s",
      "scratch_mib",
      "fwd_gflops",
      "fwd_bwd_gflops",
    ],
  )
  print("\nper-device scratch memory of fwd+bwd (MiB)")
  common.print_table(memory, list(memory[0]))
  print()
  for k_, v_ in summary.items():
    print(f"{k_}: {v_:.2f}")
  name = "ring_attention_quick" if args.quick else "ring_attention"
  print(
    "wrote",
    common.write_json(
      name, {"config": vars(args), "rows": rows, "memory": memory, "summary": summary}
    ),
  )


if __name__ == "__main__":
  main()
