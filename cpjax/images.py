"""Moved to :mod:`cpjax.data.images`; this path re-exports it for existing code."""

from cpjax.data.images import *  # noqa: F403
from cpjax.data.images import __all__  # noqa: F401

