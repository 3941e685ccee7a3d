"""Moved to :mod:`cpjax.training` (the step, :mod:`cpjax.training.step`, and its loss,
:mod:`cpjax.training.loss`); this path re-exports them for existing code."""

from cpjax.training import *  # noqa: F403
from cpjax.training import __all__  # noqa: F401

