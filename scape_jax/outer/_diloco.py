"""DiLoCo: an inner optimizer per replica group, an outer Nesterov step every r.

Every step is an inner step: each replica group runs the inner method on its
own copy of the parameters, with the inner method's exchange over the
group's workers ('data'). After every `sync_every`-th step (t % r == 0) the
outer step runs:

    Delta = mean over groups of (theta_group - theta_old)   one all-reduce
    M     = mu * M + Delta                                  over 'replica'
    theta = theta_old + lr_outer * (mu * M + Delta)          (Nesterov)
    every group and theta_old <- theta

With one group, mu = 0 and lr_outer = 1 this is the inner method alone. The
inner method's state carries on across synchronisations (DiLoCo, Sec. 6.1).

Pier adds a lazy start: steps t <= L run the inner method data-parallel over
all workers ('replica' and 'data'), so that the groups stay identical, and
every r of those steps the outer momentum accumulates
M = mu0 * M + (theta_t - theta_old) without being applied (momentum warmup).
At the last lazy step theta_old is set to the model; the groups then train
apart. `pier` fills in the paper's schedules (`scape_jax.outer._pier`).

Each step is one of `PHASES`, a static argument of `update`: the trainer
compiles one program per phase, so only the sync step holds the all-reduce
over 'replica' and only it (and the lazy-start sync) touches theta_old and M.
Leaves of the state placed in host memory (`offload_memory_kinds`) come back
to the device for those steps and leave the update in host memory again.

References:
  Douillard et al., "DiLoCo: Distributed Low-Communication Training of
  Language Models", 2023; Fan and Zhang, "Pier", Algorithms 1-2 (lines
  10-21); `docs/design.md`, "DiLoCo and Pier".
"""

import dataclasses
import functools
from typing import NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import optax

from scape_jax.comm.collectives import varying
from scape_jax.optim import _common
from scape_jax.optim._common import ScalarOrSchedule
from scape_jax.comm.axes import REPLICA

INNER, SYNC, LAZY, LAZY_SYNC, SWITCH = PHASES = (
    'inner', 'sync', 'lazy', 'lazy_sync', 'switch')
HOST = 'pinned_host'  # The memory kind of offloaded state.
DEVICE = 'device'


class DiLoCoState(NamedTuple):
  """State of `diloco`: the inner state, the old model and outer momentum."""
  count: jax.Array  # int32 scalar: updates completed (the step number t - 1).
  inner: optax.OptState  # The inner method's state (its lazy start's too).
  old_params: optax.Params  # theta_old: the model at the last synchronisation.
  momentum: optax.Params  # M: the outer Nesterov momentum, like the params.

  # Fields that `offload_memory_kinds` puts in host memory between syncs.
  OFFLOADED_FIELDS = ('old_params', 'momentum')
  # One state per replica group: placed with a leading axis over the groups
  # (`scape_jax.init_sharded(..., replica_axis=...)` refuses it without).
  PER_REPLICA_GROUP = True


@dataclasses.dataclass(frozen=True)
class SyncSchedule:
  """Which phase the update after `count` updates is (step t = count + 1).

  Attributes:
    sync_every: r; the outer step follows the inner update of every step
      with t % r == 0.
    lazy_steps: L; steps t <= L are lazy-start steps (Pier); 0: none.
    momentum_warmup: lazy steps with t % r == 0 accumulate the momentum.
    where: the method named in error messages.
  """
  sync_every: int
  lazy_steps: int = 0
  momentum_warmup: bool = False
  where: str = dataclasses.field(default='diloco', compare=False)

  def __post_init__(self):
    _common.check_int(self.where, 'sync_every', self.sync_every, 1,
                      why=' (steps between synchronisations)')
    _common.check_int(self.where, 'lazy_steps', self.lazy_steps, 0)
    for name in ('sync_every', 'lazy_steps'):  # NumPy integers as ints
      object.__setattr__(self, name, int(getattr(self, name)))

  @property
  def phases(self) -> tuple:
    """The phases this schedule can produce."""
    if not self.lazy_steps:
      return (INNER, SYNC)
    lazy = (LAZY, LAZY_SYNC, SWITCH) if self.momentum_warmup else (LAZY,
                                                                   SWITCH)
    return (INNER, SYNC) + lazy

  def phase(self, count: int) -> str:
    """The phase of the update after `count` updates (a Python int)."""
    t, r, last = int(count) + 1, self.sync_every, self.lazy_steps
    if t <= last:
      if self.momentum_warmup and t % r == 0:
        return LAZY_SYNC
      return SWITCH if t == last else LAZY
    return SYNC if t % r == 0 else INNER

  def phase_index(self, count: jax.Array) -> jax.Array:
    """`PHASES.index(self.phase(count))` for a traced count."""
    t = count + 1
    on_sync = t % self.sync_every == 0
    lazy = jnp.where(
        on_sync & self.momentum_warmup, PHASES.index(LAZY_SYNC),
        jnp.where(t == self.lazy_steps, PHASES.index(SWITCH),
                  PHASES.index(LAZY)))
    after = jnp.where(on_sync, PHASES.index(SYNC), PHASES.index(INNER))
    return jnp.where(t <= self.lazy_steps, lazy, after)


