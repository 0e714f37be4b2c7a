"""SCAPE's residual offloaded to host memory (paper Section IV-E).

* the state's shardings carry the memory kind; the compiled step copies the
  residual to the device and back (read from its jaxpr);
* offload changes no number: params, m, residuals and masks after 20 steps
  equal the device-resident run bit for bit (8 devices, donated step);
* through the trainer (donated step, static density levels): a run
  resumed with offload from a device-resident checkpoint has the losses and
  state of the run without offload, bit for bit, and its checkpoint
  restores into device memory again; one of Algorithm 1 resumes in the
  distributed mode (Algorithm 2), converted;
* a memory kind the backend lacks is a clear error naming the kinds it has.
"""

import functools
import os
import shutil

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import scape_jax
from scape_jax import analysis
from scape_jax import sharding
from scape_jax import train as trainer
from scape_jax.data.prepare import make_synthetic_corpus
from scape_jax.train import checkpoint
from scape_jax.train import config as config_lib

HOST = 'pinned_host'
N = 8


def _params():
  rng = np.random.default_rng(0)
  shapes = {'w1': (40, 24), 'w2': (13, 7), 'b': (7,)}
  return {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}


def _targets(params, steps):
  """Per step and worker: what its gradient pulls the params towards."""
  rng = np.random.default_rng(1)
  return [{k: rng.normal(size=(N,) + p.shape).astype(np.float32)
           for k, p in params.items()} for _ in range(steps)]


def _tx():
  return scape_jax.scape(1e-2, density=0.1, density_warmup_steps=4,
                         clip_norm=1.0)


@functools.cache
def _mesh():
  return jax.make_mesh((N,), ('data',), devices=jax.devices()[:N])


def _step_fn(tx, specs):
  """The donated step; each worker's gradient is params - its target."""
  def local(params, state, targets):
    grads = jax.tree.map(lambda p, t: p - t[0], params, targets)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(jax.shard_map(local, mesh=_mesh(),
                               in_specs=(P(), specs, P('data')),
                               out_specs=(P(), specs)),
                 donate_argnums=(0, 1))


def _residual_kinds(state):
  return {x.sharding.memory_kind for x in jax.tree.leaves(state[0].residual)}


def _run(offload, steps=20):
  tx, params = _tx(), _params()
  state, specs = scape_jax.init_sharded(tx, params, _mesh(), offload=offload)
  params = jax.device_put(params, NamedSharding(_mesh(), P()))
  step = _step_fn(tx, specs)
  history = []
  for targets in _targets(params, steps):
    targets = jax.device_put(targets, NamedSharding(_mesh(), P('data')))
    params, state = step(params, state, targets)
    assert _residual_kinds(state) == {offload or 'device'}
    history.append(jax.tree.map(np.asarray, (params, state[0])))
  return history, step, (params, state, targets)


def test_offload_changes_no_number_over_20_steps():
  on, step, args = _run(HOST)
  off, _, _ = _run(None)
  for t, (a, b) in enumerate(zip(on, off), start=1):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      np.testing.assert_array_equal(x, y, err_msg=f'step {t}')
  final = on[-1][1]
  assert np.abs(final.residual['w1']).max() > 0  # the residual is in use
  # The step copies the new residual to host memory (its per-device bytes);
  # those copies are the step's outputs, which alias its donated inputs.
  residual = sum(p.size * 4 for k, p in _params().items() if p.ndim >= 2)
  jaxpr = step.trace(*args).jaxpr
  assert analysis.offloaded_bytes(jaxpr, skip_outputs=False) == residual
  assert analysis.offloaded_bytes(jaxpr) == 0


def test_state_shardings_carry_the_memory_kind():
  tx, params = _tx(), _params()
  with jax.set_mesh(_mesh()):
    shapes = jax.eval_shape(tx.init, params)
  placed = sharding.state_shardings(shapes, _mesh(), offload=HOST)
  kinds = sharding.offload_memory_kinds(shapes, HOST)
  assert set(jax.tree.leaves(kinds[0].residual)) == {HOST}
  for field in ('mu', 'mask', 'count', 'residual_norm'):
    assert set(jax.tree.leaves(getattr(kinds[0], field))) == {'device'}
  assert placed[0].residual['w1'].memory_kind == HOST
  assert placed[0].residual['w1'].spec == P('data')
  assert placed[0].mu['w1'].memory_kind == 'device'
  plain = sharding.state_shardings(shapes, _mesh())
  assert {s.memory_kind for s in jax.tree.leaves(plain)} == {'device'}
  by_kind = analysis.argument_bytes_by_kind(jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      shapes, placed))
  assert by_kind[HOST] == (40 * 24 + 13 * 7) * 4  # one worker's residual


