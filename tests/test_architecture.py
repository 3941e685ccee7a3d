"""The package's layers, read from its source (README, "Architecture").

Every import in ``cpjax/`` (module level or inside a function) points to the
same layer or one below it, and no two modules import each other through any
chain. (A module is as long as its concept needs: there is no line cap.)
The layers, bottom up:

* base: the shared input checks (``cpjax/checks.py``), the old paths'
  aliases (``cpjax/_deprecations.py``) and meshes and placement
  (``cpjax/parallel``);
* masks: ``cpjax/masks``;
* batch: the batch half, ``cpjax/batch`` (normalisation, layouts, balance,
  sharding);
* attention: the attention half, ``cpjax/attention`` (the ring, its
  strategies and kernels, the global-array entry point, the Flax hook, the
  CP context, the reference);
* data: ``cpjax/data`` (with the examples it ships, ``cpjax/examples``);
* models: ``cpjax/models``;
* training: ``cpjax/training``;
* top: the command line (``cpjax/cli``, ``cpjax/__main__``), the recipes it
  reads (``cpjax/recipes``), the public API (``cpjax/__init__``).

The top level holds packages and at most four modules, and no module
imports another module's ``_``-name: a ``_``-named module is its package's
own, imported only from inside that package.
"""

from __future__ import annotations

import ast
import pathlib

from tests.helpers import public_members

ROOT = pathlib.Path(__file__).resolve().parent.parent / "cpjax"
LAYERS = ("base", "masks", "batch", "attention", "data", "models", "training", "top")


def module_files() -> dict[str, pathlib.Path]:
  """{dotted module name: file} of every module in the package."""
  found = {}
  for path in sorted(ROOT.rglob("*.py")):
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts.pop()
    found[".".join(parts)] = path
  return found


MODULES = module_files()


def layer(module: str) -> str:
  if module in ("cpjax", "cpjax.__main__"):
    return "top"
  second = module.split(".")[1]
  return {
    "checks": "base",
    "_deprecations": "base",
    "parallel": "base",
    "masks": "masks",
    "batch": "batch",
    "attention": "attention",
    "data": "data",
    "examples": "data",
    "models": "models",
    "training": "training",
    "cli": "top",
    "recipes": "top",
  }[second]


def imports(module: str) -> set[str]:
  """The cpjax modules ``module`` imports."""
  path = MODULES[module]
  package = module if path.name == "__init__.py" else module.rpartition(".")[0]
  return imports_in(path.read_text(), module, package)


def imports_in(source: str, module: str, package: str) -> set[str]:
  """The cpjax modules that ``source`` (module ``module`` of ``package``)
  imports, anywhere in it: ``from pkg import name`` counts as ``pkg.name``
  when that is a module, else as ``pkg``."""
  found = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      found.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
      for alias in node.names:
        found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
  return {name for name in found if name in MODULES and name != module}


GRAPH = {module: imports(module) for module in MODULES}


def test_the_layers_are_what_the_docstring_says():
  """Guards the test itself: every layer holds modules, each where it belongs."""
  by_layer = {name: [m for m in MODULES if layer(m) == name] for name in LAYERS}
  assert all(by_layer.values()), by_layer
  assert {"cpjax.checks", "cpjax.parallel._mesh", "cpjax.parallel._platforms"} <= set(
    by_layer["base"]
  )
  assert "cpjax.masks._rules" in by_layer["masks"]
  assert {"cpjax.batch.sharding", "cpjax.batch._streams"} <= set(by_layer["batch"])
  assert {
    "cpjax.attention.ring._attention",
    "cpjax.attention.ring.kernels._common",
    "cpjax.attention.global_attention",
  } <= set(by_layer["attention"])
  assert "cpjax.models.gemma4.experts" in by_layer["models"]
  assert "cpjax.training.step" in by_layer["training"] and "cpjax.cli.train" in by_layer["top"]


