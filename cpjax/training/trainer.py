"""The ``cpjax train`` job: its state, the phases before the loop, the
periodic work and the step loop.

:func:`run_train_job` runs a :class:`~cpjax.training.run_config.RunConfig`:
it builds the mesh, the model and the sharded training state (:func:`build`,
a :class:`TrainState`), opens the data (:func:`open_data`), resumes
(:func:`resume`), compiles the step, then runs the loop with the periodic
work as hooks after each step (:func:`make_hooks`: the parity check at step
1, validation, the metrics file, TensorBoard and checkpoints), saves and
reports.

A tiny real-architecture Gemma 4 by default (``model`` picks a preset, or
``checkpoint`` fine-tunes a Hugging Face checkpoint), on synthetic packed
multimodal data or the user's own (a prepared corpus, or JSONL texts and
conversations tokenized with the checkpoint's tokenizer).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from cpjax.training.run_config import JobError, RunConfig, check
from cpjax.training.run_file import write_run_config

__all__ = [
  "Data",
  "TrainState",
  "build",
  "check_vocabulary",
  "corpus_path",
  "describe",
  "eval_hook",
  "eval_rows",
  "external_write",
  "host_value",
  "make_hooks",
  "open_data",
  "resume",
  "run_identity",
  "run_train_job",
  "step_batches",
]


def compute_dtype(name: str):
  """Return the jnp dtype named ``name``.

  Args:
    name: ``"float32"`` or ``"bfloat16"``.

  Returns:
    ``jnp.float32`` or ``jnp.bfloat16``.
  """
  import jax.numpy as jnp

  return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def host_value(x) -> float:
  """Read a replicated scalar's value, also when the array spans other processes.

  Args:
    x: the replicated scalar array.

  Returns:
    Its value.
  """
  return float(np.asarray(x.addressable_data(0)))


def checkpoint_sharding(cfg, mesh, rule, state_axes=("fsdp",)):
  """Make the ``sharding(key, shape)`` for ``Gemma4.from_pretrained``.

  Each parameter as the training step keeps it
  (:func:`cpjax.parallel.param_specs`); buffers replicated on the mesh, where
  every jitted program that reads them runs.

  Args:
    cfg: the :class:`Gemma4Config`.
    mesh: the training mesh.
    rule: the partition rule, as :func:`cpjax.parallel.param_specs` takes it.
    state_axes: as :func:`cpjax.parallel.param_specs`.

  Returns:
    ``sharding(key, shape)``.
  """
  from flax import nnx

  from cpjax import parallel
  from cpjax.models import gemma4
  from cpjax.models.gemma4.checkpoint import checkpoint_keys

  abstract = nnx.eval_shape(lambda: gemma4.Gemma4(cfg, rngs=nnx.Rngs(0)))
  nested: dict = {}
  for key, var in checkpoint_keys(abstract).items():
    if isinstance(var, nnx.Param):  # nested by path, as param_specs' rule reads it
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
        return None  # a buffer (layer_scalar, clip bounds): replicated
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
  rows: int  # rows of one microbatch
  batch_axis: str | None
  sharder: Any
  graphdef: Any
  frozen: Any
  optimizer: Any
  params: Any
  opt_state: Any
  reference: Any  # (params, frozen) on one device, for the parity check (or None)
  description: str
  expert_axes: tuple = ()  # mesh axes the MoE experts are split over (--mesh ...,ep=N)


@dataclasses.dataclass
class Data:
  """A batch source: ``next_batch()`` gives one microbatch of rows; ``state``
  / ``set_state`` save and restore where it is, for resume."""

  next_batch: Callable[[], dict]
  state: Callable[[], dict]
  set_state: Callable[[dict], None]


def build(job: RunConfig) -> TrainState:
  """Build the mesh, the model, the optimizer, and the sharded training state.

  The model is a random init or a checkpoint, each device reading its own
  shards.

  Args:
    job: the :class:`RunConfig`.

  Returns:
    The :class:`TrainState`.
  """
  import jax
  from flax import nnx

  from cpjax import parallel
  from cpjax.models import gemma4
  from cpjax.models.gemma4.partitioning import check_mesh, partition_rule
  from cpjax.training import lora

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
    raise JobError(
      f"--dtype bfloat16 with mesh axes {auto} does not compile on the CPU "
      f"(an XLA:CPU partitioner limitation); use --dtype float32 there"
    )
  compute = compute_dtype(job.dtype)
  cfg = (
    gemma4.Gemma4Config.from_hf(job.checkpoint)
    if job.checkpoint
    else gemma4.Gemma4Config.preset(job.model or "tiny")
  )
  try:
    check_mesh(cfg, mesh, batch_size=rows, ep=ep)
    if job.experts.capacity_factor is not None and not cfg.text.enable_moe_block:
      raise ValueError(
        f"--capacity-factor {job.experts.capacity_factor:g} needs a mixture of experts; "
        f"this Gemma 4 has none"
      )
  except ValueError as e:
    raise JobError(
      f"{e} (--batch-size {job.dataset.batch_size}, --microbatches {job.dataset.microbatches})"
    ) from None
  rule = partition_rule(cfg, tp=sizes.get("tp", 1), expert_axes=expert_axes)
  # Full fine-tuning keeps float32 parameters for the optimizer; a frozen
  # LoRA base is stored in --base-dtype. Activations in job.dtype.
  storage = compute_dtype(job.lora.base_dtype)
  if job.checkpoint:
    # Each device reads only its shard of each tensor.
    sharding = checkpoint_sharding(cfg, mesh, rule, job.parallel.state_axes())
    model = gemma4.Gemma4.from_pretrained(
      job.checkpoint, remat=job.remat, mesh=mesh, sharding=sharding, dtype=storage
    )
    model.dtype = compute
    description = f"Gemma 4 from {job.checkpoint}"
  else:
    model = gemma4.Gemma4(
      cfg, rngs=nnx.Rngs(job.seed), dtype=compute, remat=job.remat, param_dtype=storage
    )
    description = f"Gemma 4 {job.model or 'tiny'!r} (random init)"
  sharder = model.prepare_model_inputs_for_cp(layout=job.parallel.layout)["cp_sharder"]
  if job.lora.rank is None:
    # Buffers (layer_scalar, clip bounds) ride along untrained, as in transformers.
    graphdef, params, frozen = nnx.split(model, nnx.Param, ...)
  else:
    model, graphdef, params, frozen = add_lora(job, model)
    description += (
      f", LoRA r={job.lora.rank} alpha={job.lora.alpha:g} on "
      f"{len(lora.adapted_modules(model))} projections "
      f"({lora.lora_param_count(model):,} adapter values; base frozen in "
      f"{job.lora.base_dtype})"
    )
  optimizer = job.optimizer.build()
  # FSDP / TP: each device keeps its shard of the parameters and of Adam's
  # moments (and of a frozen LoRA base).
  state_axes = job.parallel.state_axes()
  specs = parallel.param_specs(params, mesh, rule=rule, state_axes=state_axes)
  # The parity reference runs on one device, as a user's single-device model would.
  # (Through the host: an array placed on an Explicit mesh keeps the mesh in
  # its type, and a single-device jit refuses it.)
  reference = (
    jax.tree.map(lambda x: jax.device_put(np.asarray(x), devices[0]), (params, frozen))
    if job.parity_check
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
  return TrainState(
    cfg=cfg,
    mesh=mesh,
    rows=rows,
    batch_axis=parallel.batch_axis_of(mesh),
    sharder=sharder,
    graphdef=graphdef,
    frozen=frozen,
    optimizer=optimizer,
    params=params,
    opt_state=opt_state,
    reference=reference,
    description=description,
    expert_axes=expert_axes,
  )


def add_lora(job: RunConfig, model):
  """Add LoRA adapters to ``model`` (:func:`cpjax.training.lora.apply_lora`), split for the step.

  Args:
    job: the :class:`RunConfig`.
    model: the base model.

  Returns:
    ``(model, graphdef, adapters, frozen)``: ``model`` with LoRA adapters,
    split for the step.
  """
  from cpjax.training import lora

  try:
    model = lora.apply_lora(model, job.lora, seed=job.seed)
  except (ValueError, TypeError) as e:
    raise JobError(f"LoRA: {e}") from None
  return (model, *lora.split_lora(model))


def corpus_path(job: RunConfig, path: str, flag: str, log) -> str:
  """Return a corpus to read: ``path`` itself, or a JSONL file tokenized into one.

  A JSONL file is tokenized (with the tokenizer and chat template of
  ``--tokenizer`` or ``--checkpoint``) in a fresh temporary directory.

  Args:
    job: the :class:`RunConfig`.
    path: a corpus, or a JSONL file.
    flag: the flag that gave ``path``, for errors.
    log: prints a line.

  Returns:
    The corpus's path.
  """
  if not path.endswith(".jsonl"):
    return path
  import tempfile

  from cpjax.data.records import prepare_data

  source = job.dataset.tokenizer or job.checkpoint
  if source is None:
    raise JobError(
      f"{flag} {path} is JSONL: tokenizing it needs the checkpoint's tokenizer "
      f"(--checkpoint DIR or --tokenizer DIR)"
    )
  out = tempfile.mkdtemp(prefix="cpjax-corpus-")
  atexit.register(shutil.rmtree, out, ignore_errors=True)  # read lazily during the run
  try:
    summary = prepare_data(
      path,
      out,
      checkpoint=source,
      seq_len=job.dataset.seq_len,
      truncate=job.dataset.truncate,
      progress=False,
    )
  except (ValueError, FileNotFoundError) as e:
    raise JobError(f"{flag} {path}: {e}") from None
  for line in summary.lines(show=5):
    log(line)
  return out


def check_vocabulary(batch: dict, cfg, where: str) -> dict:
  """Check that a batch's token ids are inside the model's vocabulary.

  Args:
    batch: the batch, with ``input_ids`` int[B, S].
    cfg: the :class:`Gemma4Config`.
    where: the batch's source, for the error (e.g. ``"--data PATH"``).

  Returns:
    ``batch``, unchanged.

  Raises:
    ValueError: a token id is ``>= cfg.text.vocab_size``.
  """
  top = int(batch["input_ids"].max())
  if top >= cfg.text.vocab_size:
    raise ValueError(
      f"{where} holds token id {top}, outside the model's vocabulary of {cfg.text.vocab_size}"
    )
  return batch


def open_data(job: RunConfig, cfg, rows: int, log) -> Data:
  """Open the corpus (``--data``) or synthetic packed multimodal rows.

  Args:
    job: the :class:`RunConfig`.
    cfg: the :class:`Gemma4Config`.
    rows: rows of one microbatch.
    log: prints a line.

  Returns:
    The :class:`Data`.
  """
  if job.dataset.path:
    from cpjax.data.corpus import packed_batches

    # Every process feeds the same global batch (the sharder places each
    # process's part), so every process reads the whole corpus here.
    path = corpus_path(job, job.dataset.path, "--data", log)
    stream = iter(
      packed_batches(
        path,
        batch_size=rows,
        seq_len=job.dataset.seq_len,
        seed=job.seed,
        process_index=0,
        process_count=1,
        images_per_row=job.dataset.images_per_row,
      )
    )

    def next_batch():
      return check_vocabulary(next(stream), cfg, f"--data {job.dataset.path}")

    return Data(
      next_batch,
      state=lambda: {"grain": stream.get_state()},
      set_state=lambda state: stream.set_state(state["grain"]),
    )

  from cpjax.models import gemma4

  rng = np.random.default_rng(job.seed)

  def set_state(state):
    rng.bit_generator.state = state["numpy_bit_generator"]

  return Data(
    lambda: gemma4.synthetic_batch(
      rng, cfg, batch_size=rows, seq_len=job.dataset.seq_len, max_docs=6
    ),
    state=lambda: {"numpy_bit_generator": rng.bit_generator.state},
    set_state=set_state,
  )


def run_identity(job: RunConfig, cfg) -> dict:
  """Describe what a resumed run must share with the saved one (see checkpointing).

  Args:
    job: the :class:`RunConfig`.
    cfg: the :class:`Gemma4Config`.

  Returns:
    The run's identity, a dict.
  """
  identity = {
    "model_config": cfg.to_hf(),
    "batch_size": job.dataset.batch_size,
    "seq_len": job.dataset.seq_len,
    "microbatches": job.dataset.microbatches,
    "data": job.dataset.path,
    "seed": job.seed,
  }
  if job.lora.rank is not None:  # what the saved adapters and moments are
    identity["lora"] = {
      "rank": job.lora.rank,
      "alpha": job.lora.alpha,
      "targets": (
        job.lora.targets if isinstance(job.lora.targets, str) else list(job.lora.targets)
      ),
      "base_dtype": job.lora.base_dtype,
    }
  return identity


def resume(job: RunConfig, trainer: TrainState, data: Data, log):
  """Open the run's checkpoints; with ``--resume`` restore from the latest one.

  With ``--resume`` the training state and the data's place come back from
  the latest checkpoint.

  Args:
    job: the :class:`RunConfig`.
    trainer: the :class:`TrainState`.
    data: the :class:`Data`.
    log: prints a line.

  Returns:
    ``(first_step, checkpointer or None)``.
  """
  first_step, checkpointer = 0, None
  if job.checkpointing.state_dir:
    from cpjax.training.checkpointing import TrainCheckpointer, check_run_matches

    checkpointer = TrainCheckpointer(
      job.checkpointing.state_dir, save_every=job.checkpointing.save_every
    )
    if job.checkpointing.resume:
      try:  # before any array is read: a different run's arrays may not even fit
        check_run_matches(
          checkpointer.saved_run(),
          run_identity(job, trainer.cfg),
          force=job.checkpointing.force_resume,
        )
      except ValueError as e:
        raise JobError(str(e)) from None
      first_step, restored = checkpointer.restore(
        params_like=trainer.params, opt_state_like=trainer.opt_state
      )
      trainer.params, trainer.opt_state = restored["params"], restored["opt_state"]
      data.set_state(restored["data_state"])
      log(f"resumed from {job.checkpointing.state_dir} after step {first_step}")
    elif checkpointer.latest_step() is not None:
      raise JobError(
        f"{job.checkpointing.state_dir} already holds a checkpoint (step "
        f"{checkpointer.latest_step()}); resume it with --resume or choose "
        f"another directory"
      )
  if first_step >= job.optimizer.steps:
    raise JobError(
      f"the checkpoint is after step {first_step}; --steps {job.optimizer.steps} leaves "
      f"nothing to train"
    )
  return first_step, checkpointer


def describe(job: RunConfig, trainer: TrainState, log) -> None:
  """Log the run's opening line: model, data, shapes, mesh, devices and dtype.

  Args:
    job: the :class:`RunConfig`.
    trainer: the :class:`TrainState`.
    log: prints a line.
  """
  import jax

  devices = list(trainer.mesh.devices.flat)
  procs = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
  t = trainer.cfg.text
  what = trainer.description
  what += f", data {job.dataset.path}" if job.dataset.path else ", synthetic multimodal data"
  mesh_text = " x ".join(f"{name}={size}" for name, size in trainer.mesh.shape.items())
  accum = f" in {job.dataset.microbatches} microbatches" if job.dataset.microbatches > 1 else ""
  log(
    f"cpjax train: {what}: {t.num_hidden_layers} layers d={t.hidden_size}, "
    f"S={job.dataset.seq_len} B={job.dataset.batch_size}{accum}, "
    f"mesh {mesh_text} ({job.parallel.layout}) on "
    f"{len(devices)} {devices[0].platform.upper()} devices{procs}, {job.dtype}"
  )
  if job.parallel.strategy == "auto":
    from cpjax.training.cp_strategy import run_choices

    for kind, choice in run_choices(job, trainer.cfg.text, device_memory=_device_memory()).items():
      log(f"  cp strategy for {kind}: {choice.strategy} ({choice.why})")


def _strategies(job: RunConfig, trainer: TrainState) -> dict:
  """The run's CP strategies (``parallel.strategy``, or with ``auto`` the
  rule's choice per layer kind and the loss's auto), as keywords of
  :func:`cpjax.training.make_train_step`; the rule budgets for the
  accelerator's memory (what JAX may use of it, where ``cpjax plan --target``
  takes the chip's whole memory: they differ only at the rule's edge)."""
  from cpjax.training.cp_strategy import for_run

  return for_run(job, trainer.cfg.text, device_memory=_device_memory())


def _device_memory() -> int | None:
  """One accelerator device's memory; None on the CPU (the rule's default:
  emulated devices share the host's)."""
  import jax

  device = jax.devices()[0]
  if device.platform == "cpu":
    return None
  return (device.memory_stats() or {}).get("bytes_limit")