def test_a_missing_memory_kind_names_the_available_ones():
  tx, params = _tx(), _params()
  with pytest.raises(ValueError, match=(
      r"memory kind 'hbm_far' is not available on cpu device 0; its memory "
      r"kinds are \['device', 'pinned_host', 'unpinned_host'\]")):
    scape_jax.init_sharded(tx, params, _mesh(), offload='hbm_far')


# ----------------------------------------------------------------------------
# Through the trainer.


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  path = str(tmp_path_factory.mktemp('corpus'))
  make_synthetic_corpus(path, num_tokens=1 << 15)
  return path


def _cfg(corpus, out_dir, offload, *overrides):
  return config_lib.load(None, [
      f'--config.data.corpus={corpus}', f'--config.out_dir={out_dir}',
      '--config.model.dtype=float32', '--config.data.seq_len=16',
      '--config.data.batch_size=16', '--config.eval_batches=1',
      '--config.eval_every=0', '--config.log_every=1', '--config.ckpt_every=2',
      '--config.optimizer.decay=constant', '--config.optimizer.warmup_steps=0',
      '--config.optimizer.lr=3e-3', '--config.steps=4',
      '--config.optimizer.name=scape', '--config.optimizer.scape.density=0.1',
      f'--config.optimizer.scape.offload={offload}', *overrides])


def _restored(out_dir, program, step):
  target = {'params': program.abstract_params, 'opt': program.abstract_opt}
  with checkpoint.Checkpointer(os.path.join(out_dir, 'ckpt')) as ckpt:
    state, _ = ckpt.restore(step, target)
  return state


def _resume_from(src, dst, step):
  """A copy of run `src` whose latest checkpoint is `step`."""
  shutil.copytree(src / 'ckpt', dst / 'ckpt')
  for name in os.listdir(dst / 'ckpt'):
    if name.isdigit() and int(name) > step:
      shutil.rmtree(dst / 'ckpt' / name)


@pytest.fixture(scope='module')
def plain(corpus, tmp_path_factory):
  """(out_dir, summary) of 4 device-resident Algorithm 1 steps, saved at 2
  and 4; the runs below resume from a copy of its step 2."""
  out = tmp_path_factory.mktemp('plain')
  return out, trainer.train(_cfg(corpus, out, False))


def test_trainer_offload_is_exact_and_resumes(corpus, plain, tmp_path):
  """Device-resident steps 1-2 | restored into host memory | steps 3-4."""
  plain_dir, straight = plain
  _resume_from(plain_dir, tmp_path / 'off', 2)
  resumed = trainer.train(_cfg(corpus, tmp_path / 'off', True))
  assert resumed['start_step'] == 2
  assert resumed['losses'] == straight['losses'][2:]  # donated, bit for bit

  host = trainer.build_program(_cfg(corpus, tmp_path / 'off', True))
  device = trainer.build_program(_cfg(corpus, plain_dir, False))
  assert host.abstract_opt[0].residual['lm_head']['kernel'].sharding \
      .memory_kind == HOST
  a = _restored(plain_dir, device, 4)
  b = _restored(tmp_path / 'off', host, 4)
  assert _residual_kinds(b['opt']) == {HOST}
  assert np.abs(np.asarray(b['opt'][0].residual['lm_head']['kernel'])).max(
  ) > 0
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  # Across modes: the same layout in another memory kind.
  crossed = _restored(tmp_path / 'off', device, 4)
  assert _residual_kinds(crossed['opt']) == {'device'}


def test_an_algorithm_1_checkpoint_resumes_in_the_distributed_mode(
    corpus, plain, tmp_path):
  """Algorithm 2 (tests/test_alg2.py) from Algorithm 1's step 2, converted."""
  plain_dir, straight = plain
  _resume_from(plain_dir, tmp_path / 'dist', 2)
  dist = ('--config.optimizer.scape.distributed=true',)
  resumed = trainer.train(_cfg(corpus, tmp_path / 'dist', False, *dist))
  assert resumed['start_step'] == 2
  assert resumed['losses'][0] == straight['losses'][2]  # restored exactly
  np.testing.assert_allclose(resumed['losses'], straight['losses'][2:],
                             rtol=1e-6)
  program = trainer.build_program(_cfg(corpus, tmp_path / 'dist', False,
                                       *dist))
  state = _restored(tmp_path / 'dist', program, 4)
  assert isinstance(state['opt'][0], scape_jax.ScaleByScapeDistState)