def test_no_import_from_a_higher_layer():
  upward = sorted(
    f"{m} ({layer(m)}) imports {d} ({layer(d)})"
    for m, deps in GRAPH.items()
    for d in deps
    if LAYERS.index(layer(d)) > LAYERS.index(layer(m))
  )
  assert not upward, "\n".join(upward)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One import cycle (its modules, the first repeated at the end), or None."""
  done, path = set(), []

  def visit(node):
    if node in path:
      return path[path.index(node) :] + [node]
    if node in done:
      return None
    path.append(node)
    for dep in sorted(graph[node]):
      cycle = visit(dep)
      if cycle:
        return cycle
    path.pop()
    done.add(node)
    return None

  for node in sorted(graph):
    cycle = visit(node)
    if cycle:
      return cycle
  return None


def test_no_import_cycle():
  assert find_cycle(GRAPH) is None, " -> ".join(find_cycle(GRAPH))


def test_find_cycle_finds_one():
  """The cycle check itself, on hand-made graphs."""
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
  assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_an_upward_import_would_be_seen():
  """The resolution the layer test relies on, on a hand-written module: an
  import inside a function, ``from package import module`` and a relative
  import each give an edge to the module they name."""
  source = """
from cpjax import checks
from . import records

def f():
  from cpjax.training import step
  import cpjax.models.gemma4.model
"""
  got = imports_in(source, "cpjax.data.corpus", "cpjax.data")
  assert got == {
    "cpjax.checks",
    "cpjax.data.records",
    "cpjax.training.step",
    "cpjax.models.gemma4.model",
  }
  assert [d for d in sorted(got) if LAYERS.index(layer(d)) > LAYERS.index("data")] == [
    "cpjax.models.gemma4.model",
    "cpjax.training.step",
  ]


def test_the_top_level_holds_packages_and_four_modules():
  modules = sorted(p.name for p in ROOT.glob("*.py"))
  assert modules == ["__init__.py", "__main__.py", "_deprecations.py", "checks.py"], modules


def private_imports(source: str, module: str, package: str) -> list[str]:
  """What ``source`` (module ``module`` of ``package``) imports that is
  another module's own: a ``_``-name from another module, or a ``_``-named
  module from outside its package."""
  found = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
      named = [(f"{base}.{a.name}", a.name) for a in node.names]
    elif isinstance(node, ast.Import):
      named = [(a.name, a.name.rpartition(".")[2]) for a in node.names]
    else:
      continue
    for full, name in named:
      parts = full.split(".")
      if not full.startswith("cpjax") or full == module:
        continue
      private = [i for i, p in enumerate(parts) if p.startswith("_") and not p.startswith("__")]
      if not private:
        continue
      # A _-name inside a module: that module's own. A _-named module: its
      # package's own, and the package's above it, whose part it is (the
      # ring's kernels are the ring's).
      last = private[-1]
      if (
        ".".join(parts[:last]) in MODULES and MODULES[".".join(parts[:last])].name != "__init__.py"
      ):
        found.append(f"{module} imports {full}")
        continue
      owner = ".".join(parts[: last - 1 if last > 2 else last])
      if not (module + ".").startswith(owner + "."):
        found.append(f"{module} imports {full}")
  return found


def test_no_module_imports_another_modules_private_name():
  found = [
    line
    for module, path in MODULES.items()
    for line in private_imports(
      path.read_text(), module, module if path.name == "__init__.py" else module.rpartition(".")[0]
    )
  ]
  assert not found, "\n".join(found)


def test_a_private_import_would_be_seen():
  """The rule above on hand-written imports: a package's own ``_``-module
  from inside it passes; a ``_``-name from another module, or a ``_``-module
  from another package, is caught."""
  source = """
from cpjax.batch import _streams
from cpjax.batch._streams import pad_stream
from cpjax.parallel._mesh import _AXIS_ORDER
from cpjax.masks._rules import MaskRule
import cpjax.attention.ring._passes
"""
  inside = """
