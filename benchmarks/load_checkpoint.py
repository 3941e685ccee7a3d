"""Loading a Hugging Face Gemma 4 checkpoint: throughput and peak host memory.

Writes a synthetic text-only Gemma 4 checkpoint of several GB (random
float32 tensors, sharded safetensors with an index, as the Hub stores big
models), then loads it with ``Gemma4.from_pretrained`` in a fresh child
process and records the wall time, GB/s and the child's peak RSS. The
process's RSS before loading (Python + JAX) is reported and subtracted: the
target is that loading adds at most 1.3x the checkpoint's size (the loaded
parameters themselves are 1.0x on the CPU backend).

    python benchmarks/load_checkpoint.py [--hidden 2048] [--layers 8] [--dir /tmp/ckpt]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

CHILD = r"""
import json, resource, sys, time
import jax
from cpjax.models import gemma4
path = sys.argv[1]
jax.numpy.zeros(1).block_until_ready()          # backend up before the baseline
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t0 = time.perf_counter()
model = gemma4.Gemma4.from_pretrained(path)
jax.block_until_ready(jax.tree.leaves(jax.tree.map(lambda x: x, __import__("flax").nnx.state(model))))
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print("RESULT " + json.dumps({"seconds": seconds, "rss_before": before, "rss_peak": peak}))
"""


def write_checkpoint(path: str, hidden: int, layers: int, shard_bytes: int) -> int:
  """A random checkpoint written tensor by tensor; returns its size in bytes."""
  import numpy as np
  from flax import nnx
  from safetensors.numpy import save_file

  from cpjax.models import gemma4
  from cpjax.models.gemma4.checkpoint import INDEX_FILE, checkpoint_keys

  text = gemma4.Gemma4TextConfig(
      hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
      num_attention_heads=8, num_key_value_heads=2, head_dim=hidden // 8,
      global_head_dim=hidden // 4, hidden_size_per_layer_input=0,
      final_logit_softcapping=30.0)
  cfg = gemma4.Gemma4Config(text=text, vision=None)
  shapes = {k: v.get_value().shape for k, v in checkpoint_keys(
      nnx.eval_shape(lambda: gemma4.Gemma4(cfg, rngs=nnx.Rngs(0)))).items()}
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(cfg.to_hf(), f)
  rng = np.random.default_rng(0)
  groups, size, total = [[]], 0, 0
  for key, shape in shapes.items():
    nbytes = 4 * int(np.prod(shape))
    if groups[-1] and size + nbytes > shard_bytes:
      groups.append([])
      size = 0
    groups[-1].append(key)
    size += nbytes
    total += nbytes
  weight_map = {}
  for i, group in enumerate(groups):
    name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
    save_file({k: rng.standard_normal(shapes[k], np.float32) for k in group},
              os.path.join(path, name), metadata={"format": "pt"})
    weight_map.update({k: name for k in group})
  with open(os.path.join(path, INDEX_FILE), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
  return total


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--hidden", type=int, default=2048)
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--shard-gb", type=float, default=1.0)
  parser.add_argument("--dir", default=None, help="where to write it (default: a temp dir)")
  args = parser.parse_args(argv)
  path = args.dir or tempfile.mkdtemp(prefix="cpjax-ckpt-")
  try:
    size = write_checkpoint(path, args.hidden, args.layers, int(args.shard_gb * 2**30))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", CHILD, path], capture_output=True, text=True,
                          env=env, check=True)
    res = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))[7:])
  finally:
    if args.dir is None:
      shutil.rmtree(path, ignore_errors=True)
  added = res["rss_peak"] - res["rss_before"]
  row = {"checkpoint_gb": size / 1e9, "load_s": res["seconds"],
         "gb_per_s": size / 1e9 / res["seconds"], "rss_before_gb": res["rss_before"] / 1e9,
         "rss_peak_gb": res["rss_peak"] / 1e9, "added_rss_x_checkpoint": added / size}
  print(f"\nload_checkpoint: Gemma4.from_pretrained, text-only d={args.hidden}, "
        f"{args.layers} layers, float32, {os.cpu_count()} cores")
  common.print_table([row], list(row))
  print("wrote", common.write_json("load_checkpoint", {"config": vars(args), "result": row}))


if __name__ == "__main__":
  main()
