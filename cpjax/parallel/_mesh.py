"""Training meshes: the axes, their order and types, and their sizes."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

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


def required_axis_size(mesh: Mesh, name: str, argument: str) -> int:
  """Return the size of mesh axis ``name``, which the caller's ``argument`` named.

  Unlike :func:`axis_size`, a missing axis is an error: the caller asked for it.

  >>> required_axis_size(make_mesh(cp=2), "sp", "axis_name")
  Traceback (most recent call last):
  ...
  ValueError: axis_name='sp' is not an axis of the mesh; mesh axes are ('cp',)
  """
  if not isinstance(mesh, (Mesh, jax.sharding.AbstractMesh)):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
  if name not in mesh.axis_names:
    raise ValueError(
      f"{argument}={name!r} is not an axis of the mesh; mesh axes are {tuple(mesh.axis_names)}"
    )
  return dict(mesh.shape)[name]


def axis_size(mesh: Mesh | AbstractMesh, name: str) -> int:
  """Return the size of ``mesh``'s axis ``name``, 1 when the mesh has no such axis.

  Args:
    mesh: the mesh (or an abstract one).
    name: the axis's name.

  Returns:
    The axis's size.
  """
  return int(mesh.shape[name]) if name in mesh.axis_names else 1
