"""Training meshes: data or fully-sharded data parallel x context parallel x tensor parallel.

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
context-parallel ranks (:func:`expert_axes`, :mod:`cpjax.experts`). A
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

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
  "BATCH_AXES",
  "HEAD_AXIS",
  "STATE_AXES",
  "axis_size",
  "batch_axis_of",
  "bytes_per_device",
  "expert_axes",
  "filled_after",
  "gather_safe",
  "gathered",
  "key_names",
  "lookup",
  "make_mesh",
  "param_specs",
  "parse_mesh",
  "ring_lookup",
  "shard_params",
  "shard_like_params",
  "vary_like",
  "vary_over",
  "varying_axes",
]

# rule(path, shape) -> PartitionSpec naming "tp" (or an expert's axes, or nothing) per dimension.
PartitionRule = Callable[[tuple[str, ...], tuple[int, ...]], P]


# -- Meshes -------------------------------------------------------------------

# Mesh axes that split the rows of the batch (one of them per mesh).
BATCH_AXES = ("dp", "fsdp")
# The mesh axis that splits attention heads and hidden units.
HEAD_AXIS = "tp"
_AXIS_ORDER = ("dp", "fsdp", "cp", "tp")


def make_mesh(
  *,
  cp: int = 1,
  fsdp: int = 1,
  dp: int = 1,
  tp: int = 1,
  devices: Sequence[jax.Device] | None = None,
) -> Mesh:
  """Build a training mesh with axes ``dp`` or ``fsdp`` (when > 1), ``cp``, ``tp`` (when > 1).

  ``cp`` is always an axis. Uses the first ``dp * fsdp * cp * tp`` of
  ``devices`` (default: all), with ``tp`` innermost so that its collectives
  stay on the nearest devices. ``cp`` is Explicit and the other axes Auto
  (see the module docstring).

  Args:
    cp: the context-parallel axis's size.
    fsdp: the ``fsdp`` axis's size.
    dp: the ``dp`` axis's size.
    tp: the tensor-parallel axis's size.
    devices: the devices to use (default: all).

  Returns:
    The :class:`jax.sharding.Mesh`.

  >>> make_mesh(fsdp=4, cp=2).axis_names
  ('fsdp', 'cp')
  """
  sizes = {"dp": dp, "fsdp": fsdp, "cp": cp, "tp": tp}
  for name, size in sizes.items():
    if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size < 1:
      raise ValueError(f"mesh axis {name!r} must be a positive int, got {size!r}")
  if dp > 1 and fsdp > 1:
    raise ValueError(
      f"a mesh splits the batch over one axis: got dp={dp} and fsdp={fsdp}; "
      f"use fsdp alone (it is dp that also shards the parameters)"
    )
  devices = list(jax.devices() if devices is None else devices)
  if not all(isinstance(d, jax.Device) for d in devices):
    raise TypeError(
      f"devices must be jax.Device objects (jax.devices()), got "
      f"{sorted({type(d).__name__ for d in devices})}"
    )
  need = dp * fsdp * cp * tp
  if need > len(devices):
    raise ValueError(
      f"mesh dp={dp} fsdp={fsdp} cp={cp} tp={tp} needs {need} devices, {len(devices)} available"
    )
  names = tuple(n for n in _AXIS_ORDER if sizes[n] > 1 or n == "cp")
  types = tuple(AxisType.Explicit if n == "cp" else AxisType.Auto for n in names)
  return jax.make_mesh(
    tuple(sizes[n] for n in names), names, axis_types=types, devices=devices[:need]
  )


def parse_mesh(text: str) -> dict[str, int]:
  """Parse ``"fsdp=2,cp=4"`` into ``{"fsdp": 2, "cp": 4}`` (the ``--mesh`` flag's format).

  ``ep=N`` may follow: the expert parallelism folded onto the other axes
  (:func:`expert_axes`), not an axis of its own.

  Args:
    text: the mesh, as the ``--mesh`` flag takes it.

  Returns:
    ``{axis: size}``.

  >>> parse_mesh("fsdp=2,cp=2,tp=2")
  {'fsdp': 2, 'cp': 2, 'tp': 2}
  >>> parse_mesh("cp=4,ep=4")
  {'cp': 4, 'ep': 4}
  """
  sizes: dict[str, int] = {}
  for part in text.split(","):
    name, eq, value = part.strip().partition("=")
    if not eq or name not in (*_AXIS_ORDER, "ep"):
      raise ValueError(
        f"mesh {text!r}: expected comma-separated AXIS=SIZE with AXIS in "
        f"{(*_AXIS_ORDER, 'ep')}, got {part.strip()!r}"
      )
    if name in sizes:
      raise ValueError(f"mesh {text!r} names axis {name!r} twice")
    if not value.isdigit() or int(value) < 1:
      raise ValueError(f"mesh {text!r}: axis {name!r} needs a positive integer size, got {value!r}")
    sizes[name] = int(value)
  return sizes


def expert_axes(mesh: Mesh, ep: int) -> tuple[str, ...]:
  """Return the mesh axes ``ep``-way expert parallelism folds onto.

  They are ``()`` for ``ep = 1``, else ``("cp",)``, the batch axis, or
  ``("cp", batch axis)``, whichever has ``ep`` devices (``cp`` first when two
  do: its ranks are the nearest, see :func:`make_mesh`). The experts' leading
  dimension is split over them in that order, ``cp`` major.

  Tokens must differ across the devices that hold different experts, so
  ``ep`` can only fold onto axes that split tokens (``tp`` ranks hold the
  same tokens). A mesh with ``tp`` does not take ``ep`` (on this JAX the
  SPMD partitioner aborts on the dispatch beside an Auto ``tp`` axis);
  without ``ep`` its experts split over ``tp`` instead.

  Args:
    mesh: the training mesh.
    ep: the expert parallelism.

  Returns:
    The axes, in the order the experts split over them.

  >>> expert_axes(make_mesh(fsdp=2, cp=4), 8)
  ('cp', 'fsdp')
  >>> expert_axes(make_mesh(fsdp=2, cp=2), 2)
  ('cp',)
  """
  if isinstance(ep, bool) or not isinstance(ep, (int, np.integer)) or ep < 1:
    raise ValueError(f"ep must be a positive int, got {ep!r}")
  if ep == 1:
    return ()
  if axis_size(mesh, "tp") > 1:
    raise ValueError(
      f"ep={ep} does not combine with tp={mesh.shape['tp']}: fold the experts "
      f"onto cp and the batch axis without tp (tp splits them by expert)"
    )
  batch = batch_axis_of(mesh)
  options = [("cp",), (batch,), ("cp", batch)] if batch else [("cp",)]
  options = [o for o in options if all(a in mesh.axis_names for a in o)]
  sizes = {o: int(np.prod([mesh.shape[a] for a in o])) for o in options}
  for option in options:
    if sizes[option] == ep:
      return option
  allowed = ", ".join(f"{'*'.join(o)} = {n}" for o, n in sizes.items())
  raise ValueError(
    f"ep={ep} must equal the size of the token axes it folds onto "
    f"({allowed}) of mesh {dict(mesh.shape)}"
  )


def batch_axis_of(mesh: Mesh) -> str | None:
  """Return the mesh's batch axis (``"dp"`` or ``"fsdp"``), or None.

  Args:
    mesh: the mesh.

  Returns:
    The batch axis's name, or None.
  """
  found = [a for a in mesh.axis_names if a in BATCH_AXES]
  if len(found) > 1:
    raise ValueError(f"a mesh splits the batch over one axis, this one has {found}")
  return found[0] if found else None


def axis_size(mesh: Mesh, name: str) -> int:
  """Return the size of ``mesh``'s axis ``name``, 1 when the mesh has no such axis.

  Args:
    mesh: the mesh.
    name: the axis's name.

  Returns:
    The axis's size.
  """
  return int(mesh.shape[name]) if name in mesh.axis_names else 1


# -- Values inside shard_map: the manual axes they vary over -----------------


def varying_axes(x) -> frozenset:
  """Return the mesh axes ``x`` varies over inside ``shard_map`` (empty outside).

  Args:
    x: an array.

  Returns:
    The axes' names.
  """
  mat = getattr(jax.typeof(x), "manual_axis_type", None)
  return getattr(mat, "varying", frozenset())


def vary_like(x, ref):
  """Make ``x`` varying over the mesh axes ``ref`` varies over (check_vma).

  Args:
    x: an array.
    ref: the array whose varying axes ``x`` takes.

  Returns:
    ``x``, varying over those axes too.
  """
  missing = tuple(sorted(varying_axes(ref) - varying_axes(x)))
  return lax.pcast(x, missing, to="varying") if missing else x


def vary_over(x, axes: frozenset):
  """Make ``x`` varying over ``axes`` too (check_vma).

  Args:
    x: an array.
    axes: the mesh axes.

  Returns:
    ``x``, varying over ``axes`` too.
  """
  missing = tuple(sorted(axes - varying_axes(x)))
  return lax.pcast(x, missing, to="varying") if missing else x


def filled_after(ref, shape, fill=0.0, dtype=jnp.float32):
  """Return ``fill`` everywhere in ``shape``, varying as ``ref`` does, and computed from ``ref``.

  It is an accumulator's initial value that no schedule can build before
  ``ref`` exists.

  A constant fill (``jnp.zeros``) is one broadcast, which XLA shares between
  every layer's loops; XLA:CPU builds it when the program starts and copies
  it for each loop there, so every copy stays alive until its loop runs
  (1.5 GiB of zeros through the step on the E2B slice at S = 131072, cp = 8).
  A zero made from ``ref``'s first value (0 whatever it is, even NaN) ties
  the fill to ``ref`` by data. It passes an optimization barrier with that
  value: XLA:GPU's simplifier otherwise folds ``convert(pred) * 0`` to a
  constant and fuses every such fill into one operandless fusion, all of
  them alive from the step's start.

  Args:
    ref: the array the fill is computed from.
    shape: the result's shape.
    fill: the value.
    dtype: the result's dtype.

  Returns:
    The filled array.

  >>> filled_after(jnp.ones(3), (2,), -jnp.inf)
  Array([-inf, -inf], dtype=float32)
  """
  out = jnp.full(shape, fill, dtype)
  if ref.size:  # (an empty ref has nothing to wait for)
    first = ref.reshape(-1)[0]
    zero, _ = lax.optimization_barrier(((first != first).astype(dtype) * 0, first))
    out = out + zero  # 0 or 0 * 1: never NaN
  return vary_like(out, ref)


# -- The training state's placement -----------------------------------------

# The token axes that split the training state by default (issue: state over
# every device that shares the model, as FSDP over dp_shard x cp).
STATE_AXES = ("fsdp", "cp")


def key_names(path) -> tuple[str, ...]:
  """Return a pytree key path as strings, as a :data:`PartitionRule` receives it.

  Args:
    path: a pytree key path.

  Returns:
    The path's keys as strings.

  >>> key_names(jax.tree_util.tree_leaves_with_path({"a": [0, 1]})[1][0])
  ('a', '1')
  """
  return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def param_specs(
  params, mesh: Mesh, *, rule: PartitionRule | None = None, state_axes: Sequence[str] = STATE_AXES
):
  """Return a ``PartitionSpec`` per parameter leaf (same tree as ``params``).

  ``rule(path, shape)`` gives the tensor-parallel part (``"tp"`` on the
  dimensions whose computation splits, experts' axes on their expert
  dimension; default: none); ``path`` is the leaf's key path as strings.
  Axes the rule names that ``mesh`` lacks are dropped (no ``tp`` axis: no
  ``tp`` split). Storage is then split further, ZeRO-3 style, over the
  token axes in ``state_axes`` that the rule left free: ``("fsdp", "cp")``
  (the default) flattened into one split, ``cp`` major, on the leaf's
  largest dimension whose shard it divides (each on its own when no
  dimension takes both); ``("fsdp",)`` keeps the state whole over ``cp``.
  ``tp`` goes there too when the rule did not use it (embeddings, norms, the
  vision tower), so every device stores about ``1 / (fsdp * cp * tp)`` of
  the model. A leaf that no free dimension divides (an odd-width norm scale)
  stays replicated over that axis. A rule that splits a dimension over axes
  whose sizes do not divide it is a ``ValueError`` naming the parameter.

  The training step (:func:`cpjax.training.make_train_step`) reads where the
  state lives from its shardings: a leaf split over ``cp`` enters the
  ring's ``shard_map`` split and is gathered where it is used (a Gemma 4
  decoder layer inside its remat scope, the rest when the step starts); its
  gradient leaves reduce-scattered.

  Args:
    params: the parameters.
    mesh: the training mesh.
    rule: ``rule(path, shape)``, the tensor-parallel part (default: none).
    state_axes: the token axes that split the storage further.

  Returns:
    A ``PartitionSpec`` per parameter leaf.
  """
  state_axes = tuple(state_axes)
  if set(state_axes) not in ({"fsdp"}, {"fsdp", "cp"}) or len(set(state_axes)) < len(state_axes):
    raise ValueError(f"state_axes must be ('fsdp',) or ('fsdp', 'cp'), got {state_axes!r}")
  if not isinstance(mesh, (Mesh, jax.sharding.AbstractMesh)):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
  if rule is not None and not callable(rule):
    raise TypeError(
      f"rule must be a function (path, shape) -> PartitionSpec, got {type(rule).__name__}"
    )

  def named(part) -> list[str]:
    names = part if isinstance(part, tuple) else (part,) if part else ()
    return [n for n in names if n in mesh.axis_names and axis_size(mesh, n) > 1]

  def spec(path, leaf):
    shape = tuple(np.shape(leaf))
    keys = key_names(path)
    parts = list(rule(keys, shape)) if rule is not None else []
    if len(parts) > len(shape):
      raise ValueError(
        f"partition rule for {'.'.join(keys)} names {len(parts)} dimensions, "
        f"the parameter has shape {shape}"
      )
    axes = [named(p) for p in parts]
    axes += [[] for _ in range(len(shape) - len(axes))]
    for d, names in enumerate(axes):
      ways = int(np.prod([mesh.shape[a] for a in names], dtype=int))
      if shape[d] % ways:
        raise ValueError(
          f"partition rule for {'.'.join(keys)} splits its dimension {d} of size "
          f"{shape[d]} {ways} ways (over {tuple(names)}), which does not divide it"
        )

    def used(name):
      return axis_size(mesh, name) == 1 or any(name in a for a in axes)

    # The state's token axes flattened into one split where a dimension takes
    # it (cp major: the ring's shard_map takes the leaf split over cp as
    # stored), else each on its own; then tp where the rule left it free.
    token = [a for a in ("cp", "fsdp") if a in state_axes and not used(a)]
    for group in ([token] if len(token) > 1 else []) + [[a] for a in token] + [["tp"]]:
      if any(used(a) for a in group):
        continue
      ways = int(np.prod([mesh.shape[a] for a in group], dtype=int))
      shard = [
        shape[d] // int(np.prod([mesh.shape[a] for a in axes[d]], dtype=int))
        for d in range(len(shape))
      ]
      free = [d for d in range(len(shape)) if shard[d] % ways == 0]
      if free:
        d = max(free, key=lambda d: (shard[d], -d))
        axes[d] = group + axes[d] if "cp" in group else axes[d] + group
    parts = [None if not a else a[0] if len(a) == 1 else tuple(a) for a in axes]
    while parts and parts[-1] is None:
      parts.pop()
    return P(*parts)

  return jax.tree.map_with_path(spec, params)


def shard_params(params, mesh: Mesh, specs):
  """Place ``params`` on ``mesh`` per ``specs`` (from :func:`param_specs`).

  Args:
    params: the parameters.
    mesh: the mesh.
    specs: a ``PartitionSpec`` per parameter leaf.

  Returns:
    ``params`` placed on ``mesh``.
  """
  if not isinstance(mesh, Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
  if jax.tree.structure(params) != jax.tree.structure(specs, is_leaf=lambda s: isinstance(s, P)):
    raise ValueError(
      "specs must have the tree structure of params (one PartitionSpec per "
      "leaf, as param_specs gives)"
    )
  return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)


def shard_like_params(tree, params):
  """Place ``tree`` (an optimizer state) like ``params``: every leaf whose key
  path ends in a parameter's key path, with that parameter's shape, takes the
  parameter's sharding (Adam's ``mu``/``nu``); the rest (step counts) is
  replicated on the parameters' mesh. Abstract leaves (``jax.ShapeDtypeStruct``,
  e.g. from ``jax.eval_shape(optimizer.init, params)``) come back abstract,
  with the sharding attached.

  >>> import optax
  >>> mesh = make_mesh(fsdp=2, cp=1)
  >>> params = shard_params({"w": np.zeros((4, 2))}, mesh, {"w": P("fsdp")})
  >>> state = shard_like_params(optax.adam(1e-3).init(params), params)
  >>> state[0].mu["w"].sharding.spec, state[0].count.sharding.spec
  (P('fsdp',), P())
  """
  by_path = {tuple(path): x for path, x in jax.tree_util.tree_leaves_with_path(params)}
  shardings = [getattr(x, "sharding", None) for x in by_path.values()]
  if not by_path or not all(isinstance(s, NamedSharding) for s in shardings):
    raise TypeError(
      "params must be a non-empty tree of arrays placed on a mesh (from "
      "shard_params), got leaves without a NamedSharding"
    )
  mesh = shardings[0].mesh

  def place(path, leaf):
    path = tuple(path)
    sharding = NamedSharding(mesh, P())
    for start in range(len(path)):
      param = by_path.get(path[start:])
      if param is not None and np.shape(param) == np.shape(leaf):
        sharding = param.sharding
        break
    if isinstance(leaf, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
    return jax.device_put(leaf, sharding)

  return jax.tree_util.tree_map_with_path(place, tree)


def gathered(table: jax.Array) -> jax.Array:
  """Gather ``table`` whole on every device, for a lookup (``table[ids]``).

  A no-op outside a mesh. Under one, a lookup into a table sharded over an
  Auto axis (``fsdp``) by ids sharded over that same axis (the batch rows)
  inside the ring's ``shard_map`` makes XLA's SPMD partitioner fail a check
  when the mesh has a second Auto axis (jax 0.10, CPU; fsdp x cp x tp):
  asking for the table whole first, as ZeRO-3 gathers any weight before
  use, gives the partitioner a plain local gather. The gathered table is a
  temporary, freed after the lookup and its backward.

  Args:
    table: the table.

  Returns:
    ``table``, whole on every device.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not any(kind == AxisType.Auto for kind in mesh.axis_types):
    return table
  return jax.lax.with_sharding_constraint(table, P())


def lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
  """Look up ``table[ids]`` [B, ..., D] without the whole table on any device.

  On a mesh whose Auto axes (``fsdp``, ``tp``) split the table's rows, as
  :func:`param_specs` places a table (both axes on the vocabulary), each
  device looks up the ids that fall in its own block of rows, gives zeros
  for the rest, and a sum over the table's axes completes every row: a
  reduce-scatter back to the batch's rows over the batch axis, an all-reduce
  over the others. Only the integer ids travel whole over the batch axis.
  The gradient is a scatter-add into each device's own block, so it stays
  sharded too. The lookup is a ``shard_map`` manual over those axes: it does
  not depend on the SPMD partitioner's handling of gathers (which fails a
  check on fsdp x cp x tp meshes on this JAX, see :func:`gathered`).
  Without such a mesh (one device, or inside a ``shard_map`` manual over
  every axis) it is ``table[ids]``.

  Args:
    table: [V, D] rows to look up.
    ids: int[B, ...] row numbers in ``[0, V)``; ``B`` split over the mesh's
      batch axis when it has one that divides it.

  Returns:
    ``table[ids]`` [B, ..., D].

  Example:
    >>> import numpy as np
    >>> mesh = make_mesh(fsdp=2, cp=1, tp=2)
    >>> table = np.arange(16.0).reshape(8, 2)
    >>> ids = np.array([[7, 0], [3, 3]])
    >>> with jax.set_mesh(mesh):
    ...   out = jax.jit(lookup)(jax.device_put(table, NamedSharding(mesh, P(("fsdp", "tp")))), ids)
    >>> np.asarray(out)[:, :, 0].tolist()
    [[14.0, 0.0], [6.0, 6.0]]
  """
  where = row_placement(table, ids.shape[0])
  if where is None:
    return table[ids]
  if not where.table_axes:
    return gathered(table)[ids]
  return _sharded_lookup(table, ids, where)


