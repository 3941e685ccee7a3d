"""The machine a command runs on: emulated CPU devices, and the memory one device may use."""

from __future__ import annotations

import os
import sys

from cpjax.training.targets import has_device_nodes


def cpu_unless_accelerators() -> None:
  """Run JAX on the CPU alone on a machine with no TPU or GPU device node.

  That is ``JAX_PLATFORMS=cpu``, unless the user chose: libtpu and the CUDA
  plugin, installed to compile for chips (``cpjax plan --target``), would
  otherwise probe for chips at start-up and print errors about the ones not
  there. Must run before JAX initialises.
  """
  if "JAX_PLATFORMS" not in os.environ and not has_device_nodes():
    os.environ["JAX_PLATFORMS"] = "cpu"
    # jax reads the variable when it is imported, and the command's modules
    # import it before this runs: set its flag too (read when the backends
    # start, on the first device query).
    if "jax" in sys.modules:
      sys.modules["jax"].config.update("jax_platforms", "cpu")


def use_cpu_devices(n: int, *, collectives: str | None = None) -> None:
  """Emulate ``n`` CPU devices (per process); must run before JAX initialises.

  The setting only shapes the CPU backend: when JAX finds TPU or GPU chips it
  uses them and ignores it (``JAX_PLATFORMS=cpu`` forces the CPU).
  """
  if os.environ.get("JAX_PLATFORMS", "") in ("", "cpu"):
    import jax

    jax.config.update("jax_num_cpu_devices", n)
    if collectives:
      jax.config.update("jax_cpu_collectives_implementation", collectives)


def available_memory() -> tuple[int | None, str]:
  """Return the bytes one training device may use, and what they are.

  They are an accelerator's own limit, or on the CPU backend the host's
  available memory, which every emulated device shares.

  Returns:
    (bytes one training device may use, what they are).
  """
  import jax

  device = jax.devices()[0]
  if device.platform != "cpu":
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    return (int(limit) if limit else None), f"{device.device_kind} memory"
  try:
    with open("/proc/meminfo") as f:
      info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024, "available host memory"
  except (OSError, KeyError, ValueError):
    pages = os.sysconf("SC_AVPHYS_PAGES") if hasattr(os, "sysconf") else None
    return (pages * os.sysconf("SC_PAGE_SIZE") if pages else None), "available host memory"
