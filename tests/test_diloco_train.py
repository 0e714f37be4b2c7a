"""DiLoCo and Pier through the trainer (8 simulated devices, real model).

* one group, r = 1, outer lr 1, mu = 0 equals the inner method alone over
  the same workers; two groups equal the mean of each group's inner step
  from the common model;
* the compiled programs: the inner step exchanges over 'data' only, the
  sync step adds one all-reduce of the parameters over 'replica', the lazy
  step averages over all workers;
* a run stopped between two syncs resumes bit for bit (old model, outer
  momentum in host memory, phase);
* bad settings are clear errors.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from scape_jax import analysis
from scape_jax import outer
from scape_jax import sharding
from scape_jax import train as trainer
from scape_jax.comm.collectives import pmean_gradients
from scape_jax.optim import _scape as scape_lib
from scape_jax.train import checkpoint
from scape_jax.train import config as config_lib
from scape_jax.train import methods
from scape_jax.train import step as step_lib
from scape_jax.train import trainer as trainer_lib
from tests.tiny_runs import random_batches, run_config


def _cfg(*overrides):
  base = ['--config.model.dtype=float32', '--config.data.seq_len=16',
          '--config.data.batch_size=16', '--config.optimizer.lr=1e-2',
          '--config.optimizer.warmup_steps=0', '--config.optimizer.eps=1e-3',
          '--config.optimizer.decay=constant', '--config.steps=4',
          '--config.optimizer.diloco.sync_every=2',
          '--config.optimizer.pier.sync_every=2']
  return config_lib.load(None, base + list(overrides))


_batches = random_batches


def _host(tree):
  return jax.tree.map(np.asarray, tree)


def _tiny_apply(params, tokens):
  return params['emb'][tokens] @ params['out']


def _tiny_params():
  rng = np.random.default_rng(0)
  return {'emb': rng.normal(size=(16, 8)).astype(np.float32),
          'out': rng.normal(size=(8, 16)).astype(np.float32)}


def _adamw(axes='data'):
  return optax.chain(pmean_gradients(axes), optax.adamw(1e-2, eps=1e-3))


def _identity_diloco():
  return outer.diloco(_adamw(), sync_every=1, outer_lr=1.0,
                      outer_momentum=0.0)


def _tiny_setup(tx, groups, data, params, per_replica=True, **kwargs):
  """(step, params, state): the real train step on the tiny model."""
  mesh = sharding.make_mesh(replica=groups, data=data,
                            devices=jax.devices()[:groups * data])
  layout = sharding.Layout(mesh, jax.tree.map(lambda _: P(), params),
                           per_replica=per_replica)
  with jax.set_mesh(mesh):  # SCAPE's init reads the 'data' axis size
    specs = sharding.state_partition_specs(jax.eval_shape(tx.init, params))
    if per_replica:
      params = jax.tree.map(lambda x: jnp.stack([x] * groups), params)
      state = jax.vmap(tx.init)(params)
    else:
      state = tx.init(params)
  params = jax.device_put(params, layout.shardings(layout.param_specs))
  state = jax.device_put(state, layout.shardings(specs))
  step_fn = step_lib.make_train_step(_tiny_apply, tx, layout, specs, kwargs)
  batch_sharding = NamedSharding(mesh, layout.batch_spec())

  def step(params, state, batch):
    return step_fn(params, state, jax.device_put(batch, batch_sharding))[:2]

  return step, params, state


def _tiny_run(tx, groups, data, params, batches, per_replica=True, **kwargs):
  step, params, state = _tiny_setup(tx, groups, data, params, per_replica,
                                    **kwargs)
  for b in batches:
    params, state = step(params, state, b)
  return _host(params)


def test_one_group_identity_outer_step_is_the_inner_method():
  params, batches = _tiny_params(), _batches(5, seq=4, vocab=16)
  got = _tiny_run(_identity_diloco(), 1, 8, params, batches, phase='sync')
  want = _tiny_run(_adamw(), 1, 8, params, batches, per_replica=False)
  for k in params:
    # Equal up to the rounding of theta_old + (theta_t - theta_old).
    np.testing.assert_allclose(got[k][0], want[k], rtol=1e-6, atol=1e-7)
    assert np.abs(want[k] - params[k]).max() > 1e-2  # it trained


def test_two_groups_identity_outer_step_is_the_mean_of_their_steps():
  """Group g trains on rows [8g, 8g + 8) of each batch with its own state."""
  params, batches = _tiny_params(), _batches(3, seq=4, vocab=16)
  step, both, state = _tiny_setup(_identity_diloco(), 2, 4, params,
                                  phase='sync')
  alone, theta, inner = _tiny_setup(_adamw(), 1, 4, params,
                                    per_replica=False)
  inner = [inner, jax.tree.map(jnp.copy, inner)]
  for b in batches:
    both, state = step(both, state, b)
    moved = []
    for g in range(2):
      half = jax.tree.map(lambda x, g=g: x[8 * g:8 * (g + 1)], b)
      p, inner[g] = alone(jax.tree.map(jnp.copy, theta), inner[g], half)
      moved.append(p)
    assert not np.allclose(moved[0]['out'], moved[1]['out'])
    theta = jax.tree.map(lambda x, y: (x + y) / 2, *moved)
    for k in params:
      for g in range(2):
        np.testing.assert_allclose(np.asarray(both[k][g]), theta[k],
                                   rtol=1e-6, atol=1e-7)


def test_scape_inside_diloco_gets_its_density_level():
  """The inner method's own static arguments reach it through the wrapper."""
  params, batches = _tiny_params(), _batches(2, seq=4, vocab=16)
  tx = outer.diloco(scape_lib.scape(1e-2, density=0.25, axis_name='data',
                                    density_warmup_steps=1), sync_every=2)
  inner, theta, state = _tiny_setup(tx, 2, 4, params, phase='inner',
                                    density_level=1)
  sync, _, _ = _tiny_setup(tx, 2, 4, params, phase='sync', density_level=1)
  for step, b in zip((inner, sync), batches):
    theta, state = step(theta, state, b)
    apart = np.abs(np.asarray(theta['out'][0] - theta['out'][1])).max()
    assert (apart < 1e-6) == (step is sync), apart
    # Level 1 already at the first step (by the count it would be level 0).
    assert np.asarray(state.inner[0].density).tolist() == [0.25, 0.25]


