"""Test and doctest setup: 8 emulated CPU devices, set before JAX initialises."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import hypothesis  # noqa: E402

# Each drawn shape is a fresh XLA compile: keep the default profile small and
# offer a long one (CPJAX_HYPOTHESIS_PROFILE=thorough) for soak runs.
hypothesis.settings.register_profile(
    "default", max_examples=8, deadline=None, derandomize=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow])
hypothesis.settings.register_profile(
    "thorough", max_examples=200, deadline=None,
    suppress_health_check=[hypothesis.HealthCheck.too_slow])
hypothesis.settings.load_profile(os.environ.get("CPJAX_HYPOTHESIS_PROFILE", "default"))
