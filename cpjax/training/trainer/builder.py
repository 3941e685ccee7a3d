"""Build a :class:`~cpjax.training.trainer.Trainer` from a run config: the
mesh, the model (a preset's random init or a checkpoint, each device reading
its own shards), LoRA, the optimizer and the sharded training state."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec
from jax.typing import DTypeLike

from cpjax import parallel
from cpjax.models import gemma4
from cpjax.models.gemma4.checkpoint import KeySharding, load_weights
from cpjax.models.gemma4.partitioning import check_mesh, partition_rule
from cpjax.training import lora
from cpjax.training.run_config import RunConfig, RunError, check
from cpjax.training.trainer.state import Log, Trainer, TrainState

__all__ = ["add_lora", "build", "checkpoint_sharding", "compute_dtype"]

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def compute_dtype(name: str) -> DTypeLike:
  """Return the jnp dtype named ``name``.

  Args:
    name: ``"float32"`` or ``"bfloat16"``.

  Returns:
    ``jnp.float32`` or ``jnp.bfloat16``.

  Example:
    >>> compute_dtype("bfloat16").__name__
    'bfloat16'
  """
  return _DTYPES[name]


def build(run: RunConfig, *, log: Log = print) -> Trainer:
  """Build the mesh, the model, the optimizer, and the sharded training state.

  Args:
    run: the :class:`RunConfig`; checked first
      (:func:`~cpjax.training.run_config.check`).
    log: prints a line; on processes other than 0 the trainer logs nothing.

  Returns:
    The :class:`Trainer`, its state at step 0.

  Raises:
    TypeError: ``run`` is not a :class:`RunConfig`.
    RunError: a setting cannot run, or the mesh, the batch or LoRA do not
      fit the model (before any training compute).
  """
  if not isinstance(run, RunConfig):
    raise TypeError(f"build takes a RunConfig, got {type(run).__name__}")
  check(run)
  if jax.process_index() != 0:
    log = _quiet
  mesh, expert_axes = _mesh(run)
  devices = list(mesh.devices.flat)
  sizes = dict(mesh.shape)
  rows = run.dataset.batch_size // run.dataset.microbatches
  cfg = (
    gemma4.Gemma4Config.from_hf(run.checkpoint)
    if run.checkpoint
    else gemma4.Gemma4Config.preset(run.model or "tiny")
  )
  try:
    check_mesh(cfg, mesh, batch_size=rows, ep=run.parallel.mesh_sizes().get("ep", 1))
    if run.experts.capacity_factor is not None and not cfg.text.enable_moe_block:
      raise ValueError(
        f"--capacity-factor {run.experts.capacity_factor:g} needs a mixture of experts; "
        f"this Gemma 4 has none"
      )
  except ValueError as e:
    raise RunError(
      f"{e} (--batch-size {run.dataset.batch_size}, --microbatches {run.dataset.microbatches})"
    ) from None
  rule = partition_rule(cfg, tp=sizes.get("tp", 1), expert_axes=expert_axes)
  model, description = _model(run, cfg, mesh, rule)
  sharder = model.prepare_model_inputs_for_cp(layout=run.parallel.layout)["cp_sharder"]
  if run.lora.rank is None:
    # Buffers (layer_scalar, clip bounds) ride along untrained, as in transformers.
    graphdef, params, frozen = nnx.split(model, nnx.Param, ...)
  else:
    if _has_adapters(model):  # a quantized base, adapted before it was read
      graphdef, params, frozen = lora.split_lora(model)
    else:
      model, graphdef, params, frozen = add_lora(run, model)
    description += (
      f", LoRA r={run.lora.rank} alpha={run.lora.alpha:g} on "
      f"{len(lora.adapted_modules(model))} projections "
      f"({lora.lora_param_count(model):,} adapter values; base frozen in "
      f"{run.lora.base_dtype})"
    )
  optimizer = run.optimizer.build()
  # FSDP / TP: each device keeps its shard of the parameters and of Adam's
  # moments (and of a frozen LoRA base).
  state_axes = run.parallel.state_axes()
  specs = parallel.param_specs(params, mesh, rule=rule, state_axes=state_axes)
  # The parity reference runs on one device, as a user's single-device model would.
  # (Through the host: an array placed on an Explicit mesh keeps the mesh in
  # its type, and a single-device jit refuses it.)
  reference = (
    jax.tree.map(lambda x: jax.device_put(np.asarray(x), devices[0]), (params, frozen))
    if run.parity_check
    else None
  )
  params = parallel.shard_params(params, mesh, specs)
  # What the step only reads lives on the mesh too (a random init's buffers
  # are uncommitted, a checkpoint's are read there): jitted programs over the
  # mesh (the step, validation) refuse arrays committed elsewhere.
  frozen = parallel.shard_params(
    frozen, mesh, parallel.param_specs(frozen, mesh, rule=rule, state_axes=state_axes)
  )
  opt_state = parallel.shard_like_params(optimizer.init(params), params)
  return Trainer(
    run=run,
    cfg=cfg,
    mesh=mesh,
    rows=rows,
    sharder=sharder,
    graphdef=graphdef,
    frozen=frozen,
    optimizer=optimizer,
    state=TrainState(params, opt_state),
    reference=reference,
    description=description,
    expert_axes=expert_axes,
    log=log,
  )


def _has_adapters(model: nnx.Module) -> bool:
  """Whether ``model`` already holds LoRA adapters (a quantized base read
  from a checkpoint comes adapted: :func:`_quantized_checkpoint`)."""
  return any(isinstance(v, nnx.LoRAParam) for _, v in nnx.iter_graph(model))


def _quiet(line: str) -> None:
  """Log nothing (processes other than 0)."""


def _mesh(run: RunConfig) -> tuple[Mesh, tuple[str, ...]]:
  """The run's mesh and the axes its experts are split over."""
  sizes = run.parallel.mesh_sizes()
  ep = sizes.pop("ep", 1)
  mesh = parallel.make_mesh(**sizes)
  try:
    expert_axes = parallel.expert_axes(mesh, ep)
  except ValueError as e:
    raise RunError(f"--mesh {run.parallel.mesh}: {e}") from None
  auto = [n for n in mesh.axis_names if n != "cp" and mesh.shape[n] > 1]
  if run.dtype == "bfloat16" and auto and mesh.devices.flat[0].platform == "cpu":
    # jax 0.10's CPU SPMD partitioner aborts the process (a failed check,
    # not an exception) on bfloat16 weight gradients over an fsdp/tp/dp axis
    # inside the ring's shard_map; TPU and GPU compile it.
    raise RunError(
      f"--dtype bfloat16 with mesh axes {auto} does not compile on the CPU "
      f"(an XLA:CPU partitioner limitation); use --dtype float32 there"
    )
  return mesh, expert_axes