# ----------------------------------------------------------------------------
# Memory spaces and shard_map types.


def _on_host(x) -> bool:
  space = getattr(jax.typeof(x), 'memory_space', None)
  return space == jax.memory.Space.Host


def to_device(tree):
  """The host-resident leaves of `tree` copied to device memory."""
  return jax.tree.map(
      lambda x: jax.device_put(x, jax.memory.Space.Device) if _on_host(x)
      else x, tree)


def _vma(x) -> tuple:
  return tuple(sorted(jax.typeof(x).manual_axis_type.varying))


def _like(new, old):
  """`new` in the memory space and with the varying axes of `old`, per leaf.

  State leaves leave the update where they came in (host or device), and
  every phase returns the same shard_map types (needed by `lax.switch`).
  """
  def one(n, o):
    n = varying(n, _vma(o))
    if _on_host(o) and not _on_host(n):
      n = jax.device_put(n, jax.memory.Space.Host)
    return n

  return jax.tree.map(one, new, old)


def offload_memory_kinds(state: DiLoCoState, host: str = HOST):
  """Memory kind per leaf of a (possibly abstract) `DiLoCoState`.

  The old model and outer momentum get `host`; every other leaf 'device'.
  `scape_jax.sharding.Layout.shardings` turns this tree into shardings.
  """
  kinds = {f: (host if f in DiLoCoState.OFFLOADED_FIELDS else DEVICE)
           for f in state._fields}
  return DiLoCoState(**{f: jax.tree.map(lambda _, k=k: k, getattr(state, f))
                        for f, k in kinds.items()})


# ----------------------------------------------------------------------------
# The phases.


class _Outer(NamedTuple):
  """The static settings of one `diloco`."""
  inner: optax.GradientTransformationExtraArgs
  lazy: Optional[optax.GradientTransformationExtraArgs]
  outer_lr: ScalarOrSchedule
  outer_momentum: ScalarOrSchedule
  warmup_momentum: float
  replica_axis: Union[None, str, Sequence[str]]


def _at(value: ScalarOrSchedule, t: jax.Array) -> jax.Array:
  """A hyperparameter at step number t (schedules take t = 1, 2, ...)."""
  return jnp.asarray(value(t) if callable(value) else value, jnp.float32)


def _local(tx, grads, state, params, extra):
  """One update of `tx`: (updates, its new state, the updated params)."""
  updates, inner = tx.update(grads, state.inner, params, **extra)
  return updates, inner, optax.apply_updates(params, updates)


def _inner_phase(o: _Outer, lazy: bool, grads, state, params, extra):
  updates, inner, _ = _local(o.lazy if lazy else o.inner, grads, state,
                             params, extra)
  return updates, state._replace(count=state.count + 1, inner=inner)


