"""The package as a user installs it: a wheel, installed outside the repo.

The wheel is built once from a copy of the sources (so the checkout gains
no build/ or egg-info), installed with `pip install --target`, and used
from another directory: `import scape_jax` and one SCAPE step on 2 CPU
devices, with the [train] extra's packages (flax, orbax, grain, tokenizers)
blocked; the models imported from beside a user's own `models/` package;
the config presets by name (`scape-train --config NAME`). The dependencies
come from this environment.
"""

import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

from tiny_runs import xla_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = ('pyproject.toml', 'README.md', 'scape_jax', 'models', 'configs')

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


@pytest.fixture(scope='module')
def installed(tmp_path_factory):
  """(wheel, site): the wheel built once from a copy of the sources, and the
  directory it is installed into (`pip install --target`)."""
  tmp_path = tmp_path_factory.mktemp('wheel')
  src = tmp_path / 'src'
  src.mkdir()
  for name in SOURCES:
    if (ROOT / name).is_dir():
      shutil.copytree(ROOT / name, src / name,
                      ignore=shutil.ignore_patterns('__pycache__'))
    else:
      shutil.copy(ROOT / name, src / name)
  wheel = _build_wheel(src, tmp_path / 'dist')
  site = tmp_path / 'site'
  proc = _pip('install', '--no-deps', '--no-index', '--target', str(site),
              str(wheel))
  assert proc.returncode == 0, proc.stdout + proc.stderr
  return wheel, site


def _elsewhere(tmp_path, site, code=None, args=(), devices=None):
  """Runs `python -c code` (or site/bin/ARGS) in a directory outside the
  checkout, with only the installed wheel (and this environment's
  dependencies) importable; the CompletedProcess."""
  where = tmp_path / 'elsewhere'
  where.mkdir(exist_ok=True)
  env = dict(os.environ, PYTHONPATH=str(site), JAX_PLATFORMS='cpu',
             SCAPE_JAX_CACHE=str(tmp_path / 'cache'),
             XLA_FLAGS=xla_flags(devices))
  cmd = ([sys.executable, '-c', code] if code is not None else
         [str(site / 'bin' / args[0]), *args[1:]])
  return subprocess.run(cmd, cwd=where, env=env, capture_output=True,
                        text=True, timeout=300)


def test_wheel_installs_and_runs_outside_the_repo(installed, tmp_path):
  wheel, site = installed
  names = zipfile.ZipFile(wheel).namelist()
  assert 'scape_jax/optim/_scape.py' in names
  assert 'scape_jax/models/llama.py' in names
  assert not [n for n in names if n.startswith(('tests/', 'bench/'))]
  entry = [n for n in names if n.endswith('entry_points.txt')]
  assert entry and 'scape-train = scape_jax.train.cli:main' in zipfile.ZipFile(
      wheel).read(entry[0]).decode()
  proc = _elsewhere(tmp_path, site, ONE_STEP, devices=2)
  assert proc.returncode == 0 and 'one step ok' in proc.stdout, proc.stderr
  proc = _elsewhere(tmp_path, site, args=('scape-train', '--help'))
  assert proc.returncode == 0 and '--dry-run' in proc.stdout, proc.stderr


def test_the_wheel_has_no_top_level_models_and_every_package(installed):
  """`models/` and `configs/` are installed inside the package; every
  package of the checkout's scape_jax/ is in the wheel (pyproject lists
  them by hand)."""
  wheel, _ = installed
  names = zipfile.ZipFile(wheel).namelist()
  tops = {n.split('/')[0] for n in names if '.dist-info/' not in n}
  assert tops == {'scape_jax'}, tops
  packages = {str(p.parent.relative_to(ROOT / 'scape_jax'))
              for p in (ROOT / 'scape_jax').rglob('__init__.py')}
  packages |= {'models', 'configs'}
  missing = [p for p in sorted(packages)
             if f'scape_jax/{p}/__init__.py'.replace('/./', '/') not in names
             and not any(n.startswith(f'scape_jax/{p}/') for n in names)]
  assert not missing, f'not in the wheel (add to pyproject.toml): {missing}'
  for preset in (ROOT / 'configs').glob('*.py'):
    assert f'scape_jax/configs/{preset.name}' in names


USERS_MODELS = """
import scape_jax, models
assert 'site' in scape_jax.__file__, scape_jax.__file__
assert models.MINE  # the user's own models package
from scape_jax import export_hf, models as ours
from scape_jax.train import config
assert ours.get_config('llama-tiny').vocab_size == 256
assert ours is not models and 'site' in ours.__file__
print('both ok')
"""


def test_the_installed_wheel_imports_beside_a_users_models(installed,
                                                           tmp_path):
  """From a directory holding a `models/` package of the user's own, the
  installed package imports its models (it used to import the user's:
  "cannot import name 'layers' from 'models'")."""
  _, site = installed
  (tmp_path / 'elsewhere' / 'models').mkdir(parents=True)
  (tmp_path / 'elsewhere' / 'models' / '__init__.py').write_text('MINE = 1\n')
  proc = _elsewhere(tmp_path, site, USERS_MODELS)
  assert proc.returncode == 0 and 'both ok' in proc.stdout, proc.stderr
  proc = _elsewhere(tmp_path, site, 'import runpy, sys; sys.argv = '
                    "['export_hf', '--help']; runpy.run_module("
                    "'scape_jax.export_hf', run_name='__main__')")
  assert proc.returncode == 0 and '--run' in proc.stdout, proc.stderr


def test_a_preset_by_name_outside_the_checkout(installed, tmp_path):
  """`--config NAME` finds the presets the wheel ships, from anywhere;
  a name that is none of them lists them. (llama500m's own dry run takes
  minutes on a CPU: `scape-train --config llama500m --dry-run`, run by
  hand; here its file is resolved and a small preset dry-runs.)"""
  _, site = installed
  proc = _elsewhere(tmp_path, site, (
      'from scape_jax.train import config, presets\n'
      "path = presets.resolve('llama500m')\n"
      "assert path.endswith('scape_jax/configs/llama500m.py'), path\n"
      "cfg = config.load('llama500m')\n"
      "assert cfg.model.preset == 'llama500m'\n"
      "print('resolved', config.load('llama500m.py').model.preset)"))
  assert proc.returncode == 0 and 'resolved llama500m' in proc.stdout, (
      proc.stderr)
  proc = _elsewhere(tmp_path, site, args=(
      'scape-train', '--config', 'shakespeare_llama_tiny', '--dry-run'))
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert 'per-device memory' in proc.stdout, proc.stdout
  proc = _elsewhere(tmp_path, site, args=('scape-train', '--config',
                                          'llama5OOm', '--dry-run'))
  assert proc.returncode == 2, proc.stdout + proc.stderr
  assert ("--config 'llama5OOm' is neither a config file nor a preset; the "
          'presets are gpt345m, ') in proc.stderr, proc.stderr
