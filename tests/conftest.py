"""Fixtures shared by the tests (device setup lives in the top-level conftest)."""

import jax
import pytest


@pytest.fixture(autouse=True, scope="session")
def _eight_devices():
  assert len(jax.devices()) == 8, "tests expect 8 emulated CPU devices"
