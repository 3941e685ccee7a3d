"""The plan the compiler gives: the real training step compiled abstractly.

:func:`compile_step` builds the step (AdamW, the CP strategies, FSDP and TP
shardings) with ``jax.ShapeDtypeStruct`` parameters and compiles it, for
this process's CPU devices or a target's chips; :func:`compiled_plan` reads
its ``memory_analysis()``, FLOPs, collectives and, on a target, the step
time it implies (:mod:`cpjax.training.step_time`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from cpjax.training import hlo
from cpjax.training.plan.shape import GiB, Plan, StepShape
from cpjax.training.run_config import state_axes
from cpjax.training.step_time import step_time
from cpjax.training.targets import Target, collective_bytes

if TYPE_CHECKING:
  import jax

  from cpjax.models.gemma4.config import Gemma4Config
  from cpjax.training.run_config import RunConfig
  from cpjax.training.step import TrainStep

__all__ = ["TooLarge", "compile_step", "compiled_bytes", "compiled_plan"]


def compiled_bytes(compiled: jax.stages.Compiled | TrainStep) -> int:
  """Return a compiled program's memory per device, as its compiler counts it.

  Args:
    compiled: a ``jax.stages.Compiled`` (``jax.jit(f).lower(...).compile()``).

  Returns:
    Bytes: arguments + outputs - outputs aliased to (donated) arguments +
    temporaries, from ``compiled.memory_analysis()``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> compiled = jax.jit(lambda x: x * 2).lower(jnp.zeros(256, jnp.float32)).compile()
    >>> compiled_bytes(compiled) >= 2 * 256 * 4   # the argument and the output
    True
  """
  memory = compiled.memory_analysis()
  assert memory is not None  # None where a backend has none; XLA:CPU, TPU and GPU have one
  return (
    memory.argument_size_in_bytes
    + memory.output_size_in_bytes
    - memory.alias_size_in_bytes
    + memory.temp_size_in_bytes
  )


def compile_step(
  cfg: Gemma4Config,
  shape: StepShape | RunConfig | None = None,
  *,
  devices: Sequence[jax.Device] | None = None,
  device_memory: int | None = None,
  **settings: Any,
) -> tuple[TrainStep, Any, Any, Any | None]:
  """Compile the training step of ``cfg`` abstractly (no array is made) on ``prod(mesh)`` devices.

  The batch is laid out on as many CPU devices (its shapes and shardings only).

  Args:
    cfg: the :class:`Gemma4Config`.
    shape: the step (:class:`StepShape`), or a run config to take it from;
      its mesh may carry ``ep`` (:func:`cpjax.parallel.expert_axes`).
    devices: the devices to compile for, by default the process's own
      (``cpjax plan`` sets ``jax_num_cpu_devices`` before JAX starts); or a
      target's compile-only ones (:meth:`cpjax.training.targets.Target.devices`),
      which compile with their own chip's kernels and compiler.
    device_memory: the bytes of one device, for the strategy rule's ``"auto"``.
    **settings: :class:`StepShape` fields, over ``shape``'s.

  Returns:
    ``(compiled TrainStep, params, opt_state, frozen base or None)``, the
    state as sharded ``ShapeDtypeStruct`` s.

  Raises:
    TooLarge: the target's compiler (XLA:TPU) refused it past the chip's memory.
  """
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx
  from jax.sharding import NamedSharding

  from cpjax import parallel, training
  from cpjax.attention.ring.kernels import mesh_platform, resolve_implementation
  from cpjax.models.gemma4 import Gemma4
  from cpjax.models.gemma4.partitioning import check_mesh, partition_rule

  step_shape = StepShape.take(shape, settings)
  if step_shape.mesh is None:
    raise ValueError("compile_step needs a mesh: give StepShape.mesh")
  seq_len, mesh, remat, dtype = (
    step_shape.seq_len,
    dict(step_shape.mesh),
    step_shape.remat,
    step_shape.dtype,
  )
  batch_size, lora_rank, lora_targets = (
    step_shape.batch_size,
    step_shape.lora_rank,
    step_shape.lora_targets,
  )
  base_dtype, capacity_factor = step_shape.base_dtype, step_shape.capacity_factor
  shard_state = step_shape.shard_state
  chosen = step_shape.strategies(cfg.text, device_memory=device_memory)
  strategy, loss_strategy = chosen["strategy"], chosen["loss_strategy"]

  count = math.prod(v for k, v in mesh.items() if k != "ep")
  if devices is not None and len(devices) != count:
    raise ValueError(
      f"mesh {mesh} has {count} devices, the target has {len(devices)}: give a "
      f"mesh of {len(devices)}"
    )
  if jax.device_count() < count:  # (a target's batch is laid out on as many)
    raise ValueError(f"mesh {mesh} needs {count} devices, this process has {jax.device_count()}")
  sizes = {k: v for k, v in mesh.items() if k != "ep"}
  grid = parallel.make_mesh(**sizes, devices=devices)
  # A compile-only device holds no array: the batch is laid out on a CPU mesh
  # of the same axes, and only its shapes and shardings cross over.
  host = grid if devices is None else parallel.make_mesh(**sizes, devices=None)
  ep = mesh.get("ep", 1)
  expert_axes = parallel.expert_axes(grid, ep)
  batch_axis = parallel.batch_axis_of(grid)
  rows = batch_size or (grid.shape[batch_axis] if batch_axis else 1)
  check_mesh(cfg, grid, seq_len=seq_len, batch_size=rows, ep=ep)
  compute = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype]
  # A quantized base is loaded in bfloat16 and quantized by apply_lora.
  storage = {"float32": jnp.float32}.get(base_dtype, jnp.bfloat16)
  if lora_rank is None:
    abstract = parallel.abstract_model(
      lambda: Gemma4(cfg, rngs=nnx.Rngs(0), dtype=compute, remat=remat)
    )
    graphdef, params, frozen = nnx.split(abstract, nnx.Param, ...)
  else:
    # The adapters are made by running the model: abstractly here too.
    from cpjax.training import lora

    abstract = lora.apply_lora_lazily(
      lambda: Gemma4(cfg, rngs=nnx.Rngs(0), dtype=compute, remat=remat, param_dtype=storage),
      lora.LoraConfig(
        rank=lora_rank,
        targets=lora.DEFAULT_LORA_TARGETS if lora_targets is None else lora_targets,
        target_parameters=(
          lora.DEFAULT_LORA_PARAMETERS
          if step_shape.lora_target_parameters is None
          else step_shape.lora_target_parameters
        ),
        base_dtype=cast(Any, base_dtype),  # a StepShape's is a str; LoraConfig checks it
        group_size=step_shape.group_size,
      ),
      materialize_adapters=False,
    )
    graphdef, params, frozen = lora.split_lora(abstract)
  rule = partition_rule(cfg, tp=mesh.get("tp", 1), expert_axes=expert_axes)

  def placed(tree):
    specs = parallel.param_specs(tree, grid, rule=rule, state_axes=state_axes(shard_state))
    return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(grid, s)),
      tree,
      specs,
    )

  params, frozen = placed(params), placed(frozen)
  optimizer = optax.adamw(1e-4)
  opt_state = parallel.shard_like_params(jax.eval_shape(optimizer.init, params), params)
  text = {
    "input_ids": np.ones((rows, seq_len), np.int32),
    "labels": np.ones((rows, seq_len), np.int32),
  }
  clip = step_shape.audio(cfg)
  if clip is not None:
    # A one-frame stand-in of each row's clip through the sharder (an hour's
    # features are 184 MB a row, which it would place on every device), then
    # the clip's shapes, ids and offsets in its place.
    text["input_ids"][:, 0] = cfg.audio_token_id
    width = clip[1]
    text["input_features"] = np.zeros((rows, 1, width), np.float32)
    text["input_features_mask"] = np.ones((rows, 1), bool)
  sharder = Gemma4.prepare_model_inputs_for_cp(abstract, layout=step_shape.layout)["cp_sharder"]
  kernels = resolve_implementation(None, platform=mesh_platform(grid))
  batch, layout = sharder.shard_batch(text, host, batch_axis=batch_axis, implementation=kernels)
  if clip is not None:
    from cpjax.models.gemma4.cp_batch import AUDIO_OFFSET_KEY, image_token_offsets

    frames, width, soft = clip
    ids = np.ones((rows, seq_len), np.int32)
    ids[:, :soft] = cfg.audio_token_id
    batch["input_ids"] = jax.device_put(ids, batch["input_ids"].sharding)
    offsets = np.asarray(image_token_offsets(ids == cfg.audio_token_id))
    batch[AUDIO_OFFSET_KEY] = jax.device_put(offsets, batch[AUDIO_OFFSET_KEY].sharding)
    # (the sharder passes them through whole, and the step takes them replicated)
    whole = NamedSharding(host, jax.sharding.PartitionSpec())
    for key, shape_, dtype_ in (
      ("input_features", (rows, frames, width), np.float32),
      ("input_features_mask", (rows, frames), np.bool_),
    ):
      batch[key] = jax.ShapeDtypeStruct(shape_, dtype_, sharding=whole)
  video = step_shape.video(cfg)
  if video is not None:
    batch = _with_video(batch, cfg, video, after=0 if clip is None else clip[2], host=host)
  if host is not grid:
    batch = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=NamedSharding(grid, x.sharding.spec)
      ),
      batch,
    )
  step = training.make_train_step(
    graphdef,
    optimizer,
    mesh=grid,
    layout=layout,
    frozen=frozen,
    expert_axes=expert_axes,
    capacity_factor=capacity_factor,
    strategy=strategy,
    loss_strategy=loss_strategy,
  )
  base = None
  if lora_rank is not None:
    base = placed(nnx.split(abstract, nnx.LoRAParam, nnx.Param, ...)[2])
  try:
    compiled = step.compile(params, opt_state, batch)
  except jax.errors.JaxRuntimeError as e:
    refusal = _hbm_refusal(str(e))
    if refusal is None:
      raise
    raise TooLarge(str(e), *refusal, params, opt_state, base) from e
  return compiled, params, opt_state, base


def _with_video(
  batch: dict, cfg: Gemma4Config, video, *, after: int, host: jax.sharding.Mesh
) -> dict:
  """``batch`` (sharded, text or audio) with each row's video in it, as the
  corpus's rows hold one: ``U`` video tokens after the first ``after``
  (the audio clip's), typed 2 in ``mm_token_type_ids``, each row's count
  of earlier ones, and the frames' patches, positions and counts whole on
  every device (as the sharder passes them through), as shapes only (an
  hour of frames is gigabytes a row)."""
  import jax
  from jax.sharding import NamedSharding

  from cpjax.models.gemma4.cp_batch import IMAGE_OFFSET_KEY, VIDEO_OFFSET_KEY, image_token_offsets

  frames, patches, features, soft = video
  ids = np.array(batch["input_ids"])  # (a concrete array: the sharder's output)
  rows = ids.shape[0]
  ids[:, after : after + soft] = cfg.video_token_id
  is_video = ids == cfg.video_token_id
  streams = batch["input_ids"].sharding
  batch["input_ids"] = jax.device_put(ids, streams)
  batch["mm_token_type_ids"] = jax.device_put(np.where(is_video, 2, 0).astype(np.int32), streams)
  offsets = np.asarray(image_token_offsets(is_video))
  batch[VIDEO_OFFSET_KEY] = jax.device_put(offsets, batch[IMAGE_OFFSET_KEY].sharding)
  whole = NamedSharding(host, jax.sharding.PartitionSpec())
  for key, shape_, dtype_ in (
    ("pixel_values_videos", (rows * frames, patches, features), np.float32),
    ("video_position_ids", (rows * frames, patches, 2), np.int32),
    ("num_frames_per_video", (rows,), np.int32),
  ):
    batch[key] = jax.ShapeDtypeStruct(shape_, dtype_, sharding=whole)
  return batch


# XLA:TPU refuses a program past the chip's HBM in one of two words: what
# its temporaries alone need, or what the whole program used.
_HBM_REFUSALS = (
  ("temporaries", re.compile(r"required for HLO temporaries \(([0-9.]+)([KMGT])\) exceeds")),
  ("total", re.compile(r"Ran out of memory in memory space hbm\. Used ([0-9.]+)([KMGT]) of")),
)
_SUFFIX = {"K": 2**10, "M": 2**20, "G": GiB, "T": 2**40}


def _hbm_refusal(message: str) -> tuple[float, str] | None:
  """(bytes, "temporaries" or "total") of an XLA:TPU refusal past HBM; None otherwise."""
  for what, pattern in _HBM_REFUSALS:
    found = pattern.search(message)
    if found:
      return float(found.group(1)) * _SUFFIX[found.group(2)], what
  return None


class TooLarge(RuntimeError):
  """A target's compiler refused the step: it needs more than the chip's memory.

  Attributes:
    needed: the bytes the compiler named.
    what: what they count: ``"temporaries"`` (the temporaries alone) or
      ``"total"`` (the whole program).
    params, opt_state, base: the abstract state it was compiled for (as
      :func:`compile_step` returns them).
  """

  def __init__(self, message: str, needed: float, what: str, params, opt_state, base):
    super().__init__(message)
    self.needed, self.what = needed, what
    self.params, self.opt_state, self.base = params, opt_state, base


def compiled_plan(
  cfg: Gemma4Config,
  shape: StepShape | RunConfig | None = None,
  *,
  model: str,
  target: Target | None = None,
  device_memory: int | None = None,
  **settings: Any,
) -> Plan:
  """Build the :class:`Plan` of :func:`compile_step`'s program.

  Args:
    cfg, shape, model, device_memory, **settings: as
      :func:`~cpjax.training.plan.closed_form.estimate`.
    target: a :class:`cpjax.training.targets.Target` to compile for with its
      own compiler and kernels (default: this process's devices).

  Returns:
    The :class:`Plan` of :func:`compile_step`'s program: its memory analysis,
    FLOPs and collective bytes, the parameters' and optimizer state's bytes
    per device; where the target's compiler refused it past the chip's
    memory (:class:`TooLarge`), a plan with ``refused`` set that does not fit.
  """
  from cpjax import parallel

  shape = StepShape.take(shape, settings)
  seq_len, mesh, batch_size, lora_rank = (
    shape.seq_len,
    dict(shape.mesh or {}),
    shape.batch_size,
    shape.lora_rank,
  )
  refused, step, compiled = None, None, None
  try:
    compiled, params, opt_state, base = compile_step(
      cfg,
      shape,
      devices=None if target is None else target.devices(),
      device_memory=device_memory,
    )
  except TooLarge as e:  # XLA:TPU: past the chip's HBM
    refused, params, opt_state, base = e, e.params, e.opt_state, e.base
  # The parameters: the trained ones, and under LoRA the frozen base (the
  # buffers, a few numbers, count with the rest as the closed form does).
  param_bytes = parallel.bytes_per_device(params)
  if base is not None:
    param_bytes += parallel.bytes_per_device(base)
  opt_bytes = parallel.bytes_per_device(opt_state)
  if refused is not None:  # at least what it named (and the state, with temporaries)
    total = refused.needed + (param_bytes + opt_bytes if refused.what == "temporaries" else 0)
    cost, collectives = {}, {}
  else:
    assert compiled is not None  # not refused: compiled
    cost = compiled.cost_analysis()  # None from XLA:GPU without a device
    cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
    text = compiled.as_text()
    total, collectives = compiled_bytes(compiled), collective_bytes(text)
    if target is not None and not target.chip.missing_figures():
      rows = batch_size or math.prod(v for k, v in mesh.items() if k in ("dp", "fsdp"))
      step = step_time(
        hlo.Program.parse(text),
        target.chip,
        tokens=rows * seq_len,
        devices=target.num_devices,
        cost=cost,
      )
  return Plan(
    model,
    seq_len,
    mesh,
    shape.remat,
    shape.dtype,
    param_bytes,
    opt_bytes,
    total - param_bytes - opt_bytes,
    total,
    float(cost.get("flops", math.nan)),
    "compiled" if target is None else target.name,
    lora_rank,
    shape.base_dtype if lora_rank is not None else "float32",
    collectives,
    refused is not None,
    step,
  )
