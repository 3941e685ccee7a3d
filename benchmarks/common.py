"""Shared benchmark plumbing: device setup, timing, tables, JSON."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def setup_devices(n: int = 8) -> None:
  """Emulate ``n`` CPU devices unless an accelerator platform is requested."""
  import jax

  if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
    jax.config.update("jax_num_cpu_devices", n)


def median_time(fn, *, repeats: int = 5, warmup: int = 1) -> float:
  """Median wall seconds of ``fn()`` (which must block until its work is done)."""
  for _ in range(warmup):
    fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def machine() -> dict:
  import jax

  return {
    "platform": jax.devices()[0].platform,
    "device_kind": jax.devices()[0].device_kind,
    "devices": len(jax.devices()),
    "cpu_count": os.cpu_count(),
    "python": platform.python_version(),
    "jax": jax.__version__,
  }


def print_table(rows: list[dict], columns: list[str]) -> None:
  widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
  print("  ".join(c.ljust(widths[c]) for c in columns))
  print("  ".join("-" * widths[c] for c in columns))
  for r in rows:
    print("  ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns))


def _fmt(v) -> str:
  if isinstance(v, float):
    return f"{v:.4g}"
  return "" if v is None else str(v)


def write_json(name: str, payload: dict) -> Path:
  RESULTS.mkdir(parents=True, exist_ok=True)
  path = RESULTS / f"{name}.json"
  path.write_text(json.dumps({"machine": machine(), **payload}, indent=2) + "\n")
  return path
