"""Test and doctest setup: 8 emulated CPU devices, set before JAX initialises."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu takes a lock file so that one process at a time drives the chips;
# the tests only compile for compile-only TPU devices, from two xdist
# workers and their subprocesses at once (tests/test_compile_targets.py).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# One persistent XLA compilation cache per test run, shared by the xdist
# workers and every subprocess (the CLI, notebook kernels) through the
# environment: many tests compile the same program (a run and its resume,
# the same tiny model in several files), and a cache hit loads the very
# executable the first compile produced. The process that makes it removes it.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache = tempfile.mkdtemp(prefix="cpjax-test-xla-cache-")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
# The tests compile far more than they run (tiny models, a step or two), and
# most of an XLA:CPU compile is LLVM's: at optimisation level 0 the suite
# compiles about 15% faster. The HLO passes, buffer assignment and memory
# analysis the tests read do not depend on it. (Subprocesses inherit it.)
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
  ).strip()
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
# In case a plugin imported JAX before the environment above was set.
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update(
  "jax_persistent_cache_min_compile_time_secs",
  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
)
jax.config.update(
  "jax_persistent_cache_min_entry_size_bytes",
  int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]),
)

import hypothesis  # noqa: E402

# Each drawn shape is a fresh XLA compile: keep the default profile small and
# offer a long one (CPJAX_HYPOTHESIS_PROFILE=thorough) for soak runs.
hypothesis.settings.register_profile(
  "default",
  max_examples=8,
  deadline=None,
  derandomize=True,
  suppress_health_check=[hypothesis.HealthCheck.too_slow],
)
hypothesis.settings.register_profile(
  "thorough",
  max_examples=200,
  deadline=None,
  suppress_health_check=[hypothesis.HealthCheck.too_slow],
)
hypothesis.settings.load_profile(os.environ.get("CPJAX_HYPOTHESIS_PROFILE", "default"))

# The suite runs on 2 xdist workers, a test file at a time (`--dist loadfile
# --no-loadscope-reorder` in the Makefile). Files whose single tests take a
# minute or more go first, in this order, so that the last minutes are spent
# on many small files and both workers finish together; the rest keep their
# collection order.
HEAVY_FIRST = (
  "test_multiprocess.py",
  "test_cli.py",
  "test_parallel.py",
  "test_checkpointing.py",
  "test_notebooks.py",
  "test_docs.py",
  "test_docs_commands.py",
  "test_plan.py",
  "test_compile_targets.py",
  "test_accelerator_suite.py",
  "test_step_time.py",
  "test_lora_peft.py",
  "test_lora_training.py",
  "test_lora.py",
  "test_run_config.py",
  "test_experts.py",
  "test_state_sharding.py",
  "test_gemma4_checkpoint.py",
  "test_gemma4.py",
  "test_context_parallel.py",
  "test_document_balance.py",
)


def pytest_collection_modifyitems(config, items):
  def weight(item):
    name = os.path.basename(str(item.path))
    return HEAVY_FIRST.index(name) if name in HEAVY_FIRST else len(HEAVY_FIRST)

  items.sort(key=weight)  # stable: a file's tests keep their order