def step_batches(job: RunConfig, trainer: TrainState, data: Data):
  """Fetch the step's rows (as microbatches) and shard them.

  Args:
    job: the :class:`RunConfig`.
    trainer: the :class:`TrainState`.
    data: the :class:`Data`.

  Returns:
    The step's rows (as microbatches), their sharded form and its layout.
  """
  parts = [data.next_batch() for _ in range(job.dataset.microbatches)]
  placed = [
    trainer.sharder.shard_batch(b, trainer.mesh, batch_axis=trainer.batch_axis) for b in parts
  ]
  layouts = {lay for _, lay in placed}
  assert len(layouts) == 1, "every batch has the same padded shape"
  sharded = placed[0][0] if job.dataset.microbatches == 1 else [b for b, _ in placed]
  return parts, sharded, placed[0][1]


# -- The periodic work: hooks the loop calls after each step --------------


def make_hooks(
  job: RunConfig,
  trainer: TrainState,
  data: Data,
  batches,
  layout,
  checkpointer,
  first_step: int,
  summary: dict,
  log,
) -> list:
  """Make the periodic work, in order.

  A later hook reads what an earlier one wrote into the step's record: parity
  at step 1, validation, the metrics file, TensorBoard, checkpoints. Each
  carries its ``name`` for errors.

  Args:
    job: the :class:`RunConfig`.
    trainer: the :class:`TrainState`.
    data: the :class:`Data`.
    batches: the first step's rows, for the parity check.
    layout: the step's layout.
    checkpointer: the checkpointer, or None.
    first_step: the step the run starts after.
    summary: the run's summary dict, which hooks write into.
    log: prints a line.

  Returns:
    The hooks, in order.
  """
  hooks = []

  def add(name, hook):
    hook.name = name
    hooks.append(hook)

  if job.parity_check and first_step == 0:
    add("parity check", parity_hook(job, trainer, batches, summary, log))
  if job.eval.data:
    add("validation", eval_hook(job, trainer, layout, summary, log))
  metrics_file = job.logging.metrics or (
    os.path.join(job.checkpointing.state_dir, "metrics.jsonl")
    if job.checkpointing.state_dir
    else None
  )
  if metrics_file:
    add("metrics file", metrics_hook(metrics_file, job.optimizer.lr_schedule(), first_step))
    summary["metrics_file"] = metrics_file
  if job.logging.tensorboard:
    add("TensorBoard", tensorboard_hook(job.logging.tensorboard, job.optimizer.lr_schedule()))
  if checkpointer is not None:
    add("checkpoint", save_hook(job, trainer, data, checkpointer, log))
  return hooks


