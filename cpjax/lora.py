"""Moved to :mod:`cpjax.training.lora`; this path re-exports it for existing code."""

from cpjax.training.lora import *  # noqa: F403
from cpjax.training.lora import __all__  # noqa: F401

