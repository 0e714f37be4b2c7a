"""Test setup: JAX on the CPU with 8 simulated devices, set before jax is imported.

Compiled programs go to a persistent compilation cache in a temporary
directory for the session (also used by the `train.py` subprocesses the tests
start): many tests compile the same small programs, e.g. a resumed run and
the run it resumes, and loading one is ~5x cheaper than compiling it.
"""
import atexit
import gc
import os
import shutil
import tempfile

import fast_compile  # tests/ is on sys.path: it has no __init__.py

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
# Flags that cut XLA:CPU's compile time (tests/fast_compile.py); the
# subprocesses inherit them. On the CPU alone: jaxlib 0.11 (a GPU machine's)
# no longer knows --xla_cpu_use_fusion_emitters, and an unknown XLA flag
# aborts the process (tests/test_gpu.py's workers died at start).
if (os.environ["JAX_PLATFORMS"] == "cpu"
    and "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]):
  os.environ["XLA_FLAGS"] += " " + fast_compile.FLAGS
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache = tempfile.mkdtemp(prefix="scape-jax-test-xla-cache-")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


import pytest  # noqa: E402

from scape_jax.data.prepare import make_synthetic_corpus  # noqa: E402
import tier_map  # noqa: E402  (tests/ is on sys.path: it has no __init__.py)


# First: xdist's own hook reads the xdist_group markers added here (on
# each worker) into the test ids it schedules by.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
  """Marks each test with its tier (tests/tier_map.py): `-m unit` is
  `make test-fast`. A test file missing from tier_map.MODULE_TIERS is marked
  `system` and fails tests/test_tiers.py. Groups each file's tests for
  xdist's loadgroup (but those of tier_map.SPLIT) and puts the slowest files
  first."""
  del config
  for item in items:
    module = item.path.stem
    own = tuple(m.name for m in item.iter_markers() if m.name in tier_map.TIERS)
    function = getattr(item, 'originalname', None) or item.name
    try:
      tier = tier_map.tier_of(module, function, own)
    except ValueError as e:
      raise pytest.UsageError(str(e)) from None
    if not own:
      item.add_marker(getattr(pytest.mark, tier))
    if module not in tier_map.SPLIT:
      item.add_marker(pytest.mark.xdist_group(module))
  # Stable: each file's tests keep their order (and stay together).
  items.sort(key=lambda item: tier_map.order_key(item.path.stem))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
  """A 2**16-token synthetic corpus, shared by the tests that run the
  trainer (a module may define its own `corpus` instead)."""
  path = str(tmp_path_factory.mktemp("corpus"))
  make_synthetic_corpus(path, num_tokens=1 << 16)
  return path


def pytest_sessionfinish(session):
  """Frees JAX's compiled programs and the arrays they hold while the
  session is still running: under pytest-xdist, execnet gives a worker 5 s
  to end after it reports its session finished, then interrupts it
  (SIGINT). Freeing a whole suite's programs in the garbage collection at
  exit took about that long, and the interrupt printed a KeyboardInterrupt
  in jax's `_xla_gc_callback` after the last test."""
  del session
  jax.clear_caches()
  gc.collect()
