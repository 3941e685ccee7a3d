"""The periodic work of a ``cpjax train`` run, as hooks the step loop calls
after each step with ``(i, metrics, record)``: the parity check at step 1,
validation, the metrics file, TensorBoard and checkpoints
(:func:`make_hooks` builds them in order)."""

from __future__ import annotations

import json
import os

import numpy as np

from cpjax.training.job_config import learning_rate_schedule
from cpjax.training.job_phases import (
  Data,
  TrainState,
  check_vocabulary,
  corpus_path,
  host_value,
  run_identity,
)
from cpjax.training.run_config import RunConfig, as_run_config

__all__ = ["eval_hook", "eval_rows", "external_write", "make_hooks"]


def make_hooks(job: RunConfig, trainer: TrainState, data: Data, batches, layout, checkpointer,
           first_step: int, summary: dict, log) -> list:
  """The periodic work, in order (a later hook reads what an earlier one
  wrote into the step's record): parity at step 1, validation, the metrics
  file, TensorBoard, checkpoints. Each carries its ``name`` for errors."""
  hooks = []

  def add(name, hook):
    hook.name = name
    hooks.append(hook)

  if job.parity_check and first_step == 0:
    add("parity check", parity_hook(job, trainer, batches, summary, log))
  if job.eval.data:
    add("validation", eval_hook(job, trainer, layout, summary, log))
  metrics_file = job.logging.metrics or (os.path.join(job.checkpointing.state_dir, "metrics.jsonl")
                                 if job.checkpointing.state_dir else None)
  if metrics_file:
    add("metrics file", metrics_hook(metrics_file, learning_rate_schedule(job), first_step))
    summary["metrics_file"] = metrics_file
  if job.logging.tensorboard:
    add("TensorBoard", tensorboard_hook(job.logging.tensorboard, learning_rate_schedule(job)))
  if checkpointer is not None:
    add("checkpoint", save_hook(job, trainer, data, checkpointer, log))
  return hooks


def parity_hook(job: RunConfig, trainer: TrainState, batches, summary: dict, log):
  """At step 1, the CP step's loss and gradient norm against the same rows on
  one device with unsharded parameters; a disagreement stops the run."""
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
    with external_write():
      log(f"parity with the single-device model at step 1: |dloss|/loss = {rel_loss:.1e}, "
          f"|dgrad_norm|/grad_norm = {rel_norm:.1e} ({checked} within {tol:g})")
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
    checkpointer.maybe_save(i + 1, params=trainer.params, opt_state=trainer.opt_state,
                            data_state=data.state(), run=run, force=i + 1 == job.optimizer.steps)

  def close():
    checkpointer.wait()
    log(f"train state after step {checkpointer.latest_step()} saved to {job.checkpointing.state_dir}")
    checkpointer.close()

  hook.close = close
  return hook


def eval_rows(job: RunConfig, trainer: TrainState, log) -> list[dict]:
  """The fixed validation rows: the first ``eval_rows`` packed rows of the
  validation data (in file order, one pass), in batches of the step's rows;
  the last batch is filled up with empty rows (they count no token)."""
  job = as_run_config(job)   # a TrainJob too
  from cpjax.data.corpus import flatten_image_slots, packed_rows

  path = corpus_path(job, job.eval.data, "--eval-data", log)
  rows = []
  for row in packed_rows(path, seq_len=job.dataset.seq_len, shuffle=False, num_epochs=1,
                         process_index=0, process_count=1, images_per_row=job.dataset.images_per_row):
    rows.append(check_vocabulary(row, trainer.cfg, f"--eval-data {job.eval.data}"))
    if len(rows) == job.eval.rows:
      break
  # An empty row: no token, no label, and image slots that are all padding.
  fill = {"labels": -100, "image_position_ids": -1}
  empty = {key: np.full_like(value, fill.get(key, 0)) for key, value in rows[0].items()}
  rows += [empty] * (-len(rows) % trainer.rows)
  return [flatten_image_slots({key: np.stack([r[key] for r in rows[i:i + trainer.rows]])
                               for key in rows[0]})
          for i in range(0, len(rows), trainer.rows)]


def eval_hook(job: RunConfig, trainer: TrainState, layout, summary: dict, log):
  """Every ``eval_every`` steps and after the last one: the token-mean loss
  of the fixed validation rows, with the training step's CP forward and
  shardings (no gradient), into the step's record as ``eval_loss``."""
  job = as_run_config(job)   # a TrainJob too
  import jax

  from cpjax import training

  host = eval_rows(job, trainer, log)
  placed = [trainer.sharder.shard_batch(b, trainer.mesh, batch_axis=trainer.batch_axis)
            for b in host]
  assert all(lay == layout for _, lay in placed), "validation rows have the step's shape"
  loss_sums = jax.jit(training.make_loss_fn(trainer.graphdef, mesh=trainer.mesh, layout=layout,
                                         expert_axes=trainer.expert_axes,
                                         capacity_factor=job.experts.capacity_factor))
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
      log(f"step {i + 1}: validation loss {record['eval_loss']:.4f} over "
          f"{summary['eval_rows']} rows ({int(count)} target tokens)")

  return hook


def metrics_hook(path: str, schedule, first_step: int):
  """Appends the step's record (plus the learning rate it used and the real
  tokens per second) to ``path`` as one JSON line; only process 0 writes."""
  import jax

  if os.path.dirname(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
  if first_step == 0 and jax.process_index() == 0 and os.path.exists(path):
    os.remove(path)       # a fresh run starts a fresh file; a resumed one appends

  def hook(i, metrics, record):
    line = {**record, "target_tokens": host_value(metrics["tokens"]),
            "learning_rate": float(schedule(i)),
            "tokens_per_s": record["tokens"] / record["seconds"]}
    if jax.process_index() == 0:
      with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")

  return hook


def tensorboard_hook(logdir: str, schedule):
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


def external_write():
  from tqdm.auto import tqdm

  return tqdm.external_write_mode()        # a line of its own, not inside the bar
