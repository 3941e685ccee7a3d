"""The jit-compiled training step: the loss of a sharded batch and its gradients, and the update.

Model-agnostic: the step needs only an NNX model (split into graphdef and
params) whose forward returns logits, or :class:`cpjax.attention.cp_context.HiddenStates`
(the final hidden states and the output head, so that the loss is computed
chunk by chunk by :func:`cpjax.training.loss.linear_cross_entropy` and never
holds the logits), and a batch already sharded by the model's sharder. Where
each batch key lives (sequence-sharded over ``cp``, batch-sharded,
replicated) is read from the arrays' own shardings, so no key name is known
here; ``forward`` says how the model is called and what CP context it takes.
The loss and its reduction over the ranks are :mod:`cpjax.training.loss`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cpjax.attention.cp_context import (
  CPContext,
  HiddenStates,
  batch_specs,
  manual_axes,
  parse_strategy,
  split_over,
  state_specs,
)
from cpjax.attention.ring.kernels import mesh_platform, resolve_implementation
from cpjax.batch.layout import ShardLayout
from cpjax.parallel import varying_axes
from cpjax.training.loss import LOSS_STRATEGIES, cross_entropy, cross_entropy_sums

__all__ = ["TrainStep", "default_forward", "make_loss_fn", "make_train_step", "stack_microbatches"]


_own_specs = batch_specs  # make_loss_fn's argument of the same name shadows it


def default_forward(
  model: nnx.Module, batch: Mapping[str, Any], cp: CPContext | None
) -> HiddenStates | jax.Array:
  """Run the forward the loss reads.

  That is ``model.hidden_states(batch, cp=cp)`` (a :class:`HiddenStates`)
  when the model has that method, as Gemma 4 does, else the logits [B, L, V]
  of ``model(batch, cp=cp)``; without ``cp`` (one device) the same calls
  without it.

  Args:
    model: the model.
    batch: the batch.
    cp: the :class:`CPContext`, or None on one device.

  Returns:
    :class:`HiddenStates` or logits [B, L, V].
  """
  call = getattr(model, "hidden_states", None)
  call = model if not callable(call) else call
  return call(batch) if cp is None else call(batch, cp=cp)


def make_loss_fn(
  graphdef: nnx.GraphDef,
  *,
  mesh: Mesh | None = None,
  layout: ShardLayout | None = None,
  axis_name: str = "cp",
  batch_axis: str | None = None,
  forward: Callable = default_forward,
  batch_specs: Mapping[str, P] | Callable | None = None,
  frozen: nnx.State | None = None,
  implementation: str | None = None,
  interpret: bool = False,
  expert_axes: tuple[str, ...] = (),
  capacity_factor: float | None = None,
  strategy: str | Mapping[str, str] | tuple[tuple[str, str], ...] = "ring",
  loss_strategy: str = "ring",
) -> Callable:
  """Make ``loss_sums(params, batch, frozen=frozen) -> (ce_sum, count)`` of a split NNX model.

  Without ``mesh`` the model runs on one device (``forward(model, batch,
  None)``) on an unsharded batch; with it, inside ``shard_map`` on a batch
  from the model's sharder (``layout`` is the one the sharder returned), as
  ``forward(model, local_batch, CPContext(layout, axis_name))``, and the sums
  are reduced with :func:`cross_entropy_sums`.

  Args:
    graphdef: from ``nnx.split(model)``.
    mesh, layout, axis_name, batch_axis: where the batch is sharded.
    forward: ``(model, batch, cp) -> logits [B, L, V]`` or
      :class:`HiddenStates`; the model's own call convention and CP context
      (``cp`` is a :class:`cpjax.CPContext` or
      None). ``batch["labels"]`` holds the labels.
    batch_specs: in_specs of the batch (a dict, or a function of the batch);
      default: :func:`cpjax.attention.cp_context.batch_specs`, the arrays' own shardings.
    frozen: state merged with ``params`` but not trained (e.g. the buffers
      of ``graphdef, params, frozen = nnx.split(model, nnx.Param, ...)``, or
      a frozen base under LoRA adapters, :func:`cpjax.training.lora.split_lora`); the
      default of ``loss_sums``' third argument, which a jit-compiled caller
      passes as an argument rather than as constants baked into its program.
    implementation, interpret: the ring's per-hop backend, handed to the
      model in its :class:`cpjax.CPContext` (see :func:`cpjax.ring_attention`).
    expert_axes, capacity_factor: expert parallelism, handed to the model in
      its :class:`cpjax.CPContext` (see :mod:`cpjax.models.gemma4.experts`). Parameters
      split over a manual axis (experts over ``cp``) enter the ``shard_map``
      split, as they are stored.
    strategy: how attention's K/V reach the queries, one for every layer or
      one per layer kind (``{"full_attention": "all_gather"}``), handed to
      the model in its :class:`cpjax.CPContext` (see
      :func:`cpjax.ring_attention` and :func:`cpjax.attention.cp_context.parse_strategy`).
    loss_strategy: how the loss's tokens meet a head split over cp: ``"ring"``,
      ``"all_gather"`` or ``"auto"`` (:func:`cpjax.training.loss.cross_entropy`;
      ``cpjax train`` takes ``"auto"`` with ``parallel.strategy: auto``).

  Returns:
    ``loss_sums(params, batch, frozen=frozen) -> (ce_sum, count)``.

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
  parts = _loss_parts(
    graphdef,
    mesh=mesh,
    layout=layout,
    axis_name=axis_name,
    batch_axis=batch_axis,
    forward=forward,
    batch_specs=batch_specs,
    frozen=frozen,
    implementation=implementation,
    interpret=interpret,
    expert_axes=expert_axes,
    capacity_factor=capacity_factor,
    strategy=strategy,
    loss_strategy=loss_strategy,
  )

  def loss_sums(params, batch, frozen=frozen):
    return parts(params, batch, frozen)[:2]

  return loss_sums


