"""The main job: train Gemma 4 with context parallelism.

A tiny real-architecture Gemma 4 by default (``--model`` picks a preset, or
``--checkpoint`` fine-tunes a Hugging Face checkpoint).

Synthetic packed multimodal data, or the user's own (a prepared corpus, or
JSONL texts and conversations tokenized with the checkpoint's tokenizer); a
progress bar, a parity check of the first step against the single-device
model, a validation loss, a learning-rate schedule, a metrics file with a
JSON line per step, and a closing summary.
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

__all__ = ["JobError", "LR_SCHEDULES", "TrainJob", "learning_rate_schedule", "make_optimizer",
           "run_train_job"]


class JobError(ValueError):
  """A job that cannot run as asked, found before any training compute
  (``cpjax train`` prints it as a one-line usage error, exit status 2)."""


@dataclasses.dataclass(frozen=True)
class TrainJob:
  seq_len: int = 1024
  cp: int = 8
  layout: str = "load_balanced"
  steps: int = 20
  seed: int = 0
  dtype: str = "float32"
  batch_size: int = 2
  learning_rate: float = 3e-3
  parity_check: bool = True
  model: str = "tiny"
  checkpoint: str | None = None
  remat: bool | str = False
  save: str | None = None
  data: str | None = None
  state_dir: str | None = None
  save_every: int = 0
  resume: bool = False
  force_resume: bool = False
  mesh: str | None = None        # e.g. "fsdp=2,cp=4"; None: cp only
  microbatches: int = 1          # gradient accumulation: batch_size // microbatches rows each
  tokenizer: str | None = None   # for JSONL data: the tokenizer's directory (default checkpoint)
  truncate: bool = False         # JSONL documents longer than seq_len: cut (else dropped)
  eval_data: str | None = None   # validation data (a corpus or JSONL)
  eval_every: int = 0            # steps between validations (0: only after the last step)
  eval_rows: int = 16            # the fixed validation rows: the first ones of eval_data
  warmup_steps: int = 0          # linear warmup from 0 to learning_rate
  lr_schedule: str = "constant"  # after warmup: constant, cosine or linear (decay to 0)
  max_grad_norm: float | None = None   # clip the global gradient norm (None: no clipping)
  metrics: str | None = None     # JSONL of per-step metrics (default: state_dir/metrics.jsonl)
  tensorboard: str | None = None  # a TensorBoard log directory for the same metrics
  images_per_row: int | None = None   # image slots per row (default: most images of a document)
  lora_rank: int | None = None   # LoRA: train rank-r adapters on a frozen base (None: every weight)
  lora_alpha: float = 8.0        # the adapters' scale is alpha / rank (PEFT's default alpha)
  lora_targets: str | None = None     # regex on module paths (default cpjax.lora.DEFAULT_LORA_TARGETS)
  base_dtype: str = "float32"    # the frozen base's storage dtype under LoRA
  merge_lora: bool = False       # --save writes the merged model instead of the adapter
  capacity_factor: float | None = None   # MoE: each expert's pairs per device (None: no limit)


LR_SCHEDULES = ("constant", "cosine", "linear")


def learning_rate_schedule(job: TrainJob):
  """The optax schedule of ``job``: step -> learning rate (step 0 is the first
  update). As transformers' ``get_{constant,cosine,linear}_schedule_with_warmup``:
  ``lr * s / warmup`` during the warmup, then constant, a half cosine or a
  straight line from ``lr`` to 0 at ``job.steps``.

  >>> s = learning_rate_schedule(TrainJob(learning_rate=1.0, steps=10, warmup_steps=2,
  ...                                     lr_schedule="linear"))
  >>> [round(float(s(i)), 3) for i in (0, 1, 2, 6, 10)]
  [0.0, 0.5, 1.0, 0.5, 0.0]
  """
  import optax

  if job.lr_schedule not in LR_SCHEDULES:
    raise JobError(f"lr_schedule must be one of {LR_SCHEDULES}, got {job.lr_schedule!r}")
  if job.warmup_steps < 0 or (job.lr_schedule != "constant" and job.warmup_steps >= job.steps):
    raise JobError(f"--warmup-steps {job.warmup_steps} must be >= 0, and below --steps "
                   f"{job.steps} for a {job.lr_schedule} schedule (it decays after the warmup)")
  lr, warm, rest = job.learning_rate, job.warmup_steps, max(job.steps - job.warmup_steps, 1)
  after = {"constant": optax.constant_schedule(lr),
           "cosine": optax.cosine_decay_schedule(lr, rest),
           "linear": optax.linear_schedule(lr, 0.0, rest)}[job.lr_schedule]
  if warm == 0:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, lr, warm), after], [warm])


def make_optimizer(job: TrainJob):
  """AdamW (weight decay 0.01) on :func:`learning_rate_schedule`, after
  clipping the global gradient norm to ``job.max_grad_norm`` when set."""
  import optax

  optimizer = optax.adamw(learning_rate_schedule(job), weight_decay=0.01)
  if job.max_grad_norm is None:
    return optimizer
  return optax.chain(optax.clip_by_global_norm(job.max_grad_norm), optimizer)


def _compute_dtype(name: str):
  import jax.numpy as jnp

  return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def _host(x) -> float:
  """A replicated scalar's value, also when the array spans other processes."""
  return float(np.asarray(x.addressable_data(0)))


