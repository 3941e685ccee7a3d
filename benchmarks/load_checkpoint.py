"""Loading a published-size Gemma 4 checkpoint: time and peak host memory.

Writes E2B's checkpoint at its real size in bfloat16 without downloading it:
the published ``config.json`` (tests/fixtures/gemma4/published/e2b) and the
published key set (every tensor of transformers' ``Gemma4ForConditionalGeneration``,
the audio tower and the reuse layers' K/V included, built on the meta device),
as one sparse ``model.safetensors`` of zeros (the header, then a truncate to
the full size: about 10 GB that take no disk). A fresh child process then
loads it with ``Gemma4.from_pretrained(dtype=bfloat16)``, on one device and
with an fsdp mesh over 8 emulated devices, runs a forward pass on a few
tokens, and reports time and peak RSS. The process's RSS before loading
(Python + JAX) is subtracted; the target is that loading adds at most
1.15x the bytes the model holds (one device), or the process's share of
them (the mesh: shards plus the replicas of small tensors).

With ``--base-dtype int4`` (or int8, nf4) the child loads a QLoRA base as
``cpjax train`` does: the adapted model built abstractly
(``lora.apply_lora_lazily``), each checkpoint tensor read in bfloat16 and
quantized on its devices before the next is read
(``checkpoint.load_weights``), so the bfloat16 model never exists whole.
The target is 1.15x of what the quantized model holds (a 4-bit value
counted at the half byte XLA:CPU stores it in) plus one weight being
quantized: the largest quantized tensor in bfloat16 as read and its
float32 temporaries (``quantizing_gb``). ``--model a4b --base-dtype int4`` is 26B-A4B's real
shapes: a 52 GB bfloat16 checkpoint loaded on a 24 GiB machine.

    python benchmarks/load_checkpoint.py [--model e2b] [--dir DIR]
    python benchmarks/load_checkpoint.py --model a4b --base-dtype int4 --group-size 64 --mesh 1

Needs transformers (``pip install -e .[hf]``) for the key set.
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

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED = ROOT / "tests" / "fixtures" / "gemma4" / "published"
TARGET = 1.15

CHILD = r"""
import json, resource, sys, time
mesh_size = int(sys.argv[2])
base_dtype = sys.argv[3] if sys.argv[3] != "bfloat16" else None
group_size = int(sys.argv[4]) if sys.argv[4] != "none" else None
import jax
jax.config.update("jax_num_cpu_devices", max(mesh_size, 1))
import jax.numpy as jnp
import numpy as np
from flax import nnx
from cpjax import parallel
from cpjax.models import gemma4
from cpjax.models.gemma4.checkpoint import checkpoint_keys
from cpjax.models.gemma4.partitioning import partition_rule

path = sys.argv[1]
jnp.zeros(1).block_until_ready()          # backend up before the baseline
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
kw = {}
if mesh_size > 1:
  mesh = parallel.make_mesh(fsdp=mesh_size)
  cfg = gemma4.Gemma4Config.from_hf(path)
  abstract = nnx.eval_shape(lambda: gemma4.Gemma4(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16,
                                                   param_dtype=jnp.bfloat16))
  keys = checkpoint_keys(abstract)
  shapes = {k: v.get_value() for k, v in keys.items()}
  specs = parallel.param_specs(shapes, mesh, rule=partition_rule(cfg, tp=1))
  kw = dict(mesh=mesh, sharding=lambda key, shape: specs[key])
t0 = time.perf_counter()
if base_dtype is None:
  model = gemma4.Gemma4.from_pretrained(path, dtype=jnp.bfloat16, **kw)
  leaves = [v.get_value() for v in checkpoint_keys(model).values()]
else:
  from cpjax.models.gemma4.checkpoint import load_weights
  from cpjax.training import lora
  from cpjax.training.trainer.builder import checkpoint_sharding
  cfg = gemma4.Gemma4Config.from_hf(path)
  settings = lora.LoraConfig(rank=16, base_dtype=base_dtype, group_size=group_size)
  make = lambda: gemma4.Gemma4(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16,
                               param_dtype=jnp.bfloat16)
  model = lora.apply_lora_lazily(make, settings)
  if mesh_size > 1:
    kw["sharding"] = checkpoint_sharding(cfg, mesh, partition_rule(cfg, tp=1), model=model)
  load_weights(model, path, **kw)
  leaves = jax.tree.leaves(nnx.state(model))
jax.block_until_ready(leaves)
load_s = time.perf_counter() - t0
peak_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
def nbytes(x):  # XLA:CPU stores a 4-bit value in half a byte
  return x.size // 2 if x.dtype in (jnp.int4, jnp.uint4) else x.size * x.dtype.itemsize
held = sum(nbytes(s.data) for x in leaves for s in x.addressable_shards)
logical = sum(nbytes(x) for x in leaves)
# A weight being quantized: read in bfloat16, then float32 temporaries.
quantizing = max([x.size * (2 + 4) for x in leaves if x.dtype in (jnp.int4, jnp.uint4, jnp.int8)]
                 or [0])
