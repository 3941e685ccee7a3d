"""What ptxas says of the GPU kernels: registers, spills and stack per kernel.

XLA:GPU turns the Triton kernels into PTX and ptxas into machine code, but
reports neither. :func:`kernel_usage` compiles a lowered program again with
XLA's PTX dumped, and runs ptxas (from ``nvidia-cuda-nvcc-cu12``, which
``pip install 'cpjax[cuda-compiler]'`` brings) with ``-v`` on each module holding a
kernel of cpjax's: a kernel whose tiles do not fit the registers spills to
local memory, which on Hopper costs as much as the HBM reads the tile was
meant to save. No GPU is needed.

>>> parse_usage('''ptxas info    : Compiling entry function 'cpjax_ring_dq' for 'sm_90a'
... ptxas info    : Function properties for cpjax_ring_dq
...     8 bytes stack frame, 4 bytes spill stores, 8 bytes spill loads
... ptxas info    : Used 255 registers, used 1 barriers, 8 bytes cumulative stack size''')
{'cpjax_ring_dq': Usage(registers=255, spill_stores=4, spill_loads=8, stack=8)}
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from typing import NamedTuple

import jax

__all__ = ["Usage", "kernel_usage", "parse_usage", "ptxas"]

_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


class Usage(NamedTuple):
  """One kernel's resources as ptxas reports them (bytes; registers per thread)."""

  registers: int
  spill_stores: int
  spill_loads: int
  stack: int


def ptxas() -> str:
  """Return the path of the ptxas that ``nvidia-cuda-nvcc-cu12`` installs (else the one on PATH)."""
  spec = importlib.util.find_spec("nvidia.cuda_nvcc")
  for root in (spec.submodule_search_locations or []) if spec else []:
    path = os.path.join(root, "bin", "ptxas")
    if os.path.exists(path):
      return path
  found = shutil.which("ptxas")
  if found is None:
    raise FileNotFoundError(
      "no ptxas: pip install 'cpjax[cuda]' or 'cpjax[cuda-compiler]' (nvidia-cuda-nvcc-cu12)"
    )
  return found


def parse_usage(report: str, prefix: str = "cpjax_") -> dict[str, Usage]:
  """Parse the usage of the entry functions named ``prefix...`` in ptxas -v's output.

  Args:
    report: ptxas -v's output.
    prefix: the kernels' name prefix.

  Returns:
    ``{kernel: Usage}``.
  """
  out: dict[str, Usage] = {}
  name, spill = None, (0, 0, 0)
  for line in report.splitlines():
    if m := _ENTRY.search(line):
      name, spill = m.group(1), (0, 0, 0)
    elif name and (m := _SPILL.search(line)):
      spill = tuple(int(g) for g in m.groups())
    elif name and (m := _REGS.search(line)):
      if name.startswith(prefix):
        out[name] = Usage(int(m.group(1)), spill[1], spill[2], spill[0])
      name = None
  return out


def kernel_usage(lowered: jax.stages.Lowered, *, arch: str = "sm_90a") -> dict[str, Usage]:
  """Return the ``{kernel: Usage}`` of every cpjax kernel in ``lowered``.

  Compiles ``lowered`` again with XLA's PTX dumped to a scratch folder.

  Args:
    lowered: a ``jax.stages.Lowered`` for a CUDA target.
    arch: ptxas's ``-arch``.

  Returns:
    ``{kernel: Usage}``, the worst of each name's copies.
  """
  worst: dict[str, Usage] = {}
  with tempfile.TemporaryDirectory(prefix="cpjax-ptx-") as folder:
    lowered.compile(compiler_options={"xla_dump_to": folder})
    for path in sorted(glob.glob(os.path.join(folder, "*.ptx"))):
      with open(path) as f:
        if "cpjax_" not in f.read():
          continue
      run = subprocess.run(
        [ptxas(), f"-arch={arch}", "-v", path, "-o", os.devnull],
        capture_output=True,
        text=True,
        check=True,
      )
      for name, usage in parse_usage(run.stdout + run.stderr).items():
        if name not in worst or usage.spill_stores > worst[name].spill_stores:
          worst[name] = usage
  return worst
