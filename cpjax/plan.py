"""Moved to :mod:`cpjax.training.plan`; this path re-exports it for existing code."""

from cpjax.training.plan import *  # noqa: F403
from cpjax.training.plan import __all__  # noqa: F401