def _reduced(cols, group_size):
  return sum(c.elements for c in cols
             if c.kind == 'all-reduce' and c.group_size == group_size)


def test_bytes_of_the_inner_sync_and_lazy_programs():
  cfg = _cfg('--config.optimizer.name=pier', '--config.mesh.replica=2',
             '--config.steps=20', '--config.optimizer.pier.sync_every=5')
  program = trainer.build_program(cfg)
  params = trainer.param_count(program)
  phases = {program.method.update_kwargs(s)['phase']: s for s in range(20)}
  assert set(phases) == {'lazy', 'switch', 'inner', 'sync'}  # L = 2 < r
  cols = {p: analysis.collectives_from_hlo(
      program.compile_step(s, run=False).as_text()) for p, s in phases.items()
          if p != 'switch'}
  # Inner: the dense exchange within the group of 4; nothing over groups.
  assert params <= _reduced(cols['inner'], 4) <= params + 3
  assert _reduced(cols['inner'], 2) == 0
  # The metrics pmean: loss and squared gradient norm.
  assert _reduced(cols['inner'], 8) <= 2
  # Sync: the same, plus one mean of the parameters over the 2 groups.
  assert _reduced(cols['sync'], 4) == _reduced(cols['inner'], 4)
  assert _reduced(cols['sync'], 2) == params
  assert len([c for c in cols['sync'] if c.group_size == 2]) == 1  # one op
  # Lazy start: the exchange over all 8 workers.
  assert params <= _reduced(cols['lazy'], 8) <= params + 2
  assert _reduced(cols['lazy'], 4) == _reduced(cols['lazy'], 2) == 0


# ----------------------------------------------------------------------------
# Checkpoint and resume through the trainer.


class _Preempted(Exception):
  pass


def _train_cfg(corpus, out_dir):
  return run_config(
      corpus, out_dir, '--config.eval_every=0', '--config.ckpt_every=3',
      '--config.steps=6', '--config.mesh.replica=2',
      '--config.optimizer.name=pier', '--config.optimizer.pier.sync_every=2',
      '--config.optimizer.pier.lazy_start=0.2')


def _restored(out_dir, program, step):
  target = {'params': program.abstract_params, 'opt': program.abstract_opt}
  with checkpoint.Checkpointer(os.path.join(out_dir, 'ckpt')) as ckpt:
    state, _ = ckpt.restore(step, target)
  return state


def test_resume_between_syncs_is_bit_exact(corpus, tmp_path, monkeypatch):
  """Stopped after step 3 of: switch, sync, inner | sync, inner, sync."""
  cfg = _train_cfg(corpus, tmp_path / 'a')
  program = trainer.build_program(cfg)
  assert [program.method.update_kwargs(s)['phase'] for s in range(6)] == [
      'switch', 'sync', 'inner', 'sync', 'inner', 'sync']
  assert set(jax.tree.leaves(program.opt_memory_kinds.old_params)) == {
      'pinned_host'}  # offloaded by default
  straight = trainer.train(cfg)

  class StopAfterThree(checkpoint.Checkpointer):

    def save(self, step, state, extras=None):
      super().save(step, state, extras)
      if step == 3:
        self.wait()
        raise _Preempted

  monkeypatch.setattr(trainer_lib, 'Checkpointer', StopAfterThree)
  with pytest.raises(_Preempted):
    trainer.train(_train_cfg(corpus, tmp_path / 'b'))
  monkeypatch.undo()
  resumed = trainer.train(_train_cfg(corpus, tmp_path / 'b'))
  assert resumed['start_step'] == 3
  assert resumed['losses'] == straight['losses'][3:]  # bit for bit
  for step in (3, 6):
    a = _restored(tmp_path / 'a', program, step)
    b = _restored(tmp_path / 'b', program, step)
    assert int(b['opt'].count[0]) == step
    assert b['opt'].old_params['lm_head']['kernel'].sharding.memory_kind == (
        'pinned_host')
    assert np.abs(np.asarray(b['opt'].momentum['lm_head']['kernel'])).max() > 0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize('name', ['diloco', 'pier'])
