"""Small helpers for the tests."""

import jax
import pytest


def cp_mesh(cp: int, *leading: tuple[str, int]):
  """A mesh ending in a ``cp`` axis of size ``cp``, after optional leading axes."""
  names = tuple(n for n, _ in leading) + ("cp",)
  shape = tuple(s for _, s in leading) + (cp,)
  need = 1
  for s in shape:
    need *= s
  if len(jax.devices()) < need:
    pytest.skip(f"needs {need} devices, have {len(jax.devices())}")
  return jax.make_mesh(shape, names, devices=jax.devices()[:need])
