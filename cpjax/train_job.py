"""Moved to :mod:`cpjax.training.train_job`; this path re-exports it for existing code."""

from cpjax.training.train_job import *  # noqa: F403
from cpjax.training.train_job import __all__  # noqa: F401

