"""The trainer and its training state: what the build, the hooks and the
loop share.

A :class:`Trainer` is a built run: its :class:`RunConfig`, the mesh, the
model split for the step (``graphdef`` and the ``frozen`` state it only
reads), the optimizer, and the :class:`TrainState` that each step replaces.
:func:`~cpjax.training.trainer.build` makes one;
:func:`~cpjax.training.trainer.fit` trains it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from cpjax import parallel
from cpjax.attention.cp_context import ContextParallelSharder
from cpjax.batch.layout import ShardLayout
from cpjax.models.gemma4 import Gemma4Config
from cpjax.training.cp_strategy import for_run
from cpjax.training.run_config import RunConfig

__all__ = ["Log", "TrainState", "Trainer", "device_memory", "host_value", "run_identity"]

Log = Callable[[str], None]  # prints one line


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
  """The state training moves: what is trained, the optimizer's state, and
  the steps done. A pytree (``step`` is static), so ``jax.device_get(state)``
  copies it to the host.

  Attributes:
    params: what is trained: every weight, or the LoRA adapters.
    opt_state: the optimizer's state of ``params`` (Adam's moments).
    step: the steps done.

  Example:
    >>> import jax.numpy as jnp
    >>> state = TrainState({"w": jnp.ones(2)}, (), step=3)
    >>> jax.tree.leaves(state), state.step
    ([Array([1., 1.], dtype=float32)], 3)
  """

  params: nnx.State
  opt_state: optax.OptState
  step: int = dataclasses.field(default=0, metadata={"static": True})


@dataclasses.dataclass
class Trainer:
  """A run built for training: the mesh, the model split for the step, the
  optimizer, and the :class:`TrainState` each step replaces.

  Attributes:
    run: the :class:`RunConfig` it was built from.
    cfg: the model's :class:`Gemma4Config`.
    mesh: the training mesh.
    rows: rows of one microbatch.
    sharder: shards a batch of rows over the mesh (the model's).
    graphdef: the model's structure, to merge with its state.
    frozen: what the step only reads: buffers, and under LoRA the base.
    optimizer: the run's optimizer.
    state: the training state, sharded over the mesh.
    reference: ``(params, frozen)`` on one device for the parity check at
      step 1 (None without ``parity_check``).
    description: the model in words, for the opening line.
    expert_axes: mesh axes the MoE experts are split over (``ep`` in the mesh).
    log: prints a line (a no-op on processes other than 0).
  """

  run: RunConfig
  cfg: Gemma4Config
  mesh: Mesh
  rows: int
  sharder: ContextParallelSharder
  graphdef: nnx.GraphDef
  frozen: nnx.State
  optimizer: optax.GradientTransformation
  state: TrainState
  reference: tuple[nnx.State, nnx.State] | None
  description: str
  expert_axes: tuple[str, ...] = ()
  log: Log = print

  @property
  def batch_axis(self) -> str | None:
    """The mesh axis the rows are split over (None: every device holds all)."""
    return parallel.batch_axis_of(self.mesh)

  def shard(self, rows: dict) -> tuple[dict, ShardLayout]:
    """Shard one microbatch of host rows over the mesh.

    Args:
      rows: the batch, as the model's sharder takes it.

    Returns:
      ``(sharded batch, its ShardLayout)``.
    """
    return self.sharder.shard_batch(rows, self.mesh, batch_axis=self.batch_axis)

  def strategies(self) -> dict[str, Any]:
    """Return the run's CP strategies, as keywords of :func:`cpjax.training.make_train_step`.

    ``parallel.strategy``, or with ``auto`` the rule's choice per layer kind
    and the loss's (:func:`cpjax.training.cp_strategy.for_run`). The rule
    budgets for the accelerator's memory (what JAX may use of it, where
    ``cpjax plan --target`` takes the chip's whole memory: they differ only
    at the rule's edge).
    """
    return for_run(self.run, self.cfg.text, device_memory=device_memory())

  def identity(self) -> dict:
    """Return what a resumed run must share with the saved one (:func:`run_identity`)."""
    return run_identity(self.run, self.cfg)


def device_memory() -> int | None:
  """Return one accelerator device's memory; None on the CPU (the strategy
  rule's default: emulated devices share the host's).

  Returns:
    Bytes, or None.
  """
  device = jax.devices()[0]
  if device.platform == "cpu":
    return None
  return (device.memory_stats() or {}).get("bytes_limit")


def host_value(x: jax.Array) -> float:
  """Read a replicated scalar's value, also when the array spans other processes.

  Args:
    x: the replicated scalar array.

  Returns:
    Its value.
  """
  return float(np.asarray(x.addressable_data(0)))


def run_identity(run: RunConfig, cfg: Gemma4Config) -> dict:
  """Describe what a resumed run must share with the saved one
  (:func:`cpjax.training.checkpointing.check_run_matches` compares them).

  Args:
    run: the :class:`RunConfig`.
    cfg: the model's :class:`Gemma4Config`.

  Returns:
    The run's identity, a dict.
  """
  identity = {
    "model_config": cfg.to_hf(),
    "batch_size": run.dataset.batch_size,
    "seq_len": run.dataset.seq_len,
    "microbatches": run.dataset.microbatches,
    "data": run.dataset.path,
    "seed": run.seed,
  }
  if run.lora.rank is not None:  # what the saved adapters and moments are
    identity["lora"] = {
      "rank": run.lora.rank,
      "alpha": run.lora.alpha,
      "targets": (
        run.lora.targets if isinstance(run.lora.targets, str) else list(run.lora.targets)
      ),
      "base_dtype": run.lora.base_dtype,
    }
  return identity