def parity_hook(job: RunConfig, trainer: TrainState, batches, summary: dict, log):
  """Make the parity check hook.

  At step 1, the CP step's loss and gradient norm against the same rows on
  one device with unsharded parameters; a disagreement stops the run.

  Args:
    job: the :class:`RunConfig`.
    trainer: the :class:`TrainState`.
    batches: the first step's rows (as microbatches).
    summary: the run's summary dict.
    log: prints a line.

  Returns:
    The hook.
  """
  import jax
  import optax

  from cpjax import training
  from cpjax.models import gemma4

  # Sum the microbatches' CE sums and gradients, divide once by the whole
  # step's token count, as the step does.
  single = jax.jit(jax.value_and_grad(training.make_loss_fn(trainer.graphdef), has_aux=True))
  params, frozen = trainer.reference
  ce_sum, count, ref_grads = 0.0, 0.0, None
  for b in batches:
    (s, n), g = single(params, gemma4.prepare_batch(b, trainer.cfg), frozen)
    ce_sum, count = ce_sum + s, count + n
    ref_grads = g if ref_grads is None else jax.tree.map(jax.numpy.add, ref_grads, g)
  ref_loss = float(ce_sum / count)
  ref_norm = float(optax.tree.norm(jax.tree.map(lambda g: g / count, ref_grads)))

  def hook(i, metrics, record):
    if i != 0:
      return
    dropped = int(np.sum(record.get("expert_dropped", 0)))
    if dropped:
      # The capacity factor drops per device: the one-device model, which
      # holds every token, drops others. Nothing to compare.
      summary["parity"] = {"skipped": f"{dropped} expert pairs dropped"}
      with external_write():
        log(
          f"parity with the single-device model at step 1: not checked, the capacity "
          f"factor dropped {dropped} (token, expert) pairs on the mesh's devices"
        )
      return
    rel_loss = abs(record["loss"] - ref_loss) / abs(ref_loss)
    rel_norm = abs(record["grad_norm"] - ref_norm) / ref_norm
    # float32: the CP step must match the single-device one to summation
    # order. bfloat16 activations round differently on each path; at this
    # size their gradients differ from float32 by ~20% on either path, so
    # only the loss is held to a (bf16-sized) tolerance there.
    tol = 1e-4 if job.dtype == "float32" else 1e-2
    ok = rel_loss <= tol and (job.dtype != "float32" or rel_norm <= tol)
    summary["parity"] = {"rel_loss": rel_loss, "rel_grad_norm": rel_norm, "tolerance": tol}
    checked = "loss and grad norm" if job.dtype == "float32" else "loss"
    with external_write():
      log(
        f"parity with the single-device model at step 1: |dloss|/loss = {rel_loss:.1e}, "
        f"|dgrad_norm|/grad_norm = {rel_norm:.1e} ({checked} within {tol:g})"
      )
    if not ok:
      raise RuntimeError(f"CP and single-device steps disagree: {summary['parity']}")

  return hook


