"""The one train step on its three parameter layouts (8 simulated devices).

* fsdp: AdamW with parameters and state split over 'fsdp' equals the plain
  data-parallel run to fp32 rounding;
* per replica group: each group trains its own copy, equal to a one-group
  run on that group's part of the batch;
* bad layouts are clear errors.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from scape_jax import sharding
from scape_jax import train as trainer
from scape_jax.comm.collectives import pmean_gradients
from scape_jax.train import config as config_lib
from scape_jax.train import step as step_lib
from tests.tiny_runs import random_batches


def _cfg(*overrides):
  base = ['--config.model.dtype=float32', '--config.data.seq_len=16',
          '--config.data.batch_size=16', '--config.optimizer.lr=1e-2',
          '--config.optimizer.warmup_steps=0',
          '--config.optimizer.decay=constant', '--config.steps=10']
  return config_lib.load(None, base + list(overrides))


_batches = random_batches


def _run(cfg, batches):
  program = trainer.build_program(cfg)
  params, opt_state = program.init_state()
  step_fn = program.compile_step(0)
  losses = []
  for b in batches:
    b = jax.device_put(b, program.batch_sharding())
    params, opt_state, metrics = step_fn(params, opt_state, b)
    losses.append(float(metrics['loss']))
  return program, params, opt_state, losses


@pytest.mark.parametrize('name', ['adamw', 'adams'])
def test_fsdp_equals_data_parallel(name):
  # The gradients are summed in another order (reduce-scatter instead of
  # all-reduce): equal to fp32 rounding (test below). Adam-type directions
  # m / (sqrt(v) + eps) turn an absolute rounding difference dg of a gradient
  # near 0 into dg / eps; eps = 1e-3 keeps that at rounding level too.
  args = (f'--config.optimizer.name={name}', '--config.optimizer.eps=1e-3')
  batches = _batches(10)
  _, dp_params, _, dp_losses = _run(_cfg(*args, '--config.mesh.data=8'),
                                    batches)
  program, params, opt_state, losses = _run(
      _cfg(*args, '--config.mesh.data=4', '--config.mesh.fsdp=2'), batches)
  # The parameters and the moments are really split over 'fsdp'.
  kernel = params['layers'][0]['mlp']['up_proj']['kernel']
  assert tuple(kernel.sharding.spec)[:1] == ('fsdp',)
  assert kernel.addressable_shards[0].data.shape == (32, 192)
  moments = [x for x in jax.tree.leaves(opt_state)
             if x.shape == kernel.shape]
  assert moments and all(tuple(x.sharding.spec)[:1] == ('fsdp',)
                         for x in moments)
  np.testing.assert_allclose(losses, dp_losses, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(dp_params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                               atol=1e-6)
  assert program.layout.batch_axes == ('data', 'fsdp')


def test_fsdp_mean_gradient_equals_data_parallel_to_rounding():
  """SGD(lr=1) on the real model: the update is the mean gradient itself."""
  batch = _batches(1)[0]
  updates = []
  for mesh in (['--config.mesh.data=8'],
               ['--config.mesh.data=4', '--config.mesh.fsdp=2']):
    program = trainer.build_program(_cfg(*mesh))
    params, _ = program.init_state()
    before = jax.tree.map(np.asarray, params)
    tx = optax.chain(pmean_gradients('data'), optax.sgd(1.0))
    state = tx.init(params)
    step_fn = step_lib.make_train_step(program.apply_fn, tx, program.layout,
                                       sharding.state_partition_specs(state))
    after, _, _ = step_fn(params, state,
                          jax.device_put(batch, program.batch_sharding()))
    updates.append(jax.tree.map(lambda a, b: a - np.asarray(b), before,
                                after))
  for a, b in zip(jax.tree.leaves(updates[0]), jax.tree.leaves(updates[1])):
    # |a - b| is the rounding of `params - update` (one ulp of the params).
    np.testing.assert_allclose(a, b, rtol=0, atol=1.2e-7)
    assert np.abs(a).max() > 1e-5  # every leaf really moved


def _tiny_apply(params, tokens):
  return params['emb'][tokens] @ params['out']


def _per_replica_run(groups, data, params, batches, tx):
  """Runs the real train step on a ('replica', 'data') layout."""
  mesh = sharding.make_mesh(replica=groups, data=data,
                            devices=jax.devices()[:groups * data])
  layout = sharding.Layout(mesh, jax.tree.map(lambda _: P(), params),
                           per_replica=True)
  group_state = tx.init(params)
  specs = sharding.state_partition_specs(group_state)
  stacked = jax.tree.map(lambda x: jnp.stack([x] * groups), params)
  state = jax.vmap(tx.init)(stacked)
  stacked = jax.device_put(stacked, layout.shardings(layout.param_specs))
  state = jax.device_put(state, layout.shardings(specs))
  step_fn = step_lib.make_train_step(_tiny_apply, tx, layout, specs)
  for b in batches:
    b = jax.device_put(b, NamedSharding(mesh, layout.batch_spec()))
    stacked, state, _ = step_fn(stacked, state, b)
  return stacked


def test_replica_groups_train_their_own_copies():
  rng = np.random.default_rng(0)
  params = {'emb': rng.normal(size=(16, 8)).astype(np.float32),
            'out': rng.normal(size=(8, 16)).astype(np.float32)}
  tx = optax.chain(pmean_gradients('data'), optax.adamw(1e-2))
  batches = _batches(3, batch=16, seq=4, vocab=16)
  both = _per_replica_run(2, 4, params, batches, tx)
  assert both['emb'].shape == (2, 16, 8)
  assert tuple(both['emb'].sharding.spec)[:1] == ('replica',)
  assert not np.allclose(np.asarray(both['emb'][0]),
                         np.asarray(both['emb'][1]))
  for g in range(2):  # group g saw rows [8g, 8g + 8) of each batch
    own = [jax.tree.map(lambda x: x[8 * g:8 * (g + 1)], b) for b in batches]
    alone = _per_replica_run(1, 4, params, own, tx)
    for k in params:
      np.testing.assert_allclose(np.asarray(both[k][g]),
                                 np.asarray(alone[k][0]), rtol=1e-6,
                                 atol=1e-7)


@pytest.mark.parametrize('overrides, devices, message', [
    (['--config.mesh.replica=2'], 8, 'needs a method that keeps one copy'),
    (['--config.optimizer.name=scape', '--config.mesh.fsdp=2'], 8,
     "'scape' does not run on the fsdp layout"),
    (['--config.mesh.data=2', '--config.mesh.fsdp=3'], 6,
     r"not divisible by mesh.fsdp=3"),
    (['--config.mesh.fsdp=3'], 8, 'does not divide the 8 devices'),
])
def test_bad_layouts_are_clear_errors(overrides, devices, message):
  with pytest.raises(config_lib.ConfigError, match=message):
    trainer.build_program(_cfg(*overrides), jax.devices()[:devices])
