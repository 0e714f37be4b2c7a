"""Tests for scape_jax.checkpoint on the 8-device CPU mesh."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from scape_jax.train import checkpoint

EXTRAS = {'config': {'optimizer': {'name': 'scape', 'lr': 3e-4}},
          'data': {'position': 1234, 'epoch': 2}, 'note': None}


@pytest.fixture(scope='module')
def mesh():
  return jax.make_mesh((8,), ('data',))


def _state(mesh, seed: int = 0):
  """A small train-state-like pytree with assorted shardings and dtypes."""
  k1, k2 = jax.random.split(jax.random.key(seed))
  rows, cols, rep = (NamedSharding(mesh, P('data')),
                     NamedSharding(mesh, P(None, 'data')),
                     NamedSharding(mesh, P()))
  return {
      'params': {
          # Large enough that orbax stores it out of line in a data file.
          'w': jax.device_put(jax.random.normal(k1, (256, 128)), rows),
          'emb': jax.device_put(
              jax.random.normal(k2, (16, 64)).astype(jnp.bfloat16), cols),
      },
      'opt': {'count': jax.device_put(jnp.int32(7 + seed), rep),
              'mask': jax.device_put(jnp.arange(64) % 3 == 0, rows)},
  }


def _abstract(state):
  return jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
      state)


def _listing(directory):
  """Every path under `directory` with its size and mtime."""
  out = {}
  for root, dirs, files in os.walk(directory):
    for name in dirs + files:
      path = os.path.join(root, name)
      st = os.stat(path)
      out[path] = (st.st_size, st.st_mtime_ns)
  return out


def _saved(tmp_path, mesh, steps=(5,), **kwargs):
  ckpt = checkpoint.Checkpointer(str(tmp_path / 'ckpt'), **kwargs)
  for step in steps:
    ckpt.save(step, _state(mesh, seed=step), EXTRAS)
  ckpt.close()
  return checkpoint.Checkpointer(str(tmp_path / 'ckpt'))


def test_round_trip_sharded(tmp_path, mesh):
  state = _state(mesh)
  with checkpoint.Checkpointer(str(tmp_path / 'ckpt')) as ckpt:
    assert ckpt.latest_step() is None
    ckpt.save(10, state, EXTRAS)
    ckpt.wait()
    assert ckpt.latest_step() == 10
    abstract = _abstract(state)
    restored, extras = ckpt.restore(None, abstract)
  assert extras == EXTRAS
  assert (jax.tree.structure(restored) == jax.tree.structure(state))
  for got, want, ab in zip(jax.tree.leaves(restored), jax.tree.leaves(state),
                           jax.tree.leaves(abstract)):
    assert isinstance(got, jax.Array)
    assert got.sharding == ab.sharding
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_restore_onto_other_sharding(tmp_path, mesh):
  ckpt = _saved(tmp_path, mesh)
  state = _state(mesh, seed=5)
  other = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                     sharding=NamedSharding(mesh, P())), state)
  restored, _ = ckpt.restore(5, other)
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    assert got.sharding.is_fully_replicated
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_latest_step_and_max_to_keep(tmp_path, mesh):
  ckpt = _saved(tmp_path, mesh, steps=(1, 2, 3, 4), max_to_keep=2)
  assert ckpt.all_steps() == [3, 4]
  assert ckpt.latest_step() == 4
  restored, _ = ckpt.restore(3, _abstract(_state(mesh)))
  assert int(restored['opt']['count']) == 10


def test_interrupted_save_is_invisible(tmp_path, mesh):
  ckpt = _saved(tmp_path, mesh)
  # What orbax leaves behind when a save of step 9 dies before finalizing.
  os.makedirs(tmp_path / 'ckpt' / '9.orbax-checkpoint-tmp-1234' / 'state')
  assert ckpt.all_steps() == [5]
  with pytest.raises(checkpoint.CheckpointError, match='step 9'):
    ckpt.restore(9, _abstract(_state(mesh)))
  # The next run's first save removes it (they piled up, run after run).
  ckpt.close()
  with checkpoint.Checkpointer(str(tmp_path / 'ckpt')) as again:
    again.save(6, _state(mesh), {'note': 'next run'})
  assert sorted(os.listdir(tmp_path / 'ckpt')) == ['5', '6']


def test_missing_directory_and_step(tmp_path, mesh):
  abstract = _abstract(_state(mesh))
  missing = checkpoint.Checkpointer(str(tmp_path / 'nope'))
  assert missing.latest_step() is None
  with pytest.raises(checkpoint.CheckpointError, match='nope.*does not exist'):
    missing.restore(None, abstract)
  assert not (tmp_path / 'nope').exists()
  ckpt = _saved(tmp_path, mesh, steps=(5, 6))
  with pytest.raises(checkpoint.CheckpointError,
                     match=r'step 7 .*steps there: \[5, 6\]'):
    ckpt.restore(7, abstract)
  os.makedirs(tmp_path / 'empty')
  with pytest.raises(checkpoint.CheckpointError, match='no checkpoints'):
    checkpoint.Checkpointer(str(tmp_path / 'empty')).restore(None, abstract)


def test_existing_step_is_never_overwritten(tmp_path, mesh):
  ckpt = _saved(tmp_path, mesh)
  before = _listing(tmp_path / 'ckpt')
  with pytest.raises(checkpoint.CheckpointError, match='already exists'):
    ckpt.save(5, _state(mesh, seed=1), {})
  ckpt.close()
  assert _listing(tmp_path / 'ckpt') == before


def test_non_json_extras(tmp_path, mesh):
  ckpt = checkpoint.Checkpointer(str(tmp_path / 'ckpt'))
  with pytest.raises(checkpoint.CheckpointError, match='JSON'):
    ckpt.save(1, _state(mesh), {'bad': object()})
  ckpt.close()


def test_restore_does_not_modify_directory(tmp_path, mesh):
  ckpt = _saved(tmp_path, mesh, steps=(1, 2))
  before = _listing(tmp_path / 'ckpt')
  ckpt.restore(None, _abstract(_state(mesh)))
  ckpt.restore(1, _abstract(_state(mesh)))
  ckpt.latest_step()
  with pytest.raises(checkpoint.CheckpointError):
    ckpt.restore(3, _abstract(_state(mesh)))
  ckpt.close()
  assert _listing(tmp_path / 'ckpt') == before


def _data_files(step_dir):
  """The OCDBT data files of a step's state: <step>/state/**/d/<hash>."""
  return [os.path.join(root, f) for root, _, names in os.walk(step_dir)
          for f in names if os.path.basename(root) == 'd']