class RowPlacement(NamedTuple):
  """Where a table split over its rows (vocabulary) lives, for code manual over the mesh."""

  table_axes: tuple[str, ...]  # mesh axes splitting the table's rows, major first (or none)
  batch: str | None  # the axis splitting the batch's rows (B), if it divides B
  auto: frozenset[str]  # every Auto axis of size > 1: be manual over them all
  rows: int  # the table's rows, V
  dtype: Any
  vma: frozenset[str]  # manual axes (cp) the table varies over: none, usually

  def block_rows(self) -> int:
    """Return the table rows each device holds: ``rows`` over the ``table_axes``' sizes.

    The sizes are the current abstract mesh's.

    Returns:
      The rows of one device's block.
    """
    mesh = jax.sharding.get_abstract_mesh()
    return self.rows // int(np.prod([mesh.shape[a] for a in self.table_axes], dtype=int))


def row_placement(table: jax.Array, batch_rows: int) -> RowPlacement | None:
  """Return how ``table`` [V, ...] splits over the current mesh's Auto axes.

  As :func:`param_specs` places it: None without Auto axes (one device, or
  every axis manual); ``table_axes`` empty when the split is not over the
  rows alone (then gather it).

  Args:
    table: the table [V, ...].
    batch_rows: the batch's ``B``.

  Returns:
    The :class:`RowPlacement`, or None.
  """
  mesh = jax.sharding.get_abstract_mesh()
  auto = (
    ()
    if mesh.empty
    else tuple(
      n
      for n, kind in zip(mesh.axis_names, mesh.axis_types)
      if kind == AxisType.Auto and mesh.shape[n] > 1
    )
  )
  if not auto:
    return None
  # The Auto axes' part: a split over cp was gathered when the ring's
  # shard_map began (manual over cp, the table is whole over it here).
  spec = param_specs(jax.ShapeDtypeStruct(table.shape, table.dtype), mesh, state_axes=("fsdp",))
  rows = spec[0] if len(spec) else None
  table_axes = () if rows is None else (rows,) if isinstance(rows, str) else tuple(rows)
  if any(p is not None for p in spec[1:]):
    table_axes = ()
  batch = next((a for a in auto if a in BATCH_AXES and batch_rows % mesh.shape[a] == 0), None)
  return RowPlacement(
    table_axes, batch, frozenset(auto), table.shape[0], jnp.dtype(table.dtype), varying_axes(table)
  )


