"""Radius against optax's AdamW and an independent NumPy simulation."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import scape_jax
from scape_jax import analysis
from scape_jax import train as trainer
from scape_jax.train.checkpoint import Checkpointer
from tests.constant_folding import constant_reductions
from tests.mesh_runner import MeshRunner, assert_same_states, random_params
from tests.mesh_runner import worker_grads
from tests.reference_methods import RadiusReference
from tests.tiny_runs import run_config

SHAPES = {'w1': (24, 16), 'w2': (13, 7), 'b': (7,), 's': (16,)}


def _radius_state(state):
  return state[0]


@pytest.mark.parametrize('index_radius, select', [
    (0, 'auto'), (1, 'auto'), (0, 'threshold'), (1, 'sort')])
def test_matches_numpy_simulation_across_a_cycle(index_radius, select):
  """dense -> resample -> sparse -> resample ..., every step checked; the
  masks by `lax.top_k` ('auto' at these widths) and by the sort-free
  selections of `comm.topk`."""
  params = random_params(SHAPES)
  n, interval, threshold, density, clip = 8, 3, 2, 0.2, 20.0
  steps = 3 * interval + 1
  grads = worker_grads(params, n, steps)
  names = sorted(params)  # jax flattens dicts in sorted key order
  lr_fn = optax.linear_schedule(1e-2, 1e-3, steps)
  tx = scape_jax.radius(lr_fn, density=density, interval=interval,
                        threshold=threshold, index_radius=index_radius,
                        clip_norm=clip, select=select)
  schedule = scape_jax.RadiusSchedule(interval, threshold)
  run = MeshRunner(tx, params, n, static_name='step_kind')
  ref = RadiusReference([params[k] for k in names],
                        [params[k].ndim >= 2 for k in names], n,
                        density=density, interval=interval,
                        threshold=threshold, lr_fn=lambda i: float(lr_fn(i)),
                        clip=clip, index_radius=index_radius)
  clipped = 0
  for i, g in enumerate(grads):
    run.step(g, schedule.kind(i))
    clipped += ref.step([[g[k][w] for k in names] for w in range(n)]) > clip
    assert ref.kinds[-1] == schedule.kind(i)
    st = _radius_state(run.state)
    for j, k in enumerate(names):
      tol = dict(rtol=2e-5, atol=2e-6, err_msg=f'{k} step {i + 1}')
      np.testing.assert_allclose(np.asarray(run.params[k]), ref.w[j], **tol)
      np.testing.assert_allclose(np.asarray(st.adam.mu[k]), ref.m[j], **tol)
      np.testing.assert_allclose(np.asarray(st.adam.nu[k]), ref.v[j], **tol)
      if not ref.sparse[j]:
        assert isinstance(st.residual[k], optax.MaskedNode)
        continue
      if ref.mask[j] is not None:
        offsets = np.asarray(st.mask[k])
        np.testing.assert_array_equal(offsets[offsets < params[k].size],
                                      np.flatnonzero(ref.mask[j]))
      for w in range(n):
        np.testing.assert_allclose(np.asarray(st.residual[k])[w],
                                   ref.e[w][j], **tol)
    np.testing.assert_allclose(  # the logged ||e^n|| over the sparse leaves
        np.asarray(st.residual_norm).reshape(-1),
        [np.sqrt(sum(np.sum(np.square(ref.e[w][j], dtype=np.float64))
                     for j in range(len(names)) if ref.sparse[j]))
         for w in range(n)], rtol=1e-4, atol=1e-7)
  assert ref.kinds[:4] == ['dense', 'dense', 'resample', 'sparse']
  assert ref.kinds.count('resample') == 3 and ref.kinds[-1] == 'sparse'
  assert float(jnp.min(st.residual_norm)) > 0  # the last step was sparse
  assert 0 < clipped < steps
  assert run.traces == 3  # one program per step kind
  if index_radius:  # widening made the masks larger than k
    assert max(int(m.sum()) for m in ref.mask if m is not None) > max(ref.k)


def _adamw_chain(lr, clip):
  return optax.chain(scape_jax.pmean_gradients('data'),
                     optax.clip_by_global_norm(clip),
                     optax.adamw(lr, b1=0.9, b2=0.95, eps=1e-8,
                                 weight_decay=0.1))


@pytest.mark.parametrize('static', [True, False])
def test_dense_steps_equal_the_adamw_method_bit_for_bit(static):
  """Before the first resample Radius is the trainer's dense AdamW."""
  params = random_params(SHAPES)
  grads = worker_grads(params, 8, 6)
  tx = scape_jax.radius(1e-2, density=0.1, interval=50, clip_norm=1.0)
  run = MeshRunner(tx, params, 8, static_name='step_kind')
  base = MeshRunner(_adamw_chain(1e-2, 1.0), params, 8)
  for g in grads:
    run.step(g, 'dense' if static else None)
    base.step(g)
  for k in params:
    np.testing.assert_array_equal(np.asarray(run.params[k]),
                                  np.asarray(base.params[k]))