def _damage_biggest_data_file(step_dir, damage: str) -> None:
  """Garbles one byte of, or truncates, the largest array data file."""
  path = max(_data_files(step_dir), key=os.path.getsize)
  data = bytearray(open(path, 'rb').read())
  if damage == 'garble':
    data[len(data) // 2] ^= 0x5A
  else:
    data = data[:len(data) // 2]
  with open(path, 'wb') as f:
    f.write(bytes(data))


def test_garbled_array_data(tmp_path, mesh):
  """One flipped bit pattern inside an array's stored bytes.

  Orbax itself reads a garbled value back without complaint; the checksum
  manifest catches it. The array is random int32 bits: incompressible, so
  the compressor stores it verbatim and its bytes can be found in the data
  files (a byte picked by position alone, e.g. the middle of the biggest
  file, may belong to no array that is read back).
  """
  w = np.random.default_rng(0).integers(-2**31, 2**31, size=(256, 128),
                                        dtype=np.int64).astype(np.int32)
  state = {'w': jax.device_put(w, NamedSharding(mesh, P('data'))),
           'b': jax.device_put(jnp.ones(8), NamedSharding(mesh, P()))}
  with checkpoint.Checkpointer(str(tmp_path / 'ckpt')) as ckpt:
    ckpt.save(5, state, {})
  needle = w[128, 60:68].tobytes()
  hits = 0
  for path in _data_files(tmp_path / 'ckpt' / '5' / 'state'):
    data = bytearray(open(path, 'rb').read())
    at = data.find(needle)
    while at >= 0:  # every stored copy of these bytes
      data[at + 3] ^= 0x5A
      hits += 1
      at = data.find(needle, at + 1)
    with open(path, 'wb') as f:
      f.write(bytes(data))
  assert hits, 'the bytes of w were not found stored verbatim'
  before = _listing(tmp_path / 'ckpt')
  with pytest.raises(checkpoint.CorruptCheckpointError,
                     match=r"ckpt/5 is corrupt:\n.*\['w'\]: "
                     'checksum mismatch') as e:
    checkpoint.Checkpointer(str(tmp_path / 'ckpt')).restore(5,
                                                           _abstract(state))
  assert str(tmp_path) in str(e.value)
  assert _listing(tmp_path / 'ckpt') == before


def test_changed_extras_are_corruption(tmp_path, mesh):
  """A data position edited by hand is caught by the extras' checksum."""
  ckpt = _saved(tmp_path, mesh)
  path = tmp_path / 'ckpt' / '5' / 'extras' / 'metadata'
  text = path.read_text()
  assert '1234' in text
  path.write_text(text.replace('1234', '1235'))
  with pytest.raises(checkpoint.CorruptCheckpointError,
                     match='extras .* differ from what was saved'):
    ckpt.read_extras(5)
  with pytest.raises(checkpoint.CorruptCheckpointError, match='extras'):
    ckpt.restore(5, _abstract(_state(mesh)))


def test_read_extras_and_set_aside(tmp_path, mesh):
  ckpt = _saved(tmp_path, mesh, steps=(5, 6))
  assert ckpt.read_extras(None) == (6, EXTRAS)
  moved = ckpt.set_aside(6)
  assert moved == str(tmp_path / 'ckpt.corrupt' / '6')
  assert os.path.isdir(os.path.join(moved, 'state'))
  assert ckpt.all_steps() == [5]
  ckpt.save(6, _state(mesh, seed=6), EXTRAS)  # the step is free again
  ckpt.close()
  assert ckpt.all_steps() == [5, 6]


def test_non_finite_state_is_not_saved(tmp_path, mesh):
  state = _state(mesh)
  w = np.array(state['params']['w'])
  w[3, 4] = np.nan
  state['params']['w'] = jax.device_put(w, state['params']['w'].sharding)
  with checkpoint.Checkpointer(str(tmp_path / 'ckpt')) as ckpt:
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"(?s)refusing to save step 1: non-finite .*"
                       r"\['params'\]\['w'\]"):
      ckpt.save(1, state, {})
    assert ckpt.all_steps() == []
    ckpt.save(2, state, {}, allow_non_finite=True)
    restored, _ = ckpt.restore(2, _abstract(state))
  assert np.isnan(np.asarray(restored['params']['w'])[3, 4])


def test_restore_does_not_warn_read_only(tmp_path, mesh, caplog):
  ckpt = _saved(tmp_path, mesh)
  with caplog.at_level('WARNING'):
    ckpt.latest_step()
    ckpt.restore(5, _abstract(_state(mesh)))
  assert 'read only' not in caplog.text


def test_truncated_array_data(tmp_path, mesh):
  # One replicated array: a single shard read. (With several, orbax abandons
  # the sibling reads of a failed one and they print 'Exception ignored'
  # warnings whenever they are garbage-collected.)
  state = {'w': jax.device_put(jax.random.normal(jax.random.key(0), (256, 128)),
                               NamedSharding(mesh, P()))}
  with checkpoint.Checkpointer(str(tmp_path / 'ckpt')) as ckpt:
    ckpt.save(5, state, {})
  _damage_biggest_data_file(tmp_path / 'ckpt' / '5' / 'state', 'truncate')
  before = _listing(tmp_path / 'ckpt')
  with pytest.raises(checkpoint.CheckpointError,
                     match=r'ckpt/5 is corrupt or unreadable') as e:
    ckpt.restore(5, _abstract(state))
  assert e.value.__cause__ is not None
  assert _listing(tmp_path / 'ckpt') == before


@pytest.mark.parametrize('name', ['manifest.ocdbt', '_METADATA'])
def test_corrupt_metadata(tmp_path, mesh, name):
  ckpt = _saved(tmp_path, mesh)
  path = tmp_path / 'ckpt' / '5' / 'state' / name
  path.write_bytes(path.read_bytes()[:-10])
  with pytest.raises(checkpoint.CheckpointError, match='is corrupt') as e:
    ckpt.restore(5, _abstract(_state(mesh)))
  assert e.value.__cause__ is not None


def test_corrupt_extras(tmp_path, mesh):
  ckpt = _saved(tmp_path, mesh)
  (tmp_path / 'ckpt' / '5' / 'extras' / 'metadata').write_text('{"conf')
  with pytest.raises(checkpoint.CheckpointError, match='corrupt'):
    ckpt.restore(5, _abstract(_state(mesh)))


def test_mismatched_abstract_state(tmp_path, mesh):
  ckpt = _saved(tmp_path, mesh)
  abstract = _abstract(_state(mesh))
  rows = NamedSharding(mesh, P('data'))
  wrong_dtype = dict(abstract, params=dict(
      abstract['params'],
      w=jax.ShapeDtypeStruct((256, 128), jnp.bfloat16, sharding=rows)))
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"\['params'\]\['w'\].*float32.*bfloat16"):
    ckpt.restore(5, wrong_dtype)
  wrong_shape = dict(abstract, params=dict(
      abstract['params'],
      w=jax.ShapeDtypeStruct((256, 64), jnp.float32, sharding=rows)))
  with pytest.raises(checkpoint.CheckpointError, match=r'\(256, 64\)'):
    ckpt.restore(5, wrong_shape)
  extra_leaf = dict(abstract, step=abstract['opt']['count'])
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"\['step'\]: in abstract_state"):
    ckpt.restore(5, extra_leaf)


@pytest.mark.parametrize('leaves', [[], {'a': 1}, {'a': {'shape': 3}}])
def test_a_manifest_of_the_wrong_shape_is_corruption(tmp_path, mesh, leaves):
  """Valid JSON laid out otherwise is damage, not an AttributeError."""
  ckpt = _saved(tmp_path, mesh)
  path = tmp_path / 'ckpt' / '5' / 'checksums' / 'metadata'
  path.write_text(json.dumps(dict(json.loads(path.read_text()),
                                  leaves=leaves)))
  with pytest.raises(checkpoint.CorruptCheckpointError,
                     match='malformed checksum manifest'):
    ckpt.restore(5, _abstract(_state(mesh)))