# A custom VJP whose backward is its own shard_map (the scatter-add into each
# device's block): the transpose JAX derives for a shard_map nested in the
# ring's fails to lower on this JAX (its residuals name the outer manual axis).
@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _sharded_lookup(table, ids, where):
  return _lookup_forward(table, ids, where)[0]


def _block_ids(ids, size, table_axes, batch):
  """(row within this device's block, whether it is in the block) of every id."""
  if batch in table_axes:  # every row's ids meet every block of the table
    ids = jax.lax.all_gather(ids, batch, axis=0, tiled=True)
  rel = ids - jax.lax.axis_index(table_axes) * size
  hit = (rel >= 0) & (rel < size)
  return jnp.where(hit, rel, 0), hit


def _lookup_forward(table, ids, where):
  table_axes, batch = where.table_axes, where.batch

  def local(block, ids):
    rel, hit = _block_ids(ids, block.shape[0], table_axes, batch)
    out = jnp.where(hit[..., None], block[rel], jnp.zeros((), block.dtype))
    if batch in table_axes:
      out = jax.lax.psum_scatter(out, batch, scatter_dimension=0, tiled=True)
    rest = tuple(a for a in table_axes if a != batch)
    return jax.lax.psum(out, rest) if rest else out

  out = jax.shard_map(
    local, in_specs=(P(table_axes), P(batch)), out_specs=P(batch), axis_names=set(where.auto)
  )(table, ids)
  return out, ids