def save_hook(job: RunConfig, trainer: TrainState, data: Data, checkpointer, log):
  """Saves every ``--save-every`` steps and after the last one; closing it
  waits for the last save."""
  run = run_identity(job, trainer.cfg)

  def hook(i, metrics, record):
    del metrics, record
    # The data state BEFORE the next fetch: a resumed run fetches that batch.
    checkpointer.maybe_save(
      i + 1,
      params=trainer.params,
      opt_state=trainer.opt_state,
      data_state=data.state(),
      run=run,
      force=i + 1 == job.optimizer.steps,
    )

  def close():
    checkpointer.wait()
    log(
      f"train state after step {checkpointer.latest_step()} saved to {job.checkpointing.state_dir}"
    )
    checkpointer.close()

  # A function object's attribute, which _close calls: pyrefly knows no such attribute.
  hook.close = close  # pyrefly: ignore[missing-attribute]
  return hook


def eval_rows(job: RunConfig, trainer: TrainState, log) -> list[dict]:
  """Read the fixed validation rows.

  They are the first ``eval_rows`` packed rows of the validation data (in file
  order, one pass), in batches of the step's rows; the last batch is filled up
  with empty rows (they count no token).

  Args:
    job: the :class:`RunConfig`.
    trainer: the :class:`TrainState`.
    log: prints a line.

  Returns:
    The batches of validation rows.
  """
  from cpjax.data.corpus import flatten_image_slots, packed_rows

  assert job.eval.data is not None  # validation runs only with eval.data
  path = corpus_path(job, job.eval.data, "--eval-data", log)
  rows = []
  for row in packed_rows(
    path,
    seq_len=job.dataset.seq_len,
    shuffle=False,
    num_epochs=1,
    process_index=0,
    process_count=1,
    images_per_row=job.dataset.images_per_row,
  ):
    rows.append(check_vocabulary(row, trainer.cfg, f"--eval-data {job.eval.data}"))
    if len(rows) == job.eval.rows:
      break
  # An empty row: no token, no label, and image slots that are all padding.
  fill = {"labels": -100, "image_position_ids": -1}
  empty = {key: np.full_like(value, fill.get(key, 0)) for key, value in rows[0].items()}
  rows += [empty] * (-len(rows) % trainer.rows)
  return [
    flatten_image_slots(
      {key: np.stack([r[key] for r in rows[i : i + trainer.rows]]) for key in rows[0]}
    )
    for i in range(0, len(rows), trainer.rows)
  ]


