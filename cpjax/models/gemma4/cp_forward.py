"""Gemma 4's logits computed with context parallelism, for evaluation and parity checks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cpjax.attention.cp_context import CPContext, batch_specs, state_specs
from cpjax.batch import SOURCE_INDEX_KEY
from cpjax.batch.layout import LayoutKind, ShardLayout, from_rank_order
from cpjax.models.gemma4.model import Gemma4
from cpjax.models.gemma4.partitioning import check_expert_axes, partition_rule
from cpjax.parallel import key_names

__all__ = ["cp_logits"]


def cp_logits(
  model: Gemma4,
  batch: Mapping[str, Any],
  mesh: Mesh,
  *,
  layout: LayoutKind | ShardLayout = "load_balanced",
  axis_name: str = "cp",
  batch_axis: str | None = None,
  implementation: str | None = None,
  interpret: bool = False,
  expert_axes: tuple[str, ...] = (),
  strategy: str | Mapping[str, str] = "ring",
) -> jax.Array:
  """Compute the full logits float32[B, S, V] of a :func:`prepare_batch` batch.

  Computed with context parallelism over ``axis_name`` of ``mesh`` (and the
  batch over ``batch_axis``, if given) through the model's own sharder,
  gathered back into natural token order without padding.

  Evaluates sequences too long for one device; equals ``model(batch)``.
  ``implementation`` and ``interpret`` pick the ring's per-hop backend (see
  :func:`cpjax.ring_attention`). With ``expert_axes``
  (:func:`cpjax.parallel.expert_axes`) the experts are split over those
  axes and tokens travel to them (:mod:`cpjax.models.gemma4.experts`).

  Args:
    model: the :class:`Gemma4`.
    batch: a :func:`prepare_batch` batch.
    mesh: a mesh with an ``axis_name`` axis.
    layout: the layout the model's sharder shards with: a
      :data:`~cpjax.batch.LayoutKind`, or a :class:`cpjax.ShardLayout` to
      shard exactly that way (as :func:`cpjax.shard_batch`).
    axis_name: the context-parallel mesh axis.
    batch_axis: optional mesh axis the batch is sharded over.
    implementation, interpret: the ring's per-hop backend.
    expert_axes: the mesh axes the experts are split over.
    strategy: attention's CP strategy, one or one per layer kind (see
      :class:`cpjax.CPContext`).

  Returns:
    float32[B, S, V] logits in natural token order, without padding.

  Example:
    >>> import jax, numpy as np
    >>> from cpjax.models import gemma4
    >>> cfg = gemma4.Gemma4Config.preset("tiny")
    >>> model = gemma4.Gemma4(cfg, rngs=nnx.Rngs(0))
    >>> batch = gemma4.prepare_batch({"input_ids": np.arange(1, 11)[None]}, cfg)
    >>> mesh = jax.make_mesh((2,), ("cp",), devices=jax.devices()[:2])
    >>> logits = gemma4.cp_logits(model, batch, mesh)
    >>> logits.shape, bool(np.allclose(logits, model(batch), atol=1e-4))
    ((1, 10, 512), True)
  """
  check_expert_axes(model.cfg, mesh, expert_axes)
  batch = dict(batch)
  if "labels" not in batch:  # the sharder carries labels; these are never read
    batch["labels"] = jnp.full(jnp.shape(batch["input_ids"]), -100, jnp.int32)
  sharder = model.prepare_model_inputs_for_cp(layout=layout)["cp_sharder"]
  sharded, shard_layout = sharder.shard_batch(
    batch, mesh, axis_name=axis_name, batch_axis=batch_axis, implementation=implementation
  )
  graphdef, state = nnx.split(model)
  context = CPContext(
    shard_layout, axis_name, implementation, interpret, tuple(expert_axes), strategy=strategy
  )
  specs = batch_specs(sharded)
  # The rows are split over batch_axis only where the sharder split them: it
  # leaves them whole over an Auto axis (parallel.make_mesh's fsdp), and
  # every such device then computes every row.
  labels = specs["labels"]
  rows = batch_axis if len(labels) and labels[0] == batch_axis else None

  def local(state, local_batch):
    return nnx.merge(graphdef, state)(local_batch, cp=context)

  def run(state, sharded):
    return jax.shard_map(
      local,
      mesh=mesh,
      in_specs=(state_specs(state, set(mesh.axis_names)), specs),
      out_specs=P(rows, axis_name),
    )(state, sharded)

  # Experts split over the expert axes (as training stores them), the rest whole.
  rule = partition_rule(model.cfg, tp=1, expert_axes=tuple(expert_axes))
  placement = jax.tree.map_with_path(lambda path, x: rule(key_names(path), x.shape), state)
  with jax.set_mesh(mesh):
    state = jax.tree.map(
      lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)), state, placement
    )
    logits = jax.jit(run)(state, sharded)
  return from_rank_order(logits, shard_layout, source_index=sharded.get(SOURCE_INDEX_KEY))[
    :, : shard_layout.original_seq_len
  ]