def _lazy_sync_phase(o: _Outer, accumulate: bool, grads, state, params,
                     extra):
  """A lazy-start step that then sets theta_old (and warms up M)."""
  updates, inner, theta = _local(o.lazy, grads, state, params, extra)
  momentum = state.momentum
  if accumulate:  # M <- mu0 M + (theta_t - theta_{t-r}) (Algorithm 1)
    momentum = jax.tree.map(
        lambda m, new, old: (o.warmup_momentum * m + (new - old)).astype(
            m.dtype), to_device(momentum), theta, to_device(state.old_params))
  return updates, DiLoCoState(state.count + 1, inner, theta, momentum)


def _mean_over_groups(tree, axis):
  return tree if axis is None else jax.lax.pmean(tree, axis)


def _sync_phase(o: _Outer, grads, state, params, extra):
  """An inner step, then the outer Nesterov step (Pier Alg. 2, l. 10-21)."""
  _, inner, theta_t = _local(o.inner, grads, state, params, extra)
  old, momentum = to_device(state.old_params), to_device(state.momentum)
  delta = _mean_over_groups(
      jax.tree.map(lambda new, prev: new - prev, theta_t, old),
      o.replica_axis)
  t = state.count + 1
  mu, lr = _at(o.outer_momentum, t), _at(o.outer_lr, t)
  momentum = jax.tree.map(lambda m, d: (mu * m + d).astype(m.dtype), momentum,
                          delta)
  theta = jax.tree.map(
      lambda prev, m, d: (prev + lr * (mu * m + d)).astype(prev.dtype), old,
      momentum, delta)
  updates = jax.tree.map(lambda new, p: new - p, theta, params)
  return updates, DiLoCoState(state.count + 1, inner, theta, momentum)


def _phase_fn(o: _Outer, phase: str):
  return {
      INNER: functools.partial(_inner_phase, o, False),
      LAZY: functools.partial(_inner_phase, o, True),
      LAZY_SYNC: functools.partial(_lazy_sync_phase, o, True),
      SWITCH: functools.partial(_lazy_sync_phase, o, False),
      SYNC: functools.partial(_sync_phase, o),
  }[phase]


# ----------------------------------------------------------------------------
# The transformation.


def check_outer_hypers(where: str, outer_lr, outer_momentum,
                       warmup_momentum) -> None:
  """Raises ValueError for an outer lr <= 0 or a momentum outside [0, 1)."""
  check = functools.partial(_common.check_scalar_or_schedule, where)
  check('outer_lr', outer_lr, lambda x: x > 0,
        'finite and > 0 (0 resets every sync to the old model)')
  check('outer_momentum', outer_momentum, lambda x: 0 <= x < 1, 'in [0, 1)')
  if warmup_momentum is not None:
    check('warmup_momentum', warmup_momentum, lambda x: 0 <= x < 1,
          'in [0, 1)')


def _checked_outer(inner, lazy, lazy_steps: int, outer_lr, outer_momentum,
                   warmup_momentum, replica_axis) -> _Outer:
  """`diloco`'s methods and outer hyperparameters, checked, as an `_Outer`
  (the methods taking extra keyword arguments)."""
  if lazy_steps and lazy is None:
    raise ValueError(f'diloco: lazy_steps={lazy_steps} needs the lazy-start '
                     'transformation `lazy`.')
  _common.check_transformation('diloco', 'inner', inner)
  if lazy is not None:
    _common.check_transformation('diloco', 'lazy', lazy)
  check_outer_hypers('diloco', outer_lr, outer_momentum, warmup_momentum)
  return _Outer(optax.with_extra_args_support(inner),
                None if lazy is None else optax.with_extra_args_support(lazy),
                outer_lr, outer_momentum, warmup_momentum or 0.0,
                replica_axis)


