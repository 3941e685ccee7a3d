"""Train a :class:`~cpjax.training.trainer.Trainer`: resume, compile the
step, run the step loop with the hooks after each step, save and report.

``cpjax train`` runs :func:`train`: it checks a run config, builds its
trainer (:func:`~cpjax.training.trainer.build`) and fits it (:func:`fit`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from cpjax import training
from cpjax.batch.layout import ShardLayout
from cpjax.training.checkpointing import TrainCheckpointer, check_run_matches
from cpjax.training.cp_strategy import run_choices
from cpjax.training.run_config import RunConfig, RunError
from cpjax.training.run_file import write_run_config
from cpjax.training.step import TrainStep
from cpjax.training.trainer.builder import build
from cpjax.training.trainer.data import Data, open_data, step_batches
from cpjax.training.trainer.export import save_model
from cpjax.training.trainer.hooks import Hook, make_hooks
from cpjax.training.trainer.state import Log, Trainer, TrainState, device_memory, host_value

__all__ = ["describe", "fit", "resume", "train"]


def train(run: RunConfig, *, log: Log = print) -> dict[str, Any]:
  """Train as ``run`` says and return a summary dict (what the closing lines print).

  :func:`~cpjax.training.trainer.build` (which checks ``run`` first:
  :func:`~cpjax.training.run_config.check`), then :func:`fit`. In a
  multi-process cluster every process runs this with the same run; only
  process 0 logs.

  Args:
    run: the :class:`RunConfig`.
    log: prints a line.

  Returns:
    The summary: ``losses``, ``loss_first``, ``loss_last``, ``eval_loss``,
    ``tokens_per_s``, the compiled step's memory, what the hooks wrote
    (``parity``, ``eval_losses``, ``metrics_file``), ``saved`` files, and
    the ``run`` as a dict.

  Raises:
    TypeError: ``run`` is not a :class:`RunConfig`.
    RunError: the run cannot run as asked (before any training compute).
  """
  if not isinstance(run, RunConfig):
    raise TypeError(f"train takes a RunConfig, got {type(run).__name__}")
  return fit(build(run, log=log))


def fit(trainer: Trainer) -> dict[str, Any]:
  """Open the data, resume, compile the step, run the loop, save, report.

  The loop calls the run's hooks after each step
  (:func:`~cpjax.training.trainer.make_hooks`) and closes them after it.
  When a hook fails, what was trained is saved (:func:`_save_after_failure`)
  before the error ends the run. ``run.yaml`` goes into
  ``checkpointing.state_dir`` when the run starts.

  Args:
    trainer: a :class:`Trainer` as :func:`~cpjax.training.trainer.build`
      made it (at step 0); its state moves to the last step.

  Returns:
    The summary, as :func:`train` returns it.

  Raises:
    RunError: ``trainer`` has trained already (a fit starts at step 0, or
      at a checkpoint's with ``checkpointing.resume``), or resuming fails.
  """
  run = trainer.run
  if trainer.state.step != 0:
    raise RunError(
      f"fit starts from a trainer at step 0 (or resumes from a checkpoint with "
      f"checkpointing.resume); this one is after step {trainer.state.step}: build another"
    )
  data = open_data(run, trainer.cfg, trainer.rows, trainer.log)
  checkpointer = resume(trainer, data)
  if run.checkpointing.state_dir and jax.process_index() == 0:
    write_run_config(run, run.checkpointing.state_dir)
  describe(trainer)
  first_step = trainer.state.step

  batches, sharded, layout = step_batches(trainer, data)
  step = training.make_train_step(
    trainer.graphdef,
    trainer.optimizer,
    mesh=trainer.mesh,
    layout=layout,
    frozen=trainer.frozen,
    expert_axes=trainer.expert_axes,
    capacity_factor=run.experts.capacity_factor,
    **trainer.strategies(),
  )
  # Compiled once; every step reuses it.
  step = step.compile(trainer.state.params, trainer.state.opt_state, sharded)

  summary: dict[str, Any] = {"run": dataclasses.asdict(run)}
  hooks = make_hooks(trainer, data, batches, layout, checkpointer, summary)
  try:
    losses, real_tokens, times = _loop(trainer, data, step, batches, sharded, layout, hooks)
  except _HookFailed as failure:
    try:
      saved = _save_after_failure(trainer, data, checkpointer, failure, summary)
    finally:
      _close(hooks)
    raise RuntimeError(
      f"the {failure.name} hook failed after step {failure.step}: "
      f"{type(failure.error).__name__}: {failure.error} ({saved})"
    ) from failure.error
  _close(hooks)
  return _report(trainer, step, summary, losses, real_tokens, times, first_step)


def resume(trainer: Trainer, data: Data) -> TrainCheckpointer | None:
  """Open the run's checkpoints; with ``checkpointing.resume`` restore the
  training state and the data's place from the latest one.

  Args:
    trainer: the :class:`Trainer`; its state becomes the saved one.
    data: the :class:`Data`; its place becomes the saved one.

  Returns:
    The checkpointer, or None without ``checkpointing.state_dir``.

  Raises:
    RunError: the saved run differs, a fresh run's directory holds a
      checkpoint, or the checkpoint leaves no step to train.
  """
  run, checkpointer = trainer.run, None
  if run.checkpointing.state_dir:
    checkpointer = TrainCheckpointer(
      run.checkpointing.state_dir, save_every=run.checkpointing.save_every
    )
    if run.checkpointing.resume:
      try:  # before any array is read: a different run's arrays may not even fit
        check_run_matches(
          checkpointer.saved_run(), trainer.identity(), force=run.checkpointing.force_resume
        )
      except ValueError as e:
        raise RunError(str(e)) from None
      step, restored = checkpointer.restore(
        params_like=trainer.state.params, opt_state_like=trainer.state.opt_state
      )
      trainer.state = TrainState(restored["params"], restored["opt_state"], step=step)
      data.set_state(restored["data_state"])
      trainer.log(f"resumed from {run.checkpointing.state_dir} after step {step}")
    elif checkpointer.latest_step() is not None:
      raise RunError(
        f"{run.checkpointing.state_dir} already holds a checkpoint (step "
        f"{checkpointer.latest_step()}); resume it with --resume or choose "
        f"another directory"
      )
  if trainer.state.step >= run.optimizer.steps:
    raise RunError(
      f"the checkpoint is after step {trainer.state.step}; --steps {run.optimizer.steps} "
      f"leaves nothing to train"
    )
  return checkpointer


def describe(trainer: Trainer) -> None:
  """Log the run's opening line: model, data, shapes, mesh, devices and
  dtype; with ``parallel.strategy: auto``, the strategy of each layer kind.

  Args:
    trainer: the :class:`Trainer`.
  """
  run, log = trainer.run, trainer.log
  devices = list(trainer.mesh.devices.flat)
  procs = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
  t = trainer.cfg.text
  what = trainer.description
  what += f", data {run.dataset.path}" if run.dataset.path else ", synthetic multimodal data"
  mesh_text = " x ".join(f"{name}={size}" for name, size in trainer.mesh.shape.items())
  accum = f" in {run.dataset.microbatches} microbatches" if run.dataset.microbatches > 1 else ""
  log(
    f"cpjax train: {what}: {t.num_hidden_layers} layers d={t.hidden_size}, "
    f"S={run.dataset.seq_len} B={run.dataset.batch_size}{accum}, "
    f"mesh {mesh_text} ({run.parallel.layout}) on "
    f"{len(devices)} {devices[0].platform.upper()} devices{procs}, {run.dtype}"
  )
  if run.checkpoint and not run.dataset.path:
    # Fine-tuning real weights on random rows is a smoke test, never what a
    # user who forgot --data meant: say it where it cannot be missed.
    log(
      f"WARNING: no --data: {run.checkpoint} trains on synthetic random rows, which "
      "teach it nothing (a smoke test); give --data FILE to fine-tune on your data"
    )
  if run.parallel.strategy == "auto":
    for kind, choice in run_choices(run, t, device_memory=device_memory()).items():
      log(f"  cp strategy for {kind}: {choice.strategy} ({choice.why})")


class _HookFailed(Exception):
  """A hook raised after step ``step`` (counted from 1)."""

  def __init__(self, name: str, step: int, error: BaseException):
    super().__init__(name, step, error)
    self.name, self.step, self.error = name, step, error


def _close(hooks: list[Hook]) -> None:
  for hook in hooks:  # a hook that holds a file or a writer closes it
    hook.close()


def _loop(
  trainer: Trainer,
  data: Data,
  step: TrainStep,
  batches: list[dict],
  sharded: dict | list[dict],
  layout: ShardLayout,
  hooks: list[Hook],
) -> tuple[list[float], int, list[float]]:
  """The step loop: ``(losses, real tokens, seconds per step)``. After each
  step every hook runs (:mod:`~cpjax.training.trainer.hooks`)."""
  losses, real_tokens, times = [], 0, []
  bar = tqdm(
    range(trainer.state.step, trainer.run.optimizer.steps),
    desc="train",
    unit="step",
    leave=True,
    disable=jax.process_index() != 0,
  )
  for i in bar:
    start = time.perf_counter()
    params, opt_state, metrics = step(trainer.state.params, trainer.state.opt_state, sharded)
    trainer.state = TrainState(params, opt_state, step=i + 1)
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
    batches, sharded, lay = step_batches(trainer, data)
    assert lay == layout, "every batch has the same padded shape"
  return losses, real_tokens, times


def _save_after_failure(
  trainer: Trainer,
  data: Data,
  checkpointer: TrainCheckpointer | None,
  failure: _HookFailed,
  summary: dict[str, Any],
) -> str:
  """Saves the training state after the failed step (``--state-dir``, unless
  the checkpoint hook already did or is what failed) and the ``--save``
  output; says what was saved. Nothing is saved after a failed parity check
  (the run disagrees with the single-device model), nor in a multi-process
  run (a hook that writes files runs on process 0 alone, and a save is a
  collective the other processes would never join)."""
  run, step = trainer.run, failure.step
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
          params=trainer.state.params,
          opt_state=trainer.state.opt_state,
          data_state=data.state(),
          run=trainer.identity(),
          force=True,
        )
      saved.append(f"the train state after step {step} is in {run.checkpointing.state_dir}")
    except Exception as e:  # noqa: BLE001 -- reported, and --save still tried
      saved.append(f"saving the train state failed too: {type(e).__name__}: {e}")
  if run.checkpointing.save:
    try:
      summary["saved"] = save_model(trainer)
      saved.append(f"the weights after step {step} are in {run.checkpointing.save}")
    except Exception as e:  # noqa: BLE001 -- reported with the hook's error
      saved.append(f"saving --save failed too: {type(e).__name__}: {e}")
  return "; ".join(saved) or "nothing was saved: no --save or --state-dir"


def _report(
  trainer: Trainer,
  step: TrainStep,
  summary: dict[str, Any],
  losses: list[float],
  real_tokens: int,
  times: list[float],
  first_step: int,
) -> dict[str, Any]:
  """Fill in the summary, save ``--save``, and log the closing lines."""
  run, log = trainer.run, trainer.log
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
    else f"over steps {first_step + 1}-{run.optimizer.steps} ({len(losses)} steps)"
  )
  log(
    f"loss {losses[0]:.3f} -> {losses[-1]:.3f} {ran}; "
    f"{summary['tokens_per_s']:.0f} real tokens/s after the first step "
    f"(first step {times[0]:.1f} s)"
  )
  if run.checkpointing.save:
    summary["saved"] = save_model(trainer)
  log(
    f"per-device memory of the compiled step: scratch {summary['scratch_mib_per_device']:.1f} MiB, "
    f"arguments {summary['arguments_mib_per_device']:.1f} MiB"
  )
  return summary
