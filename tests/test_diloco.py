"""DiLoCo and Pier against an independent NumPy reference (8 simulated devices).

* the phases of a step, in Python and traced;
* Pier's schedules at the paper's boundaries;
* 2 groups x 2 workers, r = 3, 12 steps through the lazy start, the
  switch, the momentum-decay phases and the syncs: params, outer momentum and
  old model match the reference after every step, with the phases as static
  arguments (with and without host offload) and in one `lax.switch`;
* one group, r = 1, outer lr 1, mu = 0 is the inner method; two groups are
  the mean of the groups' inner steps;
* bad settings are clear errors.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from diloco_reference import diloco_reference
from scape_jax import outer
from scape_jax import sharding
from scape_jax.comm.collectives import pmean_gradients
from scape_jax.sharding import layout as layout_lib

# ----------------------------------------------------------------------------
# Phases and schedules.


def test_phases_of_a_pier_run():
  schedule = outer.SyncSchedule(3, lazy_steps=4, momentum_warmup=True)
  got = [schedule.phase(count) for count in range(12)]
  assert got == ['lazy', 'lazy', 'lazy_sync', 'switch', 'inner', 'sync',
                 'inner', 'inner', 'sync', 'inner', 'inner', 'sync']
  # Lazy start ending on a sync step: that lazy sync also sets theta_old.
  ends_on_sync = outer.SyncSchedule(2, lazy_steps=4, momentum_warmup=True)
  assert [ends_on_sync.phase(c) for c in range(5)] == [
      'lazy', 'lazy_sync', 'lazy', 'lazy_sync', 'inner']
  no_warmup = outer.SyncSchedule(2, lazy_steps=3)
  assert [no_warmup.phase(c) for c in range(5)] == [
      'lazy', 'lazy', 'switch', 'sync', 'inner']


@pytest.mark.parametrize('r, lazy, warmup', [(1, 0, False), (3, 4, True),
                                             (2, 4, True), (2, 3, False),
                                             (5, 7, True)])
def test_traced_phase_equals_python(r, lazy, warmup):
  schedule = outer.SyncSchedule(r, lazy, warmup)
  counts = jnp.arange(30)
  traced = jax.jit(jax.vmap(schedule.phase_index))(counts)
  assert [outer.PHASES[i] for i in traced] == [schedule.phase(c)
                                               for c in range(30)]
  assert {schedule.phase(c) for c in range(30)} <= set(schedule.phases)


def test_pier_schedules_at_the_paper_boundaries():
  total = 100_000
  mu = outer.pier_momentum(total)
  lr = outer.pier_outer_lr(total)
  # t < 0.15 T exactly: 14_999 is below, 15_000 is not.
  for t, want in [(10_001, 0.99), (14_999, 0.99), (15_000, 0.95),
                  (19_999, 0.95), (20_000, 0.9), (99_999, 0.9)]:
    assert float(mu(t)) == pytest.approx(want), t
  for t, want in [(10_000, 0.0), (12_500, 0.25), (15_000, 0.5),
                  (19_999, 0.9999), (20_000, 1.1), (79_999, 1.1),
                  (80_000, 0.9), (100_000, 0.9)]:
    assert float(lr(t)) == pytest.approx(want, abs=1e-6), t
  assert outer.lazy_start_steps(0.1, total) == 10_000
  assert outer.lazy_start_steps(0.1, 12) == 1


# ----------------------------------------------------------------------------
# The transformation inside shard_map, against the NumPy reference.

GROUPS, WORKERS, STEPS, R = 2, 2, 12, 3
LAZY_START = 0.34  # L = floor(0.34 * 12) = 4: lazy sync at 3, switch at 4.
MU_AT, LR_WARMUP_END, LR_DROP_AT = (0.6, 0.8), 0.6, 0.9
INNER_LR = 0.05


def _params():
  rng = np.random.default_rng(0)
  return {'b': rng.normal(size=(4,)).astype(np.float32),
          'w': rng.normal(size=(3, 4)).astype(np.float32)}


def _grads(params):
  """grads[t][g][w] per leaf (sorted keys), and the [R, D, ...] arrays."""
  rng = np.random.default_rng(1)
  stacked = [{k: rng.normal(size=(GROUPS, WORKERS) + v.shape).astype(
      np.float32) for k, v in params.items()} for _ in range(STEPS)]
  nested = [[[[s[k][g, w] for k in sorted(params)] for w in range(WORKERS)]
             for g in range(GROUPS)] for s in stacked]
  return stacked, nested


def _pier(inner_axis='data'):
  def adamw(axes):
    return optax.chain(pmean_gradients(axes), optax.adamw(
        INNER_LR, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1))

  return outer.pier(
      adamw(inner_axis), adamw(('replica', inner_axis)), STEPS, R,
      lazy_start=LAZY_START,
      outer_momentum=outer.pier_momentum(STEPS, MU_AT),
      outer_lr=outer.pier_outer_lr(STEPS, LAZY_START, LR_WARMUP_END,
                                   LR_DROP_AT))


def _placed(tx, params, offload: bool):
  """(layout, stacked params, state, state shardings) on 2 x 2 devices."""
  mesh = sharding.make_mesh(replica=GROUPS, data=WORKERS,
                            devices=jax.devices()[:GROUPS * WORKERS])
  layout = sharding.Layout(mesh, jax.tree.map(lambda _: P(), params),
                           per_replica=True)
  shapes = jax.eval_shape(tx.init, params)
  specs = sharding.state_partition_specs(shapes)
  kinds = outer.offload_memory_kinds(shapes) if offload else None
  state_shardings = layout.shardings(specs, kinds)
  stacked = jax.tree.map(lambda x: jnp.stack([x] * GROUPS), params)
  state = jax.jit(jax.vmap(tx.init), out_shardings=state_shardings)(stacked)
  stacked = jax.device_put(stacked, layout.shardings(layout.param_specs))
  return layout, stacked, state, specs


def _step_fn(tx, layout, specs, phase):
  def local(params, state, grads):
    p, s = layout.enter(params), layout.enter(state)
    g = jax.tree.map(lambda x: x[0, 0], grads)  # this worker's gradient
    updates, s = tx.update(g, s, p, phase=phase)
    return layout.leave(optax.apply_updates(p, updates)), layout.leave(s)

  pspecs = layout.global_specs(layout.param_specs)
  sspecs = layout.global_specs(specs)
  fn = jax.shard_map(local, mesh=layout.mesh,
                     in_specs=(pspecs, sspecs, P('replica', 'data')),
                     out_specs=(pspecs, sspecs))
  return jax.jit(fn, donate_argnums=(0, 1))


def _run_outer(tx, params, stacked_grads, schedule, offload, static):
  layout, theta, state, specs = _placed(tx, params, offload)
  programs = {}
  history = []
  grad_sharding = NamedSharding(layout.mesh, P('replica', 'data'))
  for count, grads in enumerate(stacked_grads):
    phase = schedule.phase(count) if static else None
    if phase not in programs:
      programs[phase] = _step_fn(tx, layout, specs, phase)
    theta, state = programs[phase](theta, state,
                                   jax.device_put(grads, grad_sharding))
    kinds = {x.sharding.memory_kind for x in
             jax.tree.leaves((state.old_params, state.momentum))}
    assert kinds == ({'pinned_host'} if offload else {'device'})
    history.append(jax.tree.map(np.asarray, (theta, state.momentum,
                                             state.old_params)))
    assert int(state.count[0]) == count + 1
  return history


def _reference_mu(t):
  return 0.99 if t < 0.6 * STEPS else (0.95 if t < 0.8 * STEPS else 0.9)


def _reference_lr(t):
  start, end = LAZY_START * STEPS, LR_WARMUP_END * STEPS
  if t < end:
    return (t - start) / (end - start)
  return 1.1 if t < LR_DROP_AT * STEPS else 0.9


@pytest.mark.parametrize('static, offload', [(True, True), (True, False),
                                             (False, False)])
def test_pier_matches_numpy_reference(static, offload):
  params = _params()
  stacked, nested = _grads(params)
  schedule = outer.sync_schedule(STEPS, R, LAZY_START)
  got = _run_outer(_pier(), params, stacked, schedule, offload, static)
  want = diloco_reference(
      [params[k] for k in sorted(params)], nested, sync_every=R,
      lazy_steps=4, warmup=True, mu_of=_reference_mu,
      outer_lr_of=_reference_lr, lr=INNER_LR)
  apart = []
  for t, ((theta, m, old), (ref_theta, ref_m, ref_old)) in enumerate(
      zip(got, want), start=1):
    for j, k in enumerate(sorted(params)):
      for g in range(GROUPS):
        np.testing.assert_allclose(theta[k][g], ref_theta[g][j], rtol=2e-6,
                                   atol=2e-6, err_msg=f't={t} {k} group {g}')
        np.testing.assert_allclose(old[k][g], ref_old[j], rtol=2e-6,
                                   atol=2e-6, err_msg=f't={t} {k} old')
        np.testing.assert_allclose(m[k][g], ref_m[j], rtol=2e-6, atol=2e-6,
                                   err_msg=f't={t} {k} momentum')
    apart.append(float(np.abs(theta['w'][0] - theta['w'][1]).max()))
  # Identical through the lazy start, apart between syncs, together at syncs.
  assert max(apart[:4]) == 0.0
  assert min(apart[4], apart[6], apart[7], apart[9], apart[10]) > 1e-3
  assert max(apart[5], apart[8], apart[11]) < 1e-6
  # The warmup reached M before the first sync, and mu, lr changed on the way.
  assert np.abs(got[2][1]['w']).max() > 0


def test_update_requires_params_and_a_known_phase():
  tx = outer.diloco(optax.sgd(0.1), 2, replica_axis=None)
  params = {'w': jnp.ones(3)}
  state = tx.init(params)
  with pytest.raises(ValueError, match='needs params'):
    tx.update(params, state)
  with pytest.raises(ValueError, match=r"phase='lazy'; allowed with this "
                     r"schedule: \('inner', 'sync'\)"):
    tx.update(params, state, params, phase='lazy')


def test_single_process_use_without_shard_map():
  """A plain optax user: one group, no mesh, no phase."""
  tx = outer.diloco(optax.sgd(1.0), 2, outer_lr=1.0, outer_momentum=0.0,
                    replica_axis=None)
  params = {'w': jnp.array([1.0, 2.0])}
  state = tx.init(params)
  for _ in range(4):
    updates, state = tx.update({'w': jnp.array([0.5, -0.5])}, state, params)
    params = optax.apply_updates(params, updates)
  np.testing.assert_allclose(params['w'], [-1.0, 4.0])
  np.testing.assert_allclose(state.old_params['w'], [-1.0, 4.0])


# ----------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize('kwargs, message', [
    (dict(sync_every=0), r'sync_every=0 must be an integer >= 1'),
    (dict(sync_every=2, outer_momentum=1.0), r'outer_momentum=1.0 must be in'),
    (dict(sync_every=2, outer_lr=-1.0),
     r'outer_lr=-1.0 must be finite and > 0'),
    (dict(sync_every=2, outer_lr=0.0),
     r'outer_lr=0.0 must be finite and > 0 \(0 resets'),
    # Not numbers: a string passed float() before, None raised TypeError.
    (dict(sync_every=2, outer_lr='0.7'), r"outer_lr='0.7' must be finite "
     r'and > 0 \(0 resets .*\), or an optax schedule'),
    (dict(sync_every=2, outer_momentum=None),
     r'outer_momentum=None must be in \[0, 1\), or an optax schedule'),
    (dict(sync_every=2, outer_lr=float('inf')), r'outer_lr=inf must be finite'),
    (dict(sync_every=2, lazy_steps=3), r'lazy_steps=3 needs the lazy-start'),
    (dict(sync_every=2.0), r'sync_every=2.0 must be an integer >= 1'),
])
def test_bad_diloco_arguments(kwargs, message):
  with pytest.raises(ValueError, match=message):
    outer.diloco(optax.sgd(0.1), **kwargs)


@pytest.mark.parametrize('kwargs', [dict(inner=None),
                                    dict(lazy=lambda p: p, lazy_steps=2)])
def test_an_inner_method_that_is_no_transformation_is_named(kwargs):
  """diloco(None, ...) raised AttributeError ('NoneType' ... 'init') from
  optax's wrapper; a lazy start that is a bare function, likewise."""
  name = next(iter(kwargs))
  args = {'inner': optax.sgd(0.1), 'sync_every': 2, **kwargs}
  with pytest.raises(TypeError, match=rf'^diloco: {name}=.* must be an optax '
                     r'GradientTransformation \(with init and update\)'):
    outer.diloco(**args)