def diloco(
    inner: optax.GradientTransformation,
    sync_every: int,
    outer_lr: ScalarOrSchedule = 0.7,
    outer_momentum: ScalarOrSchedule = 0.9,
    *,
    lazy: Optional[optax.GradientTransformation] = None,
    lazy_steps: int = 0,
    warmup_momentum: Optional[float] = None,
    replica_axis: Union[None, str, Sequence[str]] = REPLICA,
) -> optax.GradientTransformationExtraArgs:
  """DiLoCo's outer loop around any inner method (and Pier's lazy start).

  Call `update` inside `shard_map` with each worker's local gradients and
  the params (required): each replica group runs `inner` on its own copy
  (its exchange over its workers), and every `sync_every`-th step the outer
  Nesterov step averages the groups' change over `replica_axis`. The
  returned updates move each group's params to the new model
  (`theta_new - params`).

  Args:
    inner: the inner method; its exchange runs over the group's workers.
    sync_every: r, steps between synchronisations (>= 1).
    outer_lr: the outer learning rate, or a schedule of the step number t
      (1, 2, ...) of the synchronising step.
    outer_momentum: the outer Nesterov momentum mu in [0, 1), or a schedule
      of t.
    lazy: Pier's lazy start: the inner method with its exchange over every
      worker (e.g. over ('replica', 'data')); its state must have the
      structure of `inner`'s, which continues from it after the switch.
    lazy_steps: L; steps t <= L run `lazy`. 0: no lazy start.
    warmup_momentum: mu0 of Pier's momentum warmup: every r lazy steps
      M <- mu0 M + (theta_t - theta_{t-r}). None: no warmup.
    replica_axis: the mesh axis (or axes) over the replica groups; None for a
      single group outside `shard_map`.

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is
    `DiLoCoState`. `update` takes the static keyword `phase`, one of
    `PHASES` (`SyncSchedule.phase` of the state's count); given, the
    step holds that phase's computation and collectives only. Without it all
    phases are compiled into one `lax.switch` on the count, and offloaded
    state is copied to the device every step. Other keywords go to `inner`.

  References:
    DiLoCo (Douillard et al., 2023); Pier, Algorithms 1-2;
    `docs/design.md`, "DiLoCo and Pier".
  """
  schedule = SyncSchedule(sync_every, lazy_steps, warmup_momentum is not None)
  o = _checked_outer(inner, lazy, lazy_steps, outer_lr, outer_momentum,
                     warmup_momentum, replica_axis)

  def init_fn(params):
    inner_state = o.inner.init(params)
    if o.lazy is not None:
      _check_same_structure(inner_state, jax.eval_shape(o.lazy.init, params))
    return DiLoCoState(
        count=jnp.zeros([], jnp.int32), inner=inner_state,
        old_params=jax.tree.map(jnp.copy, params),
        momentum=jax.tree.map(jnp.zeros_like, params))

  def update_fn(updates, state, params=None, *, phase=None, **extra):
    if params is None:
      raise ValueError('diloco: update needs params (the outer step moves '
                       'every group to the new model).')
    if phase is not None:
      if phase not in schedule.phases:
        raise ValueError(f'diloco: phase={phase!r}; allowed with this '
                         f'schedule: {schedule.phases}.')
      new_updates, new_state = _phase_fn(o, phase)(updates, state, params,
                                                   extra)
      return _like(new_updates, params), _like(new_state, state)
    return _switch(o, schedule, updates, state, params, extra)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _switch(o: _Outer, schedule: SyncSchedule, grads, state, params, extra):
  """Every phase in one `lax.switch` on the count (no static phase given)."""
  on_device = state._replace(old_params=to_device(state.old_params),
                             momentum=to_device(state.momentum))

  def branch(phase):
    def run(g, s, p):
      new_updates, new_state = _phase_fn(o, phase)(g, s, p, extra)
      return _like(new_updates, p), _like(new_state, s)
    return run

  index = schedule.phase_index(state.count)
  available = [p if p in schedule.phases else INNER for p in PHASES]
  new_updates, new_state = jax.lax.switch(
      index, [branch(p) for p in available], grads, on_device, params)
  return new_updates, _like(new_state, state)


def _check_same_structure(inner_state, lazy_state) -> None:
  a = jax.tree.map(lambda x: (x.shape, x.dtype), inner_state)
  b = jax.tree.map(lambda x: (x.shape, x.dtype), lazy_state)
  if jax.tree.structure(a) != jax.tree.structure(b) or a != b:
    raise ValueError(
        'diloco: the lazy-start transformation must have the state of the '
        'inner one (the groups continue from it after the switch); got '
        f'{jax.tree.structure(b)} vs {jax.tree.structure(a)}.')
