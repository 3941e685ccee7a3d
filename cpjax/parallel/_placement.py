"""The training state's placement: partition specs for parameters and placing them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cpjax.parallel._mesh import axis_size

# rule(path, shape) -> PartitionSpec naming "tp" (or an expert's axes, or nothing) per dimension.
PartitionRule = Callable[[tuple[str, ...], tuple[int, ...]], P]
# A pytree that placing keeps (its leaves move, its structure and type stay).
_Tree = TypeVar("_Tree")

# The token axes that split the training state by default (issue: state over
# every device that shares the model, as FSDP over dp_shard x cp).
STATE_AXES = ("fsdp", "cp")


def key_names(path: jax.tree_util.KeyPath) -> tuple[str, ...]:
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
  params: Any,
  mesh: Mesh | AbstractMesh,
  *,
  rule: PartitionRule | None = None,
  state_axes: Sequence[str] = STATE_AXES,
) -> Any:
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


def shard_params(params: _Tree, mesh: Mesh, specs: Any) -> _Tree:
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


def shard_like_params(tree: _Tree, params: Any) -> _Tree:
  """Place ``tree`` (an optimizer state) like ``params``: every leaf whose key
  path ends in a parameter's key path, with that parameter's shape, takes the
  parameter's sharding (Adam's ``mu``/``nu``); the rest (step counts) is
  replicated on the parameters' mesh. Abstract leaves (``jax.ShapeDtypeStruct``,
  e.g. from ``jax.eval_shape(optimizer.init, params)``) come back abstract,
  with the sharding attached.

  >>> import optax
  >>> from cpjax.parallel import make_mesh
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
  mesh = cast(NamedSharding, shardings[0]).mesh  # every leaf's is one, checked above

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


def bytes_per_device(tree: Any) -> int:
  """Count the bytes one device holds of the arrays in ``tree`` (its largest shard per leaf).

  A 4-bit leaf (int4, a QLoRA base's values) takes half a byte a value, as
  XLA:TPU, XLA:GPU and XLA:CPU hold it (numpy's ``itemsize`` says 1).

  Args:
    tree: a pytree of arrays.

  Returns:
    The bytes.

  >>> bytes_per_device({"q": jax.ShapeDtypeStruct((4, 1024), jax.numpy.int4)})
  2048
  """
  total = 0
  for x in jax.tree.leaves(tree):
    sharding = getattr(x, "sharding", None)  # (None: an unplaced ShapeDtypeStruct)
    shape = sharding.shard_shape(x.shape) if sharding is not None else np.shape(x)
    if x.dtype == jax.dtypes.float0:  # an integer's gradient: no data
      continue
    total += -(-int(np.prod(shape)) * jax.dtypes.itemsize_bits(x.dtype) // 8)
  return total


def place(x: jax.Array, mesh: Mesh, spec: P) -> jax.Array:
  """Give ``x`` the sharding ``spec`` names, on Explicit and Auto meshes alike.

  Args:
    x: an array (inside or outside ``jit``).
    mesh: the mesh ``spec`` names axes of.
    spec: the partition spec.

  Returns:
    ``x`` resharded (its Explicit axes) or constrained (all named axes Auto).
  """
  sharding = NamedSharding(mesh, spec)
  named = {
    a for part in spec if part is not None for a in (part if isinstance(part, tuple) else (part,))
  }
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  if named and all(types[a] == AxisType.Auto for a in named):
    return jax.lax.with_sharding_constraint(x, sharding)
  return jax.reshard(x, sharding)


def gather_dim(x: jax.Array, dim: int) -> jax.Array:
  """Un-shard dimension ``dim`` of ``x`` (other dimensions keep their sharding).

  On an Explicit mesh a permuting gather along a sharded dimension has no
  unambiguous output sharding, so the dimension is made whole first.
  """
  sharding = jax.typeof(x).sharding
  spec = getattr(sharding, "spec", None)
  if spec is None or dim >= len(spec) or spec[dim] is None:
    return x
  parts = list(spec)
  parts[dim] = None
  return jax.reshard(x, NamedSharding(sharding.mesh, P(*parts)))
