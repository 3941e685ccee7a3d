"""The public signatures are annotated (issue 62, item 5).

A public signature is a function or method whose name does not start with
``_``, defined at module level or directly in a class whose name does not
start with ``_`` (closures aside), in any module under ``cpjax/``: a
``_``-named module's public names are its package's API. Each annotates every
parameter but ``self`` and ``cls`` (``*args`` and ``**kwargs`` included) and
its return, so pyrefly checks the calls into the package and the code behind
them.
"""

from __future__ import annotations

import ast
import pathlib

from tests.helpers import public_members

ROOT = pathlib.Path(__file__).resolve().parent.parent / "cpjax"


def unannotated(source: str, path: str) -> list[str]:
  """``path:line name(param)`` for each unannotated parameter and
  ``path:line name -> return`` for each unannotated return of the public
  signatures in ``source``."""
  members = public_members(ast.parse(source))
  found = []
  for node, owner in members:
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      continue
    if node.name.startswith("_"):
      continue
    where, name = f"{path}:{node.lineno}", owner + node.name
    a = node.args
    params = a.posonlyargs + a.args + a.kwonlyargs
    params += [p for p in (a.vararg, a.kwarg) if p is not None]
    for i, param in enumerate(params):
      if owner and i == 0 and param.arg in ("self", "cls"):
        continue
      if param.annotation is None:
        found.append(f"{where} {name}({param.arg})")
    if node.returns is None:
      found.append(f"{where} {name} -> return")
  return found


def test_every_public_signature_is_annotated():
  missing = [
    line
    for path in sorted(ROOT.rglob("*.py"))
    for line in unannotated(path.read_text(), str(path.relative_to(ROOT.parent)))
  ]
  assert not missing, f"{len(missing)} unannotated:\n" + "\n".join(missing)


def test_a_missing_annotation_would_be_seen():
  """The rule above on a hand-written module: a bare parameter, a bare
  ``**kwargs`` and a missing return are caught, in a function and in a public
  class's method; ``self``, private names, private classes and closures pass."""
  source = """
def full(x: int, *, y: str = "") -> int:
  def inner(z):
    return z
  return x

def bare(x, y: int):
  pass

def no_return(x: int):
  pass

def _private(x):
  pass

class Public:
  def method(self, x: int, **kwargs) -> None:
    pass

  @classmethod
  def make(cls) -> Public:
    return cls()

  def _own(self, x):
    pass

class _Private:
  def method(self, x):
    pass
"""
  assert unannotated(source, "m.py") == [
    "m.py:7 bare(x)",
    "m.py:7 bare -> return",
    "m.py:10 no_return -> return",
    "m.py:17 Public.method(kwargs)",
  ]
