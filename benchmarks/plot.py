"""PNG plots from the benchmarks' JSON (benchmarks/results/*.json).

    python benchmarks/plot.py      # writes benchmarks/results/*.png

* ``ring_speedup.png``: forward+backward time per case and method (ring benchmark);
* ``speedup_vs_peers.png``: cpjax's speedup over each peer, per case;
* ``memory_vs_seq_len.png``: per-device scratch memory against S (ring attention
  alone, and the whole training step of the long-context benchmark);
* ``step_time_vs_seq_len.png``: training-step time against S, cp=8 vs one device.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _load(name):
  path = RESULTS / f"{name}.json"
  return json.loads(path.read_text()) if path.exists() else None


def plot_ring(plt, ring):
  rows = [r for r in ring["rows"] if "fwd_bwd_s" in r]
  cases = list(dict.fromkeys(r["case"] for r in rows))
  methods = list(dict.fromkeys(f"{r['method']} ({r['layout']})" for r in rows))
  fig, ax = plt.subplots(figsize=(10, 4.5))
  width = 0.8 / len(methods)
  for m_i, method in enumerate(methods):
    xs, ys = [], []
    for c_i, case in enumerate(cases):
      for r in rows:
        if r["case"] == case and f"{r['method']} ({r['layout']})" == method:
          xs.append(c_i + m_i * width)
          ys.append(r["fwd_bwd_s"])
    ax.bar(xs, ys, width, label=method)
  ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))], cases)
  ax.set_yscale("log")
  ax.set_ylabel("forward+backward seconds (log)")
  ax.set_title("Ring attention, B1 H8 D64 fp32, 8 emulated CPU devices")
  ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  fig.savefig(RESULTS / "ring_speedup.png", dpi=120)


def plot_speedups(plt, ring):
  """cpjax's forward+backward speedup over each peer, per case (one run)."""

  def t(case, method, layout):
    for r in ring["rows"]:
      if (r["case"], r["method"], r["layout"]) == (case, method, layout) and "fwd_bwd_s" in r:
        return r["fwd_bwd_s"]
    return None

  window = next(r["case"] for r in ring["rows"] if r["case"].startswith("window"))
  pairs = [
    (
      "causal vs ringattention",
      t("causal", "ringattention", "contiguous"),
      t("causal", "cpjax", "load_balanced"),
    ),
    (
      "causal vs all-gather KV",
      t("causal", "all-gather KV", "contiguous"),
      t("causal", "cpjax", "load_balanced"),
    ),
    (
      "causal vs dense 1 device",
      t("causal", "dense 1 device", "-"),
      t("causal", "cpjax", "load_balanced"),
    ),
    (
      "16 docs vs ringattention",
      t("16 docs", "ringattention", "contiguous"),
      t("16 docs", "cpjax", "load_balanced"),
    ),
    (
      "GQA vs ringattention",
      t("GQA Hkv=2", "ringattention", "contiguous"),
      t("GQA Hkv=2", "cpjax", "load_balanced"),
    ),
    (
      f"{window} vs no window",
      t("no window", "cpjax", "load_balanced"),
      t(window, "cpjax", "load_balanced"),
    ),
  ]
  pairs = [(name, peer / ours) for name, peer, ours in pairs if peer and ours]
  fig, ax = plt.subplots(figsize=(8, 4))
  bars = ax.barh([p[0] for p in pairs], [p[1] for p in pairs], color="tab:blue")
  ax.bar_label(bars, fmt="%.1fx", fontsize=8)
  ax.axvline(1.0, color="k", lw=0.8)
  ax.set_xscale("log")
  ax.set_xlabel("speedup of cpjax (load-balanced), forward+backward (log)")
  ax.set_title("cpjax against its peers, same run")
  fig.tight_layout()
  fig.savefig(RESULTS / "speedup_vs_peers.png", dpi=120)


def plot_memory(plt, ring, long_ctx):
  fig, ax = plt.subplots(figsize=(7, 4.5))
  if ring:
    mem = ring["memory"]
    s = [m["S"] for m in mem]
    for key, label in (
      ("cpjax_mib", "cpjax ring attention"),
      ("allgather_mib", "all-gather KV"),
      ("ringattention_mib", "ringattention 0.1.2"),
    ):
      if key in mem[0]:
        ax.plot(s, [m[key] for m in mem], "o-", label=f"{label} (attention fwd+bwd)")
  if long_ctx:
    for mode in ("cp=8 ring", "1 device dense"):
      pts = [
        (r["S"], r["scratch_mib"])
        for r in long_ctx["rows"]
        if r["mode"] == mode and "scratch_mib" in r
      ]
      if pts:
        ax.plot(*zip(*pts), "s--", label=f"training step, {mode}")
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("sequence length S")
  ax.set_ylabel("per-device scratch MiB (memory_analysis)")
  ax.set_title("Per-device memory against sequence length")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(RESULTS / "memory_vs_seq_len.png", dpi=120)


def plot_step_time(plt, long_ctx):
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for mode in ("cp=8 ring", "1 device dense"):
    pts = [(r["S"], r["step_s"]) for r in long_ctx["rows"] if r["mode"] == mode and "step_s" in r]
    if pts:
      ax.plot(*zip(*pts), "o-", label=mode)
    failed = [r["S"] for r in long_ctx["rows"] if r["mode"] == mode and r.get("status") != "ok"]
    for s in failed:
      ax.axvline(s, ls=":", color="gray")
      ax.text(s, ax.get_ylim()[1] * 0.5, f" {mode}: out of memory", fontsize=7, rotation=90)
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("sequence length S")
  ax.set_ylabel("training step seconds")
  ax.set_title("Tiny Gemma4-style model, one training step, 24 GiB / 2 cores")
  ax.legend()
  fig.tight_layout()
  fig.savefig(RESULTS / "step_time_vs_seq_len.png", dpi=120)


def main():
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  ring, long_ctx = _load("ring_attention"), _load("long_context")
  if ring is None and long_ctx is None:
    sys.exit("no benchmark JSON under benchmarks/results: run the benchmarks first")
  if ring:
    plot_ring(plt, ring)
    plot_speedups(plt, ring)
  plot_memory(plt, ring, long_ctx)
  if long_ctx:
    plot_step_time(plt, long_ctx)
  print("wrote", ", ".join(p.name for p in sorted(RESULTS.glob("*.png"))))


if __name__ == "__main__":
  main()