def _lookup_backward(where, ids, g):
  table_axes, batch = where.table_axes, where.batch
  size = where.block_rows()

  def local(ids, g):
    rel, hit = _block_ids(ids, size, table_axes, batch)
    if batch in table_axes:
      g = jax.lax.all_gather(g, batch, axis=0, tiled=True)
    g = jnp.where(hit[..., None], g, jnp.zeros((), g.dtype))
    block = filled_after(g, (size, g.shape[-1]), dtype=where.dtype)
    block = block.at[rel].add(g.astype(where.dtype))
    # Rows split over a batch axis that does not split the table (dp) all
    # add into the same (replicated) block.
    return block if batch in table_axes or batch is None else jax.lax.psum(block, batch)

  d_table = jax.shard_map(
    local, in_specs=(P(batch), P(batch)), out_specs=P(table_axes), axis_names=set(where.auto)
  )(ids, g)
  # Inside the ring's shard_map the ids differ per cp rank while the table
  # does not: its gradient is the sum over those ranks.
  spread = tuple(sorted(varying_axes(d_table) - where.vma))
  return (jax.lax.psum(d_table, spread) if spread else d_table), None


_sharded_lookup.defvjp(_lookup_forward, _lookup_backward)


def ring_lookup(block: jax.Array, ids: jax.Array, axis_name: str = "cp") -> jax.Array:
  """Look up ``table[ids]`` [B, L, D] inside a ``shard_map`` manual over ``axis_name``.

  Each rank holds one block of the table's rows and its own tokens.

  Rank ``i`` holds rows ``[i * Vb, (i + 1) * Vb)`` (``block`` [Vb, D], as
  :func:`param_specs` stores a table over ``fsdp x cp``, cp major) and the
  ids of its ``L`` tokens. Each rank's ids travel round the ring with their
  partial rows: every rank adds the rows that fall in its block and passes
  both on, and after ``n`` hops (one ``ppermute`` of ``[B, L, D]`` each, as
  a reduce-scatter moves) they are home, complete. No rank holds the whole
  table or more than one ``[B, L, D]`` partial at a time; the gradient is a
  scatter-add into each rank's own block (the transposed ring). The block's
  split over Auto axes (``fsdp``, ``tp``) is :func:`lookup`'s.

  Args:
    block: [Vb, D] this rank's rows of the table.
    ids: int[B, ...] row numbers in ``[0, n * Vb)``, this rank's tokens.
    axis_name: the manual mesh axis the rows are split over.

  Returns:
    ``table[ids]`` [B, L, D] of this rank's tokens.

  Example:
    >>> import numpy as np
    >>> mesh = jax.make_mesh((2,), ("cp",), devices=jax.devices()[:2])
    >>> table = np.arange(8.0).reshape(4, 2)           # rank 0: rows 0-1, rank 1: rows 2-3
    >>> ids = np.array([[3, 0, 1, 2]])                  # rank 0: [3, 0], rank 1: [1, 2]
    >>> f = jax.shard_map(ring_lookup, mesh=mesh, in_specs=(P("cp"), P(None, "cp")),
    ...                   out_specs=P(None, "cp"))
    >>> put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    >>> np.asarray(jax.jit(f)(put(table, P("cp")), put(ids, P(None, "cp"))))[0, :, 0].tolist()
    [6.0, 0.0, 2.0, 4.0]
  """
  return _ring_lookup(block, ids, axis_name)


