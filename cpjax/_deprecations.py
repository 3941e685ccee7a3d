"""Old import paths that keep working for one release, with a warning.

cpjax 0.2 moved its modules into packages (the batch half, the attention
half, meshes and placement); the old module paths below still import, as the
new modules themselves, with a :class:`DeprecationWarning` that names the new
path and the release that removes the old one (the CHANGELOG lists them).
The aliases are served by a finder on :data:`sys.meta_path`, so ``import``,
``from ... import`` and attribute access (``cpjax.sharding``) all work, and
an old and a new path give the very same module object (a patch made
through either is seen through both).

>>> import sys, warnings
>>> _ = sys.modules.pop("cpjax.sharding", None)  # (an earlier import warned already)
>>> with warnings.catch_warnings(record=True) as caught:
...   warnings.simplefilter("always")
...   import cpjax.sharding
>>> import cpjax.batch.sharding
>>> cpjax.sharding is cpjax.batch.sharding, caught[0].category.__name__
(True, 'DeprecationWarning')
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any, ParamSpec, TypeVar

__all__ = [
  "MOVED",
  "MOVED_NAMES",
  "REMOVED_IN",
  "install",
  "moved_attribute",
  "new_name",
  "RENAMED_KEYWORDS",
  "rename_keyword",
  "renamed_keywords",
]

# The release that removes the old paths, and the day they were deprecated.
REMOVED_IN = "0.3"
DEPRECATED_ON = "2026-12-06"

# {old module path: new module path}; an old package's submodules follow it.
MOVED = {
  "cpjax.layout": "cpjax.batch.layout",
  "cpjax.balance": "cpjax.batch.balance",
  "cpjax.sharding": "cpjax.batch.sharding",
  "cpjax.ring": "cpjax.attention.ring",
  "cpjax.global_attention": "cpjax.attention.global_attention",
  "cpjax.flax_attention": "cpjax.attention.flax_attention",
  "cpjax.cp_context": "cpjax.attention.cp_context",
  "cpjax.reference": "cpjax.attention.reference",
  "cpjax.experts": "cpjax.models.gemma4.experts",
}


def new_name(old: str) -> str | None:
  """The module ``old`` moved to (its own entry or its package's), or None.

  >>> new_name("cpjax.ring.kernels"), new_name("cpjax.batch")
  ('cpjax.attention.ring.kernels', None)
  """
  for moved, new in MOVED.items():
    if old == moved or old.startswith(moved + "."):
      return new + old[len(moved) :]
  return None


def warn(old: str, new: str, stacklevel: int = 3) -> None:
  warnings.warn(
    f"{old} moved to {new} (deprecated on {DEPRECATED_ON}, removed in cpjax {REMOVED_IN}); "
    f"import {new}",
    DeprecationWarning,
    stacklevel=stacklevel,
  )


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Finds an old module path and loads it as the new module itself."""

  def find_spec(self, fullname, path=None, target=None):
    new = new_name(fullname)
    if new is None:
      return None
    real = importlib.util.find_spec(new)
    if real is None:
      return None
    return importlib.machinery.ModuleSpec(
      fullname, self, is_package=real.submodule_search_locations is not None
    )

  def create_module(self, spec):
    new = new_name(spec.name)
    assert new is not None  # find_spec made specs for moved names only
    warn(spec.name, new, stacklevel=8)
    module = importlib.import_module(new)
    # The import system sets __spec__ on what create_module returns; keep the
    # new module's own, so that it stays importable and reloadable as itself.
    spec.loader_state = module.__spec__
    return module

  def exec_module(self, module):
    module.__spec__ = module.__spec__.loader_state


def install() -> None:
  """Put the alias finder first on ``sys.meta_path`` (once)."""
  if not any(isinstance(f, _Alias) for f in sys.meta_path):
    sys.meta_path.insert(0, _Alias())


# {(module, old name): new dotted path} of functions that left their module.
MOVED_NAMES = {
  ("cpjax.attention.global_attention", "to_rank_order"): "cpjax.batch.layout.to_rank_order",
  ("cpjax.attention.global_attention", "from_rank_order"): "cpjax.batch.layout.from_rank_order",
  (
    "cpjax.batch",
    "attention_mask_to_padding_mask",
  ): "cpjax.batch.normalize.attention_mask_to_padding_mask",
  ("cpjax.batch", "next_token_labels"): "cpjax.batch.normalize.next_token_labels",
  ("cpjax.batch", "normalize_batch"): "cpjax.batch.normalize.normalize_batch",
  ("cpjax.batch", "synthesize_document_ids"): "cpjax.batch.normalize.synthesize_document_ids",
  ("cpjax.batch", "vision_group_ids"): "cpjax.batch.normalize.vision_group_ids",
  ("cpjax.checks", "axis_size"): "cpjax.checks.bound_axis_size",
  # The run config is a run everywhere (issue 62: one name per concept).
  ("cpjax.training.run_config", "JobError"): "cpjax.training.run_config.RunError",
  ("cpjax.training.trainer", "run_train_job"): "cpjax.training.trainer.train",
  # Documents are document_ids (SameDocument reads them); a per-hop kernel
  # backend is an implementation, a chip a target (issue 62).
  ("cpjax", "SameSegment"): "cpjax.masks.SameDocument",
  ("cpjax.masks", "SameSegment"): "cpjax.masks.SameDocument",
  ("cpjax.attention.ring.kernels", "KernelTarget"): (
    "cpjax.attention.ring.kernels.PallasImplementation"
  ),
  ("cpjax.attention.ring.kernels", "TARGETS"): (
    "cpjax.attention.ring.kernels.PALLAS_IMPLEMENTATIONS"
  ),
}


def moved_attribute(module: str, name: str) -> Any:
  """``module.name`` for a name that moved (:data:`MOVED_NAMES`), with its
  warning; else the ``AttributeError`` Python would raise. A module's
  ``__getattr__`` calls this."""
  new = MOVED_NAMES.get((module, name))
  if new is None:
    raise AttributeError(f"module {module!r} has no attribute {name!r}")
  # A name cpjax exports is used from there (one path per name).
  home, _, attr = new.rpartition(".")
  shown = f"cpjax.{attr}" if attr in getattr(sys.modules["cpjax"], "__all__", ()) else new
  warn(f"{module}.{name}", shown)
  return getattr(importlib.import_module(home), attr)


def module_attribute(name: str) -> types.ModuleType:
  """``cpjax.<name>`` for a moved top-level module, imported with its warning."""
  old = f"cpjax.{name}"
  if old not in MOVED:
    raise AttributeError(f"module 'cpjax' has no attribute {name!r}")
  return importlib.import_module(old)


_P = ParamSpec("_P")
_R = TypeVar("_R")
_V = TypeVar("_V")

# {(function, old keyword): new keyword} of every renamed_keywords function
# imported so far (the CHANGELOG lists each).
RENAMED_KEYWORDS: dict[tuple[str, str], str] = {}


def rename_keyword(
  where: str, given: Mapping[str, _V], old: str, new: str, *, stacklevel: int = 3
) -> dict[str, _V]:
  """Return ``given`` with its key ``old`` renamed ``new``, warning that
  ``old`` is deprecated; giving both is a ``TypeError`` naming both.

  ``where`` is the public path of what takes the keywords (a function, or
  the name of a mapping's owner): the warning says ``where.old moved to
  where.new``, which the test suite's filter turns into an error when cpjax
  itself still passes the old name. The warning points at the frame
  ``stacklevel`` (1: this function, 3: the caller of the function that
  calls it, as :func:`renamed_keywords` does).

  >>> import warnings
  >>> with warnings.catch_warnings(record=True) as caught:
  ...   warnings.simplefilter("always")
  ...   rename_keyword("cpjax.f", {"segment_ids": 1, "causal": True}, "segment_ids", "document_ids")
  {'document_ids': 1, 'causal': True}
  >>> print(caught[0].message)  # doctest: +NORMALIZE_WHITESPACE
  cpjax.f.segment_ids moved to cpjax.f.document_ids (deprecated on 2026-12-06,
  removed in cpjax 0.3); call it document_ids
  >>> rename_keyword("cpjax.f", {"segment_ids": 1, "document_ids": 1}, "segment_ids",
  ...                "document_ids")
  Traceback (most recent call last):
  ...
  TypeError: cpjax.f got document_ids and its deprecated name segment_ids: give document_ids alone
  """
  if old not in given:
    return dict(given)
  if new in given:
    raise TypeError(f"{where} got {new} and its deprecated name {old}: give {new} alone")
  warnings.warn(
    f"{where}.{old} moved to {where}.{new} (deprecated on {DEPRECATED_ON}, removed in "
    f"cpjax {REMOVED_IN}); call it {new}",
    DeprecationWarning,
    stacklevel=stacklevel,
  )
  return {(new if k == old else k): v for k, v in given.items()}


def renamed_keywords(where: str, **renames: str) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
  """Decorate a function whose keywords were renamed (``renames``: ``old="new"``)
  so that each old keyword still works for one release, with the warning of
  :func:`rename_keyword`. Its signature (and type) is the new one.

  >>> @renamed_keywords("cpjax.f", segment_ids="document_ids")
  ... def f(*, document_ids=None):
  ...   return document_ids
  >>> import warnings
  >>> with warnings.catch_warnings(record=True) as caught:
  ...   warnings.simplefilter("always")
  ...   f(segment_ids=[1, 2])
  [1, 2]
  >>> caught[0].category.__name__, f(document_ids=[3])
  ('DeprecationWarning', [3])
  >>> RENAMED_KEYWORDS.pop(("cpjax.f", "segment_ids"))  # listed (an example: taken out again)
  'document_ids'
  """

  RENAMED_KEYWORDS.update({(where, old): new for old, new in renames.items()})

  def decorate(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    @functools.wraps(fn)
    def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
      given: dict[str, Any] = dict(kwargs)
      for old, new in renames.items():
        given = rename_keyword(where, given, old, new)
      return fn(*args, **given)

    return call

  return decorate
