"""The phases of a ``cpjax train`` run before its step loop: build the mesh,
the model and the sharded training state (:func:`build`), open the data
(:func:`open_data`), resume (:func:`resume`), describe the run, and cut a
step's rows (:func:`step_batches`). :mod:`cpjax.training.train_job` runs them."""

from __future__ import annotations

import atexit
import dataclasses
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np

from cpjax.training.job_config import JobError, make_optimizer
from cpjax.training.run_config import RunConfig, as_run_config

__all__ = ["Data", "TrainState", "build", "check_vocabulary", "corpus_path", "describe", "host_value",
           "open_data", "resume", "run_identity", "step_batches"]


def compute_dtype(name: str):
  import jax.numpy as jnp

  return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def host_value(x) -> float:
  """A replicated scalar's value, also when the array spans other processes."""
  return float(np.asarray(x.addressable_data(0)))


def checkpoint_sharding(cfg, mesh, rule, state_axes=("fsdp",)):
  """``sharding(key, shape)`` for ``Gemma4.from_pretrained``: each parameter as
  the training step keeps it (:func:`cpjax.parallel.param_specs`); buffers
  replicated on the mesh, where every jitted program that reads them runs."""
  from flax import nnx

  from cpjax import parallel
  from cpjax.models import gemma4
  from cpjax.models.gemma4.checkpoint import checkpoint_keys

  abstract = nnx.eval_shape(lambda: gemma4.Gemma4(cfg, rngs=nnx.Rngs(0)))
  nested: dict = {}
  for key, var in checkpoint_keys(abstract).items():
    if isinstance(var, nnx.Param):      # nested by path, as param_specs' rule reads it
      *parents, leaf = key.split(".")
      node = nested
      for name in parents:
        node = node.setdefault(name, {})
      node[leaf] = var.get_value()
  specs = parallel.param_specs(nested, mesh, rule=rule, state_axes=state_axes)

  def sharding(key, shape):
    node = specs
    for name in key.split("."):
      if not isinstance(node, dict) or name not in node:
        return None                     # a buffer (layer_scalar, clip bounds): replicated
      node = node[name]
    return node

  return sharding


@dataclasses.dataclass
class TrainState:
  """What the phases share: the model split for the step, its sharder and
  the mesh, and the training state (``params``, ``opt_state``) as it moves.
  ``params`` are what is trained (every weight, or the LoRA adapters);
  ``frozen`` what the step only reads (buffers, and under LoRA the base)."""

  cfg: Any
  mesh: Any
  rows: int                    # rows of one microbatch
  batch_axis: str | None
  sharder: Any
  graphdef: Any
  frozen: Any
  optimizer: Any
  params: Any
  opt_state: Any
  reference: Any               # (params, frozen) on one device, for the parity check (or None)
  description: str
  expert_axes: tuple = ()      # mesh axes the MoE experts are split over (--mesh ...,ep=N)


@dataclasses.dataclass
class Data:
  """A batch source: ``next_batch()`` gives one microbatch of rows; ``state``
  / ``set_state`` save and restore where it is, for resume."""

  next_batch: Callable[[], dict]
  state: Callable[[], dict]
  set_state: Callable[[dict], None]


