"""The periodic work: hooks the loop calls after each step.

A :class:`Hook` is called as ``hook(i, metrics, record)`` after step ``i + 1``
(``i`` counts from 0): ``metrics`` are the step's device arrays, ``record``
its host values (``step``, ``loss``, ``grad_norm``, ``tokens``: real tokens,
``seconds``), to which a hook may add for the hooks after it (the validation
loss). :func:`make_hooks` makes a run's hooks in order: the parity check at
step 1, validation, the metrics file, TensorBoard, checkpoints. After the
loop every hook is closed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import jax
import numpy as np
import optax
from tensorboardX import SummaryWriter
from tqdm.auto import tqdm

from cpjax import training
from cpjax.batch.layout import ShardLayout
from cpjax.models import gemma4
from cpjax.training.checkpointing import TrainCheckpointer
from cpjax.training.trainer.data import Data, eval_rows
from cpjax.training.trainer.state import Trainer, host_value

__all__ = [
  "Checkpoints",
  "Hook",
  "MetricsFile",
  "ParityCheck",
  "TensorBoard",
  "Validation",
  "external_write",
  "make_hooks",
]

Metrics = Mapping[str, jax.Array]


class Hook:
  """Periodic work after each step; ``name`` says which, in errors."""

  name: ClassVar[str] = "hook"

  def __call__(self, i: int, metrics: Metrics, record: dict[str, Any]) -> None:
    """Run after step ``i + 1``; may add to ``record`` for later hooks."""
    raise NotImplementedError

  def close(self) -> None:
    """Release what the hook holds (after the loop, also after a failure)."""


def make_hooks(
  trainer: Trainer,
  data: Data,
  batches: list[dict],
  layout: ShardLayout,
  checkpointer: TrainCheckpointer | None,
  summary: dict,
) -> list[Hook]:
  """Make the run's periodic work, in order.

  A later hook reads what an earlier one wrote into the step's record: parity
  at step 1, validation, the metrics file, TensorBoard, checkpoints.

  Args:
    trainer: the :class:`Trainer`, at the step the loop starts after.
    data: the :class:`Data`.
    batches: the first step's rows (as microbatches), for the parity check.
    layout: the step's layout.
    checkpointer: the checkpointer, or None.
    summary: the run's summary dict, which hooks write into.

  Returns:
    The hooks, in order.
  """
  run, hooks = trainer.run, []
  if run.parity_check and trainer.state.step == 0:
    hooks.append(ParityCheck(trainer, batches, summary))
  if run.eval.data:
    hooks.append(Validation(trainer, layout, summary))
  metrics_file = run.logging.metrics or (
    os.path.join(run.checkpointing.state_dir, "metrics.jsonl")
    if run.checkpointing.state_dir
    else None
  )
  if metrics_file:
    hooks.append(MetricsFile(metrics_file, run.optimizer.lr_schedule(), trainer.state.step))
    summary["metrics_file"] = metrics_file
  if run.logging.tensorboard and jax.process_index() == 0:
    hooks.append(TensorBoard(run.logging.tensorboard, run.optimizer.lr_schedule()))
  if checkpointer is not None:
    hooks.append(Checkpoints(trainer, data, checkpointer))
  return hooks


class ParityCheck(Hook):
  """At step 1, the CP step's loss and gradient norm against the same rows on
  one device with unsharded parameters; a disagreement stops the run.

  Args:
    trainer: the :class:`Trainer` (with its ``reference``).
    batches: the first step's rows (as microbatches).
    summary: the run's summary dict: ``parity`` goes into it.
  """

  name = "parity check"

  def __init__(self, trainer: Trainer, batches: list[dict], summary: dict):
    if trainer.reference is None:
      raise ValueError("ParityCheck needs a trainer built with parity_check, got no reference")
    # Sum the microbatches' CE sums and gradients, divide once by the whole
    # step's token count, as the step does.
    single = jax.jit(jax.value_and_grad(training.make_loss_fn(trainer.graphdef), has_aux=True))
    params, frozen = trainer.reference
    ce_sum, count, grads = 0.0, 0.0, None
    for b in batches:
      (s, n), g = single(params, gemma4.prepare_batch(b, trainer.cfg), frozen)
      ce_sum, count = ce_sum + s, count + n
      grads = g if grads is None else jax.tree.map(jax.numpy.add, grads, g)
    self.loss = float(ce_sum / count)
    self.grad_norm = float(optax.tree.norm(jax.tree.map(lambda g: g / count, grads)))
    self.dtype, self.summary, self.log = trainer.run.dtype, summary, trainer.log

  def __call__(self, i: int, metrics: Metrics, record: dict[str, Any]) -> None:
    if i != 0:
      return
    dropped = int(np.sum(record.get("expert_dropped", 0)))
    if dropped:
      # The capacity factor drops per device: the one-device model, which
      # holds every token, drops others. Nothing to compare.
      self.summary["parity"] = {"skipped": f"{dropped} expert pairs dropped"}
      with external_write():
        self.log(
          f"parity with the single-device model at step 1: not checked, the capacity "
          f"factor dropped {dropped} (token, expert) pairs on the mesh's devices"
        )
      return
    rel_loss = abs(record["loss"] - self.loss) / abs(self.loss)
    rel_norm = abs(record["grad_norm"] - self.grad_norm) / self.grad_norm
    # float32: the CP step must match the single-device one to summation
    # order. bfloat16 activations round differently on each path; at this
    # size their gradients differ from float32 by ~20% on either path, so
    # only the loss is held to a (bf16-sized) tolerance there.
    exact = self.dtype == "float32"
    tol = 1e-4 if exact else 1e-2
    ok = rel_loss <= tol and (not exact or rel_norm <= tol)
    self.summary["parity"] = {"rel_loss": rel_loss, "rel_grad_norm": rel_norm, "tolerance": tol}
    checked = "loss and grad norm" if exact else "loss"
    with external_write():
      self.log(
        f"parity with the single-device model at step 1: |dloss|/loss = {rel_loss:.1e}, "
        f"|dgrad_norm|/grad_norm = {rel_norm:.1e} ({checked} within {tol:g})"
      )
    if not ok:
      raise RuntimeError(f"CP and single-device steps disagree: {self.summary['parity']}")


class Validation(Hook):
  """Every ``eval.every`` steps and after the last one: the token-mean loss of
  the fixed validation rows (:func:`~cpjax.training.trainer.eval_rows`), with
  the training step's CP forward and shardings (no gradient), into the step's
  record as ``eval_loss`` and the summary's ``eval_losses``.

  Args:
    trainer: the :class:`Trainer`; the hook reads its state when called.
    layout: the step's layout (the validation rows have the step's shape).
    summary: the run's summary dict.
  """

  name = "validation"

  def __init__(self, trainer: Trainer, layout: ShardLayout, summary: dict):
    self.trainer, self.summary = trainer, summary
    host = eval_rows(trainer.run, trainer.cfg, trainer.rows, trainer.log)
    placed = [trainer.shard(b) for b in host]
    assert all(lay == layout for _, lay in placed), "validation rows have the step's shape"
    self.placed = [b for b, _ in placed]
    self.loss_sums = jax.jit(
      training.make_loss_fn(
        trainer.graphdef,
        mesh=trainer.mesh,
        layout=layout,
        expert_axes=trainer.expert_axes,
        capacity_factor=trainer.run.experts.capacity_factor,
        **trainer.strategies(),
      )
    )
    self.counted = sum(int(np.sum(b["labels"] != -100)) for b in host)
    summary["eval_rows"] = sum(int(np.any(b["attention_mask"], axis=1).sum()) for b in host)
    summary["eval_losses"] = []

  def __call__(self, i: int, metrics: Metrics, record: dict[str, Any]) -> None:
    run, trainer = self.trainer.run, self.trainer
    if not ((run.eval.every and (i + 1) % run.eval.every == 0) or i + 1 == run.optimizer.steps):
      return
    ce_sum = count = 0.0
    with jax.set_mesh(trainer.mesh):
      for batch in self.placed:
        s, n = self.loss_sums(trainer.state.params, batch, trainer.frozen)
        ce_sum, count = ce_sum + host_value(s), count + host_value(n)
    assert count == self.counted, "the CP loss counts every validation label once"
    record["eval_loss"] = ce_sum / max(count, 1.0)
    self.summary["eval_losses"].append((i + 1, record["eval_loss"]))
    with external_write():
      trainer.log(
        f"step {i + 1}: validation loss {record['eval_loss']:.4f} over "
        f"{self.summary['eval_rows']} rows ({int(count)} target tokens)"
      )


class MetricsFile(Hook):
  """Appends the step's record (plus the learning rate it used and the real
  tokens per second) to ``path`` as one JSON line; only process 0 writes.

  Args:
    path: the JSONL file; a run from step 0 starts it afresh, a resumed one appends.
    schedule: the learning-rate schedule.
    first_step: the step the run starts after.
  """

  name = "metrics file"

  def __init__(self, path: str, schedule: optax.Schedule, first_step: int):
    self.path, self.schedule = path, schedule
    if os.path.dirname(path):
      os.makedirs(os.path.dirname(path), exist_ok=True)
    if first_step == 0 and jax.process_index() == 0 and os.path.exists(path):
      os.remove(path)

  def __call__(self, i: int, metrics: Metrics, record: dict[str, Any]) -> None:
    line = {
      **record,
      "target_tokens": host_value(metrics["tokens"]),
      "learning_rate": float(np.asarray(self.schedule(i))),
      "tokens_per_s": record["tokens"] / record["seconds"],
    }
    if jax.process_index() == 0:
      with open(self.path, "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")


class TensorBoard(Hook):
  """Writes the step's scalars as TensorBoard events (tensorboardX: a
  pure-Python writer of TensorBoard's event files, without TensorFlow). Make
  it on process 0 only.

  Args:
    logdir: the events' directory.
    schedule: the learning-rate schedule.
  """

  name = "TensorBoard"

  def __init__(self, logdir: str, schedule: optax.Schedule):
    self.writer, self.schedule = SummaryWriter(logdir), schedule

  def __call__(self, i: int, metrics: Metrics, record: dict[str, Any]) -> None:
    scalars = {
      "loss": record["loss"],
      "grad_norm": record["grad_norm"],
      "learning_rate": float(np.asarray(self.schedule(i))),
      "tokens_per_s": record["tokens"] / record["seconds"],
    }
    if "eval_loss" in record:
      scalars["eval_loss"] = record["eval_loss"]
    for tag, value in scalars.items():
      self.writer.add_scalar(tag, value, record["step"])

  def close(self) -> None:
    """Close the writer: it writes what its thread still holds (flush() does not)."""
    self.writer.close()


class Checkpoints(Hook):
  """Saves the training state and the data's place every
  ``checkpointing.save_every`` steps and after the last one; closing it waits
  for the last save.

  Args:
    trainer: the :class:`Trainer`; the hook reads its state when called.
    data: the :class:`Data`.
    checkpointer: the run's checkpointer.
  """

  name = "checkpoint"

  def __init__(self, trainer: Trainer, data: Data, checkpointer: TrainCheckpointer):
    self.trainer, self.data, self.checkpointer = trainer, data, checkpointer
    self.identity = trainer.identity()

  def __call__(self, i: int, metrics: Metrics, record: dict[str, Any]) -> None:
    state = self.trainer.state
    # The data state BEFORE the next fetch: a resumed run fetches that batch.
    self.checkpointer.maybe_save(
      i + 1,
      params=state.params,
      opt_state=state.opt_state,
      data_state=self.data.state(),
      run=self.identity,
      force=i + 1 == self.trainer.run.optimizer.steps,
    )

  def close(self) -> None:
    """Wait for the last save, log it, and close the checkpointer."""
    self.checkpointer.wait()
    self.trainer.log(
      f"train state after step {self.checkpointer.latest_step()} saved to "
      f"{self.trainer.run.checkpointing.state_dir}"
    )
    self.checkpointer.close()


def external_write() -> AbstractContextManager:
  """Return tqdm's context for printing a line of its own, outside the progress bar.

  Returns:
    The context manager.
  """
  return tqdm.external_write_mode()