# The backward is written out so that every hop's scatter-add lands in one
# gradient buffer of the block: differentiating the hops gives one
# block-sized buffer per hop, which XLA:CPU keeps alive until it sums them
# (the table's size several times over; measured on the E2B slice at
# S = 131072, cp = 8).
@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _ring_lookup(block, ids, axis_name):
  return _ring_forward(block, ids, axis_name)[0]


def _ring(ids, axis_name: str, rows: int):
  """(ring size, one hop's permutation, ``hits(ids) -> (row in this rank's block, in it)``)."""
  n = jax.lax.axis_size(axis_name)
  start = jax.lax.axis_index(axis_name) * rows

  def hits(visiting):
    rel = visiting - start
    hit = (rel >= 0) & (rel < rows)
    return jnp.where(hit, rel, 0), hit

  return n, [(i, (i + 1) % n) for i in range(n)], hits


def _ring_forward(block, ids, axis_name):
  n, hop, hits = _ring(ids, axis_name, block.shape[0])

  def add(visiting, total):
    rel, hit = hits(visiting)
    return total + jnp.where(hit[..., None], lookup(block, rel), jnp.zeros((), block.dtype))

  def step(_, carry):
    visiting, total = carry
    total = jax.lax.ppermute(add(visiting, total), axis_name, hop)
    return jax.lax.ppermute(visiting, axis_name, hop), total

  # A loop, not n unrolled hops: XLA:TPU's scheduler starts the unrolled
  # hops' ppermutes early, several [B, L, D] partials in flight at once.
  total = vary_like(jnp.zeros((*ids.shape, *block.shape[1:]), block.dtype), ids)
  visiting, total = jax.lax.fori_loop(0, n - 1, step, (ids, total))
  return jax.lax.ppermute(add(visiting, total), axis_name, hop), (block, ids)