def _model(
  run: RunConfig, cfg: gemma4.Gemma4Config, mesh: Mesh, rule: Callable
) -> tuple[gemma4.Gemma4, str]:
  """The model (a random init, or the checkpoint read shard by shard) and its description."""
  # Full fine-tuning keeps float32 parameters for the optimizer; a frozen
  # LoRA base is stored in --base-dtype (a quantized one is loaded in
  # bfloat16, and apply_lora quantizes it). Activations in run.dtype.
  base = run.lora.base_dtype
  compute = compute_dtype(run.dtype)
  storage = compute_dtype("bfloat16" if base in lora.QUANTIZED_DTYPES else base)
  if run.checkpoint and run.lora.rank is not None and base in lora.QUANTIZED_DTYPES:
    return _quantized_checkpoint(run, cfg, mesh, rule, storage, compute), (
      f"Gemma 4 from {run.checkpoint} (quantized to {base} as it was read)"
    )
  if run.checkpoint:
    sharding = checkpoint_sharding(cfg, mesh, rule, run.parallel.state_axes())
    model = gemma4.Gemma4.from_pretrained(
      run.checkpoint, remat=run.remat, mesh=mesh, sharding=sharding, dtype=storage
    )
    model.dtype = compute
    return model, f"Gemma 4 from {run.checkpoint}"
  model = gemma4.Gemma4(
    cfg, rngs=nnx.Rngs(run.seed), dtype=compute, remat=run.remat, param_dtype=storage
  )
  return model, f"Gemma 4 {run.model or 'tiny'!r} (random init)"


