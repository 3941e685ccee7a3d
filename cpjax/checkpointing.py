"""Moved to :mod:`cpjax.training.checkpointing`; this path re-exports it for existing code."""

from cpjax.training.checkpointing import *  # noqa: F403
from cpjax.training.checkpointing import __all__  # noqa: F401