def test_density_one_is_adamw_at_every_step_kind():
  params = random_params(SHAPES)
  grads = worker_grads(params, 4, 7)
  tx = scape_jax.radius(1e-2, density=1.0, interval=2, clip_norm=1.0)
  run = MeshRunner(tx, params, 4, static_name='step_kind')
  base = MeshRunner(_adamw_chain(1e-2, 1.0), params, 4)
  schedule = scape_jax.RadiusSchedule(2, 0)
  for i, g in enumerate(grads):
    run.step(g, schedule.kind(i))
    base.step(g)
  assert all(isinstance(x, optax.MaskedNode) for x in
             jax.tree.leaves(_radius_state(run.state).residual,
                             is_leaf=lambda x: isinstance(x, optax.MaskedNode)))
  for k in params:
    np.testing.assert_array_equal(np.asarray(run.params[k]),
                                  np.asarray(base.params[k]))


@pytest.mark.parametrize('clip_norm', [1.0, 0.0])
def test_inject_hyperparams_as_the_docstring_says(clip_norm):
  """With the static_args that `radius`'s docstring names, clip_norm and
  weight_decay arrive as arrays; the run equals the plain one (0 disables
  the clip, as None does)."""
  params = random_params(SHAPES)
  grads = worker_grads(params, 4, 7)
  kw = dict(density=0.3, interval=2, threshold=1)
  injected = optax.inject_hyperparams(
      scape_jax.radius,
      static_args=('density', 'interval', 'threshold', 'index_radius'))(
          learning_rate=1e-2, clip_norm=clip_norm, weight_decay=0.1, **kw)
  plain = scape_jax.radius(1e-2, clip_norm=clip_norm or None,
                           weight_decay=0.1, **kw)
  a = MeshRunner(injected, params, 4)
  b = MeshRunner(plain, params, 4)
  for g in grads:
    a.step(g)
    b.step(g)
  for k in params:
    np.testing.assert_allclose(np.asarray(a.params[k]),
                               np.asarray(b.params[k]), rtol=1e-6, atol=1e-7)


def test_switch_fallback_equals_static_kinds():
  params = random_params(SHAPES)
  grads = worker_grads(params, 4, 7)
  tx = scape_jax.radius(1e-2, density=0.3, interval=2, threshold=1)
  schedule = scape_jax.RadiusSchedule(2, 1)
  a = MeshRunner(tx, params, 4, static_name='step_kind')
  b = MeshRunner(tx, params, 4)
  for i, g in enumerate(grads):
    a.step(g, schedule.kind(i))
    b.step(g)  # no step_kind: lax.switch on the state's count
  assert_same_states((a.params, a.state), (b.params, b.state))


def test_schedule_kinds():
  s = scape_jax.RadiusSchedule(interval=4, threshold=6)
  kinds = [s.kind(c) for c in range(14)]  # steps t = 1..14
  assert kinds == ['dense'] * 7 + ['resample'] + ['sparse'] * 3 + [
      'resample'] + ['sparse'] * 2
  idx = np.asarray(jax.vmap(s.kind_index)(jnp.arange(14)))
  assert [('dense', 'sparse', 'resample')[i] for i in idx] == kinds