def test_an_outer_method_reports_only_its_inner_methods_stats(name,
                                                              monkeypatch):
  """Not every registered method's: another one's `stats` may fail on this
  state (a study method of bench/fidelity_tools.py did, run in the same
  process)."""

  def foreign(opt_state):
    raise AssertionError('stats of a method that is not the inner one')

  monkeypatch.setitem(methods.REGISTRY, 'foreign',
                      methods.MethodSpec('foreign', None, stats=foreign))
  cfg = _cfg(f'--config.optimizer.name={name}', '--config.mesh.replica=2',
             f'--config.optimizer.{name}.inner=scape',
             f'--config.optimizer.{name}.sync_every=2',
             *([] if name == 'diloco' else
               ['--config.optimizer.pier.lazy_start=0']))
  method = methods.build(cfg.optimizer, 4)
  mesh = sharding.make_mesh(replica=1, data=8)
  with jax.set_mesh(mesh):  # SCAPE's init reads the 'data' axis size
    state = method.tx.init(_tiny_params())
  stats = method.stats(state)
  assert sorted(stats) == ['density', 'residual_norm']
  assert float(stats['density']) == 1.0


# ----------------------------------------------------------------------------
# Bad settings.


@pytest.mark.parametrize('overrides, message', [
    (['--config.optimizer.name=diloco', '--config.mesh.replica=2',
      '--config.mesh.data=2'],
     r'mesh.replica=2 x mesh.data=2 .* = 4 devices, but 8 are in use'),
])
def test_mesh_must_cover_every_device(overrides, message):
  with pytest.raises(config_lib.ConfigError, match=message):
    trainer.build_program(_cfg(*overrides))


@pytest.mark.parametrize('overrides, message', [
    (['--config.optimizer.diloco.sync_every=0'],
     r'optimizer.diloco: diloco: sync_every=0 must be an integer >= 1'),
    (['--config.optimizer.pier.sync_every=-3'],
     r'optimizer.pier: pier: sync_every=-3'),
    (['--config.optimizer.pier.lazy_start=1.0'],
     r'optimizer.pier: pier: lazy_start=1.0 must be in \[0, 1\)'),
    (['--config.optimizer.pier.lazy_start=-0.5'],
     r'lazy_start=-0.5 must be in \[0, 1\)'),
    (['--config.optimizer.diloco.inner=pier'],
     r"inner='pier' is not an inner method; allowed: adamw, adams, scape, "
     'radius, demo$'),
    (['--config.optimizer.diloco.inner=sgd'],
     r"inner='sgd' is not an inner method; allowed: adamw,"),
    (['--config.optimizer.pier.inner=scape', '--config.steps=100'],
     r"inner='scape': the lazy start .* needs a dense one \(adamw, adams\)"),
    (['--config.optimizer.diloco.outer_momentum=1'],
     r'outer_momentum=1.0 must be in \[0, 1\)'),
])
def test_bad_outer_settings(overrides, message):
  with pytest.raises(config_lib.ConfigError, match=message):
    _cfg(*overrides)


@pytest.mark.parametrize('name', ['diloco', 'pier'])
def test_one_replica_group_is_noted(name):
  """mesh.replica=1 (the default) is one group: allowed (DiLoCo's k = 1),
  but said, since the outer step then averages nothing."""
  program = trainer.build_program(_cfg(f'--config.optimizer.name={name}'))
  assert program.notes == (
      f"optimizer.name='{name}' with mesh.replica=1 runs one group: the outer "
      'step averages nothing (a lookahead on one model); mesh.replica sets '
      'the number of groups',)
  assert not trainer.build_program(_cfg(
      f'--config.optimizer.name={name}', '--config.mesh.replica=2')).notes


def test_pier_with_scape_inner_needs_no_lazy_start():
  cfg = _cfg('--config.optimizer.name=pier', '--config.mesh.replica=2',
             '--config.optimizer.pier.inner=scape',
             '--config.optimizer.pier.lazy_start=0')
  program = trainer.build_program(cfg)
  assert program.method.update_kwargs(0) == {'density_level': 0,
                                             'phase': 'inner'}


def test_offload_to_a_missing_memory_kind_is_a_config_error(monkeypatch):
  original = outer.offload_memory_kinds
  monkeypatch.setattr(outer, 'offload_memory_kinds',
                      lambda state: original(state, host='hbm_far'))
  cfg = _cfg('--config.optimizer.name=pier', '--config.mesh.replica=2')
  with pytest.raises(config_lib.ConfigError, match=(
      r"optimizer.pier.offload: memory kind 'hbm_far' is not available on cpu"
      r" device 0; its memory kinds are \['device', 'pinned_host', "
      r"'unpinned_host'\]. Set optimizer.pier.offload=False")):
    trainer.build_program(cfg)
