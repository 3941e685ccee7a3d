"""Token-mean cross entropy and the jit-compiled training step.

The loss is ``sum(CE over labels != -100) / count(labels != -100)`` with both
sums reduced exactly (``psum``) across the ``cp`` axis and a data-parallel
axis when the mesh has one, so it equals the single-device loss of the same
batch, and so do its gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import contextlib

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cpjax.batch import IGNORE_INDEX
from cpjax.layout import ShardLayout
from cpjax.models.gemma4.model import IMAGE_OFFSET_KEY, CPContext

__all__ = ["TrainStep", "batch_specs", "make_loss_fn", "make_train_step", "token_cross_entropy"]


def token_cross_entropy(logits, labels, *, ignore_index: int = IGNORE_INDEX):
  """(sum of per-token CE, number of counted tokens), both float32 scalars.

  logits: [B, L, V]; labels: int[B, L] (``ignore_index`` = not counted).

  >>> import numpy as np
  >>> s, n = token_cross_entropy(np.zeros((1, 2, 4)), np.array([[1, -100]]))
  >>> round(float(s), 4), float(n)     # log(4), one token
  (1.3863, 1.0)
  """
  labels = jnp.asarray(labels)
  valid = labels != ignore_index
  ce = optax.softmax_cross_entropy_with_integer_labels(
      jnp.asarray(logits, jnp.float32), jnp.where(valid, labels, 0))
  return jnp.sum(jnp.where(valid, ce, 0.0)), jnp.sum(valid, dtype=jnp.float32)


def batch_specs(batch: Mapping[str, Any], layout: ShardLayout, *, axis_name: str = "cp",
                batch_axis: str | None = None) -> dict:
  """``shard_map`` in_specs of a batch from the aux-only sharder.

  >>> from cpjax.layout import ShardLayout
  >>> lay = ShardLayout(6, 8, 2, replicated_keys=("input_ids",))
  >>> batch_specs({"input_ids": 0, "labels": 0, "pixel_values": 0}, lay, batch_axis="dp")
  {'input_ids': P('dp',), 'labels': P('dp', 'cp'), 'pixel_values': P()}
  """
  specs = {}
  for key in batch:
    if key == "pixel_values":
      specs[key] = P()
    elif key in layout.replicated_keys or key == IMAGE_OFFSET_KEY:
      specs[key] = P(batch_axis)
    else:
      specs[key] = P(batch_axis, axis_name)
  return specs


def make_loss_fn(graphdef, *, mesh: Mesh | None = None, layout: ShardLayout | None = None,
                 axis_name: str = "cp", batch_axis: str | None = None) -> Callable:
  """``loss_sums(params, batch) -> (ce_sum, count)`` of a split NNX model.

  Without ``mesh`` the model runs on one device with dense attention on an
  unsharded batch (:func:`cpjax.models.gemma4.prepare_batch`); with it, inside
  ``shard_map`` on a batch from the model's aux-only sharder (``layout`` is
  the one the sharder returned).

  >>> import numpy as np
  >>> from cpjax import next_token_labels
  >>> from cpjax.models.gemma4 import Gemma4, Gemma4Config, prepare_batch
  >>> graphdef, params = nnx.split(Gemma4(Gemma4Config(num_layers=1), rngs=nnx.Rngs(0)))
  >>> ids = np.arange(8, dtype=np.int32)[None]
  >>> batch = prepare_batch({"input_ids": ids, "labels": next_token_labels(ids)})
  >>> ce_sum, count = make_loss_fn(graphdef)(params, batch)
  >>> float(count), bool(4.0 < ce_sum / count < 7.0)   # 7 shifted labels; about log(256) at init
  (7.0, True)
  """
  if mesh is None:
    def single(params, batch):
      model = nnx.merge(graphdef, params)
      return token_cross_entropy(model(batch), batch["labels"])
    return single
  if layout is None:
    raise ValueError("layout is required with a mesh: pass the ShardLayout the sharder returned")
  axes = (axis_name,) if batch_axis is None else (batch_axis, axis_name)

  def local(params, batch):
    model = nnx.merge(graphdef, params)
    ce_sum, count = token_cross_entropy(model(batch, cp=CPContext(layout, axis_name)),
                                        batch["labels"])
    return jax.lax.psum(ce_sum, axes), jax.lax.psum(count, axes)

  def sharded(params, batch):
    specs = batch_specs(batch, layout, axis_name=axis_name, batch_axis=batch_axis)
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), specs), out_specs=(P(), P()))(
        params, batch)
  return sharded


def make_train_step(graphdef, optimizer: optax.GradientTransformation, *,
                    mesh: Mesh | None = None, layout: ShardLayout | None = None,
                    axis_name: str = "cp", batch_axis: str | None = None) -> "TrainStep":
  """One compiled step ``(params, opt_state, batch) -> (params, opt_state, metrics)``.

  ``metrics`` holds ``loss`` (token mean), ``tokens`` (counted labels) and
  ``grad_norm``. The step is compiled once per batch shape: calling it for
  every step with same-shaped batches never recompiles. ``params`` and
  ``opt_state`` are donated.

  Example:
    >>> import numpy as np, optax
    >>> from flax import nnx
    >>> from cpjax.models.gemma4 import Gemma4, Gemma4Config, prepare_batch
    >>> graphdef, params = nnx.split(Gemma4(Gemma4Config(num_layers=1), rngs=nnx.Rngs(0)))
    >>> opt = optax.adam(1e-3)
    >>> step = make_train_step(graphdef, opt)
    >>> ids = np.arange(8, dtype=np.int32)[None]
    >>> batch = prepare_batch({"input_ids": ids, "labels": ids})
    >>> params, state, metrics = step(params, opt.init(params), batch)
    >>> float(metrics["tokens"])
    8.0
  """
  loss_sums = make_loss_fn(graphdef, mesh=mesh, layout=layout, axis_name=axis_name,
                           batch_axis=batch_axis)

  def step(params, opt_state, batch):
    def objective(p):
      ce_sum, count = loss_sums(p, batch)
      return ce_sum / jnp.maximum(count, 1.0), count

    (loss, count), grads = jax.value_and_grad(objective, has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, {"loss": loss, "tokens": count,
                               "grad_norm": optax.tree.norm(grads)}

  return TrainStep(jax.jit(step, donate_argnums=(0, 1)), mesh)


class TrainStep:
  """A jit-compiled training step that places fresh parameters on its mesh.

  Call it like the step function; ``compile(params, opt_state, batch)``
  compiles ahead of time and returns a step whose ``memory_analysis()``
  reports per-device memory, without compiling twice.
  """

  def __init__(self, jitted, mesh: Mesh | None, executable=None):
    self.jitted = jitted
    self.mesh = mesh
    self._executable = executable

  def _place(self, params, opt_state):
    if self.mesh is None:
      return params, opt_state
    # Fresh parameters live on one device, the step's outputs on the whole
    # mesh: place them like the outputs so step 2 reuses step 1's program.
    return jax.device_put((params, opt_state), NamedSharding(self.mesh, P()))

  def _context(self):
    return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

  def __call__(self, params, opt_state, batch):
    params, opt_state = self._place(params, opt_state)
    with self._context():
      return (self._executable or self.jitted)(params, opt_state, batch)

  def compile(self, params, opt_state, batch) -> "TrainStep":
    params, opt_state = self._place(params, opt_state)
    with self._context():
      executable = self.jitted.lower(params, opt_state, batch).compile()
    return TrainStep(self.jitted, self.mesh, executable)

  def memory_analysis(self):
    if self._executable is None:
      raise ValueError("memory_analysis needs a compiled step: call .compile(...) first")
    return self._executable.memory_analysis()