def _checkpoint_sharding(cfg, mesh, rule):
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
  specs = parallel.param_specs(nested, mesh, rule=rule)

  def sharding(key, shape):
    node = specs
    for name in key.split("."):
      if not isinstance(node, dict) or name not in node:
        return None                     # a buffer (layer_scalar, clip bounds): replicated
      node = node[name]
    return node

  return sharding


@dataclasses.dataclass
class _Trainer:
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
class _Data:
  """A batch source: ``next_batch()`` gives one microbatch of rows; ``state``
  / ``set_state`` save and restore where it is, for resume."""

  next_batch: Callable[[], dict]
  state: Callable[[], dict]
  set_state: Callable[[dict], None]


def run_train_job(job: TrainJob, *, log=print) -> dict:
  """Train and return a summary dict (what the closing lines print).

  The phases: build the model and mesh, open the data, resume, compile the
  step, check parity with the single-device model, run the step loop (with
  the periodic work as hooks after each step; a hook with a ``close``
  method is closed after the loop), report.

  In a multi-process cluster every process runs this with the same job;
  only process 0 logs.
  """
  import jax

  if jax.process_index() != 0:
    log = lambda *_: None  # noqa: E731
  trainer = _build(job)
  data = _open_data(job, trainer.cfg, trainer.rows, log)
  first_step, checkpointer = _resume(job, trainer, data, log)
  _describe(job, trainer, log)

  batches, sharded, layout = _step_batches(job, trainer, data)
  from cpjax import train

  step = train.make_train_step(trainer.graphdef, trainer.optimizer, mesh=trainer.mesh,
                               layout=layout, frozen=trainer.frozen,
                               expert_axes=trainer.expert_axes,
                               capacity_factor=job.capacity_factor)
  step = step.compile(trainer.params, trainer.opt_state, sharded)  # once; every step reuses it

  summary = {"job": dataclasses.asdict(job)}
  hooks = _hooks(job, trainer, data, batches, layout, checkpointer, first_step, summary, log)
  try:
    losses, real_tokens, times = _loop(job, trainer, data, step, sharded, batches, layout,
                                       first_step=first_step, hooks=hooks)
  except _HookFailed as failure:
    # What was trained is saved before the error ends the run.
    saved = _save_after_failure(job, trainer, data, checkpointer, failure.step, summary, log)
    _close(hooks)
    raise RuntimeError(f"the {failure.name} hook failed after step {failure.step}: "
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
  for hook in hooks:            # a hook that holds a file or a writer closes it
    getattr(hook, "close", lambda: None)()


def _save_after_failure(job: TrainJob, trainer, data, checkpointer, step: int, summary: dict,
                        log) -> str:
  """Saves the training state after ``step`` (``--state-dir``, unless the
  checkpoint hook already did) and the ``--save`` output; says what was saved."""
  saved = []
  if checkpointer is not None:
    if checkpointer.latest_step() != step:
      checkpointer.maybe_save(step, params=trainer.params, opt_state=trainer.opt_state,
                              data_state=data.state(), run=_run_identity(job, trainer.cfg),
                              force=True)
    saved.append(f"the train state after step {step} is in {job.state_dir}")
  if job.save:
    summary["saved"] = _save_model(job, trainer, log)
    saved.append(f"the weights after step {step} are in {job.save}")
  return "; ".join(saved) or "nothing was saved: no --save or --state-dir"


# ------------------------------------------------------------------ the phases
def _build(job: TrainJob) -> _Trainer:
  """The mesh, the model (random init or a checkpoint, each device reading
  its own shards), the optimizer, and the sharded training state."""
  import jax
  from flax import nnx

  from cpjax import lora, parallel
  from cpjax.models import gemma4
  from cpjax.models.gemma4.partitioning import check_mesh, partition_rule

  sizes = parallel.parse_mesh(job.mesh) if job.mesh else {"cp": job.cp}
  ep = sizes.pop("ep", 1)
  mesh = parallel.make_mesh(**sizes)
  try:
    expert_axes = parallel.expert_axes(mesh, ep)
  except ValueError as e:
    raise JobError(f"--mesh {job.mesh}: {e}") from None
  devices = list(mesh.devices.flat)
  if job.batch_size % job.microbatches:
    raise JobError(f"--microbatches {job.microbatches} does not divide --batch-size "
                   f"{job.batch_size}")
  rows = job.batch_size // job.microbatches
  auto = [n for n in mesh.axis_names if n != "cp" and mesh.shape[n] > 1]
  if job.dtype == "bfloat16" and auto and devices[0].platform == "cpu":
    # jax 0.10's CPU SPMD partitioner aborts the process (a failed check,
    # not an exception) on bfloat16 weight gradients over an fsdp/tp/dp axis
    # inside the ring's shard_map; TPU and GPU compile it.
    raise JobError(f"--dtype bfloat16 with mesh axes {auto} does not compile on the CPU "
                   f"(an XLA:CPU partitioner limitation); use --dtype float32 there")
  compute = _compute_dtype(job.dtype)
  cfg = (gemma4.Gemma4Config.from_hf(job.checkpoint) if job.checkpoint
         else gemma4.Gemma4Config.preset(job.model))
  try:
    check_mesh(cfg, mesh, batch_size=rows, ep=ep)
    if job.capacity_factor is not None and not cfg.text.enable_moe_block:
      raise ValueError(f"--capacity-factor {job.capacity_factor:g} needs a mixture of experts; "
                       f"this Gemma 4 has none")
  except ValueError as e:
    raise JobError(f"{e} (--batch-size {job.batch_size}, --microbatches {job.microbatches})"
                   ) from None
  rule = partition_rule(cfg, tp=sizes.get("tp", 1), expert_axes=expert_axes)
  if job.base_dtype != "float32" and job.lora_rank is None:
    raise JobError(f"--base-dtype {job.base_dtype} needs --lora-rank: full fine-tuning keeps "
                   f"float32 parameters for the optimizer")
  # Full fine-tuning keeps float32 parameters for the optimizer; a frozen
  # LoRA base is stored in --base-dtype. Activations in job.dtype.
  storage = _compute_dtype(job.base_dtype)
  if job.checkpoint:
    # Each device reads only its shard of each tensor.
    model = gemma4.Gemma4.from_pretrained(job.checkpoint, remat=job.remat, mesh=mesh,
                                          sharding=_checkpoint_sharding(cfg, mesh, rule),
                                          dtype=storage)
    model.dtype = compute
    description = f"Gemma 4 from {job.checkpoint}"
  else:
    model = gemma4.Gemma4(cfg, rngs=nnx.Rngs(job.seed), dtype=compute, remat=job.remat,
                          param_dtype=storage)
    description = f"Gemma 4 {job.model!r} (random init)"
  sharder = model.prepare_model_inputs_for_cp(layout=job.layout)["cp_sharder"]
  if job.lora_rank is None:
    # Buffers (layer_scalar, clip bounds) ride along untrained, as in transformers.
    graphdef, params, frozen = nnx.split(model, nnx.Param, ...)
  else:
    model, graphdef, params, frozen = _lora(job, model)
    description += (f", LoRA r={job.lora_rank} alpha={job.lora_alpha:g} on "
                    f"{len(lora.adapted_modules(model))} projections "
                    f"({lora.lora_param_count(model):,} adapter values; base frozen in "
                    f"{job.base_dtype})")
  optimizer = make_optimizer(job)
  # FSDP / TP: each device keeps its shard of the parameters and of Adam's
  # moments (and of a frozen LoRA base).
  specs = parallel.param_specs(params, mesh, rule=rule)
  # The parity reference runs on one device, as a user's single-device model would.
  # (Through the host: an array placed on an Explicit mesh keeps the mesh in
  # its type, and a single-device jit refuses it.)
  reference = (jax.tree.map(lambda x: jax.device_put(np.asarray(x), devices[0]),
                            (params, frozen)) if job.parity_check else None)
  params = parallel.shard_params(params, mesh, specs)
  # What the step only reads lives on the mesh too (a random init's buffers
  # are uncommitted, a checkpoint's are read there): jitted programs over the
  # mesh (the step, validation) refuse arrays committed elsewhere.
  frozen = parallel.shard_params(frozen, mesh, parallel.param_specs(frozen, mesh, rule=rule))
  opt_state = parallel.shard_like_params(optimizer.init(params), params)
  return _Trainer(cfg=cfg, mesh=mesh, rows=rows, batch_axis=parallel.batch_axis_of(mesh),
                  sharder=sharder, graphdef=graphdef, frozen=frozen, optimizer=optimizer,
                  params=params, opt_state=opt_state, reference=reference,
                  description=description, expert_axes=expert_axes)


def _lora(job: TrainJob, model):
  """``(model, graphdef, adapters, frozen)``: ``model`` with LoRA adapters
  (:func:`cpjax.lora.apply_lora`) split for the step."""
  from cpjax import lora

  try:
    settings = lora.LoraSettings(rank=job.lora_rank, alpha=job.lora_alpha,
                                 targets=job.lora_targets or lora.DEFAULT_LORA_TARGETS)
    model = lora.apply_lora(model, rank=settings.rank, alpha=settings.alpha,
                            targets=settings.targets, seed=job.seed)
  except (ValueError, TypeError) as e:
    raise JobError(f"LoRA: {e}") from None
  return (model, *lora.split_lora(model))


def _corpus(job: TrainJob, path: str, flag: str, log) -> str:
  """A corpus to read: ``path`` itself, or a JSONL file tokenized into one
  (with the tokenizer and chat template of ``--tokenizer`` or
  ``--checkpoint``) in a fresh temporary directory."""
  if not path.endswith(".jsonl"):
    return path
  import tempfile

  from cpjax.records import prepare_data

  source = job.tokenizer or job.checkpoint
  if source is None:
    raise JobError(f"{flag} {path} is JSONL: tokenizing it needs the checkpoint's tokenizer "
                   f"(--checkpoint DIR or --tokenizer DIR)")
  out = tempfile.mkdtemp(prefix="cpjax-corpus-")
  atexit.register(shutil.rmtree, out, ignore_errors=True)   # read lazily during the run
  try:
    summary = prepare_data(path, out, checkpoint=source, seq_len=job.seq_len,
                           truncate=job.truncate, progress=False)
  except (ValueError, FileNotFoundError) as e:
    raise JobError(f"{flag} {path}: {e}") from None
  for line in summary.lines(show=5):
    log(line)
  return out


def _check_vocabulary(batch: dict, cfg, where: str) -> dict:
  top = int(batch["input_ids"].max())
  if top >= cfg.text.vocab_size:
    raise ValueError(f"{where} holds token id {top}, outside the model's vocabulary of "
                     f"{cfg.text.vocab_size}")
  return batch


def _open_data(job: TrainJob, cfg, rows: int, log) -> _Data:
  """The corpus (``--data``) or synthetic packed multimodal rows."""
  if job.data:
    from cpjax.corpus import packed_batches

    # Every process feeds the same global batch (the sharder places each
    # process's part), so every process reads the whole corpus here.
    path = _corpus(job, job.data, "--data", log)
    stream = iter(packed_batches(path, batch_size=rows, seq_len=job.seq_len,
                                 seed=job.seed, process_index=0, process_count=1,
                                 images_per_row=job.images_per_row))

    def next_batch():
      return _check_vocabulary(next(stream), cfg, f"--data {job.data}")

    return _Data(next_batch, state=lambda: {"grain": stream.get_state()},
                 set_state=lambda state: stream.set_state(state["grain"]))

  from cpjax.models import gemma4

  rng = np.random.default_rng(job.seed)

  def set_state(state):
    rng.bit_generator.state = state["numpy_bit_generator"]

  return _Data(lambda: gemma4.synthetic_batch(rng, cfg, batch_size=rows, seq_len=job.seq_len,
                                              max_docs=6),
               state=lambda: {"numpy_bit_generator": rng.bit_generator.state},
               set_state=set_state)


def _run_identity(job: TrainJob, cfg) -> dict:
  """What a resumed run must share with the saved one (see checkpointing)."""
  from cpjax import lora

  identity = {"model_config": cfg.to_hf(), "batch_size": job.batch_size,
              "seq_len": job.seq_len, "microbatches": job.microbatches, "data": job.data,
              "seed": job.seed}
  if job.lora_rank is not None:        # what the saved adapters and moments are
    identity["lora"] = {"rank": job.lora_rank, "alpha": job.lora_alpha,
                        "targets": job.lora_targets or lora.DEFAULT_LORA_TARGETS,
                        "base_dtype": job.base_dtype}
  return identity


def _resume(job: TrainJob, trainer: _Trainer, data: _Data, log):
  """``(first_step, checkpointer or None)``; with ``--resume`` the training
  state and the data's place come back from the latest checkpoint."""
  first_step, checkpointer = 0, None
  if job.state_dir:
    from cpjax.checkpointing import TrainCheckpointer, check_run_matches

    checkpointer = TrainCheckpointer(job.state_dir, save_every=job.save_every)
    if job.resume:
      try:      # before any array is read: a different run's arrays may not even fit
        check_run_matches(checkpointer.saved_run(), _run_identity(job, trainer.cfg),
                          force=job.force_resume)
      except ValueError as e:
        raise JobError(str(e)) from None
      first_step, restored = checkpointer.restore(params_like=trainer.params,
                                                  opt_state_like=trainer.opt_state)
      trainer.params, trainer.opt_state = restored["params"], restored["opt_state"]
      data.set_state(restored["data_state"])
      log(f"resumed from {job.state_dir} after step {first_step}")
    elif checkpointer.latest_step() is not None:
      raise JobError(f"{job.state_dir} already holds a checkpoint (step "
                     f"{checkpointer.latest_step()}); resume it with --resume or choose "
                     f"another directory")
  if first_step >= job.steps:
    raise JobError(f"the checkpoint is after step {first_step}; --steps {job.steps} leaves "
                   f"nothing to train")
  return first_step, checkpointer


def _describe(job: TrainJob, trainer: _Trainer, log) -> None:
  import jax

  devices = list(trainer.mesh.devices.flat)
  procs = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
  t = trainer.cfg.text
  what = trainer.description
  what += f", data {job.data}" if job.data else ", synthetic multimodal data"
  mesh_text = " x ".join(f"{name}={size}" for name, size in trainer.mesh.shape.items())
  accum = f" in {job.microbatches} microbatches" if job.microbatches > 1 else ""
  log(f"cpjax train: {what}: {t.num_hidden_layers} layers d={t.hidden_size}, "
      f"S={job.seq_len} B={job.batch_size}{accum}, mesh {mesh_text} ({job.layout}) on "
      f"{len(devices)} {devices[0].platform.upper()} devices{procs}, {job.dtype}")


def _step_batches(job: TrainJob, trainer: _Trainer, data: _Data):
  """The step's rows (as microbatches), their sharded form and its layout."""
  parts = [data.next_batch() for _ in range(job.microbatches)]
  placed = [trainer.sharder.shard_batch(b, trainer.mesh, batch_axis=trainer.batch_axis)
            for b in parts]
  layouts = {lay for _, lay in placed}
  assert len(layouts) == 1, "every batch has the same padded shape"
  sharded = placed[0][0] if job.microbatches == 1 else [b for b, _ in placed]
  return parts, sharded, placed[0][1]


def _loop(job: TrainJob, trainer: _Trainer, data: _Data, step, sharded, batches, layout, *,
          first_step: int, hooks):
  """The step loop: ``(losses, real tokens, seconds per step)``. After each
  step every hook runs as ``hook(i, metrics, record)``: ``i`` counts from 0,
  ``metrics`` are the step's (device arrays), ``record`` the step's host
  values (``step``, ``loss``, ``grad_norm``, ``tokens``: real tokens,
  ``seconds``), to which a hook may add (the validation loss)."""
  import jax
  from tqdm.auto import tqdm

  losses, real_tokens, times = [], 0, []
  bar = tqdm(range(first_step, job.steps), desc="train", unit="step", leave=True,
             disable=jax.process_index() != 0)
  for i in bar:
    start = time.perf_counter()
    trainer.params, trainer.opt_state, metrics = step(trainer.params, trainer.opt_state, sharded)
    loss = _host(metrics["loss"])
    times.append(time.perf_counter() - start)
    tokens = sum(int(np.sum(b["attention_mask"])) for b in batches)
    record = {"step": i + 1, "loss": loss, "grad_norm": _host(metrics["grad_norm"]),
              "tokens": tokens, "seconds": times[-1]}
    for key in ("expert_tokens", "expert_dropped"):   # a mixture of experts' routing
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
    batches, sharded, lay = _step_batches(job, trainer, data)
    assert lay == layout, "every batch has the same padded shape"
  return losses, real_tokens, times


# ------------------------------------------------------------------ the hooks
def _hooks(job: TrainJob, trainer: _Trainer, data: _Data, batches, layout, checkpointer,
           first_step: int, summary: dict, log) -> list:
  """The periodic work, in order (a later hook reads what an earlier one
  wrote into the step's record): parity at step 1, validation, the metrics
  file, TensorBoard, checkpoints. Each carries its ``name`` for errors."""
  hooks = []

  def add(name, hook):
    hook.name = name
    hooks.append(hook)

  if job.parity_check and first_step == 0:
    add("parity check", _parity_hook(job, trainer, batches, summary, log))
  if job.eval_data:
    add("validation", _eval_hook(job, trainer, layout, summary, log))
  metrics_file = job.metrics or (os.path.join(job.state_dir, "metrics.jsonl")
                                 if job.state_dir else None)
  if metrics_file:
    add("metrics file", _metrics_hook(metrics_file, learning_rate_schedule(job), first_step))
    summary["metrics_file"] = metrics_file
  if job.tensorboard:
    add("TensorBoard", _tensorboard_hook(job.tensorboard, learning_rate_schedule(job)))
  if checkpointer is not None:
    add("checkpoint", _save_hook(job, trainer, data, checkpointer, log))
  return hooks


def _parity_hook(job: TrainJob, trainer: _Trainer, batches, summary: dict, log):
  """At step 1, the CP step's loss and gradient norm against the same rows on
  one device with unsharded parameters; a disagreement stops the run."""
  import jax
  import optax
  from tqdm.auto import tqdm

  from cpjax import train
  from cpjax.models import gemma4

  # Sum the microbatches' CE sums and gradients, divide once by the whole
  # step's token count, as the step does.
  single = jax.jit(jax.value_and_grad(train.make_loss_fn(trainer.graphdef), has_aux=True))
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
      with tqdm.external_write_mode():
        log(f"parity with the single-device model at step 1: not checked, the capacity "
            f"factor dropped {dropped} (token, expert) pairs on the mesh's devices")
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
    with tqdm.external_write_mode():      # a line of its own, not inside the bar
      log(f"parity with the single-device model at step 1: |dloss|/loss = {rel_loss:.1e}, "
          f"|dgrad_norm|/grad_norm = {rel_norm:.1e} ({checked} within {tol:g})")
    if not ok:
      raise RuntimeError(f"CP and single-device steps disagree: {summary['parity']}")

  return hook


def _save_hook(job: TrainJob, trainer: _Trainer, data: _Data, checkpointer, log):
  """Saves every ``--save-every`` steps and after the last one; closing it
  waits for the last save."""
  run = _run_identity(job, trainer.cfg)

  def hook(i, metrics, record):
    del metrics, record
    # The data state BEFORE the next fetch: a resumed run fetches that batch.
    checkpointer.maybe_save(i + 1, params=trainer.params, opt_state=trainer.opt_state,
                            data_state=data.state(), run=run, force=i + 1 == job.steps)

  def close():
    checkpointer.wait()
    log(f"train state after step {checkpointer.latest_step()} saved to {job.state_dir}")
    checkpointer.close()

  hook.close = close
  return hook


def _eval_rows(job: TrainJob, trainer: _Trainer, log) -> list[dict]:
  """The fixed validation rows: the first ``eval_rows`` packed rows of the
  validation data (in file order, one pass), in batches of the step's rows;
  the last batch is filled up with empty rows (they count no token)."""
  from cpjax.corpus import flatten_image_slots, packed_rows

  path = _corpus(job, job.eval_data, "--eval-data", log)
  rows = []
  for row in packed_rows(path, seq_len=job.seq_len, shuffle=False, num_epochs=1,
                         process_index=0, process_count=1, images_per_row=job.images_per_row):
    rows.append(_check_vocabulary(row, trainer.cfg, f"--eval-data {job.eval_data}"))
    if len(rows) == job.eval_rows:
      break
  # An empty row: no token, no label, and image slots that are all padding.
  fill = {"labels": -100, "image_position_ids": -1}
  empty = {key: np.full_like(value, fill.get(key, 0)) for key, value in rows[0].items()}
  rows += [empty] * (-len(rows) % trainer.rows)
  return [flatten_image_slots({key: np.stack([r[key] for r in rows[i:i + trainer.rows]])
                               for key in rows[0]})
          for i in range(0, len(rows), trainer.rows)]


def _eval_hook(job: TrainJob, trainer: _Trainer, layout, summary: dict, log):
  """Every ``eval_every`` steps and after the last one: the token-mean loss
  of the fixed validation rows, with the training step's CP forward and
  shardings (no gradient), into the step's record as ``eval_loss``."""
  import jax

  from cpjax import train

  host = _eval_rows(job, trainer, log)
  placed = [trainer.sharder.shard_batch(b, trainer.mesh, batch_axis=trainer.batch_axis)
            for b in host]
  assert all(lay == layout for _, lay in placed), "validation rows have the step's shape"
  loss_sums = jax.jit(train.make_loss_fn(trainer.graphdef, mesh=trainer.mesh, layout=layout,
                                         expert_axes=trainer.expert_axes,
                                         capacity_factor=job.capacity_factor))
  counted = sum(int(np.sum(b["labels"] != -100)) for b in host)
  summary["eval_rows"] = sum(int(np.any(b["attention_mask"], axis=1).sum()) for b in host)
  summary["eval_losses"] = []

  def hook(i, metrics, record):
    del metrics
    if not ((job.eval_every and (i + 1) % job.eval_every == 0) or i + 1 == job.steps):
      return
    ce_sum = count = 0.0
    with jax.set_mesh(trainer.mesh):
      for batch, _ in placed:
        s, n = loss_sums(trainer.params, batch, trainer.frozen)
        ce_sum, count = ce_sum + _host(s), count + _host(n)
    assert count == counted, "the CP loss counts every validation label once"
    record["eval_loss"] = ce_sum / max(count, 1.0)
    summary["eval_losses"].append((i + 1, record["eval_loss"]))
    with _external_write():
      log(f"step {i + 1}: validation loss {record['eval_loss']:.4f} over "
          f"{summary['eval_rows']} rows ({int(count)} target tokens)")

  return hook


def _metrics_hook(path: str, schedule, first_step: int):
  """Appends the step's record (plus the learning rate it used and the real
  tokens per second) to ``path`` as one JSON line; only process 0 writes."""
  import jax

  if os.path.dirname(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
  if first_step == 0 and jax.process_index() == 0 and os.path.exists(path):
    os.remove(path)       # a fresh run starts a fresh file; a resumed one appends

  def hook(i, metrics, record):
    line = {**record, "target_tokens": _host(metrics["tokens"]),
            "learning_rate": float(schedule(i)),
            "tokens_per_s": record["tokens"] / record["seconds"]}
    if jax.process_index() == 0:
      with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")

  return hook


def _tensorboard_hook(logdir: str, schedule):
  """The step's scalars as TensorBoard events (tensorboardX: a pure-Python
  writer of TensorBoard's event files, without TensorFlow); process 0 only."""
  import jax

  if jax.process_index() != 0:
    return lambda i, metrics, record: None
  from tensorboardX import SummaryWriter

  writer = SummaryWriter(logdir)

  def hook(i, metrics, record):
    del metrics
    scalars = {"loss": record["loss"], "grad_norm": record["grad_norm"],
               "learning_rate": float(schedule(i)),
               "tokens_per_s": record["tokens"] / record["seconds"]}
    if "eval_loss" in record:
      scalars["eval_loss"] = record["eval_loss"]
    for tag, value in scalars.items():
      writer.add_scalar(tag, value, record["step"])

  hook.close = writer.close        # writes what its thread still holds (flush() does not)
  return hook


def _external_write():
  from tqdm.auto import tqdm

  return tqdm.external_write_mode()        # a line of its own, not inside the bar


def _save_model(job: TrainJob, trainer: _Trainer, log) -> list[str] | None:
  """``--save``: the trained model as a Hugging Face checkpoint, or the LoRA
  adapter as PEFT's files (or merged into the base); the files written."""
  if not job.save:
    return None
  import jax
  from flax import nnx

  from cpjax import lora

  trained = nnx.merge(trainer.graphdef, *jax.device_get((trainer.params, trainer.frozen)))
  if job.lora_rank is not None and not job.merge_lora:
    files = lora.save_adapter(trained, job.save, base_model_name_or_path=job.checkpoint)
    log(f"saved the LoRA adapter to {job.save} (PEFT's adapter_config.json and "
        f"adapter_model.safetensors)")
    return files
  if job.lora_rank is not None:
    trained = lora.merge_lora(trained)
  files = trained.save_pretrained(job.save)
  # A fine-tuned checkpoint keeps the tokenizer, template and processor
  # settings it was trained with, so that it loads as the original did.
  kept = [name for name in _BESIDE_WEIGHTS
          if job.checkpoint and os.path.isfile(os.path.join(job.checkpoint, name))]
  for name in kept:
    shutil.copyfile(os.path.join(job.checkpoint, name), os.path.join(job.save, name))
  merged = " with the LoRA adapter merged in" if job.lora_rank is not None else ""
  also = f", and {job.checkpoint}'s {', '.join(kept)}" if kept else ""
  log(f"saved a Hugging Face checkpoint{merged} to {job.save} ({len(files)} safetensors "
      f"file(s){also})")
  return files


# The files of a checkpoint directory besides its config and weights.
_BESIDE_WEIGHTS = ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
                   "tokenizer.model", "special_tokens_map.json", "chat_template.jinja",
                   "processor_config.json", "preprocessor_config.json")


# ------------------------------------------------------------------ the report
def _report(job: TrainJob, trainer: _Trainer, step, summary: dict, losses, real_tokens, times,
            first_step: int, log) -> dict:
  mem = step.memory_analysis()
  steady = times[1:] or times
  tokens_per_step = real_tokens / len(times)
  summary.update({
      "losses": losses, "first_step": first_step,
      "loss_first": losses[0], "loss_last": losses[-1],
      "eval_loss": summary["eval_losses"][-1][1] if summary.get("eval_losses") else None,
      "tokens_per_s": tokens_per_step / float(np.median(steady)),
      "first_step_s": times[0],
      "scratch_mib_per_device": mem.temp_size_in_bytes / 2**20,
      "arguments_mib_per_device": mem.argument_size_in_bytes / 2**20,
  })
  ran = (f"over {len(losses)} steps" if first_step == 0 else
         f"over steps {first_step + 1}-{job.steps} ({len(losses)} steps)")
  log(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} {ran}; "
      f"{summary['tokens_per_s']:.0f} real tokens/s after the first step "
      f"(first step {times[0]:.1f} s)")
  if job.save:
    summary["saved"] = _save_model(job, trainer, log)
  log(f"per-device memory of the compiled step: scratch {summary['scratch_mib_per_device']:.1f} MiB, "
      f"arguments {summary['arguments_mib_per_device']:.1f} MiB")
  return summary
