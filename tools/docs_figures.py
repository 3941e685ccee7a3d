"""The docs' pictures, drawn from the code itself at each build (``make docs``,
through tools/docs_hooks.py): what they show is what cpjax does today.

* ``layouts.png``: which rank holds which tokens of one packed row, in each
  layout (``shard_batch`` on 8 CPU devices; lines are document boundaries);
* ``ring-step.png``: one ring step's tile map on each rank (queries x keys):
  allowed pairs, pairs computed but masked, and tiles skipped without work,
  from the mask rule's token predicate and block classifier;
* ``strategies.png``: the bytes each rank sends in one attention layer's
  forward and backward, per CP strategy and cp size, for Gemma 4's layer
  kinds (``cpjax.training.cp_strategy.bytes_sent``), and the one the rule picks;
* ``recipes-memory.png``: each published-size recipe's memory a chip, by the
  plan's closed form and by its chips' compiler (the recipe file's notes),
  as a share of the chip's memory;
* ``slice-hosts.png``: TPU slices drawn as hosts x chips at their torus
  coordinates, each chip labelled with its place in the run's mesh and the
  ring's hops drawn between them (libtpu's compile-only devices of the
  target, ``cpjax.make_mesh`` on them, as ``cpjax plan --target`` lays them out).
"""

from __future__ import annotations

import io

import numpy as np


def _png(fig) -> bytes:
  out = io.BytesIO()
  fig.savefig(out, format="png", dpi=110, bbox_inches="tight")
  return out.getvalue()


def _row(cp: int, tokens_per_rank: int):
  import jax

  import cpjax
  from cpjax.models import gemma4

  mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices("cpu")[:cp])
  batch = gemma4.synthetic_batch(
    np.random.default_rng(0),
    gemma4.Gemma4Config.preset("tiny"),
    batch_size=1,
    seq_len=tokens_per_rank * cp,
    max_docs=4,
  )
  return cpjax, mesh, batch


def layouts(cp: int = 8, tokens_per_rank: int = 64) -> bytes:
  """One packed row over ``cp`` ranks in each layout: colour = owning rank."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  cpjax, mesh, batch = _row(cp, tokens_per_rank)
  kinds = cpjax.batch.LAYOUT_KINDS
  fig, axes = plt.subplots(len(kinds), 1, figsize=(10, 1.1 * len(kinds)), sharex=True)
  for ax, kind in zip(axes, kinds):
    sharded, layout = cpjax.shard_batch(batch, mesh, layout=kind)
    ax.imshow(
      cpjax.token_ranks(sharded, layout), aspect="auto", cmap="tab10", interpolation="nearest"
    )
    docs = np.asarray(batch["_packed_seq_ids"])[0]  # (and 0 for the padding)
    docs = np.pad(docs, (0, layout.padded_seq_len - docs.size))
    for t in np.flatnonzero(np.diff(docs)) + 0.5:
      ax.axvline(t, color="k", lw=0.8)
    ax.set_yticks([])
    ax.set_ylabel(kind, rotation=0, ha="right")
  axes[-1].set_xlabel("token of the row (colour: the rank that holds it; lines: documents)")
  fig.tight_layout()
  data = _png(fig)
  plt.close(fig)
  return data


def ring_step(cp: int = 8, tokens_per_rank: int = 64, step: int = 1) -> bytes:
  """Ring step ``step`` of a causal, document-masked row in the load-balanced layout."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  from cpjax.masks import Tokens

  cpjax, mesh, batch = _row(cp, tokens_per_rank)
  sharded, layout = cpjax.shard_batch(batch, mesh, layout="load_balanced")
  docs = np.asarray(sharded["_packed_seq_ids"])  # rank r at [r*L, (r+1)*L)
  rule = cpjax.AttentionMask.create(causal=True, document_ids=docs).rule
  colours = matplotlib.colors.ListedColormap(["#dddddd", "#30307a", "#f5c400"])
  block = layout.chunk_len // 2
  size = layout.local_seq_len
  fig, axes = plt.subplots(1, cp, figsize=(2 * cp, 2.4))
  for r, ax in enumerate(axes):
    src = (r - step) % cp
    q = Tokens(
      cpjax.local_token_indices(layout, r), {"document_ids": docs[:, r * size : (r + 1) * size]}
    )
    k = Tokens(
      cpjax.local_token_indices(layout, src),
      {"document_ids": docs[:, src * size : (src + 1) * size]},
    )
    allowed = np.asarray(rule.allowed(q, k))[0]
    visit = np.asarray(rule.classify(q, k, block, block).any)[0]
    skipped = np.kron(~visit, np.ones((block, block), bool))
    ax.imshow(
      np.where(skipped, 0, np.where(allowed, 2, 1)),
      cmap=colours,
      vmin=0,
      vmax=2,
      interpolation="nearest",
    )
    ax.set_title(f"rank {r} <- rank {src}", fontsize=8)
    ax.set_xticks([])
    ax.set_yticks([])
  fig.suptitle(
    f"ring step {step}: queries (rows) x keys (columns): allowed (gold), computed but "
    "masked (navy), tiles skipped without work (grey)",
    fontsize=9,
  )
  data = _png(fig)
  plt.close(fig)
  return data


