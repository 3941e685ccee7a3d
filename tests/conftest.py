"""Fixtures shared by the tests (device setup lives in the top-level conftest)."""

import jax
import pytest


@pytest.fixture(autouse=True, scope="session")
def _eight_devices():
  assert len(jax.devices()) == 8, "tests expect 8 emulated CPU devices"


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
  """``hf_checkpoint("dense" | "moe")``: the directory of
  :func:`tests.helpers.write_transformers_checkpoint`'s model (made once per test process;
  skipped without transformers)."""
  made = {}

  def get(kind: str) -> str:
    pytest.importorskip("transformers", reason="a checkpoint saved by transformers needs it")
    if kind not in made:
      from tests.helpers import write_transformers_checkpoint

      made[kind] = write_transformers_checkpoint(str(tmp_path_factory.mktemp(f"hf-{kind}")), kind)
    return made[kind]

  return get