@pytest.mark.parametrize('index_radius', [0, 2])
def test_bytes_of_each_step_kind_from_the_compiled_step(index_radius):
  shapes = {'w1': (256, 64), 'w2': (96, 40), 'b': (64,), 's': (40,)}
  params = random_params(shapes)
  n, density = 8, 0.05
  tx = scape_jax.radius(1e-2, density=density, interval=4,
                        index_radius=index_radius)
  run = MeshRunner(tx, params, n, static_name='step_kind')
  grads = run.abstract_grads(params)
  total = sum(p.size for p in params.values())
  slots = sum(min(p.size, -(-p.size * 5 // 100) * (2 * index_radius + 1))
              for p in (params['w1'], params['w2']))
  sparse_values = slots + params['b'].size + params['s'].size
  for kind, values in (('dense', total), ('resample', total),
                       ('sparse', sparse_values)):
    cols = analysis.collectives(run.compiled(kind), run.params, run.state,
                                grads)
    assert {c.kind for c in cols} == {'all-reduce'}, analysis.format_table(
        cols)
    table = analysis.format_table(cols)
    assert sum(c.elements for c in cols) == values, (kind, table)
    assert analysis.bytes_sent(cols) == pytest.approx(
        analysis.ring_all_reduce_bytes(4 * values, n))


def test_resample_has_no_reduction_of_constants():
  """The flushed residual's norm is not a reduction of constant zeros, which
  XLA:CPU folded for minutes on a large leaf (`_radius._residual_norm`)."""
  params = random_params({'w': (64, 32), 'b': (32,)})
  tx = scape_jax.radius(1e-2, density=0.3, interval=2, axis_name=None)
  state = tx.init(params)
  for kind in ('dense', 'resample', 'sparse'):
    jaxpr = jax.make_jaxpr(lambda g, s, p, kind=kind: tx.update(
        g, s, p, step_kind=kind))(params, state, params)
    assert constant_reductions(jaxpr.jaxpr) == [], kind


def test_init_global_view_and_partition_specs():
  params = random_params(SHAPES)
  tx = scape_jax.radius(1e-2, density=0.25, index_radius=1)
  with jax.set_mesh(MeshRunner(tx, params, 8).mesh):
    st = _radius_state(jax.eval_shape(tx.init, params))
  assert st.residual['w1'].shape == (8, 24, 16)
  assert st.mask['w1'].shape == (min(384, 96 * 3),)
  assert st.mask['w1'].dtype == jnp.int32
  assert isinstance(st.mask['b'], optax.MaskedNode)
  specs = _radius_state(scape_jax.state_partition_specs((st,)))
  assert specs.residual['w1'] == jax.sharding.PartitionSpec('data')
  assert specs.mask['w1'] == jax.sharding.PartitionSpec()


@pytest.mark.parametrize('kwargs, match', [
    (dict(density=0.0), r'density=0.0 must be in \(0, 1\]'),
    (dict(density=1.5), r'density=1.5 must be in \(0, 1\]'),
    (dict(density=-0.1), r'density=-0.1 must be in \(0, 1\]'),
    (dict(interval=0), r'interval=0 must be an integer >= 1'),
    (dict(interval=2.5), r'interval=2.5 must be an integer >= 1'),
    (dict(threshold=-1), r'threshold=-1 must be an integer >= 0'),
    (dict(index_radius=-1), r'index_radius=-1 must be an integer >= 0'),
    (dict(b2=1.0), r'b2=1.0 must be in \[0, 1\)'),
    (dict(select='heap'), r"select='heap'; allowed: \('auto', 'sort'"),
])
def test_rejects_bad_settings(kwargs, match):
  with pytest.raises(ValueError, match=match):
    scape_jax.radius(1e-2, **kwargs)


def test_rejects_bad_step_kind_and_unbound_axis():
  params = random_params({'w': (8, 8)})
  tx = scape_jax.radius(1e-2, axis_name=None)
  state = tx.init(params)
  with pytest.raises(ValueError, match="step_kind='warm'"):
    tx.update(params, state, params, step_kind='warm')
  with pytest.raises(ValueError, match="axis_name='data' is not bound"):
    scape_jax.radius(1e-2).init(params)


# ----------------------------------------------------------------------------
# Through the trainer.


def _cfg(corpus, out_dir, *overrides):
  return run_config(
      corpus, out_dir, '--config.eval_every=0',
      '--config.optimizer.name=radius', '--config.optimizer.radius.interval=3',
      '--config.optimizer.radius.dense_fraction=0.0',
      '--config.optimizer.radius.density=0.1', *overrides)


def _train_rows(out_dir):
  with open(os.path.join(out_dir, 'metrics.jsonl')) as f:
    return [r for r in map(json.loads, f) if r['split'] == 'train']


def _final_state(cfg):
  program = trainer.build_program(cfg)
  with Checkpointer(os.path.join(cfg.out_dir, 'ckpt')) as ckpt:
    state, _ = ckpt.restore(None, {'params': program.abstract_params,
                                   'opt': program.abstract_opt})
  return state


def _resume_from(src, dst, step):
  """A copy of run `src` whose latest checkpoint is `step`."""
  shutil.copytree(src / 'ckpt', dst / 'ckpt')
  for name in os.listdir(dst / 'ckpt'):
    if name.isdigit() and int(name) > step:
      shutil.rmtree(dst / 'ckpt' / name)


def test_trainer_resumes_bit_exactly_and_logs_bytes_per_kind(corpus,
                                                             tmp_path):
  """Steps 1-2 dense, 3 resample, 4 sparse | resume | 5 sparse."""
  a = _cfg(corpus, tmp_path / 'a', '--config.steps=5',
           '--config.ckpt_every=1')
  straight = trainer.train(a)
  _resume_from(tmp_path / 'a', tmp_path / 'b', 4)
  b = _cfg(corpus, tmp_path / 'b', '--config.steps=5')
  resumed = trainer.train(b)
  assert resumed['start_step'] == 4
  assert resumed['losses'] == straight['losses'][4:]  # bit for bit
  for x, y in zip(jax.tree.leaves(_final_state(a)),
                  jax.tree.leaves(_final_state(b)), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  residual = _radius_state(_final_state(b)['opt']).residual_norm
  assert float(jnp.min(residual)) > 0  # the mask and residual were in use
  rows = _train_rows(tmp_path / 'a')
  assert [r['residual_norm'] > 0 for r in rows] == [False] * 3 + [True] * 2
  sent = [r['comm_bytes'] for r in rows]
  assert sent[0] == sent[1] == sent[2] > 3 * sent[3] and sent[3] == sent[4]
