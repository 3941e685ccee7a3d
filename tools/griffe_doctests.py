"""A griffe extension for the API pages (mkdocs.yml): docstrings' doctests as code.

cpjax's docstrings hold runnable examples (pytest runs them: ``--doctest-modules``)
wherever they read best, not only in an ``Examples:`` section. Markdown would
take a ``>>>`` line for a quote and ``[...]`` output for a link; each run of
``>>>`` lines and their output becomes a ``pycon`` code block instead.
"""

from __future__ import annotations

import re

import griffe

_DOCTEST = re.compile(r"^( *)>>> .*(?:\n\1(?:>>>|\.\.\.)? ?.*\S.*)*", re.M)


class DoctestsAsCode(griffe.Extension):
  def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
    if obj.docstring is None or ">>>" not in obj.docstring.value:
      return
    obj.docstring.value = _DOCTEST.sub(
      lambda m: f"{m.group(1)}```pycon\n{m.group(0)}\n{m.group(1)}```", obj.docstring.value
    )
