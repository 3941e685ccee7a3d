"""Running a kernel in Pallas' interpreter inside ``shard_map`` (tests on CPU).

Pallas' HLO interpreter (``interpret=True``) turns a kernel into XLA loops,
about a hundred times faster on CPU than the Mosaic interpreter
(``pltpu.InterpretParams``), but with jax 0.10.2 it cannot run inside a
``shard_map`` with ``check_vma=True``: it evaluates the kernel, traced
without mesh-axis types, on operands that vary over the mesh, and an index
computed in the kernel then fails the "varying manual axes must match"
check. :func:`run` binds the interpreted call as one opaque operation whose
result varies like its operands and lowers it with that check off, which is
sound here: a kernel never communicates across the mesh.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import jax
from jax._src import config, dispatch
from jax._src import core as jax_core
from jax._src.interpreters import mlir

__all__ = ["run"]

_interpreted_p = jax_core.Primitive("cpjax_interpreted_kernel")
_interpreted_p.multiple_results = True
_interpreted_p.def_impl(functools.partial(dispatch.apply_primitive, _interpreted_p))


@_interpreted_p.def_abstract_eval
def _abstract_eval(*avals, call, out_shapes):
  del call
  like = max(avals, key=lambda a: len(getattr(getattr(a, "mat", None), "varying", ())))
  return [like.update(shape=shape, dtype=dtype, weak_type=False) for shape, dtype in out_shapes]


def _untyped(avals):
  return [a.update_manual_axis_type(jax_core.empty_mat) for a in avals]


def _lowering(ctx, *args, call, out_shapes):
  del out_shapes
  ctx = ctx.replace(avals_in=_untyped(ctx.avals_in), avals_out=_untyped(ctx.avals_out))
  with config._check_vma(False):  # noqa: SLF001
    return mlir.lower_fun(call, multiple_results=True)(ctx, *args)


mlir.register_lowering(_interpreted_p, _lowering)


def run(
  call: Callable[..., list[jax.Array]],
  *args: jax.Array,
  out_shapes: Iterable[tuple[tuple[int, ...], Any]],
) -> list[jax.Array]:
  """``call(*args)``, a list of arrays of ``out_shapes`` ((shape, dtype), ...),
  evaluated by the interpreter as one operation (see the module docstring)."""
  return _interpreted_p.bind(*args, call=call, out_shapes=tuple(out_shapes))
