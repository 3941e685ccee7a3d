"""Write the notebooks from the cell sources below (outputs empty).

    python notebooks/build_notebooks.py

Editing the cells here and rebuilding keeps the .ipynb files reviewable.
"""

import hashlib
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent

SETUP = r"""# Setup: pick the devices BEFORE JAX initialises.
# On Colab, first install cpjax from the repository checkout:
#   !git clone <the cpjax repository> /content/cpjax && pip install -e /content/cpjax
import glob, os, shutil

SMALL = os.environ.get("CPJAX_NOTEBOOK_SMALL") == "1"   # the test suite runs small sizes
has_tpu = (bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/*"))
           or "COLAB_TPU_ADDR" in os.environ)
has_gpu = shutil.which("nvidia-smi") is not None

import jax
jax.config.update("jax_num_cpu_devices", 8)        # 8 CPU devices, beside any chips
if not (has_tpu or has_gpu):
    jax.config.update("jax_platforms", "cpu")

chips = [d for d in jax.devices() if d.platform != "cpu"]
if len(chips) >= 4:
    cp_devices, single_device = chips, chips[0]
    where = f"{len(chips)} {chips[0].platform.upper()} chips"
else:
    # One chip cannot show context parallelism: the CP parts run on 8 CPU
    # devices set up beside it, and the chip (if any) runs the single-device parts.
    cp_devices = jax.devices("cpu")[:8]
    single_device = chips[0] if chips else jax.devices("cpu")[0]
    where = ("8 emulated CPU devices" + (f" (the one {chips[0].platform.upper()} chip runs the "
             "single-device parts)" if chips else ""))
mesh = jax.make_mesh((len(cp_devices),), ("cp",), devices=cp_devices)
print(f"context parallelism over {where}; mesh {dict(mesh.shape)}")

# The ring's per-hop backend on the mesh's devices: fused Pallas kernels on
# TPU or GPU chips, the XLA tile loop on CPU devices.
from cpjax.parallel import resolve_implementation
implementation = resolve_implementation(None, platform=cp_devices[0].platform)
print(f"ring attention per hop: {implementation}")
# Mosaic TPU tiles are 128 tokens: give each rank chunks of at least that.
tokens_per_rank = 256 if implementation == "pallas_tpu" else 40
"""