def build(job: RunConfig) -> TrainState:
  """The mesh, the model (random init or a checkpoint, each device reading
  its own shards), the optimizer, and the sharded training state."""
  import jax
  from flax import nnx

  from cpjax import parallel
  from cpjax.models import gemma4
  from cpjax.models.gemma4.partitioning import check_mesh, partition_rule
  from cpjax.training import lora

  job = as_run_config(job)
  sizes = job.parallel.mesh_sizes()
  ep = sizes.pop("ep", 1)
  mesh = parallel.make_mesh(**sizes)
  try:
    expert_axes = parallel.expert_axes(mesh, ep)
  except ValueError as e:
    raise JobError(f"--mesh {job.parallel.mesh}: {e}") from None
  devices = list(mesh.devices.flat)
  rows = job.dataset.batch_size // job.dataset.microbatches
  auto = [n for n in mesh.axis_names if n != "cp" and mesh.shape[n] > 1]
  if job.dtype == "bfloat16" and auto and devices[0].platform == "cpu":
    # jax 0.10's CPU SPMD partitioner aborts the process (a failed check,
    # not an exception) on bfloat16 weight gradients over an fsdp/tp/dp axis
    # inside the ring's shard_map; TPU and GPU compile it.
    raise JobError(f"--dtype bfloat16 with mesh axes {auto} does not compile on the CPU "
                   f"(an XLA:CPU partitioner limitation); use --dtype float32 there")
  compute = compute_dtype(job.dtype)
  cfg = (gemma4.Gemma4Config.from_hf(job.checkpoint) if job.checkpoint
         else gemma4.Gemma4Config.preset(job.model or "tiny"))
  try:
    check_mesh(cfg, mesh, batch_size=rows, ep=ep)
    if job.experts.capacity_factor is not None and not cfg.text.enable_moe_block:
      raise ValueError(f"--capacity-factor {job.experts.capacity_factor:g} needs a mixture of experts; "
                       f"this Gemma 4 has none")
  except ValueError as e:
    raise JobError(f"{e} (--batch-size {job.dataset.batch_size}, --microbatches {job.dataset.microbatches})"
                   ) from None
  rule = partition_rule(cfg, tp=sizes.get("tp", 1), expert_axes=expert_axes)
  # Full fine-tuning keeps float32 parameters for the optimizer; a frozen
  # LoRA base is stored in --base-dtype. Activations in job.dtype.
  storage = compute_dtype(job.lora.base_dtype)
  if job.checkpoint:
    # Each device reads only its shard of each tensor.
    sharding = checkpoint_sharding(cfg, mesh, rule, job.parallel.state_axes())
    model = gemma4.Gemma4.from_pretrained(job.checkpoint, remat=job.remat, mesh=mesh,
                                          sharding=sharding, dtype=storage)
    model.dtype = compute
    description = f"Gemma 4 from {job.checkpoint}"
  else:
    model = gemma4.Gemma4(cfg, rngs=nnx.Rngs(job.seed), dtype=compute, remat=job.remat,
                          param_dtype=storage)
    description = f"Gemma 4 {job.model or 'tiny'!r} (random init)"
  sharder = model.prepare_model_inputs_for_cp(layout=job.parallel.layout)["cp_sharder"]
  if job.lora.rank is None:
    # Buffers (layer_scalar, clip bounds) ride along untrained, as in transformers.
    graphdef, params, frozen = nnx.split(model, nnx.Param, ...)
  else:
    model, graphdef, params, frozen = add_lora(job, model)
    description += (f", LoRA r={job.lora.rank} alpha={job.lora.alpha:g} on "
                    f"{len(lora.adapted_modules(model))} projections "
                    f"({lora.lora_param_count(model):,} adapter values; base frozen in "
                    f"{job.lora.base_dtype})")
  optimizer = make_optimizer(job)
  # FSDP / TP: each device keeps its shard of the parameters and of Adam's
  # moments (and of a frozen LoRA base).
  state_axes = job.parallel.state_axes()
  specs = parallel.param_specs(params, mesh, rule=rule, state_axes=state_axes)
  # The parity reference runs on one device, as a user's single-device model would.
  # (Through the host: an array placed on an Explicit mesh keeps the mesh in
  # its type, and a single-device jit refuses it.)
  reference = (jax.tree.map(lambda x: jax.device_put(np.asarray(x), devices[0]),
                            (params, frozen)) if job.parity_check else None)
  params = parallel.shard_params(params, mesh, specs)
  # What the step only reads lives on the mesh too (a random init's buffers
  # are uncommitted, a checkpoint's are read there): jitted programs over the
  # mesh (the step, validation) refuse arrays committed elsewhere.
  frozen = parallel.shard_params(frozen, mesh, parallel.param_specs(frozen, mesh, rule=rule,
                                                                    state_axes=state_axes))
  opt_state = parallel.shard_like_params(optimizer.init(params), params)
  return TrainState(cfg=cfg, mesh=mesh, rows=rows, batch_axis=parallel.batch_axis_of(mesh),
                  sharder=sharder, graphdef=graphdef, frozen=frozen, optimizer=optimizer,
                  params=params, opt_state=opt_state, reference=reference,
                  description=description, expert_axes=expert_axes)