def _loss_parts(
  graphdef,
  *,
  mesh,
  layout,
  axis_name,
  batch_axis,
  forward,
  batch_specs,
  frozen,
  implementation,
  interpret,
  expert_axes,
  capacity_factor,
  strategy,
  loss_strategy="ring",
) -> Callable:
  """:func:`make_loss_fn` returning ``(ce_sum, count, metrics)``: ``metrics``
  are the forward's own (:attr:`HiddenStates.metrics`) summed over the ranks,
  or ``{}``."""

  def merge(params, frozen):
    return nnx.merge(graphdef, params) if frozen is None else nnx.merge(graphdef, params, frozen)

  def metrics_of(output):
    return dict(output.metrics or {}) if isinstance(output, HiddenStates) else {}

  default_frozen = frozen
  parse_strategy(strategy)  # a bad strategy fails here, on one device too
  if loss_strategy not in LOSS_STRATEGIES:
    raise ValueError(f"loss_strategy must be one of {LOSS_STRATEGIES}, got {loss_strategy!r}")
  if mesh is None:
    if expert_axes or capacity_factor is not None:
      raise ValueError(
        f"expert_axes {tuple(expert_axes)} and capacity_factor "
        f"{capacity_factor} need a mesh (one device runs every expert, "
        f"dropping nothing)"
      )

    def single(params, batch, frozen=default_frozen):
      output = forward(merge(params, frozen), batch, None)
      return (*cross_entropy(output, batch["labels"]), metrics_of(output))

    return single
  if layout is None:
    raise ValueError("layout is required with a mesh: pass the ShardLayout the sharder returned")
  manual = manual_axes(mesh, axis_name)
  # The default backend is the mesh's, not the process's: a mesh of TPU
  # devices compiled from a CPU host (cpjax plan --target) takes the TPU kernels.
  implementation = resolve_implementation(implementation, platform=mesh_platform(mesh))
  axes = tuple(a for a in mesh.axis_names if a in manual and a in (batch_axis, axis_name))
  varied = tuple(a for a in manual if mesh.shape[a] > 1)
  context = CPContext(
    layout,
    axis_name,
    implementation,
    interpret,
    tuple(expert_axes),
    capacity_factor,
    strategy=strategy,
  )
  specs_of = _own_specs if batch_specs is None else batch_specs
  # The model's class, from the graph definition (its first node).
  at_use = getattr(graphdef.nodes[0].type, "GATHERED_AT_USE", ())

  def local(params, batch, frozen, context):
    # State stored split over cp enters split: what the model gathers where
    # it uses it (its GATHERED_AT_USE: each decoder layer inside its remat
    # scope, the tables and head) stays split, the rest is gathered now.
    params, frozen = (context.gather(tree, skip=at_use) for tree in (params, frozen))
    # Every rank uses the same parameters on its own tokens: marking them
    # varying once, here, makes each parameter's gradient ONE sum over the
    # ranks (the transpose of this cast), however many times the model uses
    # it (a tied table is looked up and is the head).
    # (Axes of size 1 need no sum: casting over them would only give the
    # SPMD partitioner a cross-partition sum to place, which it refuses for
    # gradients returned by a nested shard_map, as expert parallelism's.)
    params = jax.tree.map(lambda x: _vary(x, varied), params)
    output = forward(merge(params, frozen), batch, context)
    ce_sum, count = cross_entropy_sums(
      output, batch["labels"], axis_names=axes, strategy=loss_strategy
    )
    metrics = {k: jax.lax.psum(v, axes) if axes else v for k, v in metrics_of(output).items()}
    return ce_sum, count, metrics

  def experts(keys):
    # Experts split over the ring's axis by expert parallelism: each rank
    # runs its own (a split over cp beside ep on the batch axis is storage).
    return axis_name in expert_axes and "experts" in keys

  def sharded(params, batch, frozen=default_frozen):
    specs = specs_of(batch) if callable(specs_of) else dict(specs_of)
    in_specs = (state_specs(params, manual), specs, state_specs(frozen, manual))
    # What is stored split over cp, to be gathered where it is used.
    split = split_over(in_specs[0], axis_name, skip=experts) + split_over(
      in_specs[2], axis_name, skip=experts
    )
    run = functools.partial(
      local, context=dataclasses.replace(context, gathered=tuple(sorted(split)))
    )
    return jax.shard_map(run, mesh=mesh, in_specs=in_specs, out_specs=P(), axis_names=manual)(
      params, batch, frozen
    )

  return sharded


