"""Models with a context-parallel forward."""