QUICKSTART = [
  (
    "markdown",
    "# cpjax quick start\n\nShard a packed multimodal batch over a `cp` mesh "
    "axis, see which tokens each rank holds in each layout, draw what one ring "
    "step of attention computes and skips, and check `ring_attention` against the "
    "dense reference. Runs top to bottom on CPU, GPU or a Colab TPU runtime.",
  ),
  ("code", SETUP),
  (
    "code",
    r"""import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import cpjax
from cpjax.models import gemma4

cp = mesh.shape["cp"]
seq_len = 10 * cp if SMALL else tokens_per_rank * cp
batch = gemma4.synthetic_batch(np.random.default_rng(0), gemma4.Gemma4Config.preset("tiny"),
                               batch_size=1, seq_len=seq_len, max_docs=4)
print({k: v.shape for k, v in batch.items()})""",
  ),
  (
    "markdown",
    "## Which tokens does each rank hold?\n\nContiguous: rank r owns one "
    "block. Load-balanced: the padded row is cut into 2*cp chunks and rank r "
    "owns chunks r and 2*cp-1-r, so every rank has the same causal work on one "
    "document. Document-balanced: for packed rows, the sharder reorders whole "
    "documents (`_source_index` says where each token came from) so that the "
    "stripes each rank owns carry the same work; documents stay whole, so every "
    "mask means what it meant.",
  ),
  (
    "code",
    r"""kinds = cpjax.batch.LAYOUT_KINDS
fig, axes = plt.subplots(len(kinds), 1, figsize=(10, 1.1 * len(kinds)), sharex=True)
for ax, kind in zip(axes, kinds):
    sharded, layout = cpjax.shard_batch(batch, mesh, layout=kind)
    # The rank that holds each token of the row (natural order, padding at the end).
    ranks = cpjax.token_ranks(sharded, layout)
    ax.imshow(ranks, aspect="auto", cmap="tab10", interpolation="nearest")
    docs = np.asarray(batch["_packed_seq_ids"])[0]  # (and 0 for the padding)
    docs = np.pad(docs, (0, layout.padded_seq_len - docs.size))
    for t in np.flatnonzero(np.diff(docs)) + 0.5:
        ax.axvline(t, color="k", lw=0.8)
    ax.set_yticks([]); ax.set_ylabel(kind, rotation=0, ha="right")
    restored = cpjax.unshard_batch(sharded, layout)
    assert all(np.array_equal(restored[k], v) for k, v in cpjax.normalize_batch(batch).items())
axes[-1].set_xlabel("token index in the row (colour = owning rank, lines = document boundaries)")
plt.tight_layout(); plt.show()
print("unshard_batch restores the batch in every layout")""",
  ),
  (
    "markdown",
    "## One ring step\n\nAt ring step h, rank r holds the keys of rank "
    "(r - h) mod cp. Each panel is the causal, packed-document mask between "
    "rank r's queries and those keys; grey tiles are skipped without any work.",
  ),
  (
    "code",
    r"""from cpjax.masks import Tokens

sharded, layout = cpjax.shard_batch(batch, mesh, layout="load_balanced")
docs = np.asarray(sharded["_packed_seq_ids"])          # rank order: rank r at [r*L, (r+1)*L)
rule = cpjax.AttentionMask.create(causal=True, document_ids=docs).rule
colours = matplotlib.colors.ListedColormap(["#dddddd", "#30307a", "#f5c400"])
step = 1
block = layout.chunk_len // 2 if layout.chunk_len % 2 == 0 else layout.chunk_len
fig, axes = plt.subplots(1, cp, figsize=(2 * cp, 2.4))
for r, ax in enumerate(axes):
    src = (r - step) % cp
    L = layout.local_seq_len
    q = Tokens(cpjax.local_token_indices(layout, r), {"document_ids": docs[:, r * L:(r + 1) * L]})
    k = Tokens(cpjax.local_token_indices(layout, src),
               {"document_ids": docs[:, src * L:(src + 1) * L]})
    allowed = np.asarray(rule.allowed(q, k))[0]                   # the token predicate
    visit = np.asarray(rule.classify(q, k, block, block).any)[0]  # the block map: non-empty
    skipped = np.kron(~visit, np.ones((block, block), bool))
    ax.imshow(np.where(skipped, 0, np.where(allowed, 2, 1)), cmap=colours, vmin=0, vmax=2,
              interpolation="nearest")
    ax.set_title(f"rank {r} <- {src}", fontsize=8); ax.set_xticks([]); ax.set_yticks([])
plt.suptitle(f"ring step {step}: queries (rows) x keys (columns): allowed (gold), computed "
             "but masked (navy), tiles skipped without work (grey)", fontsize=9)
plt.show()""",
  ),
  ("markdown", "## Ring attention equals dense attention"),
  (
    "code",
    r"""import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

rng = np.random.default_rng(1)
doc_ids = np.asarray(cpjax.shard_batch(batch, mesh, layout="contiguous")[0]["_packed_seq_ids"])
S = doc_ids.shape[1]
q = rng.standard_normal((1, S, 4, 16)).astype(np.float32)
k, v = (rng.standard_normal((1, S, 2, 16)).astype(np.float32) for _ in range(2))
for kind in ("contiguous", "load_balanced"):
    layout = cpjax.ShardLayout(S, S, cp, kind)
    order = cpjax.rank_order(layout)
    put = lambda x: jax.device_put(x[:, order], NamedSharding(mesh, P(None, "cp")))
    ring = jax.jit(jax.shard_map(
        lambda q, k, v, d: cpjax.ring_attention(q, k, v, layout=layout, document_ids=d,
                                                sliding_window=S // 3,
                                                implementation=implementation),
        mesh=mesh, in_specs=P(None, "cp"), out_specs=P(None, "cp")))
    out = np.asarray(ring(put(q), put(k), put(v), put(doc_ids)))[:, np.argsort(order)]
    ref = np.asarray(cpjax.reference_attention(q, k, v, document_ids=doc_ids,
                                               sliding_window=S // 3))
    print(f"{kind:>13}: max |ring - dense| = {np.abs(out - ref).max():.2e}")
    assert np.allclose(out, ref, atol=1e-4)""",
  ),
  (
    "markdown",
    "## Without shard_map: global arrays and a mask object\n\n"
    "`context_parallel_attention` takes global arrays in rank order and runs the "
    "ring itself; `to_rank_order` / `from_rank_order` move arrays between natural "
    "and rank order. The mask is an `AttentionMask`: a rule (here Gemma 4's "
    "sliding-layer vision rule, built from rules) and the per-token arrays it reads.",
  ),
  (
    "code",
    r"""layout = cpjax.ShardLayout(S, S, cp, "load_balanced")
to = lambda x: cpjax.to_rank_order(x, layout)
types = np.zeros((1, S), np.int32); types[:, S // 4:S // 2] = 1       # one image
groups = np.asarray(cpjax.vision_group_ids(types))
rule = (cpjax.LocalWindow(S // 8, None)                                # window behind ...
        & (cpjax.LocalWindow(None, 0) | cpjax.SameVisionGroup())      # ... causal, or same image
        & cpjax.SameDocument())
print(rule, "reach:", rule.reach(), "plan:", cpjax.ring_plan(layout, mask=rule))
mask = cpjax.AttentionMask(rule, {"document_ids": to(doc_ids), "vision_group_ids": to(groups)})
out = cpjax.context_parallel_attention(to(q), to(k), to(v), mesh=mesh, layout=layout, mask=mask,
                                       implementation=implementation)
print(f"ran the {implementation} per-hop implementation")
ref = cpjax.reference_attention(q, k, v, mask=cpjax.AttentionMask(
    rule, {"document_ids": doc_ids, "vision_group_ids": groups}))
print(f"max |ring - dense| = {np.abs(cpjax.from_rank_order(out, layout) - ref).max():.2e}")
assert np.allclose(cpjax.from_rank_order(out, layout), ref, atol=1e-4)""",
  ),
]

