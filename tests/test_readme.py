"""README's Python examples run as written, and the placement helpers they use.

Each ```python block of the README, except those of "Use the trained model"
(run by test_hf.py on an exported model), is run in a fresh interpreter on 8
CPU devices from an empty directory.
"""

import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import scape_jax

ROOT = pathlib.Path(__file__).resolve().parents[1]
SKIPPED_SECTIONS = ('Use the trained model',)


def _blocks():
  blocks = []
  for section in re.split(r'\n## ', (ROOT / 'README.md').read_text()):
    title = section.split('\n', 1)[0]
    if title in SKIPPED_SECTIONS:
      continue
    blocks += [(title, b) for b in
               re.findall(r'```python\n(.*?)```', section, re.S)]
  return blocks


def test_readme_has_the_examples():
  titles = [t for t, _ in _blocks()]
  assert titles.count('Using SCAPE in your own optax pipeline') == 1


@pytest.mark.parametrize('index', range(len(_blocks())))
def test_readme_block_runs(tmp_path, index):
  title, code = _blocks()[index]
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS='cpu',
             XLA_FLAGS=os.environ['XLA_FLAGS'])  # conftest's: 8 devices
  proc = subprocess.run([sys.executable, '-c', code], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, f'README block {index} ({title}):\n' + (
      proc.stderr[-3000:])
  loss = re.search(r'loss after 20 steps: ([0-9.]+)', proc.stdout)
  if loss:  # the examples train: well below the first step's loss (~0.5)
    assert float(loss.group(1)) < 0.2, proc.stdout


def _mesh(n=8):
  return jax.make_mesh((n,), ('data',))


def test_init_sharded_places_a_chain_by_its_specs():
  mesh = _mesh()
  params = {'w': jnp.ones((16, 8)), 'b': jnp.zeros((8,))}
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   scape_jax.scale_by_scape(density=0.25, axis_name='data'))
  opt_state, specs = scape_jax.init_sharded(tx, params, mesh)
  with jax.set_mesh(mesh):
    want = scape_jax.state_partition_specs(tx.init(params))
  assert specs == want
  residual = opt_state[1].residual['w']
  assert residual.shape == (8, 16, 8)
  assert residual.sharding.spec == P('data')
  assert {s.data.shape for s in residual.addressable_shards} == {(1, 16, 8)}
  assert opt_state[1].count.sharding.is_fully_replicated


def test_place_replicates_or_splits():
  mesh = _mesh()
  x = np.arange(32.0).reshape(8, 4)
  split = scape_jax.place({'x': x}, mesh, P('data'))['x']
  assert {s.data.shape for s in split.addressable_shards} == {(1, 4)}
  np.testing.assert_array_equal(split, x)
  assert scape_jax.place(x, mesh).sharding.is_fully_replicated


def test_init_sharded_names_a_bad_axis():
  with pytest.raises(ValueError, match="axis_name='dp' is not an axis"):
    scape_jax.init_sharded(scape_jax.scape(1e-3, density=0.1, axis_name='dp'),
                           {'w': jnp.ones(4)}, _mesh(), axis_name='dp')


def test_the_placement_helpers_name_a_bad_mesh_or_axis():
  """A mesh that is not a Mesh, and an axis name the mesh lacks or of
  another type, are refused by name (mesh=None was 'NoneType object has no
  attribute axis_names' or a device_put TypeError; state_partition_specs
  took axis_name=3 into P(3) and state_shardings 'dp' into a JAX error)."""
  params = {'w': jnp.ones((8, 4))}
  tx = scape_jax.scape(1e-3, density=0.5)
  state, _ = scape_jax.init_sharded(tx, params, _mesh())
  for call in (lambda: scape_jax.init_sharded(tx, params, None),
               lambda: scape_jax.place(params, 'data'),
               lambda: scape_jax.state_shardings(state, None)):
    with pytest.raises(ValueError, match=r'mesh=.* must be a '
                       r'jax.sharding.Mesh'):
      call()
  with pytest.raises(ValueError, match=r"state_shardings: axis_name='dp' is "
                     r'not an axis'):
    scape_jax.state_shardings(state, _mesh(), 'dp')
  with pytest.raises(ValueError, match=r'state_partition_specs: axis_name=3 '
                     r'must be None, a mesh axis name \(str\) or a tuple'):
    scape_jax.state_partition_specs(state, 3)
  # None: per-worker fields not split, as before.
  specs = scape_jax.state_partition_specs(state, None)
  assert specs[0].residual['w'] == P(None)
  assert scape_jax.state_shardings(state, _mesh(), None)[0].residual[
      'w'].spec == P(None)
