"""``make mutants`` (tools/mutants.py) stays runnable: every mutant's text
occurs exactly once in its file, its mutated Python still compiles (a
mutant that breaks the syntax is caught by any test, and tests nothing),
and it names tests that exist, so a rename or
an edit that moves the code cannot quietly empty the mutation check (running
the mutants themselves takes an hour: ``make mutants``, part of ``make soak``)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def load_mutants():
  spec = importlib.util.spec_from_file_location("cpjax_mutants", ROOT / "tools" / "mutants.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses resolve the module by name
  spec.loader.exec_module(module)
  return module


def test_every_mutant_applies_once_and_names_real_tests():
  mutants = load_mutants().MUTANTS
  assert len(mutants) >= 100
  assert len({m.name for m in mutants}) == len(mutants)
  stale = [
    (m.name, m.file, (ROOT / m.file).read_text().count(m.old))
    for m in mutants
    if (ROOT / m.file).read_text().count(m.old) != 1
  ]
  assert stale == []
  broken = []
  for m in mutants:
    if m.file.endswith(".py"):
      try:
        compile((ROOT / m.file).read_text().replace(m.old, m.new), m.file, "exec")
      except SyntaxError as e:
        broken.append((m.name, str(e)))
  assert broken == []
  missing = []
  for m in mutants:
    assert m.old != m.new, m.name
    for test in m.tests:
      path, _, name = test.partition("::")
      source = (ROOT / path).read_text() if (ROOT / path).is_file() else None
      if source is None or (name and f"def {name.split('[')[0]}(" not in source):
        missing.append((m.name, test))
  assert missing == []
