"""The module paths of cpjax 0.1 still import for one release
(cpjax/_deprecations.py), warn, and are the new modules themselves."""

from __future__ import annotations

import functools
import importlib
import sys

import chex
import jax
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
    from cpjax.ring.kernels import PALLAS_IMPLEMENTATIONS  # noqa: PLC0415
    from cpjax.ring.kernels._implementations import PallasImplementation  # noqa: PLC0415
  from cpjax.attention.ring.kernels import _implementations

  assert PALLAS_IMPLEMENTATIONS is _implementations.PALLAS_IMPLEMENTATIONS
  assert PallasImplementation is _implementations.PallasImplementation
  assert _deprecations.new_name("cpjax.ringside") is None  # a prefix, not a package


def test_a_renamed_name_resolves_through_an_old_package_path_too():
  """0.1's path and 0.1's name together: two warnings, the new object."""
  forget("cpjax.ring")
  with pytest.warns(DeprecationWarning) as caught:
    from cpjax.ring.kernels import TARGETS  # noqa: PLC0415
  from cpjax.attention.ring.kernels import PALLAS_IMPLEMENTATIONS

  assert TARGETS is PALLAS_IMPLEMENTATIONS
  assert any(
    "cpjax.attention.ring.kernels.TARGETS moved to "
    "cpjax.attention.ring.kernels.PALLAS_IMPLEMENTATIONS" in str(w.message)
    for w in caught
  )


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
  for (module, name), new in _deprecations.MOVED_NAMES.items():
    assert f"`{module}.{name}` -> `{new}`" in text, (module, name)
  importlib.import_module("cpjax.models.gemma4")  # its renamed keywords register on import
  for (where, old), new in _deprecations.RENAMED_KEYWORDS.items():
    assert f"`{where}({old}=)` -> `{where}({new}=)`" in text, (where, old)
  assert f"removed in {_deprecations.REMOVED_IN}" in text


# ------------------------------------------------- renamed keywords
def _docs():
  return np.array([[1, 1, 2, 2]], np.int32)


def _qkv():
  x = np.random.default_rng(0).standard_normal((1, 4, 2, 8)).astype(np.float32)
  return x, x, x


def _ring(**keywords):
  from jax.sharding import PartitionSpec as P

  from tests.helpers import cp_mesh

  lay, mesh = cpjax.ShardLayout(4, 4, 2, "contiguous"), cp_mesh(2)
  # Compiled: the ring's many small ops one by one take seconds a call.
  ring = jax.jit(
    jax.shard_map(
      lambda q, k, v, kw: cpjax.ring_attention(q, k, v, layout=lay, **kw),
      mesh=mesh,
      in_specs=P(None, "cp"),
      out_specs=P(None, "cp"),
    )
  )
  return ring(*jax.device_put((*_qkv(), keywords), jax.NamedSharding(mesh, P(None, "cp"))))


def _masks(**keywords):
  from cpjax.models import gemma4

  cfg = gemma4.Gemma4Config.preset("tiny")
  return gemma4.gemma4_masks(cfg, padding_mask=np.zeros((1, 4), bool), **keywords)["full_attention"]


def _global(**keywords):
  from tests.helpers import cp_mesh

  lay = cpjax.ShardLayout(4, 4, 2, "contiguous")
  attend = functools.partial(cpjax.context_parallel_attention, mesh=cp_mesh(2), layout=lay)
  return jax.jit(lambda q, k, v, kw: attend(q, k, v, **kw))(*_qkv(), keywords)


# Each function that renamed a keyword: {public path: call(**keywords)}.
RENAMED = {
  "cpjax.AttentionMask.create": lambda **kw: cpjax.AttentionMask.create(**kw).allowed(),
  "cpjax.reference_attention": lambda **kw: cpjax.reference_attention(*_qkv(), **kw),
  "cpjax.ring_attention": _ring,
  "cpjax.context_parallel_attention": _global,
  "cpjax.models.gemma4.gemma4_masks": lambda **kw: _masks(**kw).allowed(),
  "cpjax.masks.resolve_mask": lambda **kw: cpjax.masks.resolve_mask(**kw).allowed(),
}


def test_every_renamed_keyword_is_tested():
  importlib.import_module("cpjax.models.gemma4")
  assert sorted(RENAMED) == sorted(where for where, _ in _deprecations.RENAMED_KEYWORDS)


@pytest.mark.parametrize("where", sorted(RENAMED))
def test_an_old_keyword_warns_and_gives_what_the_new_one_gives(where):
  call = RENAMED[where]
  with pytest.warns(
    DeprecationWarning,
    match=rf"{where}\.segment_ids moved to {where}\.document_ids "
    r"\(deprecated on 2026-12-06, removed in cpjax 0\.3\)",
  ) as caught:
    old = call(segment_ids=_docs())
  # The warning points at the caller's line, not at cpjax's wrapper.
  assert all(w.filename == __file__ for w in caught if "segment_ids" in str(w.message))
  chex.assert_trees_all_equal(old, call(document_ids=_docs()))


@pytest.mark.parametrize("where", sorted(RENAMED))
def test_an_old_and_a_new_keyword_together_are_a_type_error(where):
  with pytest.raises(
    TypeError, match=f"{where} got document_ids and its deprecated name segment_ids"
  ):
    RENAMED[where](segment_ids=_docs(), document_ids=_docs())


def test_a_masks_old_array_name_warns_and_builds_the_same_mask():
  with pytest.warns(
    DeprecationWarning,
    match="cpjax.AttentionMask.arrays.segment_ids moved to cpjax.AttentionMask.arrays.document_ids",
  ) as caught:
    old = cpjax.AttentionMask(cpjax.SameDocument(), {"segment_ids": _docs()})
  assert caught[0].filename == __file__
  new = cpjax.AttentionMask(cpjax.SameDocument(), {"document_ids": _docs()})
  chex.assert_trees_all_equal(old, new)
  with pytest.raises(TypeError, match="arrays got document_ids and its deprecated name"):
    cpjax.AttentionMask(cpjax.SameDocument(), {"document_ids": _docs(), "segment_ids": _docs()})


def test_the_old_mask_rule_name_is_the_new_rule():
  with pytest.warns(DeprecationWarning, match="cpjax.SameSegment moved to cpjax.SameDocument"):
    old = cpjax.SameSegment
  with pytest.warns(
    DeprecationWarning, match="cpjax.masks.SameSegment moved to cpjax.SameDocument"
  ):
    from cpjax.masks import SameSegment  # noqa: PLC0415
  assert old is SameSegment is cpjax.SameDocument
  assert repr(old()) == "SameDocument()"


def test_plans_run_shape_warns_and_still_plans_the_run():
  from cpjax.models.gemma4 import Gemma4Config
  from cpjax.training import plan
  from cpjax.training.run_config import RunConfig, with_values

  run = with_values(RunConfig(), {"dataset.seq_len": 512, "parallel.cp": 2, "remat": "full"})
  with pytest.warns(DeprecationWarning, match="run_shape moved to cpjax.training.plan.StepShape"):
    shape = plan.run_shape(run)
  cfg = Gemma4Config.preset("tiny")
  assert plan.estimate(cfg, model="tiny", **shape) == plan.estimate(cfg, run, model="tiny")
