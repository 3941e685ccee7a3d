"""The module paths of cpjax 0.1 still import for one release
(cpjax/_deprecations.py), warn, and are the new modules themselves."""

from __future__ import annotations

import importlib
import sys

import chex
import numpy as np
import pytest

import cpjax
from cpjax import _deprecations


def forget(name: str) -> None:
  """Drop an old path (and its submodules) from sys.modules, so the next
  import goes through the finder again; the new modules stay."""
  for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
    if _deprecations.new_name(key) is not None:
      del sys.modules[key]


@pytest.mark.parametrize("old", sorted(_deprecations.MOVED))
def test_an_old_module_path_is_the_new_module_with_a_warning(old):
  new = _deprecations.MOVED[old]
  forget(old)
  with pytest.warns(DeprecationWarning, match=f"{old} moved to {new} .*removed in cpjax 0.3"):
    module = importlib.import_module(old)
  assert module is importlib.import_module(new)
  # The new module keeps its own identity: spec, name, and no __path__ it lacked.
  assert module.__spec__.name == new and module.__name__ == new
  assert hasattr(module, "__path__") == (
    importlib.util.find_spec(new).submodule_search_locations is not None
  )


def test_an_old_packages_submodules_and_names_follow_it():
  forget("cpjax.ring")
  with pytest.warns(DeprecationWarning):
    from cpjax.ring.kernels import TARGETS  # noqa: PLC0415
    from cpjax.ring.kernels._targets import KernelTarget  # noqa: PLC0415
  from cpjax.attention.ring.kernels import _targets

  assert TARGETS is _targets.TARGETS and KernelTarget is _targets.KernelTarget
  assert _deprecations.new_name("cpjax.ringside") is None  # a prefix, not a package


def test_an_old_path_as_an_attribute_and_a_patch_through_it(monkeypatch):
  forget("cpjax.sharding")
  monkeypatch.delattr(cpjax, "sharding", raising=False)
  with pytest.warns(DeprecationWarning, match="cpjax.sharding moved to cpjax.batch.sharding"):
    old = cpjax.sharding
  from cpjax.batch import sharding

  monkeypatch.setattr(old, "MIN_STRIPE_LEN", 7)
  assert sharding.MIN_STRIPE_LEN == 7
  with pytest.raises(AttributeError, match="module 'cpjax' has no attribute 'nothing'"):
    cpjax.nothing  # noqa: B018


@pytest.mark.parametrize("module,name", sorted(_deprecations.MOVED_NAMES))
def test_a_moved_name_warns_and_resolves_to_its_new_home(module, name):
  new = _deprecations.MOVED_NAMES[module, name]
  home, _, attr = new.rpartition(".")
  with pytest.warns(DeprecationWarning, match=f"{module}.{name} moved to cpjax"):
    got = getattr(importlib.import_module(module), name)
  assert got is getattr(importlib.import_module(home), attr)


def test_the_old_batch_modules_function_still_computes():
  with pytest.warns(
    DeprecationWarning, match="cpjax.batch.normalize_batch moved to cpjax.normalize_batch"
  ):
    from cpjax.batch import normalize_batch  # noqa: PLC0415
  out = normalize_batch({"input_ids": [[1, 2]], "labels": [[2, -100]]})
  chex.assert_trees_all_equal(out["padding_mask"], np.zeros((1, 2), bool))
  with pytest.raises(AttributeError, match="no attribute 'shard_batch'"):
    cpjax.batch.shard_batch  # noqa: B018 (its API path is cpjax.shard_batch)


def test_the_changelog_lists_every_moved_path():
  changelog = cpjax.__path__[0] + "/../CHANGELOG.md"
  text = open(changelog).read()
  for old, new in _deprecations.MOVED.items():
    assert f"`{old}` -> `{new}`" in text, old
  assert f"removed in {_deprecations.REMOVED_IN}" in text


def test_plans_run_shape_warns_and_still_plans_the_run():
  from cpjax.models.gemma4 import Gemma4Config
  from cpjax.training import plan
  from cpjax.training.run_config import RunConfig, with_values

  run = with_values(RunConfig(), {"dataset.seq_len": 512, "parallel.cp": 2, "remat": "full"})
  with pytest.warns(DeprecationWarning, match="run_shape moved to cpjax.training.plan.StepShape"):
    shape = plan.run_shape(run)
  cfg = Gemma4Config.preset("tiny")
  assert plan.estimate(cfg, model="tiny", **shape) == plan.estimate(cfg, run, model="tiny")
