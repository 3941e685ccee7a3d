"""Moved to :mod:`cpjax.data.records`; this path re-exports it for existing code."""

from cpjax.data.records import *  # noqa: F403
from cpjax.data.records import __all__  # noqa: F401