def add_lora(job: RunConfig, model):
  """``(model, graphdef, adapters, frozen)``: ``model`` with LoRA adapters
  (:func:`cpjax.training.lora.apply_lora`) split for the step."""
  from cpjax.training import lora

  try:
    settings = lora.LoraSettings(rank=job.lora.rank, alpha=job.lora.alpha,
                                 targets=job.lora.targets or lora.DEFAULT_LORA_TARGETS)
    model = lora.apply_lora(model, rank=settings.rank, alpha=settings.alpha,
                            targets=settings.targets, seed=job.seed)
  except (ValueError, TypeError) as e:
    raise JobError(f"LoRA: {e}") from None
  return (model, *lora.split_lora(model))


def corpus_path(job: RunConfig, path: str, flag: str, log) -> str:
  """A corpus to read: ``path`` itself, or a JSONL file tokenized into one
  (with the tokenizer and chat template of ``--tokenizer`` or
  ``--checkpoint``) in a fresh temporary directory."""
  if not path.endswith(".jsonl"):
    return path
  import tempfile

  from cpjax.data.records import prepare_data

  source = job.dataset.tokenizer or job.checkpoint
  if source is None:
    raise JobError(f"{flag} {path} is JSONL: tokenizing it needs the checkpoint's tokenizer "
                   f"(--checkpoint DIR or --tokenizer DIR)")
  out = tempfile.mkdtemp(prefix="cpjax-corpus-")
  atexit.register(shutil.rmtree, out, ignore_errors=True)   # read lazily during the run
  try:
    summary = prepare_data(path, out, checkpoint=source, seq_len=job.dataset.seq_len,
                           truncate=job.dataset.truncate, progress=False)
  except (ValueError, FileNotFoundError) as e:
    raise JobError(f"{flag} {path}: {e}") from None
  for line in summary.lines(show=5):
    log(line)
  return out


def check_vocabulary(batch: dict, cfg, where: str) -> dict:
  top = int(batch["input_ids"].max())
  if top >= cfg.text.vocab_size:
    raise ValueError(f"{where} holds token id {top}, outside the model's vocabulary of "
                     f"{cfg.text.vocab_size}")
  return batch


def open_data(job: RunConfig, cfg, rows: int, log) -> Data:
  """The corpus (``--data``) or synthetic packed multimodal rows."""
  if job.dataset.path:
    from cpjax.data.corpus import packed_batches

    # Every process feeds the same global batch (the sharder places each
    # process's part), so every process reads the whole corpus here.
    path = corpus_path(job, job.dataset.path, "--data", log)
    stream = iter(packed_batches(path, batch_size=rows, seq_len=job.dataset.seq_len,
                                 seed=job.seed, process_index=0, process_count=1,
                                 images_per_row=job.dataset.images_per_row))

    def next_batch():
      return check_vocabulary(next(stream), cfg, f"--data {job.dataset.path}")

    return Data(next_batch, state=lambda: {"grain": stream.get_state()},
                 set_state=lambda state: stream.set_state(state["grain"]))

  from cpjax.models import gemma4

  rng = np.random.default_rng(job.seed)

  def set_state(state):
    rng.bit_generator.state = state["numpy_bit_generator"]

  return Data(lambda: gemma4.synthetic_batch(rng, cfg, batch_size=rows, seq_len=job.dataset.seq_len,
                                              max_docs=6),
               state=lambda: {"numpy_bit_generator": rng.bit_generator.state},
               set_state=set_state)