from cpjax.attention.ring.kernels import _common
from cpjax.attention.ring._passes import ring_passes
"""
  assert private_imports(inside, "cpjax.attention.ring._attention", "cpjax.attention.ring") == []
  assert private_imports(source, "cpjax.batch.sharding", "cpjax.batch") == [
    "cpjax.batch.sharding imports cpjax.parallel._mesh._AXIS_ORDER",
    "cpjax.batch.sharding imports cpjax.masks._rules.MaskRule",
    "cpjax.batch.sharding imports cpjax.attention.ring._passes",
  ]


def test_no_module_only_re_exports_another():
  """One path per name: no module is a shim that re-exports a moved one."""
  shims = {
    m
    for m, path in MODULES.items()
    if (ast.get_docstring(ast.parse(path.read_text())) or "").startswith("Moved to")
    or "import *" in path.read_text()
  }
  assert shims == set()


def test_the_public_api_lists_what_it_imports():
  """``cpjax.__all__`` names every public object ``cpjax/__init__.py``
  imports, once, and each resolves."""
  import cpjax

  tree = ast.parse(MODULES["cpjax"].read_text())
  bound = [
    alias.asname or alias.name
    for node in tree.body
    if isinstance(node, ast.ImportFrom)
    for alias in node.names
  ]
  assert len(cpjax.__all__) == len(set(cpjax.__all__))
  assert sorted(cpjax.__all__) == sorted(n for n in bound if not n.startswith("_"))
  for name in cpjax.__all__:
    assert getattr(cpjax, name) is not None, name


def test_no_public_name_hides_a_module():
  """``cpjax.X`` is either a module of the package or a public object, never
  both (the context manager once hid the module ``cpjax.context_parallel``)."""
  import cpjax

  modules = {m.split(".")[1] for m in MODULES if m.count(".") >= 1}
  assert modules & set(cpjax.__all__) == set()


def public_modules() -> list[str]:
  """The package's modules whose dotted names have no ``_`` part."""
  return [m for m in MODULES if not any(p.startswith("_") for p in m.split("."))]


def export_places() -> dict[tuple[str, str], set[str]]:
  """{(defining module, qualified name): the public modules that export it}
  for every function and class of the package. A module exports an object
  it defines, lists in ``__all__``, or (a package) imports; ruff's unused
  import check catches a plain module's re-export outside ``__all__``."""
  import importlib
  import inspect

  places: dict[tuple[str, str], set[str]] = {}
  for name in public_modules():
    module = importlib.import_module(name)
    package = MODULES[name].name == "__init__.py"
    listed = set(getattr(module, "__all__", ()))
    for attr, obj in vars(module).items():
      if attr.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
        continue
      if not getattr(obj, "__module__", "").startswith("cpjax"):
        continue
      if obj.__module__ == name or attr in listed or package:
        places.setdefault((obj.__module__, obj.__qualname__), set()).add(name)
  return places


def test_no_object_is_exported_from_more_than_two_places():
  """One path per name: an object's home (its module, or the package of an
  internal ``_module``) and, at most, one package above it (``cpjax`` for
  the core)."""
  places = export_places()
  assert places[("cpjax.attention.ring._attention", "ring_attention")] == {
    "cpjax",
    "cpjax.attention.ring",
  }
  assert places[("cpjax.parallel._mesh", "make_mesh")] == {"cpjax", "cpjax.parallel"}
  many = {key: sorted(where) for key, where in places.items() if len(where) > 2}
  assert many == {}


def public_functions():
  """(module file, qualified name, node) of every public function and method
  of the public modules (properties aside: their docstrings name a value)."""
  found = []
  for name in public_modules():
    members = public_members(ast.parse(MODULES[name].read_text()))
    for node, owner in members:
      if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
        continue
      if any(
        getattr(d, "id", getattr(d, "attr", "")) in ("property", "cached_property", "setter")
        for d in node.decorator_list
      ):
        continue
      found.append((name, owner + node.name, node))
  return found


# Words a docstring opens with when it names a thing instead of saying what
# the function does.
NOUN_OPENINGS = {"The", "A", "An", "One", "Every", "Each", "What", "Which", "Whether", "How"}


def test_public_functions_say_what_they_do_verb_first():
  """Every public function has a docstring, and it opens with a verb
  (``Return ...``, ``Shard ...``), as optax's and the Google style guide's
  do."""
  import re

  functions = public_functions()
  assert len(functions) > 200
  noun, missing = [], []
  for module, name, node in functions:
    doc = ast.get_docstring(node)
    if not doc:
      missing.append(f"{module}.{name}")
      continue
    first = doc.split()[0]
    if not re.fullmatch(r"[A-Z][a-z]+,?", first) or first.rstrip(",") in NOUN_OPENINGS:
      noun.append(f"{module}.{name}: {doc.splitlines()[0][:60]}")
  assert missing == []
  assert noun == []