def test_the_mode_conversion_keeps_the_states_dense_leaves(corpus, tmp_path):
  """The conversion compresses the leaves the saved state compressed, not
  those of the default rank rule: two kinds of leaves that rule would
  compress are dense here, `embed_tokens` by `dense_leaves` and a scanned
  model's stacked norm scales; either alone fails a conversion that uses
  the rule (one run of both, not a run of each: each run is two
  compiles)."""
  extra = ('--config.optimizer.scape.dense_leaves=embed_tokens',
           '--config.model.scan_layers=true')
  straight = trainer.train(_cfg(corpus, tmp_path / 'a', False, *extra))
  _resume_from(tmp_path / 'a', tmp_path / 'b', 2)
  resumed = trainer.train(_cfg(corpus, tmp_path / 'b', False, *extra,
                               '--config.optimizer.scape.distributed=true'))
  assert resumed['start_step'] == 2
  np.testing.assert_allclose(resumed['losses'], straight['losses'][2:],
                             rtol=1e-6)


def test_a_damaged_newest_checkpoint_of_the_other_mode_is_set_aside(
    corpus, plain, tmp_path):
  """Converting modes falls back past a corrupt checkpoint as a plain resume
  does (the conversion re-raised it as a mismatch: exit 2, nothing moved)."""
  plain_dir, straight = plain
  out = tmp_path / 'dist'
  shutil.copytree(plain_dir / 'ckpt', out / 'ckpt')
  data = [os.path.join(root, f)
          for root, _, names in os.walk(out / 'ckpt' / '4')
          for f in names if os.path.basename(root) == 'd']
  path = max(data, key=os.path.getsize)
  with open(path, 'r+b') as f:
    f.seek(os.path.getsize(path) // 2)
    byte = f.read(1)
    f.seek(-1, os.SEEK_CUR)
    f.write(bytes([byte[0] ^ 0x5A]))
  resumed = trainer.train(_cfg(corpus, out, False,
                               '--config.optimizer.scape.distributed=true'))
  assert resumed['start_step'] == 2
  assert resumed['losses'][0] == straight['losses'][2]
  assert (tmp_path / 'dist' / 'ckpt.corrupt' / '4').is_dir()


def test_offload_to_a_missing_kind_is_a_config_error(corpus, tmp_path):
  cfg = _cfg(corpus, tmp_path, True,
             '--config.optimizer.scape.offload_kind=hbm_far')
  with pytest.raises(config_lib.ConfigError, match=(
      r"optimizer.scape.offload: memory kind 'hbm_far' is not available on "
      r"cpu device 0; its memory kinds are \['device', 'pinned_host', "
      r"'unpinned_host'\]. Set optimizer.scape.offload=False")):
    trainer.build_program(cfg)


def test_dry_run_reports_device_and_host_bytes(corpus, tmp_path):
  on = trainer.dry_run(_cfg(corpus, tmp_path, True))
  program = trainer.build_program(_cfg(corpus, tmp_path, False))
  residual = 4 * sum(x.size for x in jax.tree.leaves(
      program.abstract_opt[0].residual)) // N  # one worker's
  off = analysis.argument_bytes_by_kind((program.abstract_params,
                                         program.abstract_opt))
  assert set(off) == {'device'}
  assert on['state_host_bytes'] == residual
  assert on['state_device_bytes'] == off['device'] - residual
  # The update returns the new residual to host memory; the step's select
  # between it and the old one (its finite check) then writes the output,
  # which aliases the donated input: one transient host copy.
  assert on['host_offload_bytes'] == residual
  assert on['host_bytes'] == 2 * residual
  # The CPU compiler counts host-placed arguments as device memory.
  assert on['host_compiled_bytes'] == 0
  assert on['device_bytes_placed'] == on['device_bytes'] - residual


def test_scape_offload_as_an_outer_methods_inner(corpus, tmp_path):
  for pier_offload in (True, False):
    program = trainer.build_program(_cfg(
        corpus, tmp_path, True, '--config.optimizer.name=pier',
        '--config.mesh.replica=2', '--config.optimizer.pier.inner=scape',
        '--config.optimizer.pier.lazy_start=0',
        '--config.optimizer.pier.sync_every=2',
        f'--config.optimizer.pier.offload={pier_offload}'))
    state = program.abstract_opt
    assert _residual_kinds(state.inner) == {HOST}
    assert state.inner[0].mu['lm_head']['kernel'].sharding.memory_kind == (
        'device')
    assert state.old_params['lm_head']['kernel'].sharding.memory_kind == (
        HOST if pier_offload else 'device')