def eval_hook(job: RunConfig, trainer: TrainState, layout, summary: dict, log):
  """Make the validation hook.

  Every ``eval_every`` steps and after the last one: the token-mean loss of
  the fixed validation rows, with the training step's CP forward and
  shardings (no gradient), into the step's record as ``eval_loss``.

  Args:
    job: the :class:`RunConfig`.
    trainer: the :class:`TrainState`.
    layout: the step's layout.
    summary: the run's summary dict.
    log: prints a line.

  Returns:
    The hook.
  """
  import jax

  from cpjax import training

  host = eval_rows(job, trainer, log)
  placed = [
    trainer.sharder.shard_batch(b, trainer.mesh, batch_axis=trainer.batch_axis) for b in host
  ]
  assert all(lay == layout for _, lay in placed), "validation rows have the step's shape"
  loss_sums = jax.jit(
    training.make_loss_fn(
      trainer.graphdef,
      mesh=trainer.mesh,
      layout=layout,
      expert_axes=trainer.expert_axes,
      capacity_factor=job.experts.capacity_factor,
      **_strategies(job, trainer),
    )
  )
  counted = sum(int(np.sum(b["labels"] != -100)) for b in host)
  summary["eval_rows"] = sum(int(np.any(b["attention_mask"], axis=1).sum()) for b in host)
  summary["eval_losses"] = []

  def hook(i, metrics, record):
    del metrics
    if not ((job.eval.every and (i + 1) % job.eval.every == 0) or i + 1 == job.optimizer.steps):
      return
    ce_sum = count = 0.0
    with jax.set_mesh(trainer.mesh):
      for batch, _ in placed:
        s, n = loss_sums(trainer.params, batch, trainer.frozen)
        ce_sum, count = ce_sum + host_value(s), count + host_value(n)
    assert count == counted, "the CP loss counts every validation label once"
    record["eval_loss"] = ce_sum / max(count, 1.0)
    summary["eval_losses"].append((i + 1, record["eval_loss"]))
    with external_write():
      log(
        f"step {i + 1}: validation loss {record['eval_loss']:.4f} over "
        f"{summary['eval_rows']} rows ({int(count)} target tokens)"
      )

  return hook