TRAINING = [
  (
    "markdown",
    "# Training with context parallelism\n\nTrain a tiny real-architecture Gemma 4 a "
    "few dozen steps with CP and on a single device, plot both loss curves, and "
    "show per-device memory against sequence length.",
  ),
  ("code", SETUP),
  (
    "code",
    r"""import time
import matplotlib.pyplot as plt
import numpy as np
import optax
from flax import nnx
from cpjax import training
from cpjax.models import gemma4

cp = mesh.shape["cp"]
steps = 3 if SMALL else 40
seq_len = 16 * cp if SMALL else 2 * max(tokens_per_rank, 64) * cp
cfg = gemma4.Gemma4Config.preset("tiny-moe" if SMALL else "tiny")
rng = np.random.default_rng(0)
batches = [gemma4.synthetic_batch(rng, cfg, batch_size=2, seq_len=seq_len) for _ in range(steps)]
model = gemma4.Gemma4(cfg, rngs=nnx.Rngs(0))
sharder = model.prepare_model_inputs_for_cp(layout="load_balanced")["cp_sharder"]
# Buffers (layer_scalar, clip bounds) are not trained: they ride along as `frozen`.
graphdef, params0, buffers = nnx.split(model, nnx.Param, ...)
opt = optax.adamw(3e-3)""",
  ),
  (
    "code",
    r"""# With CP: the aux streams are sharded, the model slices its own streams.
sharded = [sharder.shard_batch(b, mesh) for b in batches]
layout = sharded[0][1]
cp_step = training.make_train_step(graphdef, opt, mesh=mesh, layout=layout, frozen=buffers,
                                   implementation=implementation)
params, state = jax.tree.map(lambda x: x.copy(), params0), opt.init(params0)
cp_losses = []
for sb, _ in sharded:
    params, state, m = cp_step(params, state, sb)
    cp_losses.append(float(np.asarray(m["loss"].addressable_data(0))))

# Single device, dense attention, the same batches.
single_step = training.make_train_step(graphdef, opt, frozen=buffers)
p1 = jax.device_put(jax.tree.map(lambda x: x.copy(), params0), single_device)
s1 = jax.device_put(opt.init(params0), single_device)
single_losses = []
for b in batches:
    p1, s1, m = single_step(p1, s1, jax.device_put(gemma4.prepare_batch(b, cfg), single_device))
    single_losses.append(float(m["loss"]))

plt.plot(single_losses, "o-", label="single device (dense attention)")
plt.plot(cp_losses, "x--", label=f"cp={cp} ring attention, load-balanced")
plt.xlabel("step"); plt.ylabel("token-mean cross entropy"); plt.legend(); plt.show()
rel = np.abs(np.subtract(cp_losses, single_losses)) / np.abs(single_losses)
print("largest relative |loss difference|:", rel.max())
# Step 1 starts both runs from the same parameters: on CPU devices the two paths
# differ only in float32 summation order (7e-8 measured). Later steps compound
# that through Adam, which divides each gradient by its own running magnitude:
# where a gradient is near zero, summation-order noise becomes a full-size
# step (and MoE routing can flip). Measured at the suite's size (3 steps,
# tiny-moe, AdamW): 4.7e-5 on one CPU, 1.4e-3 on another (2e-7 with SGD). A
# chip's matmuls run at their own precision, hence the looser bound there.
on_cpu = single_device.platform == cp_devices[0].platform == "cpu"
assert rel[0] < (1e-6 if on_cpu else 2e-2), rel
if SMALL and on_cpu:
    assert rel.max() < 1e-2, rel""",
  ),
  (
    "markdown",
    "## Per-device memory against sequence length\n\nThe compiled training "
    "step's scratch memory per device (`memory_analysis()`), with CP and with the "
    "dense single-device path.",
  ),
  (
    "code",
    r"""# The test suite (SMALL) compiles one length; a real run draws the curve.
lengths = [16 * cp] if SMALL else [n * max(tokens_per_rank, 64) * cp for n in (2, 4, 8)]
rows = []
for s in lengths:
    b = gemma4.synthetic_batch(np.random.default_rng(1), cfg, batch_size=2, seq_len=s)
    sb, lay = sharder.shard_batch(b, mesh)
    st = training.make_train_step(graphdef, opt, mesh=mesh, layout=lay, frozen=buffers,
                                  implementation=implementation)
    cp_mib = st.compile(params0, opt.init(params0), sb).memory_analysis().temp_size_in_bytes / 2**20
    dense = training.make_train_step(graphdef, opt, frozen=buffers).compile(
        params0, opt.init(params0), gemma4.prepare_batch(b, cfg))
    rows.append((s, cp_mib, dense.memory_analysis().temp_size_in_bytes / 2**20))
s_, cp_m, dense_m = zip(*rows)
plt.loglog(s_, cp_m, "o-", base=2, label=f"cp={cp} (per device)")
plt.loglog(s_, dense_m, "s-", base=2, label="single device, dense")
plt.xlabel("sequence length"); plt.ylabel("scratch MiB"); plt.legend(); plt.show()
for r in rows:
    print("S=%6d  cp %8.1f MiB  dense %8.1f MiB" % r)""",
  ),
]


def build(cells, name):
  nb = nbformat.v4.new_notebook()
  nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
  nb.cells = [
    nbformat.v4.new_markdown_cell(src) if kind == "markdown" else nbformat.v4.new_code_cell(src)
    for kind, src in cells
  ]
  # Cell ids from the cell's place and source, so a rebuild changes only
  # the cells that changed (nbformat draws them at random).
  for i, cell in enumerate(nb.cells):
    cell.id = hashlib.sha1(f"{name}:{i}:{cell.source}".encode()).hexdigest()[:8]
  nbformat.write(nb, HERE / name)


if __name__ == "__main__":
  build(QUICKSTART, "quickstart.ipynb")
  build(TRAINING, "training.ipynb")
  print("wrote", HERE / "quickstart.ipynb", HERE / "training.ipynb")