t0 = time.perf_counter()
ids = np.array([[2, 818, 5279, 529, 506, 10450, 236761, 107]], np.int32)
batch = gemma4.prepare_batch({"input_ids": ids}, model.cfg)
# The forward (one device, a bfloat16 base): a quantized one's numerics are
# tests/test_qlora.py's, and 26B-A4B's eager forward would not fit this host.
logits = model(batch) if mesh_size == 1 and base_dtype is None else None
if logits is not None:
  logits.block_until_ready()
forward_s = time.perf_counter() - t0
print("RESULT " + json.dumps({"load_s": load_s, "forward_s": forward_s, "rss_before": before,
                              "rss_peak_load": peak_load, "bytes_held": held,
                              "bytes_logical": logical, "quantizing": quantizing,
                              "finite": None if logits is None else bool(np.isfinite(np.asarray(
                                  logits, np.float32)).all())}))
"""


def published_key_set(model: str) -> dict[str, tuple[tuple[int, ...], str]]:
  """{key: (shape, safetensors dtype)} of the published checkpoint, as
  transformers builds the model (the tied head is not stored)."""
  import torch
  import transformers

  cfg = transformers.Gemma4Config.from_pretrained(PUBLISHED / model)
  with torch.device("meta"):
    hf = transformers.Gemma4ForConditionalGeneration(cfg)
  tied = cfg.get_text_config().tie_word_embeddings
  return {
    k: (tuple(v.shape), "BF16")
    for k, v in hf.state_dict().items()
    if not (tied and k == "lm_head.weight")
  }


def write_sparse_checkpoint(path: str, model: str) -> int:
  """config.json + a sparse model.safetensors of zeros; returns the tensor bytes."""
  os.makedirs(path, exist_ok=True)
  shutil.copy(PUBLISHED / model / "config.json", os.path.join(path, "config.json"))
  header, offset = {"__metadata__": {"format": "pt"}}, 0
  for key, (shape, dtype) in sorted(published_key_set(model).items()):
    size = 2
    for n in shape:
      size *= n
    header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
    offset += size
  text = json.dumps(header, separators=(",", ":")).encode()
  text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
  file = os.path.join(path, "model.safetensors")
  with open(file, "wb") as f:
    f.write(len(text).to_bytes(8, "little"))
    f.write(text)
  os.truncate(file, 8 + len(text) + offset)
  return offset


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--model",
    default="e2b",
    choices=("e2b", "e4b", "a4b"),
    help="published size (default e2b; e4b needs ~16 GB of RAM per run, a4b a quantized base)",
  )
  parser.add_argument(
    "--base-dtype",
    default="bfloat16",
    choices=("bfloat16", "int8", "int4", "nf4"),
    help="bfloat16 (Gemma4.from_pretrained) or a QLoRA base quantized as it is read",
  )
  parser.add_argument("--group-size", type=int, default=None, help="a quantized base's groups")
  parser.add_argument(
    "--mesh", type=int, nargs="+", default=[1, 8], help="fsdp sizes to load onto (default 1 8)"
  )
  parser.add_argument("--dir", default=None, help="where to write it (default: a temp dir)")
  args = parser.parse_args(argv)
  path = args.dir or tempfile.mkdtemp(prefix="cpjax-ckpt-")
  rows = []
  try:
    size = write_sparse_checkpoint(path, args.model)
    for n in args.mesh:
      env = {**os.environ, "JAX_PLATFORMS": "cpu"}
      proc = subprocess.run(
        [sys.executable, "-c", CHILD, path, str(n), args.base_dtype, str(args.group_size).lower()],
        capture_output=True,
        text=True,
        env=env,
      )
      if proc.returncode:
        raise RuntimeError(f"child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
      res = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))[7:])
      added = res["rss_peak_load"] - res["rss_before"]
      rows.append(
        {
          "base": args.base_dtype + (f" g{args.group_size}" if args.group_size else ""),
          "devices": n,
          "file_gb": size / 1e9,
          "model_gb": res["bytes_logical"] / 1e9,
          "process_share_gb": res["bytes_held"] / 1e9,
          "load_s": res["load_s"],
          "gb_per_s": res["bytes_logical"] / 1e9 / res["load_s"],
          "rss_before_gb": res["rss_before"] / 1e9,
          "rss_peak_gb": res["rss_peak_load"] / 1e9,
          "added_x_share": added / res["bytes_held"],
          "quantizing_gb": res["quantizing"] / 1e9,
          "allowed_gb": (TARGET * res["bytes_held"] + res["quantizing"]) / 1e9,
          "ok": added <= TARGET * res["bytes_held"] + res["quantizing"],
          "forward_s": res["forward_s"],
          "logits_finite": res["finite"],
        }
      )
  finally:
    if args.dir is None:
      shutil.rmtree(path, ignore_errors=True)
  how = (
    "Gemma4.from_pretrained, bfloat16"
    if args.base_dtype == "bfloat16"
    else f"apply_lora_lazily + load_weights, quantized to {args.base_dtype} as read"
  )
  print(
    f"\nload_checkpoint: {how}, published {args.model} key set in bfloat16, "
    f"sparse single file, {os.cpu_count()} cores"
  )
  common.print_table(rows, list(rows[0]))
  name = "load_checkpoint"
  if (args.model, args.base_dtype) != ("e2b", "bfloat16"):
    name += f"_{args.model}_{args.base_dtype}"
  print("wrote", common.write_json(name, {"config": vars(args), "rows": rows}))


if __name__ == "__main__":
  main()