def metrics_hook(path: str, schedule, first_step: int):
  """Appends the step's record (plus the learning rate it used and the real
  tokens per second) to ``path`` as one JSON line; only process 0 writes."""
  import jax

  if os.path.dirname(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
  if first_step == 0 and jax.process_index() == 0 and os.path.exists(path):
    os.remove(path)  # a fresh run starts a fresh file; a resumed one appends

  def hook(i, metrics, record):
    line = {
      **record,
      "target_tokens": host_value(metrics["tokens"]),
      "learning_rate": float(schedule(i)),
      "tokens_per_s": record["tokens"] / record["seconds"],
    }
    if jax.process_index() == 0:
      with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")

  return hook


def tensorboard_hook(logdir: str, schedule):
  """Make the hook that writes the step's scalars as TensorBoard events.

  tensorboardX: a pure-Python writer of TensorBoard's event files, without
  TensorFlow; process 0 only.

  Args:
    logdir: the events' directory.
    schedule: the learning-rate schedule.

  Returns:
    The hook.
  """
  import jax

  if jax.process_index() != 0:
    return lambda i, metrics, record: None
  from tensorboardX import SummaryWriter

  writer = SummaryWriter(logdir)

  def hook(i, metrics, record):
    del metrics
    scalars = {
      "loss": record["loss"],
      "grad_norm": record["grad_norm"],
      "learning_rate": float(schedule(i)),
      "tokens_per_s": record["tokens"] / record["seconds"],
    }
    if "eval_loss" in record:
      scalars["eval_loss"] = record["eval_loss"]
    for tag, value in scalars.items():
      writer.add_scalar(tag, value, record["step"])

  # Writes what its thread still holds (flush() does not); a function object's
  # attribute, which _close calls: pyrefly knows no such attribute.
  hook.close = writer.close  # pyrefly: ignore[missing-attribute]
  return hook


def external_write():
  """Return tqdm's context for printing a line of its own, outside the progress bar.

  Returns:
    The context manager.
  """
  from tqdm.auto import tqdm

  return tqdm.external_write_mode()  # a line of its own, not inside the bar


# -- The step loop ----------------------------------------------------------


def run_train_job(job: RunConfig, *, log=print) -> dict:
  """Train and return a summary dict (what the closing lines print).

  The phases: build the model and mesh, open the data, resume, compile the
  step, check parity with the single-device model, run the step loop (with
  the periodic work as hooks after each step; a hook with a ``close``
  method is closed after the loop), report.

  ``job`` is a :class:`RunConfig`; it is checked first
  (:func:`~cpjax.training.run_config.check`), and
  written as ``run.yaml`` into ``checkpointing.state_dir`` when the run
  starts and beside the ``checkpointing.save`` output at the end.

  In a multi-process cluster every process runs this with the same job;
  only process 0 logs.
  """
  import jax

  if not isinstance(job, RunConfig):
    raise TypeError(f"run_train_job takes a RunConfig, got {type(job).__name__}")
  check(job)
  if jax.process_index() != 0:
    log = lambda *_: None  # noqa: E731
  trainer = build(job)
  data = open_data(job, trainer.cfg, trainer.rows, log)
  first_step, checkpointer = resume(job, trainer, data, log)
  if job.checkpointing.state_dir and jax.process_index() == 0:
    write_run_config(job, job.checkpointing.state_dir)
  describe(job, trainer, log)

  batches, sharded, layout = step_batches(job, trainer, data)
  from cpjax import training

  step = training.make_train_step(
    trainer.graphdef,
    trainer.optimizer,
    mesh=trainer.mesh,
    layout=layout,
    frozen=trainer.frozen,
    expert_axes=trainer.expert_axes,
    capacity_factor=job.experts.capacity_factor,
    **_strategies(job, trainer),
  )
  step = step.compile(trainer.params, trainer.opt_state, sharded)  # once; every step reuses it

  summary = {"job": dataclasses.asdict(job)}
  hooks = make_hooks(job, trainer, data, batches, layout, checkpointer, first_step, summary, log)
  try:
    losses, real_tokens, times = _loop(
      job, trainer, data, step, sharded, batches, layout, first_step=first_step, hooks=hooks
    )
  except _HookFailed as failure:
    # What was trained is saved before the error ends the run.
    try:
      saved = _save_after_failure(job, trainer, data, checkpointer, failure, summary, log)
    finally:
      _close(hooks)
    raise RuntimeError(
      f"the {failure.name} hook failed after step {failure.step}: "
      f"{type(failure.error).__name__}: {failure.error} ({saved})"
    ) from failure.error
  _close(hooks)
  return _report(job, trainer, step, summary, losses, real_tokens, times, first_step, log)


class _HookFailed(Exception):
  """A hook raised after step ``step`` (counted from 1)."""

  def __init__(self, name: str, step: int, error: BaseException):
    super().__init__(name, step, error)
    self.name, self.step, self.error = name, step, error


def _close(hooks) -> None:
  for hook in hooks:  # a hook that holds a file or a writer closes it
    getattr(hook, "close", lambda: None)()


def _save_after_failure(
  job: RunConfig, trainer, data, checkpointer, failure: _HookFailed, summary: dict, log
) -> str:
  """Saves the training state after the failed step (``--state-dir``, unless
  the checkpoint hook already did or is what failed) and the ``--save``
  output; says what was saved. Nothing is saved after a failed parity check
  (the run disagrees with the single-device model), nor in a multi-process
  run (a hook that writes files runs on process 0 alone, and a save is a
  collective the other processes would never join)."""
  import jax

  step = failure.step
  if failure.name == "parity check":
    return "nothing was saved: the run disagrees with the single-device model"
  if jax.process_count() > 1:
    return (
      f"nothing was saved after step {step}: the run spans {jax.process_count()} "
      f"processes; --state-dir holds the last periodic checkpoint"
    )
  saved = []
  if checkpointer is not None and failure.name != "checkpoint":
    try:
      if checkpointer.latest_step() != step:
        checkpointer.maybe_save(
          step,
          params=trainer.params,
          opt_state=trainer.opt_state,
          data_state=data.state(),
          run=run_identity(job, trainer.cfg),
          force=True,
        )
      saved.append(f"the train state after step {step} is in {job.checkpointing.state_dir}")
    except Exception as e:  # noqa: BLE001 -- reported, and --save still tried
      saved.append(f"saving the train state failed too: {type(e).__name__}: {e}")
  if job.checkpointing.save:
    try:
      summary["saved"] = _save_model(job, trainer, log)
      saved.append(f"the weights after step {step} are in {job.checkpointing.save}")
    except Exception as e:  # noqa: BLE001 -- reported with the hook's error
      saved.append(f"saving --save failed too: {type(e).__name__}: {e}")
  return "; ".join(saved) or "nothing was saved: no --save or --state-dir"


def _loop(
  job: RunConfig,
  trainer: TrainState,
  data: Data,
  step,
  sharded,
  batches,
  layout,
  *,
  first_step: int,
  hooks,
):
  """The step loop: ``(losses, real tokens, seconds per step)``. After each
  step every hook runs as ``hook(i, metrics, record)``: ``i`` counts from 0,
  ``metrics`` are the step's (device arrays), ``record`` the step's host
  values (``step``, ``loss``, ``grad_norm``, ``tokens``: real tokens,
  ``seconds``), to which a hook may add (the validation loss)."""
  import jax
  from tqdm.auto import tqdm

  losses, real_tokens, times = [], 0, []
  bar = tqdm(
    range(first_step, job.optimizer.steps),
    desc="train",
    unit="step",
    leave=True,
    disable=jax.process_index() != 0,
  )
  for i in bar:
    start = time.perf_counter()
    trainer.params, trainer.opt_state, metrics = step(trainer.params, trainer.opt_state, sharded)
    loss = host_value(metrics["loss"])
    times.append(time.perf_counter() - start)
    tokens = sum(int(np.sum(b["attention_mask"])) for b in batches)
    record = {
      "step": i + 1,
      "loss": loss,
      "grad_norm": host_value(metrics["grad_norm"]),
      "tokens": tokens,
      "seconds": times[-1],
    }
    for key in ("expert_tokens", "expert_dropped"):  # a mixture of experts' routing
      if key in metrics:
        record[key] = np.asarray(jax.device_get(metrics[key])).astype(int).tolist()
    for hook in hooks:
      try:
        hook(i, metrics, record)
      except Exception as e:
        raise _HookFailed(hook.name, i + 1, e) from e
    losses.append(loss)
    real_tokens += tokens
    bar.set_postfix(loss=f"{loss:.3f}")
    batches, sharded, lay = step_batches(job, trainer, data)
    assert lay == layout, "every batch has the same padded shape"
  return losses, real_tokens, times


def _save_model(job: RunConfig, trainer: TrainState, log) -> list[str] | None:
  """``--save``: the trained model as a Hugging Face checkpoint, or the LoRA
  adapter as PEFT's files (or merged into the base); the files written."""
  if not job.checkpointing.save:
    return None
  import jax
  from flax import nnx

  from cpjax.training import lora

  trained = nnx.merge(trainer.graphdef, *jax.device_get((trainer.params, trainer.frozen)))
  if job.lora.rank is not None and not job.lora.merge:
    files = lora.save_adapter(
      trained, job.checkpointing.save, base_model_name_or_path=job.checkpoint
    )
    write_run_config(job, job.checkpointing.save)
    log(
      f"saved the LoRA adapter to {job.checkpointing.save} (PEFT's adapter_config.json, "
      f"adapter_model.safetensors, and the run's run.yaml)"
    )
    return files
  if job.lora.rank is not None:
    trained = lora.merge_lora(trained)
  files = trained.save_pretrained(job.checkpointing.save)
  # A fine-tuned checkpoint keeps the tokenizer and template it was trained
  # with (--tokenizer's, else the checkpoint's) and the checkpoint's processor
  # and generation settings, so that it loads as the original did.
  kept = []
  for name in _BESIDE_WEIGHTS:
    source = (
      job.dataset.tokenizer
      if job.dataset.tokenizer and name in _TOKENIZER_FILES
      else job.checkpoint
    )
    path = os.path.join(source, name) if source else None
    if path and os.path.isfile(path):
      target = os.path.join(job.checkpointing.save, name)
      if not (os.path.exists(target) and os.path.samefile(path, target)):
        shutil.copyfile(path, target)
      kept.append(name)
  write_run_config(job, job.checkpointing.save)
  kept.append("run.yaml")
  merged = " with the LoRA adapter merged in" if job.lora.rank is not None else ""
  also = f", and {', '.join(kept)}"
  log(
    f"saved a Hugging Face checkpoint{merged} to {job.checkpointing.save} "
    f"({len(files)} safetensors "
    f"file(s){also})"
  )
  return files


# The files of a checkpoint directory besides its config and weights.
_TOKENIZER_FILES = (
  "tokenizer.json",
  "tokenizer_config.json",
  "tokenizer.model",
  "special_tokens_map.json",
  "chat_template.jinja",
)
_BESIDE_WEIGHTS = (
  "generation_config.json",
  *_TOKENIZER_FILES,
  "processor_config.json",
  "preprocessor_config.json",
)


def _report(
  job: RunConfig,
  trainer: TrainState,
  step,
  summary: dict,
  losses,
  real_tokens,
  times,
  first_step: int,
  log,
) -> dict:
  mem = step.memory_analysis()
  steady = times[1:] or times
  tokens_per_step = real_tokens / len(times)
  summary.update(
    {
      "losses": losses,
      "first_step": first_step,
      "loss_first": losses[0],
      "loss_last": losses[-1],
      "eval_loss": summary["eval_losses"][-1][1] if summary.get("eval_losses") else None,
      "tokens_per_s": tokens_per_step / float(np.median(steady)),
      "first_step_s": times[0],
      "scratch_mib_per_device": mem.temp_size_in_bytes / 2**20,
      "arguments_mib_per_device": mem.argument_size_in_bytes / 2**20,
    }
  )
  ran = (
    f"over {len(losses)} steps"
    if first_step == 0
    else f"over steps {first_step + 1}-{job.optimizer.steps} ({len(losses)} steps)"
  )
  log(
    f"loss {losses[0]:.3f} -> {losses[-1]:.3f} {ran}; "
    f"{summary['tokens_per_s']:.0f} real tokens/s after the first step "
    f"(first step {times[0]:.1f} s)"
  )
  if job.checkpointing.save:
    summary["saved"] = _save_model(job, trainer, log)
  log(
    f"per-device memory of the compiled step: scratch {summary['scratch_mib_per_device']:.1f} MiB, "
    f"arguments {summary['arguments_mib_per_device']:.1f} MiB"
  )
  return summary
