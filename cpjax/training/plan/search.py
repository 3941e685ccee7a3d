"""Searching meshes and slices: the smallest that the plan says fits.

:func:`best_mesh` estimates every fsdp x cp mesh of a device count and keeps
the smallest; :func:`smallest_mesh` doubles the devices until one fits;
:func:`smallest_slice` compiles a chip's slices for that chip
(``cpjax plan --target v5e``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cpjax.training.plan.closed_form import estimate
from cpjax.training.plan.compiled import compiled_plan
from cpjax.training.plan.shape import Plan, StepShape

if TYPE_CHECKING:
  from cpjax.models.gemma4.config import Gemma4Config
  from cpjax.training.run_config import RunConfig
  from cpjax.training.targets import Chip

__all__ = ["SMALLER_SLICE_SLACK", "best_mesh", "smallest_mesh", "smallest_slice"]


def _meshes(
  cfg, devices: int, seq_len: int, expert_parallel: bool, batch_size: int | None
) -> list[dict]:
  """List the fsdp x cp meshes of ``devices`` devices the rows split over:
  fsdp dividing ``batch_size`` where one is given; with ``expert_parallel``,
  the largest ep dividing the experts folded onto ``cp * fsdp``, ``cp`` or
  ``fsdp``."""
  meshes = []
  for cp_log in range(int(math.log2(devices)) + 1):
    cp = 2**cp_log
    fsdp = devices // cp
    if seq_len % (2 * cp) or cfg.text.num_attention_heads == 0 or (batch_size or fsdp) % fsdp:
      continue
    mesh = {"fsdp": fsdp, "cp": cp} if fsdp > 1 else {"cp": cp}
    if expert_parallel and cfg.text.enable_moe_block:
      ep = max(
        (n for n in (cp * fsdp, cp, fsdp) if n > 1 and cfg.text.num_experts % n == 0), default=1
      )
      mesh = {**mesh, "ep": ep} if ep > 1 else mesh
    meshes.append(mesh)
  return meshes


def best_mesh(
  cfg: Gemma4Config,
  shape: StepShape | RunConfig | None = None,
  *,
  model: str,
  devices: int,
  expert_parallel: bool = False,
  platform: str = "tpu",
  device_memory: int | None = None,
  **settings: Any,
) -> Plan | None:
  """Find the fsdp x cp mesh of ``devices`` devices with the smallest estimate.

  Args:
    cfg: the :class:`Gemma4Config`.
    shape: the step (:class:`StepShape`, its mesh ignored), or a run config.
    model: the model's name in the plan.
    devices: the mesh's devices (a power of two).
    expert_parallel: fold expert parallelism onto the mesh's token axes.
    platform: as :func:`estimate`'s.
    device_memory: the bytes of one device, for the strategy rule's
      ``"auto"`` on each mesh (:meth:`StepShape.strategies`), as ``cpjax
      train`` takes it.
    **settings: :class:`StepShape` fields, over ``shape``'s.

  Returns:
    The :class:`Plan` of that mesh (fitting or not); None when no mesh of
    that many devices splits the rows.

  >>> from cpjax.models.gemma4 import Gemma4Config
  >>> best_mesh(Gemma4Config.preset("e2b"), model="e2b", devices=8, seq_len=131072).mesh
  {'cp': 8}
  """
  if not isinstance(devices, int) or devices < 1 or devices & (devices - 1):
    raise ValueError(f"devices must be a power of two, got {devices!r}")
  step = StepShape.take(shape, {"mesh": None, **settings})
  plans = [
    estimate(
      cfg,
      step,
      model=model,
      mesh=mesh,
      platform=platform,
      device_memory=device_memory,
    )
    for mesh in _meshes(cfg, devices, step.seq_len, expert_parallel, step.batch_size)
  ]
  return min(plans, key=lambda p: p.total, default=None)


def smallest_mesh(
  cfg: Gemma4Config,
  shape: StepShape | RunConfig | None = None,
  *,
  model: str,
  device_memory: int,
  max_devices: int = 4096,
  expert_parallel: bool = False,
  platform: str = "tpu",
  **settings: Any,
) -> Plan | None:
  """Find the fewest-device (fsdp, cp) mesh whose estimate fits ``device_memory``.

  Ties: the one with more memory to spare. With ``expert_parallel`` each mesh
  folds the largest ``ep`` that divides the experts onto its token axes
  (``cp * fsdp``, ``cp`` or ``fsdp``).

  Args:
    cfg, shape, model, platform, **settings: as :func:`best_mesh`.
    device_memory: the bytes one device holds.
    max_devices: the most devices to try.
    expert_parallel: fold expert parallelism onto each mesh's token axes.

  Returns:
    The :class:`Plan` of that mesh; None when none up to ``max_devices``.
  """
  step = StepShape.take(shape, {"mesh": None, **settings})
  devices = 1
  while devices <= max_devices:
    best = best_mesh(
      cfg,
      step,
      model=model,
      devices=devices,
      expert_parallel=expert_parallel,
      platform=platform,
      device_memory=device_memory,
    )
    if best is not None and best.fits(device_memory):
      return best
    devices *= 2
  return None


# How far past the memory the target search still compiles a smaller slice,
# by the compiler-to-closed-form ratio of the slice it just compiled (that
# ratio moves between slices: E2B LoRA at S = 131072 on v5e, 1.32x on 4 chips).
SMALLER_SLICE_SLACK = 1.1


def smallest_slice(
  cfg: Gemma4Config,
  shape: StepShape | RunConfig | None = None,
  *,
  chip: Chip,
  model: str,
  max_devices: int = 4096,
  expert_parallel: bool = False,
  device_memory: int | None = None,
  report: Callable[[Plan], object] | None = None,
  **settings: Any,
) -> tuple[Plan | None, list[Plan]]:
  """Find the smallest slice of ``chip`` whose compiler fits the training step.

  The target search: the closed form's smallest slice
  (:meth:`~cpjax.training.targets.Chip.slices`, each with :func:`best_mesh`'s
  mesh) is compiled for its chips (:func:`compiled_plan`); when it fits, the
  next smaller slice is compiled while that fits and its closed form, scaled
  by the compiler-to-closed-form ratio just measured, is within
  :data:`SMALLER_SLICE_SLACK` of the memory; when it does not fit, the next
  larger one until one fits. Each compile takes seconds (tiny) to minutes (a
  published size: XLA:TPU refuses one past the chip's memory only at its end).

  Args:
    cfg, shape, model, **settings: as :func:`best_mesh` (``dtype``: the
      activations of the estimate and of the compiled step).
    chip: a :class:`~cpjax.training.targets.Chip`.
    max_devices: the largest slice to try.
    expert_parallel: as :func:`smallest_mesh`'s.
    device_memory: the bytes to fit (default: the chip's memory).
    report: called with each compiled :class:`Plan` as it comes (a compile
      of a published size takes minutes).

  Returns:
    (the compiled :class:`Plan` of the smallest slice that fits, None when
    none does; every compiled plan, in the order tried). A plan's ``source``
    names its slice (``"v5e-8"``).
  """
  step = StepShape.take(shape, {"mesh": None, **settings})
  memory = chip.memory if device_memory is None else device_memory
  slices = chip.slices(max_devices)
  estimates = [
    best_mesh(
      cfg,
      step,
      model=model,
      devices=t.num_devices,
      expert_parallel=expert_parallel,
      device_memory=memory,
      platform=chip.platform,
    )
    for t in slices
  ]
  start = next((i for i, e in enumerate(estimates) if e is not None and e.fits(memory)), None)
  tried: list[Plan] = []

  def estimate(i: int) -> Plan:
    """Slice i's closed-form plan: only slices that have one are compiled."""
    found = estimates[i]
    assert found is not None
    return found

  def compiled(i: int) -> Plan:
    mesh = estimate(i).mesh
    tried.append(
      compiled_plan(cfg, step, model=model, mesh=mesh, target=slices[i], device_memory=memory)
    )
    if report is not None:
      report(tried[-1])
    return tried[-1]

  if start is None:
    return None, tried
  i = start
  if compiled(i).fits(memory):
    while (
      i > 0
      and estimates[i - 1] is not None
      and estimate(i - 1).total * tried[-1].total / estimate(i).total
      <= SMALLER_SLICE_SLACK * memory
      and compiled(i - 1).fits(memory)
    ):
      i -= 1
  else:
    for j in range(i + 1, len(slices)):
      if estimates[j] is not None and compiled(j).fits(memory):
        break
  fitting = [p for p in tried if p.fits(memory)]
  best = min(
    fitting, key=lambda p: math.prod(v for k, v in p.mesh.items() if k != "ep"), default=None
  )
  return best, tried