def _ring_backward(axis_name, residuals, g):
  # Every rank added its rows to each token's row, so the token's cotangent
  # goes to every rank: (ids, g) travel the ring once more, and each rank
  # adds those that fall in its block into one buffer.
  block, ids = residuals
  n, hop, hits = _ring(ids, axis_name, block.shape[0])
  whole = row_placement(block, ids.shape[0]) is None  # no Auto axis splits the block

  def add(visiting, g, d_block):
    rel, hit = hits(visiting)
    part = jnp.where(hit[..., None], g, jnp.zeros((), g.dtype)).astype(block.dtype)
    if whole:  # a scatter-add into the one buffer, in place
      return d_block.at[rel].add(part)
    # lookup's own scatter over the Auto axes, then added
    return d_block + jax.vjp(lambda t: lookup(t, rel), block)[1](part)[0]

  def step(_, carry):
    visiting, g, d_block = carry
    d_block = add(visiting, g, d_block)
    return jax.lax.ppermute(visiting, axis_name, hop), jax.lax.ppermute(g, axis_name, hop), d_block

  # A loop, as the forward: one [B, L, D] cotangent in flight, not several
  # (E2B at S = 262144 on a v6e-16: four float32 [16384, 8960] ones of the
  # per-layer table, 2.2 GiB, at XLA:TPU's peak when unrolled).
  d_block = filled_after(g, block.shape, dtype=block.dtype)
  visiting, g, d_block = jax.lax.fori_loop(0, n - 1, step, (ids, g, d_block))
  return add(visiting, g, d_block), None