@pytest.mark.parametrize('inner, lazy, name', [
    (None, optax.sgd(0.1), 'inner'), (optax.sgd(0.1), optax.sgd, 'lazy')])
def test_pier_names_an_inner_method_that_is_no_transformation(inner, lazy,
                                                              name):
  with pytest.raises(TypeError, match=rf'^pier: {name}=.* must be an optax '
                     r'GradientTransformation'):
    outer.pier(inner, lazy, 100, 4)


def test_numpy_integers_are_integers():
  """sync_every=np.int64(4) (e.g. from a NumPy sweep) is 4, not an error."""
  schedule = outer.SyncSchedule(np.int64(4), np.int32(2))
  assert schedule == outer.SyncSchedule(4, 2)
  assert type(schedule.sync_every) is int
  outer.diloco(optax.sgd(0.1), np.int64(4))


def test_pier_names_a_bad_total_steps():
  with pytest.raises(ValueError, match=r'pier: total_steps=-10 must be an '
                     r'integer >= 1 \(T, the steps of the run\)'):
    outer.pier(optax.sgd(0.1), optax.sgd(0.1), -10, 4)


@pytest.mark.parametrize('kwargs, message', [
    (dict(sync_every=0), r'^pier: sync_every=0 must be an integer >= 1'),
    (dict(sync_every=4, outer_lr=0.0),
     r'^pier: outer_lr=0.0 must be finite and > 0'),
    (dict(sync_every=4, outer_momentum=1.0),
     r'^pier: outer_momentum=1.0 must be in \[0, 1\)'),
    (dict(sync_every=4, warmup_momentum=-0.5),
     r'^pier: warmup_momentum=-0.5 must be in \[0, 1\)'),
])
def test_pier_errors_name_pier(kwargs, message):
  """Pier's bad arguments are reported as Pier's, not DiLoCo's."""
  with pytest.raises(ValueError, match=message):
    outer.pier(optax.sgd(0.1), optax.sgd(0.1), 100, **kwargs)


@pytest.mark.parametrize('p', [-0.1, 1.0, 1.5])
def test_lazy_start_outside_unit_interval(p):
  with pytest.raises(ValueError, match=rf'lazy_start={p} must be in \[0, 1\)'):
    outer.pier(optax.sgd(0.1), optax.sgd(0.1), 100, 5, lazy_start=p)


def test_lazy_transformation_must_share_the_inner_state():
  tx = outer.diloco(optax.sgd(0.1), 2, lazy=optax.adam(0.1), lazy_steps=2)
  with pytest.raises(ValueError, match='must have the state of the inner'):
    tx.init({'w': jnp.ones(3)})


def test_missing_memory_kind_names_the_available_ones():
  mesh = sharding.make_mesh(data=2, devices=jax.devices()[:2])
  with pytest.raises(ValueError, match=r"memory kind 'hbm_far' is not "
                     r"available .* its memory kinds are \['device', "
                     r"'pinned_host', 'unpinned_host'\]"):
    layout_lib.check_memory_kinds(mesh, {'device', 'hbm_far'})

