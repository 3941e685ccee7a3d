"""Moved to :mod:`cpjax.data.tokenizer`; this path re-exports it for existing code."""

from cpjax.data.tokenizer import *  # noqa: F403
from cpjax.data.tokenizer import __all__  # noqa: F401