def run_identity(job: RunConfig, cfg) -> dict:
  """What a resumed run must share with the saved one (see checkpointing)."""
  job = as_run_config(job)
  from cpjax.training import lora

  identity = {"model_config": cfg.to_hf(), "batch_size": job.dataset.batch_size,
              "seq_len": job.dataset.seq_len, "microbatches": job.dataset.microbatches, "data": job.dataset.path,
              "seed": job.seed}
  if job.lora.rank is not None:        # what the saved adapters and moments are
    identity["lora"] = {"rank": job.lora.rank, "alpha": job.lora.alpha,
                        "targets": job.lora.targets or lora.DEFAULT_LORA_TARGETS,
                        "base_dtype": job.lora.base_dtype}
  return identity


def resume(job: RunConfig, trainer: TrainState, data: Data, log):
  """``(first_step, checkpointer or None)``; with ``--resume`` the training
  state and the data's place come back from the latest checkpoint."""
  first_step, checkpointer = 0, None
  if job.checkpointing.state_dir:
    from cpjax.training.checkpointing import TrainCheckpointer, check_run_matches

    checkpointer = TrainCheckpointer(job.checkpointing.state_dir, save_every=job.checkpointing.save_every)
    if job.checkpointing.resume:
      try:      # before any array is read: a different run's arrays may not even fit
        check_run_matches(checkpointer.saved_run(), run_identity(job, trainer.cfg),
                          force=job.checkpointing.force_resume)
      except ValueError as e:
        raise JobError(str(e)) from None
      first_step, restored = checkpointer.restore(params_like=trainer.params,
                                                  opt_state_like=trainer.opt_state)
      trainer.params, trainer.opt_state = restored["params"], restored["opt_state"]
      data.set_state(restored["data_state"])
      log(f"resumed from {job.checkpointing.state_dir} after step {first_step}")
    elif checkpointer.latest_step() is not None:
      raise JobError(f"{job.checkpointing.state_dir} already holds a checkpoint (step "
                     f"{checkpointer.latest_step()}); resume it with --resume or choose "
                     f"another directory")
  if first_step >= job.optimizer.steps:
    raise JobError(f"the checkpoint is after step {first_step}; --steps {job.optimizer.steps} leaves "
                   f"nothing to train")
  return first_step, checkpointer


def describe(job: RunConfig, trainer: TrainState, log) -> None:
  import jax

  devices = list(trainer.mesh.devices.flat)
  procs = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
  t = trainer.cfg.text
  what = trainer.description
  what += f", data {job.dataset.path}" if job.dataset.path else ", synthetic multimodal data"
  mesh_text = " x ".join(f"{name}={size}" for name, size in trainer.mesh.shape.items())
  accum = f" in {job.dataset.microbatches} microbatches" if job.dataset.microbatches > 1 else ""
  log(f"cpjax train: {what}: {t.num_hidden_layers} layers d={t.hidden_size}, "
      f"S={job.dataset.seq_len} B={job.dataset.batch_size}{accum}, mesh {mesh_text} ({job.parallel.layout}) on "
      f"{len(devices)} {devices[0].platform.upper()} devices{procs}, {job.dtype}")


def step_batches(job: RunConfig, trainer: TrainState, data: Data):
  """The step's rows (as microbatches), their sharded form and its layout."""
  parts = [data.next_batch() for _ in range(job.dataset.microbatches)]
  placed = [trainer.sharder.shard_batch(b, trainer.mesh, batch_axis=trainer.batch_axis)
            for b in parts]
  layouts = {lay for _, lay in placed}
  assert len(layouts) == 1, "every batch has the same padded shape"
  sharded = placed[0][0] if job.dataset.microbatches == 1 else [b for b, _ in placed]
  return parts, sharded, placed[0][1]
