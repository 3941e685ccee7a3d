"""Meshes and placement: data or fully-sharded data parallel x context parallel x tensor parallel.

One mesh holds up to three kinds of axis:

* ``"dp"`` or ``"fsdp"``: rows of the batch. Under ``"fsdp"`` every parameter
  and its optimizer state is also sharded over the axis (ZeRO-3): each device
  stores 1/fsdp of it, and the compiler gathers a weight where it is used.
* ``"cp"``: the sequence. The ring runs over it. By default the state is
  split over ``fsdp x cp`` together (:data:`STATE_AXES`), as FSDP over
  NeMo's ``dp_shard x cp``: a cp rank holds 1/(fsdp * cp) of it, and each
  weight is gathered over ``cp`` inside the ring's ``shard_map`` where it
  is used (a Gemma 4 decoder layer inside its remat scope).
* ``"tp"``: attention heads and MLP hidden units (Megatron's column / row
  split), where the head counts allow.

Expert parallelism (``ep``) is not an axis of its own: it folds onto the
axes whose devices already hold different tokens, ``cp`` and the batch axis,
as Megatron-Core folds expert-parallel groups onto its data- and
context-parallel ranks (:func:`expert_axes`, :mod:`cpjax.models.gemma4.experts`). A
mixture of experts' expert dimension is split over those axes, and tokens,
not weights, travel between them.

Design: ``shard_map`` is manual over ``cp`` only, inside a ``jit`` that
shards the rest. The ring needs manual control (``ppermute`` hops, the
per-hop mask metadata, a custom VJP), so it lives in ``shard_map``; FSDP and
TP need none: they are shardings of the weights, and XLA's SPMD partitioner
inserts the all-gathers, reduce-scatters and all-reduces and schedules them
against compute. That keeps every model unaware of FSDP and TP (the same
Gemma 4 code runs on one device, under CP alone, or on a 3-D mesh), and the
parallelism of a weight is a one-line :class:`~jax.sharding.PartitionSpec`
that a user can change. :func:`make_mesh` therefore marks ``cp`` Explicit
(the batch's shardings say which streams are sequence-sharded) and the
other axes Auto (the partitioner's to decide).

Example:
  >>> import jax, numpy as np
  >>> mesh = make_mesh(fsdp=2, cp=2, tp=2)
  >>> dict(mesh.shape)
  {'fsdp': 2, 'cp': 2, 'tp': 2}
  >>> params = {"w": np.zeros((8, 6), np.float32), "b": np.zeros((3,), np.float32)}
  >>> rule = lambda path, shape: P("tp", None) if shape == (8, 6) else P()
  >>> specs = param_specs(params, mesh, rule=rule)
  >>> specs["w"], specs["b"]       # tp from the rule, fsdp x cp on a free dim it divides
  (P(('cp', 'fsdp', 'tp'),), P())
  >>> param_specs(params, mesh, rule=lambda path, shape: P("tp", None) if shape == (8, 6) else P(),
  ...             state_axes=("fsdp",))["w"]      # whole over cp: fsdp on the largest free dim
  P('tp', 'fsdp')
"""

from __future__ import annotations

from jax.sharding import PartitionSpec as P  # noqa: F401 (the example above uses it)

from cpjax.parallel._abstract import abstract_model, linear_tracing
from cpjax.parallel._lookup import (
  RowPlacement,
  gather_safe,
  gathered,
  lookup,
  ring_lookup,
  row_placement,
)
from cpjax.parallel._mesh import (
  BATCH_AXES,
  HEAD_AXIS,
  axis_size,
  batch_axis_of,
  expert_axes,
  make_mesh,
  parse_mesh,
  required_axis_size,
)
from cpjax.parallel._placement import (
  STATE_AXES,
  PartitionRule,
  bytes_per_device,
  gather_dim,
  key_names,
  param_specs,
  place,
  shard_like_params,
  shard_params,
)
from cpjax.parallel._platforms import (
  IMPLEMENTATIONS,
  chunk_multiple,
  mesh_platform,
  resolve_implementation,
)
from cpjax.parallel._vary import filled_after, vary_like, vary_over, varying_axes

__all__ = [
  "BATCH_AXES",
  "HEAD_AXIS",
  "IMPLEMENTATIONS",
  "PartitionRule",
  "RowPlacement",
  "STATE_AXES",
  "abstract_model",
  "axis_size",
  "batch_axis_of",
  "bytes_per_device",
  "chunk_multiple",
  "expert_axes",
  "filled_after",
  "gather_safe",
  "gather_dim",
  "gathered",
  "key_names",
  "linear_tracing",
  "lookup",
  "make_mesh",
  "mesh_platform",
  "param_specs",
  "parse_mesh",
  "place",
  "required_axis_size",
  "resolve_implementation",
  "ring_lookup",
  "row_placement",
  "shard_params",
  "shard_like_params",
  "vary_like",
  "vary_over",
  "varying_axes",
]