def strategies(seq_len: int = 131072) -> bytes:
  """Bytes a rank sends per strategy and cp, for E2B's and 26B-A4B's layer kinds."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  from cpjax.models.gemma4 import Gemma4Config
  from cpjax.training import cp_strategy

  cps = (2, 4, 8, 16, 32)
  panels = [(m, kind) for m in ("e2b", "a4b") for kind in ("sliding_attention", "full_attention")]
  fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2), sharey=True)
  for ax, (model, kind) in zip(axes, panels):
    text = Gemma4Config.preset(model).text
    hq, hkv, dh, window = cp_strategy._kind_shapes(text, kind, 1)
    for strategy, colour in zip(cp_strategy.STRATEGIES, ("C0", "C1", "C2", "C3")):
      xs, ys = [], []
      for cp in cps:
        try:
          sent, _ = cp_strategy.bytes_sent(
            strategy, seq_len=seq_len, cp=cp, q_heads=hq, kv_heads=hkv, head_dim=dh, window=window
          )
        except ValueError:  # the heads do not allow it at this cp
          continue
        xs.append(cp)
        ys.append(sent / 2**20)
      ax.plot(xs, ys, "o-", color=colour, label=strategy)
    picked = [cp_strategy.choose(text, seq_len=seq_len, cp=cp)[kind].strategy for cp in cps]
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(cps, [f"{c}\n{p}" for c, p in zip(cps, picked)], fontsize=7)
    ax.set_title(f"{model} {kind.split('_')[0]} (Hq {hq}, Hkv {hkv}, D {dh})", fontsize=9)
    ax.set_xlabel("cp, and the rule's pick", fontsize=8)
  axes[0].set_ylabel(f"MiB a rank sends, S = {seq_len}")
  axes[-1].legend(fontsize=8)
  fig.tight_layout()
  data = _png(fig)
  plt.close(fig)
  return data


def recipes_memory() -> bytes:
  """Closed form and compiler, a chip, against its memory, for every recipe."""
  import re

  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  from cpjax import recipes
  from cpjax.training import plan

  rows = []
  for name, recipe in sorted(recipes.RECIPES.items()):
    if recipe.device_memory is None:
      continue
    with open(recipes.path(name)) as f:
      notes = f.read()
    form = re.search(r"^# planned by .* total ([0-9.]+ [KMG]iB) ", notes, re.M)
    by = re.search(r"^# compiled by XLA:\w+ .*?: ([0-9.]+ GiB) per device", notes, re.M)
    memory = plan.parse_bytes(recipe.device_memory)
    share = lambda m: plan.parse_bytes(m.group(1).replace(" ", "")) / memory if m else None
    rows.append((f"{name} ({recipe.target})", share(form), share(by)))
  fig, ax = plt.subplots(figsize=(8, 0.28 * len(rows) + 1))
  y = np.arange(len(rows))
  ax.barh(y - 0.2, [r[1] or 0 for r in rows], 0.4, label="closed form", color="C7")
  ax.barh(y + 0.2, [r[2] or 0 for r in rows], 0.4, label="the chip's compiler", color="C0")
  ax.axvline(1.0, color="C3", lw=1)
  ax.set_yticks(y, [r[0] for r in rows], fontsize=7)
  ax.invert_yaxis()
  ax.set_xlabel("memory a chip, as a share of the chip's (red: all of it)")
  ax.legend(fontsize=8, loc="lower right")
  fig.tight_layout()
  data = _png(fig)
  plt.close(fig)
  return data


# The slices drawn: the README's multi-host run, a 3-D v5p slice, and a mesh
# of three axes on the same v5e slice as the first.
SLICES = (
  ("a4b-qlora-128k-v5e", "v5e-16", "cp=16,ep=16"),
  ("a4b-lora-256k-v5p", "v5p-16", "cp=8"),
  ("a mesh of three axes", "v5e-16", "fsdp=2,cp=4,tp=2"),
)


def slice_hosts(slices=SLICES) -> bytes:
  """Each of ``slices`` (title, target, mesh) as hosts x chips with its mesh and ring."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  from cpjax import parallel
  from cpjax.training.targets import parse_target

  fig, axes = plt.subplots(1, len(slices), figsize=(5.2 * len(slices), 5.4))
  for ax, (title, name, mesh_text) in zip(axes, slices):
    target = parse_target(name)
    sizes = {k: v for k, v in parallel.parse_mesh(mesh_text).items() if k != "ep"}
    mesh = parallel.make_mesh(**sizes, devices=target.devices())
    # A 3-D slice's z planes side by side, one column apart.
    nx = max(d.coords[0] for d in mesh.devices.flat) + 1
    at = {d.id: (d.coords[0] + d.coords[2] * (nx + 1), d.coords[1]) for d in mesh.devices.flat}
    for index, d in np.ndenumerate(mesh.devices):
      x, y = at[d.id]
      ax.add_patch(
        plt.Rectangle(
          (x - 0.42, y - 0.42), 0.84, 0.84, color=plt.cm.Pastel1(d.process_index), ec="k"
        )
      )
      label = "\n".join(f"{axis} {i}" for axis, i in zip(mesh.axis_names, index))
      ax.text(x, y, label, ha="center", va="center", fontsize=7)
    # The ring: cp rank r sends its K/V to rank r + 1 (the last to the first),
    # in every group of the other axes; drawn for the first group.
    cp_axis = mesh.axis_names.index("cp")
    ring = np.moveaxis(mesh.devices, cp_axis, -1).reshape(-1, mesh.shape["cp"])[0]
    for a, b in zip(ring, np.roll(ring, -1)):
      # A hop between z planes (dashed) is one link of the torus's third dimension.
      style = "--" if a.coords[2] != b.coords[2] else "-"
      arrow = dict(arrowstyle="->", color="C3", lw=1.2, ls=style, shrinkA=11, shrinkB=11)
      ax.annotate("", at[b.id], at[a.id], arrowprops=dict(arrow, connectionstyle="arc3,rad=0.25"))
    hosts = len({d.process_index for d in mesh.devices.flat})
    planes = " (z planes side by side)" if len(target.shape) == 3 else ""
    ax.set_title(
      f"{title}\n{name}: topology {target.topology.split(':')[-1]}{planes}, "
      f"{hosts} hosts of {len(at) // hosts} chips\nmesh {mesh_text}",
      fontsize=9,
    )
    xs, ys = zip(*at.values())
    ax.set_xlim(min(xs) - 0.6, max(xs) + 0.6)
    ax.set_ylim(max(ys) + 0.6, min(ys) - 0.6)
    ax.set_aspect("equal")
    ax.axis("off")
  fig.text(
    0.5,
    0.02,
    "colour: the host (one cpjax process each); text: the chip's place in the mesh; "
    "red arrows: the ring's hops along cp (first group of the other axes; dashed: a z link)",
    ha="center",
    fontsize=9,
  )
  data = _png(fig)
  plt.close(fig)
  return data


FIGURES = {
  "figures/layouts.png": layouts,
  "figures/ring-step.png": ring_step,
  "figures/strategies.png": strategies,
  "figures/recipes-memory.png": recipes_memory,
  "figures/slice-hosts.png": slice_hosts,
}