def _vary(x, axes):
  missing = tuple(sorted(set(axes) - varying_axes(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def make_train_step(
  graphdef: nnx.GraphDef,
  optimizer: optax.GradientTransformation,
  *,
  mesh: Mesh | None = None,
  layout: ShardLayout | None = None,
  axis_name: str = "cp",
  batch_axis: str | None = None,
  forward: Callable = default_forward,
  batch_specs: Mapping[str, P] | Callable | None = None,
  frozen: nnx.State | None = None,
  implementation: str | None = None,
  interpret: bool = False,
  expert_axes: tuple[str, ...] = (),
  capacity_factor: float | None = None,
  strategy: str | Mapping[str, str] | tuple[tuple[str, str], ...] = "ring",
  loss_strategy: str = "ring",
) -> "TrainStep":
  """Make one compiled step ``(params, opt_state, batch) -> (params, opt_state, metrics)``.

  ``metrics`` holds ``loss`` (token mean), ``tokens`` (counted labels),
  ``grad_norm``, and the forward's own :attr:`HiddenStates.metrics` summed
  over the ranks and microbatches (a mixture of experts' ``expert_tokens``,
  ``expert_dropped``). The step is compiled once per batch shape: calling it for
  every step with same-shaped batches never recompiles. ``params`` and
  ``opt_state`` are donated. ``forward``, ``batch_specs`` and ``frozen``
  (untrained state, e.g. buffers), ``implementation`` and ``interpret`` (the
  ring's per-hop backend) as :func:`make_loss_fn`.

  Args:
    graphdef: from ``nnx.split(model)``.
    optimizer: the optax optimizer.
    mesh, layout, axis_name, batch_axis, forward, batch_specs, frozen: as
      :func:`make_loss_fn`, and so are ``implementation``, ``interpret``,
      ``expert_axes``, ``capacity_factor``, ``strategy`` and ``loss_strategy``.

  Returns:
    The :class:`TrainStep`.

  Example (a bare ``nnx.Embed`` as a bigram model, called through ``forward``):
    >>> import numpy as np
    >>> graphdef, params = nnx.split(nnx.Embed(16, 16, rngs=nnx.Rngs(0)))
    >>> opt = optax.sgd(1.0)
    >>> forward = lambda model, batch, cp: model(batch["input_ids"])
    >>> step = make_train_step(graphdef, opt, forward=forward)
    >>> batch = {"input_ids": np.arange(8)[None], "labels": np.arange(1, 9)[None] % 8}
    >>> params, state, first = step(params, opt.init(params), batch)
    >>> params, state, second = step(params, state, batch)
    >>> float(first["tokens"]), bool(second["loss"] < first["loss"])
    (8.0, True)
  """
  loss_parts = _loss_parts(
    graphdef,
    mesh=mesh,
    layout=layout,
    axis_name=axis_name,
    batch_axis=batch_axis,
    forward=forward,
    batch_specs=batch_specs,
    frozen=frozen,
    implementation=implementation,
    interpret=interpret,
    expert_axes=expert_axes,
    capacity_factor=capacity_factor,
    strategy=strategy,
    loss_strategy=loss_strategy,
  )

  def sums_and_grads(params, batch, frozen, scaled: bool = False):
    """(CE sum, count, metrics) of one batch and the gradient of the CE
    sum, or (``scaled``) of the token mean: the backward then starts from
    1 / count, so no divided copy of the gradients is ever made."""
    ce_sum, pullback, (count, metrics) = jax.vjp(
      lambda p: _split_aux(loss_parts(p, batch, frozen)), params, has_aux=True
    )
    seed = 1.0 / jnp.maximum(count, 1.0) if scaled else jnp.ones_like(ce_sum)
    return ce_sum, count, metrics, pullback(seed.astype(ce_sum.dtype))[0]

  def accumulate(params, batches, frozen):
    # Sum CE sums, counts and gradients of sums over the microbatches, one
    # microbatch's activations alive at a time; dividing once by the total
    # count makes the result the whole batch's token mean and its gradient.
    stacked = stack_microbatches(batches)

    def body(carry, batch):
      return jax.tree.map(jnp.add, carry, sums_and_grads(params, batch, frozen)), None

    # The gradients' zeros keep the parameters' shardings (experts split over
    # cp among them); the metrics' shapes come from the forward alone.
    first = jax.tree.map(lambda x: x[0], stacked)
    metrics = jax.eval_shape(lambda: loss_parts(params, first, frozen)[2])
    zeros = (
      jnp.float32(0),
      jnp.float32(0),
      jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), metrics),
      jax.tree.map(jnp.zeros_like, params),
    )
    return jax.lax.scan(body, zeros, stacked)[0]

  def step(params, opt_state, batch, frozen=frozen):
    if isinstance(batch, Mapping):
      ce_sum, count, metrics, grads = sums_and_grads(params, batch, frozen, scaled=True)
      denominator = jnp.maximum(count, 1.0)
    else:
      ce_sum, count, metrics, grads = accumulate(params, batch, frozen)
      denominator = jnp.maximum(count, 1.0)
      grads = jax.tree.map(lambda g: g / denominator, grads)
    loss = ce_sum / denominator
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return (
      params,
      opt_state,
      {**metrics, "loss": loss, "tokens": count, "grad_norm": optax.tree.norm(grads)},
    )

  return TrainStep(step, mesh, frozen=frozen)


def _split_aux(parts):
  ce_sum, count, metrics = parts
  return ce_sum, (count, metrics)


def stack_microbatches(batches: Sequence[Mapping[str, Any]]) -> dict:
  """Stack K same-shaped batches into one batch with a leading microbatch axis [K, ...].

  ``ValueError`` (before any compute) when the batches differ in keys,
  shapes or dtypes: every microbatch must have the one compiled shape.

  Args:
    batches: K same-shaped batches.

  Returns:
    One batch with a leading microbatch axis [K, ...].

  >>> import numpy as np
  >>> stack_microbatches([{"x": np.zeros((2, 3))}, {"x": np.ones((2, 3))}])["x"].shape
  (2, 2, 3)
  """
  batches = list(batches)
  if not batches or not all(isinstance(b, Mapping) for b in batches):
    raise TypeError(
      f"microbatches must be a non-empty sequence of batch dicts, got "
      f"{[type(b).__name__ for b in batches]}"
    )
  first = batches[0]
  for i, b in enumerate(batches[1:], 1):
    if set(b) != set(first):
      raise ValueError(f"microbatch {i} has keys {sorted(b)}, microbatch 0 has {sorted(first)}")
    for key in first:
      got, want = (
        (jnp.shape(b[key]), jnp.result_type(b[key])),
        (jnp.shape(first[key]), jnp.result_type(first[key])),
      )
      if got != want:
        raise ValueError(
          f"microbatch {i} key {key!r} has shape/dtype {got}, microbatch 0 has "
          f"{want}: every microbatch must have the same shape"
        )
  return {key: jnp.stack([jnp.asarray(b[key]) for b in batches]) for key in first}


def _has_sub_byte(tree: Any) -> bool:
  """Whether any array of ``tree`` has an integer dtype of fewer than 8 bits."""
  return any(
    jnp.issubdtype(x.dtype, jnp.integer) and jnp.iinfo(x.dtype).bits < 8
    for x in jax.tree.leaves(tree)
    if hasattr(x, "dtype")
  )


class TrainStep:
  """A jit-compiled training step that places fresh parameters on its mesh.

  Call it like the step function. Parameters and optimizer state keep the
  shardings they have on the step's mesh (e.g. FSDP / TP from
  :func:`cpjax.parallel.shard_params`); anything not yet on the mesh is
  replicated onto it, and the updated state comes back with the same
  shardings, so step 2 reuses step 1's program. ``compile(params,
  opt_state, batch)`` compiles ahead of time and returns a step whose
  ``memory_analysis()`` and ``cost_analysis()`` describe the program,
  without compiling twice. ``step`` is the uncompiled step function (wrap
  it, e.g. in ``chex.assert_max_traces``, and pass it to a new
  ``TrainStep`` to count compilations). ``frozen`` (untrained state: buffers,
  a frozen LoRA base) is the step's fourth argument: an input of the
  compiled program, never donated, never a constant inside it.
  """

  def __init__(self, step: Callable, mesh: Mesh | None, executable=None, *, frozen=None):
    self.step = step
    self.mesh = mesh
    self.frozen = frozen
    self._executable = executable
    self._jitted: dict = {}
    self._sub_byte: bool | None = None

  def _place(self, params, opt_state, frozen=None):
    if self.mesh is None:
      return params, opt_state, frozen
    # Fresh parameters live on one device: replicate them on the mesh.
    # Leaves already sharded on this mesh stay where they are.
    replicated = NamedSharding(self.mesh, P())

    def place(x):
      sharding = getattr(x, "sharding", None)
      if isinstance(sharding, NamedSharding) and sharding.mesh == self.mesh:
        return x
      return jax.device_put(x, replicated)

    return jax.tree.map(place, (params, opt_state, frozen))

  def _jit(self, params, opt_state):
    kwargs: dict[str, Any] = {}  # jax.jit's keywords
    if self.mesh is None:
      key = None
    else:
      state_shardings = jax.tree.map(lambda x: x.sharding, (params, opt_state))
      key = tuple(jax.tree.leaves(state_shardings)), jax.tree.structure(state_shardings)
      kwargs = {"out_shardings": (*state_shardings, NamedSharding(self.mesh, P()))}
    if key not in self._jitted:
      self._jitted[key] = jax.jit(self.step, donate_argnums=(0, 1), **kwargs)
    return self._jitted[key]

  def _context(self):
    return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

  def __call__(self, params, opt_state, batch):
    params, opt_state, frozen = self._place(params, opt_state, self.frozen)
    self.frozen = frozen  # placed once; later steps reuse it
    with self._context():
      # A sub-byte frozen array (a 4-bit base) goes through jit: the runtime
      # makes int4 arrays unpacked, and a program compiled ahead of time
      # refuses all but the packed layout it chose (XLA:CPU).
      if self._sub_byte is None:  # (the frozen state is placed once: checked once)
        self._sub_byte = _has_sub_byte(frozen)
      if self._executable is not None and not self._sub_byte:
        return self._executable(params, opt_state, batch, frozen)
      return self._jit(params, opt_state)(params, opt_state, batch, frozen)

  def lower(
    self, params: Any, opt_state: Any, batch: Mapping[str, Any] | Sequence[Mapping[str, Any]]
  ) -> jax.stages.Lowered:
    """Lower the step.

    The arguments (and ``frozen``) may be ``jax.ShapeDtypeStruct`` s with
    shardings.

    Args:
      params: the parameters.
      opt_state: the optimizer state.
      batch: the batch.

    Returns:
      The lowered step.
    """
    frozen = self.frozen
    if self.mesh is not None and any(
      not isinstance(getattr(x, "sharding", None), NamedSharding)
      for x in jax.tree.leaves((params, opt_state, frozen))
    ):
      params, opt_state, frozen = self._place(params, opt_state, frozen)
    with self._context():
      return self._jit(params, opt_state).lower(params, opt_state, batch, frozen)

  def compile(
    self, params: Any, opt_state: Any, batch: Mapping[str, Any] | Sequence[Mapping[str, Any]]
  ) -> "TrainStep":
    """Compile the step ahead of time for these arguments.

    They may be ``jax.ShapeDtypeStruct`` s with shardings, as in :meth:`lower`.

    Args:
      params: the parameters.
      opt_state: the optimizer state.
      batch: the batch.

    Returns:
      A :class:`TrainStep` that runs the compiled program.
    """
    executable = self.lower(params, opt_state, batch).compile()
    return TrainStep(self.step, self.mesh, executable, frozen=self.frozen)

  def memory_analysis(self) -> Any:
    """Return the compiled program's memory analysis.

    Returns:
      XLA's memory statistics: argument, output, alias and temporary bytes.
    """
    return self._compiled().memory_analysis()

  def cost_analysis(self) -> Any | None:
    """Return the compiled program's cost analysis.

    Returns:
      XLA's cost analysis (its FLOPs, ...); None from XLA:GPU without a device.
    """
    return self._compiled().cost_analysis()

  def as_text(self) -> str:
    """Return the compiled program's text (HLO): its buffers' shapes and its collectives."""
    return self._compiled().as_text()

  @property
  def input_shardings(self) -> Any:
    """The compiled program's shardings of ``(params, opt_state, batch, frozen)``."""
    return self._compiled().input_shardings[0]

  @property
  def args_info(self) -> Any:
    """The compiled program's ``(params, opt_state, batch, frozen)``: leaves' shapes, dtypes."""
    return self._compiled().args_info[0]

  def _compiled(self):
    if self._executable is None:
      raise ValueError(
        "memory_analysis, cost_analysis and as_text need a compiled step: call .compile(...) first"
      )
    return self._executable
