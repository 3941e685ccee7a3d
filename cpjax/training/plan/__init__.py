"""Plan before renting: per-device memory, FLOPs and step time of a Gemma 4
training step on a mesh.

* :mod:`~cpjax.training.plan.shape`: what a run fixes of its step
  (:class:`StepShape`, derived from a run config in one place) and the
  plan's report (:class:`Plan`);
* :mod:`~cpjax.training.plan.closed_form`: :func:`estimate`, the closed
  form written from the architecture;
* :mod:`~cpjax.training.plan.compiled`: :func:`compile_step` and
  :func:`compiled_plan`, the real step compiled abstractly for this machine
  or a target's chips;
* :mod:`~cpjax.training.plan.search`: the smallest mesh or slice that fits.

Each entry point takes a :class:`StepShape`, a
:class:`~cpjax.training.run_config.RunConfig`, or the shape's fields as
keywords, with the run config's defaults.

>>> from cpjax.models.gemma4 import Gemma4Config
>>> from cpjax.training.run_config import RunConfig, with_values
>>> run = with_values(RunConfig(), {"dataset.seq_len": 4096, "parallel.cp": 2})
>>> plan = estimate(Gemma4Config.preset("tiny"), run, model="tiny")
>>> plan.mesh, plan.remat, plan.dtype
({'cp': 2}, 'none', 'float32')
"""

from cpjax.training.plan.closed_form import (
  DISPATCH_GPU,
  GPU_LAYER_VALUES,
  GPU_LAYER_VALUES_LORA,
  LOSS_CHUNK_LOGITS,
  MLP_TILE_VALUES,
  PLATFORMS,
  TPU_PEAK_VALUES,
  estimate,
  lora_param_count,
)
from cpjax.training.plan.compiled import TooLarge, compile_step, compiled_bytes, compiled_plan
from cpjax.training.plan.search import SMALLER_SLICE_SLACK, best_mesh, smallest_mesh, smallest_slice
from cpjax.training.plan.shape import (
  SHARD_STATE,
  GiB,
  Plan,
  StepShape,
  format_bytes,
  parse_bytes,
  run_shape,
)
from cpjax.training.targets import collective_bytes

__all__ = [
  "DISPATCH_GPU",
  "GPU_LAYER_VALUES",
  "GPU_LAYER_VALUES_LORA",
  "GiB",
  "LOSS_CHUNK_LOGITS",
  "MLP_TILE_VALUES",
  "PLATFORMS",
  "Plan",
  "SHARD_STATE",
  "SMALLER_SLICE_SLACK",
  "StepShape",
  "TPU_PEAK_VALUES",
  "TooLarge",
  "best_mesh",
  "collective_bytes",
  "compile_step",
  "compiled_bytes",
  "compiled_plan",
  "estimate",
  "format_bytes",
  "lora_param_count",
  "parse_bytes",
  "run_shape",
  "smallest_mesh",
  "smallest_slice",
]
