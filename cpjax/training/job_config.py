"""What a ``cpjax train`` run is: its settings (:class:`TrainJob`), the
learning-rate schedule and the optimizer they make, and the error for a run
that cannot start (:class:`JobError`)."""

from __future__ import annotations

import dataclasses

__all__ = ["JobError", "LR_SCHEDULES", "TrainJob", "learning_rate_schedule", "make_optimizer"]


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
  lora_targets: str | None = None     # regex on module paths (default cpjax.training.lora.DEFAULT_LORA_TARGETS)
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
