"""Token-mean cross entropy, its exact CP reduction, and the jit-compiled training step.

Model-agnostic: the step needs only an NNX model (split into graphdef and
params) whose forward returns logits, and a batch already sharded by the
model's sharder. Where each batch key lives (sequence-sharded over ``cp``,
batch-sharded, replicated) is read from the arrays' own shardings, so no key
name is known here; ``forward`` says how the model is called and what CP
context it takes.

The loss is ``sum(CE over labels != -100) / count(labels != -100)`` with both
sums reduced exactly (``psum``) across the ``cp`` axis and a data-parallel
axis when the mesh has one (:func:`cross_entropy_sums`), so it equals the
single-device loss of the same batch, and so do its gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cpjax.batch import IGNORE_INDEX
from cpjax.layout import ShardLayout
from cpjax.sharding import CPContext

__all__ = ["TrainStep", "batch_specs", "cross_entropy_sums", "default_forward", "make_loss_fn",
           "make_train_step", "token_cross_entropy"]


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


def cross_entropy_sums(logits, labels, *, axis_names: tuple[str, ...] = ("cp",),
                       ignore_index: int = IGNORE_INDEX):
  """The CP loss reduction: (CE sum, token count) over every rank of ``axis_names``.

  Call it inside ``shard_map`` on this rank's logits [B, L, V] and labels
  int[B, L]; both sums are ``psum`` -ed over ``axis_names`` (the ``cp`` axis
  and a data-parallel axis), so ``ce_sum / count`` is the token-mean loss of
  the whole global batch on every rank, exactly the single-device loss, and
  differentiating it gives the single-device gradients. With
  ``axis_names=()`` it is :func:`token_cross_entropy`.

  Example:
    >>> import jax, numpy as np
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((2,), ("cp",), devices=jax.devices()[:2])
    >>> f = jax.jit(jax.shard_map(lambda x, y: cross_entropy_sums(x, y), mesh=mesh,
    ...                           in_specs=P(None, "cp"), out_specs=P()))
    >>> put = lambda x: jax.device_put(x, jax.NamedSharding(mesh, P(None, "cp")))
    >>> s, n = f(put(np.zeros((1, 4, 4))), put(np.array([[1, -100, 2, 3]])))
    >>> round(float(s / n), 4), float(n)       # log(4) over 3 counted tokens
    (1.3863, 3.0)
  """
  ce_sum, count = token_cross_entropy(logits, labels, ignore_index=ignore_index)
  if not axis_names:
    return ce_sum, count
  return jax.lax.psum(ce_sum, tuple(axis_names)), jax.lax.psum(count, tuple(axis_names))


def batch_specs(batch: Mapping[str, Any]) -> dict:
  """``shard_map`` in_specs of a sharded batch: each array's own ``PartitionSpec``.

  The model's sharder decides where every key lives; this reads it back
  (``jax.typeof(x).sharding`` under ``jit`` on an Explicit mesh, the array's
  sharding outside). Keys with no named sharding (numpy arrays, scalars) are
  replicated: ``P()``.

  >>> import jax, numpy as np, cpjax
  >>> mesh = jax.make_mesh((2,), ("cp",), devices=jax.devices()[:2])
  >>> batch, _ = cpjax.shard_batch({"input_ids": np.zeros((1, 6), np.int32),
  ...                               "labels": np.zeros((1, 6), np.int32)}, mesh, aux_only=True)
  >>> batch_specs(batch)["input_ids"], batch_specs(batch)["labels"]
  (P(None, None), P(None, 'cp'))
  """
  def spec(x):
    sharding = getattr(jax.typeof(x), "sharding", None) if isinstance(x, jax.Array) else None
    return sharding.spec if isinstance(sharding, NamedSharding) else P()
  return {key: spec(x) for key, x in batch.items()}


_own_specs = batch_specs  # make_loss_fn's argument of the same name shadows it


def default_forward(model, batch: Mapping[str, Any], cp: CPContext | None):
  """``model(batch, cp=cp)``, or ``model(batch)`` on one device: the logits [B, L, V]."""
  return model(batch) if cp is None else model(batch, cp=cp)


def make_loss_fn(graphdef, *, mesh: Mesh | None = None, layout: ShardLayout | None = None,
                 axis_name: str = "cp", batch_axis: str | None = None,
                 forward: Callable = default_forward,
                 batch_specs: Mapping[str, P] | Callable | None = None,
                 frozen=None) -> Callable:
  """``loss_sums(params, batch) -> (ce_sum, count)`` of a split NNX model.

  Without ``mesh`` the model runs on one device (``forward(model, batch,
  None)``) on an unsharded batch; with it, inside ``shard_map`` on a batch
  from the model's sharder (``layout`` is the one the sharder returned), as
  ``forward(model, local_batch, CPContext(layout, axis_name))``, and the sums
  are reduced with :func:`cross_entropy_sums`.

  Args:
    graphdef: from ``nnx.split(model)``.
    mesh, layout, axis_name, batch_axis: where the batch is sharded.
    forward: ``(model, batch, cp) -> logits [B, L, V]``; the model's own
      call convention and CP context (``cp`` is a :class:`cpjax.CPContext` or
      None). ``batch["labels"]`` holds the labels.
    batch_specs: in_specs of the batch (a dict, or a function of the batch);
      default: :func:`cpjax.train.batch_specs`, the arrays' own shardings.
    frozen: state merged with ``params`` but not trained (e.g. the buffers
      of ``graphdef, params, frozen = nnx.split(model, nnx.Param, ...)``).

  Example (any NNX model; the default ``forward`` calls ``model(batch)``):
    >>> import numpy as np
    >>> class Bigram(nnx.Module):
    ...   def __init__(self, rngs):
    ...     self.table = nnx.Embed(16, 16, rngs=rngs)
    ...   def __call__(self, batch):
    ...     return self.table(batch["input_ids"])
    >>> graphdef, params = nnx.split(Bigram(nnx.Rngs(0)))
    >>> batch = {"input_ids": np.arange(8)[None], "labels": np.array([[1, 2, 3, 4, 5, 6, 7, -100]])}
    >>> ce_sum, count = make_loss_fn(graphdef)(params, batch)
    >>> float(count)                     # the -100 label is not counted
    7.0
  """
  def merge(params):
    return nnx.merge(graphdef, params) if frozen is None else nnx.merge(graphdef, params, frozen)

  if mesh is None:
    def single(params, batch):
      return token_cross_entropy(forward(merge(params), batch, None), batch["labels"])
    return single
  if layout is None:
    raise ValueError("layout is required with a mesh: pass the ShardLayout the sharder returned")
  axes = (axis_name,) if batch_axis is None else (batch_axis, axis_name)
  context = CPContext(layout, axis_name)
  specs_of = _own_specs if batch_specs is None else batch_specs

  def local(params, batch):
    logits = forward(merge(params), batch, context)
    return cross_entropy_sums(logits, batch["labels"], axis_names=axes)

  def sharded(params, batch):
    specs = specs_of(batch) if callable(specs_of) else dict(specs_of)
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), specs), out_specs=(P(), P()))(
        params, batch)
  return sharded


def make_train_step(graphdef, optimizer: optax.GradientTransformation, *,
                    mesh: Mesh | None = None, layout: ShardLayout | None = None,
                    axis_name: str = "cp", batch_axis: str | None = None,
                    forward: Callable = default_forward,
                    batch_specs: Mapping[str, P] | Callable | None = None,
                    frozen=None) -> "TrainStep":
  """One compiled step ``(params, opt_state, batch) -> (params, opt_state, metrics)``.

  ``metrics`` holds ``loss`` (token mean), ``tokens`` (counted labels) and
  ``grad_norm``. The step is compiled once per batch shape: calling it for
  every step with same-shaped batches never recompiles. ``params`` and
  ``opt_state`` are donated. ``forward``, ``batch_specs`` and ``frozen``
  (untrained state, e.g. buffers) as :func:`make_loss_fn`.

  Example (a bare ``nnx.Embed`` as a bigram model, called through ``forward``):
    >>> import numpy as np
    >>> graphdef, params = nnx.split(nnx.Embed(16, 16, rngs=nnx.Rngs(0)))
    >>> opt = optax.sgd(1.0)
    >>> step = make_train_step(graphdef, opt, forward=lambda model, batch, cp: model(batch["input_ids"]))
    >>> batch = {"input_ids": np.arange(8)[None], "labels": np.arange(1, 9)[None] % 8}
    >>> params, state, first = step(params, opt.init(params), batch)
    >>> params, state, second = step(params, state, batch)
    >>> float(first["tokens"]), bool(second["loss"] < first["loss"])
    (8.0, True)
  """
  loss_sums = make_loss_fn(graphdef, mesh=mesh, layout=layout, axis_name=axis_name,
                           batch_axis=batch_axis, forward=forward, batch_specs=batch_specs,
                           frozen=frozen)

  def step(params, opt_state, batch):
    def objective(p):
      ce_sum, count = loss_sums(p, batch)
      return ce_sum / jnp.maximum(count, 1.0), count

    (loss, count), grads = jax.value_and_grad(objective, has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, {"loss": loss, "tokens": count,
                               "grad_norm": optax.tree.norm(grads)}

  return TrainStep(step, mesh)


class TrainStep:
  """A jit-compiled training step that places fresh parameters on its mesh.

  Call it like the step function; ``compile(params, opt_state, batch)``
  compiles ahead of time and returns a step whose ``memory_analysis()``
  reports per-device memory, without compiling twice. ``step`` is the
  uncompiled step function (wrap it, e.g. in ``chex.assert_max_traces``,
  and pass it to a new ``TrainStep`` to count compilations).
  """

  def __init__(self, step: Callable, mesh: Mesh | None, executable=None):
    self.step = step
    self.jitted = jax.jit(step, donate_argnums=(0, 1))
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
    return TrainStep(self.step, self.mesh, executable)

  def memory_analysis(self):
    if self._executable is None:
      raise ValueError("memory_analysis needs a compiled step: call .compile(...) first")
    return self._executable.memory_analysis()