_ring_lookup.defvjp(_ring_forward, _ring_backward)


def gather_safe(x: jax.Array) -> jax.Array:
  """Gather ``x`` whole on every device when the mesh has two or more Auto axes.

  For activations entering data-dependent gathers and scatters (MoE
  dispatch): on an fsdp x cp x tp mesh XLA's SPMD partitioner fails a check
  on them (see :func:`gathered`), so the dispatch runs on whole activations
  there, repeated on each fsdp and tp rank. Meshes with one Auto axis keep
  the partitioned dispatch.

  Args:
    x: an activation.

  Returns:
    ``x`` whole on every device when the mesh has two or more Auto axes, else ``x``.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  auto = [
    n
    for n, kind in zip(mesh.axis_names, mesh.axis_types)
    if kind == AxisType.Auto and mesh.shape[n] > 1
  ]
  return jax.lax.with_sharding_constraint(x, P()) if len(auto) >= 2 else x


def bytes_per_device(tree) -> int:
  """Count the bytes one device holds of the arrays in ``tree`` (its largest shard per leaf).

  Args:
    tree: a pytree of arrays.

  Returns:
    The bytes.
  """
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if hasattr(x, "sharding") else np.shape(x)
    total += int(np.prod(shape)) * np.dtype(x.dtype).itemsize
  return total
