"""The main job: train Gemma 4 with context parallelism.

A tiny real-architecture Gemma 4 by default (``--model`` picks a preset, or
``--checkpoint`` fine-tunes a Hugging Face checkpoint).

Synthetic packed multimodal data, or the user's own (a prepared corpus, or
JSONL texts and conversations tokenized with the checkpoint's tokenizer); a
progress bar, a parity check of the first step against the single-device
model, a validation loss, a learning-rate schedule, a metrics file with a
JSON line per step, and a closing summary.

The run's settings live in :mod:`cpjax.training.job_config`, the phases before the
loop in :mod:`cpjax.training.job_phases`, the periodic work in :mod:`cpjax.training.job_hooks`;
here are the loop, the saves and the report.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time

import numpy as np

from cpjax.training.job_config import LR_SCHEDULES, JobError, learning_rate_schedule, make_optimizer
from cpjax.training.job_hooks import make_hooks
from cpjax.training.job_phases import (
  Data,
  TrainState,
  build,
  describe,
  host_value,
  open_data,
  resume,
  run_identity,
  step_batches,
)
from cpjax.training.run_config import RunConfig, TrainJob, as_run_config, check
from cpjax.training.run_file import write_run_config

__all__ = ["JobError", "LR_SCHEDULES", "RunConfig", "TrainJob", "learning_rate_schedule", "make_optimizer",
           "run_train_job"]


def run_train_job(job: RunConfig, *, log=print) -> dict:
  """Train and return a summary dict (what the closing lines print).

  The phases: build the model and mesh, open the data, resume, compile the
  step, check parity with the single-device model, run the step loop (with
  the periodic work as hooks after each step; a hook with a ``close``
  method is closed after the loop), report.

  ``job`` is a :class:`RunConfig` (or its flat form, a :class:`TrainJob`);
  it is checked first (:func:`~cpjax.training.run_config.check`), and
  written as ``run.yaml`` into ``checkpointing.state_dir`` when the run
  starts and beside the ``checkpointing.save`` output at the end.

  In a multi-process cluster every process runs this with the same job;
  only process 0 logs.
  """
  import jax

  job = as_run_config(job)
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

  step = training.make_train_step(trainer.graphdef, trainer.optimizer, mesh=trainer.mesh,
                               layout=layout, frozen=trainer.frozen,
                               expert_axes=trainer.expert_axes,
                               capacity_factor=job.experts.capacity_factor)
  step = step.compile(trainer.params, trainer.opt_state, sharded)  # once; every step reuses it

  summary = {"job": dataclasses.asdict(job)}
  hooks = make_hooks(job, trainer, data, batches, layout, checkpointer, first_step, summary, log)
  try:
    losses, real_tokens, times = _loop(job, trainer, data, step, sharded, batches, layout,
                                       first_step=first_step, hooks=hooks)
  except _HookFailed as failure:
    # What was trained is saved before the error ends the run.
    try:
      saved = _save_after_failure(job, trainer, data, checkpointer, failure, summary, log)
    finally:
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


def _save_after_failure(job: RunConfig, trainer, data, checkpointer, failure: _HookFailed,
                        summary: dict, log) -> str:
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
    return (f"nothing was saved after step {step}: the run spans {jax.process_count()} "
            f"processes; --state-dir holds the last periodic checkpoint")
  saved = []
  if checkpointer is not None and failure.name != "checkpoint":
    try:
      if checkpointer.latest_step() != step:
        checkpointer.maybe_save(step, params=trainer.params, opt_state=trainer.opt_state,
                                data_state=data.state(), run=run_identity(job, trainer.cfg),
                                force=True)
      saved.append(f"the train state after step {step} is in {job.checkpointing.state_dir}")
    except Exception as e:      # noqa: BLE001 -- reported, and --save still tried
      saved.append(f"saving the train state failed too: {type(e).__name__}: {e}")
  if job.checkpointing.save:
    try:
      summary["saved"] = _save_model(job, trainer, log)
      saved.append(f"the weights after step {step} are in {job.checkpointing.save}")
    except Exception as e:      # noqa: BLE001 -- reported with the hook's error
      saved.append(f"saving --save failed too: {type(e).__name__}: {e}")
  return "; ".join(saved) or "nothing was saved: no --save or --state-dir"


def _loop(job: RunConfig, trainer: TrainState, data: Data, step, sharded, batches, layout, *,
          first_step: int, hooks):
  """The step loop: ``(losses, real tokens, seconds per step)``. After each
  step every hook runs as ``hook(i, metrics, record)``: ``i`` counts from 0,
  ``metrics`` are the step's (device arrays), ``record`` the step's host
  values (``step``, ``loss``, ``grad_norm``, ``tokens``: real tokens,
  ``seconds``), to which a hook may add (the validation loss)."""
  import jax
  from tqdm.auto import tqdm

  losses, real_tokens, times = [], 0, []
  bar = tqdm(range(first_step, job.optimizer.steps), desc="train", unit="step", leave=True,
             disable=jax.process_index() != 0)
  for i in bar:
    start = time.perf_counter()
    trainer.params, trainer.opt_state, metrics = step(trainer.params, trainer.opt_state, sharded)
    loss = host_value(metrics["loss"])
    times.append(time.perf_counter() - start)
    tokens = sum(int(np.sum(b["attention_mask"])) for b in batches)
    record = {"step": i + 1, "loss": loss, "grad_norm": host_value(metrics["grad_norm"]),
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
    files = lora.save_adapter(trained, job.checkpointing.save, base_model_name_or_path=job.checkpoint)
    write_run_config(job, job.checkpointing.save)
    log(f"saved the LoRA adapter to {job.checkpointing.save} (PEFT's adapter_config.json, "
        f"adapter_model.safetensors, and the run's run.yaml)")
    return files
  if job.lora.rank is not None:
    trained = lora.merge_lora(trained)
  files = trained.save_pretrained(job.checkpointing.save)
  # A fine-tuned checkpoint keeps the tokenizer and template it was trained
  # with (--tokenizer's, else the checkpoint's) and the checkpoint's processor
  # and generation settings, so that it loads as the original did.
  kept = []
  for name in _BESIDE_WEIGHTS:
    source = job.dataset.tokenizer if job.dataset.tokenizer and name in _TOKENIZER_FILES else job.checkpoint
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
  log(f"saved a Hugging Face checkpoint{merged} to {job.checkpointing.save} ({len(files)} safetensors "
      f"file(s){also})")
  return files


# The files of a checkpoint directory besides its config and weights.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                    "special_tokens_map.json", "chat_template.jinja")
_BESIDE_WEIGHTS = ("generation_config.json", *_TOKENIZER_FILES, "processor_config.json",
                   "preprocessor_config.json")


def _report(job: RunConfig, trainer: TrainState, step, summary: dict, losses, real_tokens, times,
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
         f"over steps {first_step + 1}-{job.optimizer.steps} ({len(losses)} steps)")
  log(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} {ran}; "
      f"{summary['tokens_per_s']:.0f} real tokens/s after the first step "
      f"(first step {times[0]:.1f} s)")
  if job.checkpointing.save:
    summary["saved"] = _save_model(job, trainer, log)
  log(f"per-device memory of the compiled step: scratch {summary['scratch_mib_per_device']:.1f} MiB, "
      f"arguments {summary['arguments_mib_per_device']:.1f} MiB")
  return summary
