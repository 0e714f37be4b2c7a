"""The package as a user installs it: a wheel, installed outside the repo.

The wheel is built from a copy of the sources (so the checkout gains no
build/ or egg-info), installed with `pip install --target`, and used from
another directory: `import scape_jax` and one SCAPE step on 2 CPU devices.
The dependencies (jax, optax, numpy) come from this environment; the
[train] extra's (flax, orbax, grain, tokenizers) are blocked for that step.
"""

import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = ('pyproject.toml', 'README.md', 'scape_jax', 'models')

ONE_STEP = """
import sys
# `pip install .` brings jax, optax and numpy only: the [train] extra is absent.
sys.modules.update(dict.fromkeys(['flax', 'orbax', 'grain', 'tokenizers'], None))
import jax, jax.numpy as jnp, optax, scape_jax
from jax.sharding import PartitionSpec as P
assert 'site' in scape_jax.__file__, scape_jax.__file__
mesh = jax.make_mesh((2,), ('data',))
params = scape_jax.place({'w': jnp.ones((4, 8))}, mesh)
batch = scape_jax.place(jnp.arange(16.0).reshape(4, 4), mesh, P('data'))
tx = scape_jax.scape(learning_rate=0.1, density=0.25, axis_name='data')
opt_state, specs = scape_jax.init_sharded(tx, params, mesh)

def step(params, opt_state, x):
  local = jax.lax.pcast(params, 'data', to='varying')
  grads = jax.grad(lambda p: jnp.sum((x @ p['w']) ** 2))(local)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state

step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P('data')),
                             out_specs=(P(), specs)))
new, _ = step(params, opt_state, batch)
assert float(jnp.abs(new['w'] - 1).max()) > 0
print('one step ok')
"""


def _pip(*args, **kwargs):
  env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK='1', PIP_NO_INPUT='1')
  return subprocess.run([sys.executable, '-m', 'pip', *args], env=env,
                        capture_output=True, text=True, timeout=600, **kwargs)


def _build_wheel(src, dist):
  """A wheel of `src`: with pip's isolated build env (setuptools from the
  package registry), else the installed setuptools; None if neither can."""
  tries = []
  for extra in ([], ['--no-build-isolation']):
    proc = _pip('wheel', '--no-deps', '--wheel-dir', str(dist), *extra,
                str(src))
    wheels = list(dist.glob('scape_jax-*.whl'))
    if proc.returncode == 0 and wheels:
      return wheels[0]
    tries.append(f'pip wheel {" ".join(extra)}: ' +
                 ' | '.join((proc.stdout + proc.stderr).splitlines()[-3:]))
  pytest.skip('the build backend (setuptools) could not be installed or '
              'cannot build wheels here:\n' + '\n'.join(tries))


def test_wheel_installs_and_runs_outside_the_repo(tmp_path):
  src = tmp_path / 'src'
  src.mkdir()
  for name in SOURCES:
    if (ROOT / name).is_dir():
      shutil.copytree(ROOT / name, src / name,
                      ignore=shutil.ignore_patterns('__pycache__'))
    else:
      shutil.copy(ROOT / name, src / name)
  wheel = _build_wheel(src, tmp_path / 'dist')
  names = zipfile.ZipFile(wheel).namelist()
  assert 'scape_jax/optim/_scape.py' in names and 'models/llama.py' in names
  assert not [n for n in names if n.startswith(('tests/', 'bench/'))]
  entry = [n for n in names if n.endswith('entry_points.txt')]
  assert entry and 'scape-train = scape_jax.train.cli:main' in zipfile.ZipFile(
      wheel).read(entry[0]).decode()

  site = tmp_path / 'site'
  proc = _pip('install', '--no-deps', '--no-index', '--target', str(site),
              str(wheel))
  assert proc.returncode == 0, proc.stdout + proc.stderr
  elsewhere = tmp_path / 'elsewhere'
  elsewhere.mkdir()
  env = dict(os.environ, PYTHONPATH=str(site), JAX_PLATFORMS='cpu',
             XLA_FLAGS='--xla_force_host_platform_device_count=2')
  proc = subprocess.run([sys.executable, '-c', ONE_STEP], cwd=elsewhere,
                        env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0 and 'one step ok' in proc.stdout, proc.stderr
  proc = subprocess.run([str(site / 'bin' / 'scape-train'), '--help'],
                        cwd=elsewhere, env=env, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0 and '--dry-run' in proc.stdout, proc.stderr
