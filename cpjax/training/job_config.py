"""The learning-rate schedule and the optimizer a run's settings make (the
settings themselves, :class:`RunConfig` and its flat form :class:`TrainJob`,
are in :mod:`cpjax.training.run_config`)."""

from __future__ import annotations

from cpjax.training.run_config import JobError, RunConfig, TrainJob, as_run_config

__all__ = ["JobError", "LR_SCHEDULES", "RunConfig", "TrainJob", "learning_rate_schedule", "make_optimizer"]


LR_SCHEDULES = ("constant", "cosine", "linear")


def learning_rate_schedule(job: RunConfig):
  """The optax schedule of ``job``: step -> learning rate (step 0 is the first
  update). As transformers' ``get_{constant,cosine,linear}_schedule_with_warmup``:
  ``lr * s / warmup`` during the warmup, then constant, a half cosine or a
  straight line from ``lr`` to 0 at ``optimizer.steps``. ``job``: a
  :class:`RunConfig` or a :class:`TrainJob`.

  >>> s = learning_rate_schedule(TrainJob(learning_rate=1.0, steps=10, warmup_steps=2,
  ...                                     lr_schedule="linear"))
  >>> [round(float(s(i)), 3) for i in (0, 1, 2, 6, 10)]
  [0.0, 0.5, 1.0, 0.5, 0.0]
  """
  import optax

  opt = as_run_config(job).optimizer
  if opt.schedule not in LR_SCHEDULES:
    raise JobError(f"lr_schedule must be one of {LR_SCHEDULES}, got {opt.schedule!r}")
  if opt.warmup_steps < 0 or (opt.schedule != "constant" and opt.warmup_steps >= opt.steps):
    raise JobError(f"--warmup-steps {opt.warmup_steps} must be >= 0, and below --steps "
                   f"{opt.steps} for a {opt.schedule} schedule (it decays after the warmup)")
  lr, warm, rest = opt.lr, opt.warmup_steps, max(opt.steps - opt.warmup_steps, 1)
  after = {"constant": optax.constant_schedule(lr),
           "cosine": optax.cosine_decay_schedule(lr, rest),
           "linear": optax.linear_schedule(lr, 0.0, rest)}[opt.schedule]
  if warm == 0:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, lr, warm), after], [warm])


def make_optimizer(job: RunConfig):
  """AdamW (weight decay 0.01) on :func:`learning_rate_schedule`, after
  clipping the global gradient norm to ``optimizer.max_grad_norm`` when set."""
  import optax

  clip = as_run_config(job).optimizer.max_grad_norm
  optimizer = optax.adamw(learning_rate_schedule(job), weight_decay=0.01)
  if clip is None:
    return optimizer
  return optax.chain(optax.clip_by_global_norm(clip), optimizer)