def _quantized_checkpoint(
  run: RunConfig,
  cfg: gemma4.Gemma4Config,
  mesh: Mesh,
  rule: Callable,
  storage: DTypeLike,
  compute: DTypeLike,
) -> gemma4.Gemma4:
  """The adapted model, its base read from the checkpoint and quantized tensor
  by tensor on its own devices: never whole in the checkpoint's dtype
  (26B-A4B's bfloat16 is 52 GB; int4 is a quarter of it)."""

  def make() -> gemma4.Gemma4:
    model = gemma4.Gemma4(
      cfg, rngs=nnx.Rngs(0), dtype=storage, remat=run.remat, param_dtype=storage
    )
    model.dtype = compute  # as a checkpoint loaded in `storage` is then run
    return model

  try:
    model = lora.apply_lora_lazily(make, run.lora, seed=run.seed)
  except (ValueError, TypeError) as e:
    raise RunError(f"LoRA: {e}") from None
  sharding = checkpoint_sharding(cfg, mesh, rule, run.parallel.state_axes(), model=model)
  assert run.checkpoint is not None  # the caller's condition
  return load_weights(model, run.checkpoint, mesh=mesh, sharding=sharding)


def checkpoint_sharding(
  cfg: gemma4.Gemma4Config,
  mesh: Mesh,
  rule: Callable,
  state_axes: tuple[str, ...] = ("fsdp",),
  *,
  model: nnx.Module | None = None,
) -> KeySharding:
  """Make the ``sharding(key, shape)`` for ``Gemma4.from_pretrained``.

  Each parameter as the training step keeps it
  (:func:`cpjax.parallel.param_specs`); buffers replicated on the mesh, where
  every jitted program that reads them runs.

  Args:
    cfg: the :class:`Gemma4Config`.
    mesh: the training mesh.
    rule: the partition rule, as :func:`cpjax.parallel.param_specs` takes it.
    state_axes: as :func:`cpjax.parallel.param_specs`.
    model: the abstract model being filled (default: the plain Gemma 4 of
      ``cfg``); a quantized one's values and scales are asked for as
      ``key.qvalue`` and ``key.scale`` (:func:`load_weights`).

  Returns:
    ``sharding(key, shape)``: a parameter's sharding, None for a buffer.
  """
  if model is None:
    model = parallel.abstract_model(lambda: gemma4.Gemma4(cfg, rngs=nnx.Rngs(0)))
  params = nnx.state(model, nnx.Param)
  specs = parallel.param_specs(params, mesh, rule=rule, state_axes=state_axes)
  # Keyed by the checkpoint key (+ ".qvalue" / ".scale"): the path without
  # the fields of nnx's Variable (".value") and of qwix's quantized
  # projection weight (".array").
  by_key = {
    ".".join(n for n in parallel.key_names(path) if n not in ("value", "array")): spec
    for path, spec in jax.tree_util.tree_flatten_with_path(
      specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )[0]
  }

  def sharding(key: str, shape: tuple[int, ...]) -> PartitionSpec | None:
    return by_key.get(key)  # None: a buffer (layer_scalar, clip bounds), replicated

  return sharding


def add_lora(
  run: RunConfig, model: gemma4.Gemma4
) -> tuple[gemma4.Gemma4, nnx.GraphDef, nnx.State, nnx.State]:
  """Add LoRA adapters to ``model`` (:func:`cpjax.training.lora.apply_lora`), split for the step.

  Args:
    run: the :class:`RunConfig`.
    model: the base model.

  Returns:
    ``(model, graphdef, adapters, frozen)``: ``model`` with LoRA adapters,
    split for the step.

  Raises:
    RunError: the run's LoRA does not fit the model.
  """
  try:
    model = lora.apply_lora(model, run.lora, seed=run.seed)
  except (ValueError, TypeError) as e:
    raise RunError(f"LoRA: {e}") from None
  return (model, *lora.split_lora(model))
