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
  as a share of the chip's memory.
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
    source = np.asarray(sharded.get("_source_index", cpjax.rank_order(layout)[None]))[0]
    owner = np.zeros(layout.padded_seq_len, int)
    owner[source] = np.arange(layout.padded_seq_len) // layout.local_seq_len
    ax.imshow(owner[None], aspect="auto", cmap="tab10", interpolation="nearest")
    docs = np.zeros(layout.padded_seq_len, int)
    docs[source] = np.asarray(sharded["_packed_seq_ids"])[0]
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


FIGURES = {
  "figures/layouts.png": layouts,
  "figures/ring-step.png": ring_step,
  "figures/strategies.png": strategies,
  "figures/recipes-memory.png": recipes_memory,
}
