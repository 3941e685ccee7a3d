"""Moved to :mod:`cpjax.data.corpus`; this path re-exports it for existing code."""

from cpjax.data.corpus import *  # noqa: F403
from cpjax.data.corpus import __all__  # noqa: F401

# prepare_data and read_jsonl were here once; they live in cpjax.data.records.
from cpjax.data.records import prepare_data, read_jsonl  # noqa: F401
