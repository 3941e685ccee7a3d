"""The step time a compiled program implies on a chip, before renting one.

From the program's text (:class:`cpjax.training.hlo.Program`: every loop its
trips) and the chip's published figures (:class:`cpjax.training.targets.Chip`):

* compute: the matmul FLOPs and the Pallas kernels' own estimates, over the
  chip's peak (bfloat16, dense);
* memory: the bytes the program reads and writes (``cost_analysis()``'s, a
  loop's body once, plus the kernels' estimates for their other trips), over
  the chip's HBM bandwidth;
* collectives: each one's output bytes over the chip's interconnect
  bandwidth (ICI on TPUs, NVLink on GPUs); *hidden* where the compiled
  schedule runs work between its start and done, *exposed* otherwise.

The step takes ``max(compute, memory) + exposed``: the roofline of the
chip's busiest unit, plus the communication nothing hides. MFU is the
program's FLOPs over what the chip could do in that time (the recompute a
remat adds counts, as the program runs it); tokens/s are the step's tokens
over it. A bound and a model, not a measurement: kernels reach a fraction of
peak (``benchmarks/accelerator.py`` times them), and the interconnect figure
is a chip's total, shared by its links.

>>> from cpjax.training.targets import CHIPS
>>> one_matmul = '''ENTRY %main (a: bf16[4096,4096]) -> f32[4096,4096] {
...   %a = bf16[4096,4096]{1,0} parameter(0)
...   ROOT %d = f32[4096,4096]{1,0} dot(%a, %a), lhs_contracting_dims={1}
... }'''
>>> step = step_time(Program.parse(one_matmul), CHIPS["h100"], tokens=4096, devices=1, cost=None)
>>> round(step.flops / 1e9), round(step.seconds * 1e6)   # 2 * 4096**3 at 989 TFLOP/s
(137, 139)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from cpjax.training.hlo import Program

if TYPE_CHECKING:
  from cpjax.training.targets import Chip

__all__ = ["StepTime", "step_time"]


@dataclasses.dataclass(frozen=True)
class StepTime:
  """One device's step on a chip, by the model above (seconds, FLOPs, bytes).

  Attributes:
    flops: matmul and kernel FLOPs a step.
    kernel_flops: the part of ``flops`` in the Pallas kernels' estimates.
    hbm_bytes: bytes read and written.
    collective_bytes: {kind: output bytes} a step.
    compute: ``flops`` over the chip's peak.
    memory: ``hbm_bytes`` over its HBM bandwidth.
    hidden, exposed: collectives' time with work beside them, and without.
    seconds: ``max(compute, memory) + exposed``.
    tokens: tokens a step (the whole batch, every device's).
    devices: devices the step runs on.
  """

  flops: float
  kernel_flops: float
  hbm_bytes: float
  collective_bytes: dict
  compute: float
  memory: float
  hidden: float
  exposed: float
  seconds: float
  tokens: int
  devices: int

  @property
  def mfu(self) -> float:
    """The share of the chips' peak the step's FLOPs take in ``seconds``."""
    return self.compute / self.seconds if self.seconds else 0.0

  @property
  def tokens_per_second(self) -> float:
    return self.tokens / self.seconds if self.seconds else 0.0

  def summary(self) -> str:
    """Say in one line the time, what bounds it, tokens/s and MFU."""
    bound = "compute" if self.compute >= self.memory else "HBM"
    return (
      f"{_seconds(self.seconds)} a step = max(compute {_seconds(self.compute)} "
      f"[{self.flops / 1e12:.3g} TFLOP], HBM {_seconds(self.memory)} "
      f"[{self.hbm_bytes / 1e9:.3g} GB]) + exposed collectives {_seconds(self.exposed)} "
      f"(hidden {_seconds(self.hidden)}); {bound}-bound, {self.tokens:,} tokens a step, "
      f"{self.tokens_per_second:,.0f} tokens/s, MFU {100 * self.mfu:.1f}%"
    )


def _seconds(t: float) -> str:
  return f"{t * 1e3:.3g} ms" if t < 1 else f"{t:.3g} s"


def step_time(
  program: Program, chip: Chip, *, tokens: int, devices: int, cost: dict | None
) -> StepTime:
  """Return the :class:`StepTime` of a compiled program on ``chip``.

  Args:
    program: the compiled program, read.
    chip: a :class:`cpjax.training.targets.Chip` with its figures.
    tokens: tokens one step trains on (all devices).
    devices: devices it runs on.
    cost: ``compiled.cost_analysis()`` (None where the compiler gives none:
      the bytes are then the kernels' alone).

  Returns:
    The step time, per device.

  Raises:
    ValueError: the chip lacks a figure the model needs (naming them).
  """
  missing = chip.missing_figures()
  if missing:
    raise ValueError(
      f"{chip.name} has no {', '.join(missing)} figure: the step time needs the chip's peak "
      f"FLOP/s, HBM bandwidth and interconnect bandwidth (cpjax.training.targets.CHIPS)"
    )
  # Every figure is set (none missing, checked above).
  peak_flops, hbm_bandwidth, link_bandwidth = (
    chip.peak_flops,
    chip.hbm_bandwidth,
    chip.link_bandwidth,
  )
  assert peak_flops is not None and hbm_bandwidth is not None and link_bandwidth is not None
  kernels = program.kernel_costs()
  flops = program.matmul_flops() + kernels["flops"]
  hbm = kernels["bytes_accessed"]
  if cost:  # it holds each kernel call site once: add the rest, the kernels' other trips
    once = sum(
      i.cost_estimate().get("bytes_accessed", 0.0)
      for body in program.computations.values()
      for i in body
      if i.opcode == "custom-call"
    )
    hbm += cost.get("bytes accessed", 0.0) - once
  hidden = exposed = 0.0
  moved: dict[str, float] = {}
  for c in program.async_collectives():
    seconds = c.bytes * c.executions / link_bandwidth
    moved[c.kind] = moved.get(c.kind, 0.0) + c.bytes * c.executions
    if c.between:
      hidden += seconds
    else:
      exposed += seconds
  compute, memory = flops / peak_flops, hbm / hbm_bandwidth
  return StepTime(
    flops,
    kernels["flops"],
    hbm,
    moved,
    compute,
    memory,
    hidden,
    exposed,
    max(compute, memory) + exposed,
    tokens,
    devices,
  )
