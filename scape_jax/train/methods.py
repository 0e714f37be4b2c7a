"""The method registry: one config line (`optimizer.name`) -> one optimizer.

Each method declares, in one `MethodSpec` registered here:

* `section`: its config section, a dataclass of its own keys, set in a config
  file as `optimizer = dict(name='scape', scape=dict(density=0.01))` or on the
  command line as `--config.optimizer.scape.density=0.01`;
* `build`: how its optax transformation is made from the common optimizer
  keys, its section and the learning-rate schedule, and which static keyword
  arguments `tx.update` takes at each step (SCAPE's density level, Radius's
  step kind, DiLoCo's phase): each distinct value is one compiled program;
* `supports_fsdp` and `per_replica`: the parameter layouts it runs on
  (`scape_jax.sharding.Layout`);
* `stats`: what it reports in the metrics besides loss and gradient norm.

Every method is called inside `shard_map` with each worker's local gradients
and owns the data-parallel exchange over `Context.axis_name`. See
docs/design.md, "Adding a method".
"""

import dataclasses
import fractions
import functools
import math
from typing import Any, Callable, NamedTuple, Optional

import jax
import optax

from scape_jax import outer as outer_lib
from scape_jax.comm import collectives
from scape_jax.optim import _adams as adams_lib
from scape_jax.optim import _demo as demo_lib
from scape_jax.optim import _interleave as interleave_lib
from scape_jax.optim import _radius as radius_lib
from scape_jax.optim import _replica as replica_lib
from scape_jax.optim import _scape as scape_lib
from scape_jax.optim import _scape_dist as scape_dist_lib
from scape_jax.optim import _scape_local_adam as scape_local_adam_lib
from scape_jax.optim._common import compress_except
from scape_jax.comm.axes import DATA, FSDP_AXES, REPLICA
from scape_jax.sharding import memory as sharding_memory

DECAYS = ('cosine', 'constant')  # Learning-rate schedules after warmup.


@dataclasses.dataclass(frozen=True)
class Context:
  """What building a method needs to know about the layout and the run."""
  axis_name: Any = DATA  # the data-parallel exchange axis (or axes)
  fsdp: bool = False  # parameters and gradients split over the fsdp group
  total_steps: int = 1  # steps in the run (schedules in fractions of it)
  matrices: Any = None  # params -> bools: the leaves of rank >= 2 (or ndim)


class Built(NamedTuple):
  """A method's transformation and its per-step static arguments."""
  tx: optax.GradientTransformation
  # step (updates completed) -> static keyword arguments of `tx.update`.
  static_args: Optional[Callable[[int], dict]] = None
  # (abstract) opt_state -> its memory kind per leaf ('device',
  # 'pinned_host'); None: every leaf in device memory.
  memory_kinds: Optional[Callable[[Any], Any]] = None
  # opt_state -> the statistics to log; None: the spec's `stats`.
  stats: Optional[Callable[[Any], dict]] = None
  # count -> what the state after `count` updates holds that the schedule
  # chose (SCAPE: the density of its next masks); a run resumed under a
  # changed config must find the same (`resume`). None: nothing.
  state_key: Optional[Callable[[int], dict]] = None


@dataclasses.dataclass(frozen=True)
class MethodSpec:
  """One registry entry (see the module docstring)."""
  name: str
  build: Callable[[Any, Any, optax.Schedule, Context], Built]
  section: Optional[type] = None
  supports_fsdp: bool = False
  per_replica: bool = False
  dense: bool = False  # its exchange: the dense mean over any mesh axes
  stats: Callable[[Any], dict] = lambda opt_state: {}
  summary: str = ''  # one line for `--help`-style listings
  # (common keys, its section, total steps) -> a message per setting that
  # has no effect when this method is selected (a mistake; `no_effect`).
  no_effect: Optional[Callable[[Any, Any, int], list]] = None
  # Common optimizer keys this method does not read (noted at start), why.
  unread: tuple = ()
  unread_why: str = ''


REGISTRY: dict = {}


def register(spec: MethodSpec) -> MethodSpec:
  if spec.name in REGISTRY:
    raise ValueError(f'method {spec.name!r} is already registered')
  REGISTRY[spec.name] = spec
  return spec


def names() -> tuple:
  """The allowed values of `optimizer.name`."""
  return tuple(REGISTRY)


def get(name: str) -> MethodSpec:
  if name not in REGISTRY:
    raise ValueError(f'optimizer.name={name!r}; allowed: '
                     f'{", ".join(names())}.')
  return REGISTRY[name]


@dataclasses.dataclass(frozen=True)
class Method:
  """A built method: what the train loop drives."""
  spec: MethodSpec
  tx: optax.GradientTransformation
  learning_rate: optax.Schedule
  static_args: Optional[Callable[[int], dict]] = None
  memory_kinds: Optional[Callable[[Any], Any]] = None  # see `Built`
  stats_fn: Optional[Callable[[Any], dict]] = None  # `Built.stats`
  state_key_fn: Optional[Callable[[int], dict]] = None  # `Built.state_key`

  @property
  def name(self) -> str:
    return self.spec.name

  def update_kwargs(self, step: int) -> dict:
    """Static keyword arguments of the update after `step` updates."""
    return {} if self.static_args is None else self.static_args(step)

  def stats(self, opt_state) -> dict:
    return (self.stats_fn or self.spec.stats)(opt_state)

  def state_key(self, count: int) -> dict:
    """`Built.state_key` after `count` updates ({} if the method has none)."""
    return {} if self.state_key_fn is None else self.state_key_fn(count)


def selected(cfg) -> list:
  """[(spec, section)] of the method `cfg.name` and, for an outer
  method, its inner method."""
  spec = get(cfg.name)
  chosen = [(spec, getattr(cfg, spec.name) if spec.section else None)]
  inner = getattr(chosen[0][1], 'inner', None)
  if spec.per_replica and inner in REGISTRY:
    own = REGISTRY[inner]
    chosen.append((own, getattr(cfg, own.name) if own.section else None))
  return chosen


def changed(obj, name: str) -> bool:
  """Whether dataclass `obj`'s field `name` differs from its default."""
  field = {f.name: f for f in dataclasses.fields(obj)}[name]
  return getattr(obj, name) != field.default


def no_effect(cfg, total_steps: int) -> list:
  """A message per setting of the selected method(s) that would have no
  effect in a run of `total_steps` (e.g. a sync period longer than the
  run): such a run trains something other than what was asked."""
  problems = []
  if cfg.decay == 'constant' and changed(cfg, 'min_lr_ratio'):
    problems.append(f'optimizer.min_lr_ratio={cfg.min_lr_ratio} has no effect '
                    "with optimizer.decay='constant'")
  for spec, section in selected(cfg):
    if spec.no_effect:
      problems += [f'optimizer.{spec.name}.{message}' for message in
                   spec.no_effect(cfg, section, total_steps)]
  return problems


def unread_notes(cfg) -> list:
  """A line per common key set away from its default that the selected
  method does not read (config files share them across methods)."""
  notes = []
  for spec, _ in selected(cfg):
    keys = [f'optimizer.{k}={getattr(cfg, k)}' for k in spec.unread
            if changed(cfg, k)]
    if keys:
      notes.append(f'optimizer.name={spec.name!r} does not read '
                   f'{", ".join(keys)} ({spec.unread_why})')
  return notes


def schedule_notes(cfg, total_steps: int) -> list:
  """A line when the lr warmup is not shorter than the run (it is cut)."""
  if cfg.warmup_steps < total_steps:
    return []
  return [f'optimizer.warmup_steps={cfg.warmup_steps} is not shorter than '
          f'the run (steps={total_steps}): the learning rate warms up over '
          f'{max(total_steps - 1, 0)} steps instead and reaches optimizer.lr '
          'at the last one']


def learning_rate(cfg, total_steps: int) -> optax.Schedule:
  """Linear warmup from 0, then cosine decay to `min_lr_ratio * lr` or flat."""
  warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
  if cfg.decay == 'constant':
    return optax.join_schedules(
        [optax.linear_schedule(0.0, cfg.lr, warmup), optax.constant_schedule(
            cfg.lr)], [warmup])
  return optax.warmup_cosine_decay_schedule(
      0.0, cfg.lr, warmup, max(total_steps, warmup + 1),
      end_value=cfg.lr * cfg.min_lr_ratio)


def build(cfg, total_steps: int, ctx: Context = Context()) -> Method:
  """The method named by `cfg.name` (an `OptimizerConfig`)."""
  spec = get(cfg.name)
  section = getattr(cfg, spec.name) if spec.section else None
  lr = learning_rate(cfg, total_steps)
  built = spec.build(cfg, section, lr,
                     dataclasses.replace(ctx, total_steps=total_steps))
  return Method(spec, built.tx, lr, built.static_args, built.memory_kinds,
                built.stats, built.state_key)


# ----------------------------------------------------------------------------
# Dense methods: the mean gradient over the data axis, clip, then the update.


def _clip(cfg, ctx: Context) -> list:
  if cfg.clip_norm <= 0:
    return []
  return [collectives.clip_by_global_norm(cfg.clip_norm,
                                          FSDP_AXES if ctx.fsdp else None)]


def _build_adamw(cfg, section, lr, ctx) -> Built:
  del section
  return Built(optax.chain(
      collectives.pmean_gradients(ctx.axis_name), *_clip(cfg, ctx),
      optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                  weight_decay=cfg.weight_decay)))


def _build_adams(cfg, section, lr, ctx) -> Built:
  del section
  return Built(optax.chain(
      collectives.pmean_gradients(ctx.axis_name), *_clip(cfg, ctx),
      adams_lib.adams(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                      weight_decay=cfg.weight_decay)))


register(MethodSpec('adamw', _build_adamw, supports_fsdp=True, dense=True,
                    summary='dense AdamW (optax), the reference baseline'))
register(MethodSpec('adams', _build_adams, supports_fsdp=True, dense=True,
                    summary='dense AdamS: Adam normalised by its momentum'))


# ----------------------------------------------------------------------------
# SCAPE.


@dataclasses.dataclass(slots=True)
class ScapeConfig:
  density: float = 0.01  # Fraction of each compressed leaf sent, in (0, 1].
  density_warmup_steps: int = 0  # Exponential warmup from density 1.
  density_levels: int = 8  # Warmup levels (>= 2), one program each, or
  shared_warmup: bool = False  # one for the sparse ones before the last.
  mask_encoding: str = 'auto'  # One of comm.masks.ENCODINGS.
  select: str = 'auto'  # Top-k of the next mask, one of comm.topk.SELECTS.
  offload: bool = False  # The residual in host memory between steps.
  offload_kind: str = sharding_memory.HOST  # Its memory kind when offloaded.
  distributed: bool = False  # Algorithm 2: m split over the workers.
  # An authoritative fp32 copy of the parameters in the state (offloaded with
  # offload=True); the step's parameters (model.param_dtype) are its cast.
  fp32_replica: bool = False
  payload_dtype: str = 'float32'  # On the wire: also bfloat16, float16.
  offset_bits: str = '32'  # Offsets on the wire: '32', '16' or 'auto'.
  local_adam: bool = False  # Per-worker Adam (`scape_local_adam`).
  # Comma-separated parts of parameter paths ('embed_tokens'; '' none): leaves
  # sent whole every step, as norms and biases are; leaves whose entries are
  # dealt round-robin over the chunks (optim._interleave).
  dense_leaves: str = ''
  interleaved_leaves: str = ''


def _build_scape(cfg, section: ScapeConfig, lr, ctx) -> Built:
  schedule = scape_lib.DensitySchedule(
      section.density, section.density_warmup_steps, section.density_levels,
      section.shared_warmup)
  alias, wire = _scape_alias(section)
  tx = alias(
      lr, density=schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
      weight_decay=cfg.weight_decay,
      clip_norm=cfg.clip_norm if cfg.clip_norm > 0 else None,
      axis_name=ctx.axis_name, compress=compress_except(
          section.dense_leaves.split(','), 'optimizer.scape.dense_leaves',
          ctx.matrices),
      mask_encoding=section.mask_encoding,
      select=section.select, **wire)
  tx = interleave_lib.interleave_named(
      tx, section.interleaved_leaves, ctx.axis_name,
      distributed=section.distributed)
  if section.fp32_replica:
    tx = replica_lib.with_fp32_replica(tx)
  kinds = (functools.partial(sharding_memory.offload_memory_kinds,
                             kind=section.offload_kind)
           if section.offload else None)
  return Built(tx, schedule.update_kwargs, kinds,
               state_key=lambda count: {  # the masks' density
                   'density': schedule.levels[schedule.level(count)]})


def _scape_alias(section: ScapeConfig) -> tuple:
  """(alias, its wire's options): Algorithm 1, Algorithm 2 (`distributed`:
  fp32 values and int32 offsets only) or per-worker Adam (fp32 values)."""
  wire = {'payload_dtype': section.payload_dtype,
          'offset_bits': section.offset_bits}
  if section.local_adam and section.distributed:
    raise ValueError('optimizer.scape.local_adam=True with distributed=True: '
                     'Algorithm 2 splits the first moment, which local_adam '
                     'keeps per worker; allowed: one of them.')
  if section.local_adam:
    if section.payload_dtype != 'float32':
      raise ValueError(
          'optimizer.scape.local_adam=True sends float32 values; got '
          f"payload_dtype={section.payload_dtype!r} (allowed: 'float32')")
    return scape_local_adam_lib.scape_local_adam, {
        'offset_bits': section.offset_bits}
  if not section.distributed:
    return scape_lib.scape, wire
  if (section.payload_dtype, str(section.offset_bits)) != ('float32', '32'):
    raise ValueError(
        'optimizer.scape.distributed=True sends fp32 values and int32 '
        f'offsets only; got payload_dtype={section.payload_dtype!r}, '
        f'offset_bits={section.offset_bits!r} (allowed with distributed: '
        "'float32' and '32')")
  return scape_dist_lib.scape_dist, {}


def _scape_no_effect(cfg, section: ScapeConfig, total_steps: int) -> list:
  del cfg, total_steps
  problems = []
  if not section.offload and changed(section, 'offload_kind'):
    problems.append(f'offload_kind={section.offload_kind!r} has no effect '
                    'with offload=False')
  if section.offload and section.offload_kind == sharding_memory.DEVICE:
    problems.append("offload_kind='device' keeps the residual in device "
                    'memory: set offload=False, or a host memory kind '
                    f'({sharding_memory.HOST!r})')
  for name in ('density_levels', 'shared_warmup'):
    if section.density_warmup_steps == 0 and changed(section, name):
      problems.append(f'{name}={getattr(section, name)} has no effect with '
                      'density_warmup_steps=0 (no warmup: one level)')
  return problems


register(MethodSpec('scape', _build_scape, section=ScapeConfig,
                    stats=lambda s: (
                        scape_lib.scape_stats(s) or
                        scape_local_adam_lib.scape_local_adam_stats(s) or
                        scape_dist_lib.scape_dist_stats(s)),
                    no_effect=_scape_no_effect,
                    summary='AdamS with a top-k sparsified, error-fed first '
                    'moment (SCAPE Algorithm 1)'))


# ----------------------------------------------------------------------------
# Radius.


@dataclasses.dataclass(slots=True)
class RadiusConfig:
  # Fraction of each compressed leaf sent on sparse steps, in (0, 1].
  density: float = radius_lib.DENSITY
  # T: steps between resamples of the shared masks, >= 1.
  interval: int = radius_lib.INTERVAL
  # In [0, 1]: steps before threshold = ceil(dense_fraction * steps) are dense.
  dense_fraction: float = radius_lib.DENSE_FRACTION
  # r >= 0: each selected index i is widened to [i - r, i + r].
  index_radius: int = 0
  select: str = 'auto'  # Top-k at a resample, one of comm.topk.SELECTS.


def _radius_threshold(dense_fraction: float, total_steps: int) -> int:
  if not 0.0 <= dense_fraction <= 1.0:
    raise ValueError(f'dense_fraction={dense_fraction!r} must be in [0, 1].')
  return math.ceil(fractions.Fraction(repr(float(dense_fraction))) *
                   total_steps)


def _build_radius(cfg, section: RadiusConfig, lr, ctx) -> Built:
  schedule = radius_lib.RadiusSchedule(
      section.interval,
      _radius_threshold(section.dense_fraction, ctx.total_steps))
  tx = radius_lib.radius(
      lr, density=section.density, interval=schedule.interval,
      threshold=schedule.threshold, index_radius=section.index_radius,
      select=section.select,
      b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
      clip_norm=cfg.clip_norm if cfg.clip_norm > 0 else None,
      axis_name=ctx.axis_name, compress=ctx.matrices)
  return Built(tx, lambda count: {'step_kind': schedule.kind(count)},
               state_key=lambda count: {  # masks chosen, residual in use
                   'resampled': count >= schedule.first_resample})


def _radius_no_effect(cfg, section: RadiusConfig, total_steps: int) -> list:
  del cfg
  schedule = radius_lib.RadiusSchedule(
      section.interval, _radius_threshold(section.dense_fraction, total_steps))
  first = schedule.first_resample
  if first < total_steps and section.interval > 1:
    return []  # step first + 1 is sparse
  if first > total_steps:
    why = (f'every one of the {total_steps} steps is dense (the first '
           f'resample would be step {first})')
  elif section.interval == 1:
    why = 'every step from the first resample on resamples (a dense step)'
  else:
    why = (f'the first resample is the last step, {first}, and its masks '
           'are never used')
  return [f'interval={section.interval}, dense_fraction='
          f'{section.dense_fraction}: no step is sparse: {why}, so density, '
          'index_radius and select have no effect; lower dense_fraction, or '
          'choose an interval between 2 and the steps']


register(MethodSpec('radius', _build_radius, section=RadiusConfig,
                    no_effect=_radius_no_effect,
                    stats=radius_lib.radius_stats,
                    summary='AdamW on a top-k sparsified all-reduce with '
                    'masks shared by every worker (Radius)'))


# ----------------------------------------------------------------------------
# DeMo.


@dataclasses.dataclass(slots=True)
class DemoConfig:
  beta: float = demo_lib.BETA  # Momentum decay in [0, 1): m <- beta m + g.
  # Chunk side per dimension; each uses its largest divisor <= chunk.
  chunk: int = demo_lib.CHUNK
  topk: int = demo_lib.TOPK  # DCT coefficients sent per chunk, [1, chunk**2].


def _build_demo(cfg, section: DemoConfig, lr, ctx) -> Built:
  return Built(demo_lib.demo(
      lr, beta=section.beta, chunk=section.chunk, topk=section.topk,
      weight_decay=cfg.weight_decay, axis_name=ctx.axis_name))


register(MethodSpec('demo', _build_demo, section=DemoConfig,
                    unread=('b1', 'b2', 'eps', 'clip_norm'),
                    unread_why='its momentum decay is optimizer.demo.beta '
                    'and its update a sign: docs/design.md, "DeMo: choices '
                    'pinned down"',
                    stats=demo_lib.demo_stats,
                    summary='decoupled per-worker momentum synchronized '
                    'through top-k DCT coefficients, sign update (DeMo)'))


# ----------------------------------------------------------------------------
# Outer methods: an inner method per replica group, synchronised every r
# steps (DiLoCo, Pier). The inner method is any method above, set up by the
# common keys and its own section.


@dataclasses.dataclass(slots=True)
class DiLoCoConfig:
  inner: str = 'adamw'  # The inner method: a registered name, not an outer.
  sync_every: int = 50  # r: steps between synchronisations, >= 1.
  outer_lr: float = 0.7  # Outer learning rate (DiLoCo's 0.7).
  outer_momentum: float = 0.9  # Outer Nesterov momentum, in [0, 1).
  offload: bool = False  # Old model and outer momentum in pinned host memory.


@dataclasses.dataclass(slots=True)
class PierConfig:
  inner: str = 'adamw'  # The inner method; dense (adamw, adams) if lazy.
  sync_every: int = 50  # r: steps between synchronisations, >= 1.
  lazy_start: float = 0.1  # p in [0, 1): data-parallel over all; 0: none.
  momentum_warmup: bool = True  # M <- 0.9 M + delta every r lazy steps.
  momentum_decay: bool = True  # mu 0.99, 0.95, 0.9; off: outer_momentum.
  outer_lr_schedule: bool = True  # 0 -> 1, 1.1, 0.9; off: outer_lr.
  outer_momentum: float = 0.9  # Outer momentum when momentum_decay is off.
  outer_lr: float = 0.7  # Outer lr when outer_lr_schedule is off.
  offload: bool = True  # Old model and outer momentum in pinned host memory.


def _inner_method(cfg, section, lr, ctx, lazy: bool) -> tuple:
  """(inner Built, lazy-start Built or None) of an outer method's section."""
  spec = REGISTRY.get(section.inner)
  if spec is None or spec.per_replica:
    raise ValueError(
        f'inner={section.inner!r} is not an inner method; allowed: '
        f'{", ".join(n for n, s in REGISTRY.items() if not s.per_replica)}.')
  if lazy and not spec.dense:
    raise ValueError(
        f'inner={section.inner!r}: the lazy start runs the inner method '
        'data-parallel over all workers, which needs a dense one ('
        f'{", ".join(n for n, s in REGISTRY.items() if s.dense)}); or set '
        'lazy_start=0.')
  own = getattr(cfg, spec.name) if spec.section else None
  inner = spec.build(cfg, own, lr, ctx)
  inner = inner._replace(stats=inner.stats or spec.stats)
  lazy_built = spec.build(cfg, own, lr, dataclasses.replace(
      ctx, axis_name=(REPLICA, ctx.axis_name))) if lazy else None
  return inner, lazy_built


def _outer_built(tx, schedule, inner: Built, offload: bool) -> Built:
  def static_args(count: int) -> dict:
    extra = inner.static_args(count) if inner.static_args else {}
    return dict(extra, phase=schedule.phase(count))

  def state_key(count: int) -> dict:  # each group's own since the switch
    extra = inner.state_key(count) if inner.state_key else {}
    return dict(extra, lazy=count < schedule.lazy_steps)

  return Built(tx, static_args, _outer_memory_kinds(offload,
                                                     inner.memory_kinds),
               inner.stats, state_key)


def _outer_memory_kinds(offload: bool, inner_kinds):
  """An outer state's memory kinds: its own offload, and the inner
  method's (SCAPE's offloaded residual) on its inner state."""
  if inner_kinds is None:
    return outer_lib.offload_memory_kinds if offload else None

  def kinds(state):
    own = (outer_lib.offload_memory_kinds(state) if offload else
           jax.tree.map(lambda _: sharding_memory.DEVICE, state))
    return own._replace(inner=inner_kinds(state.inner))

  return kinds


def _build_diloco(cfg, section: DiLoCoConfig, lr, ctx) -> Built:
  inner, _ = _inner_method(cfg, section, lr, ctx, lazy=False)
  tx = outer_lib.diloco(inner.tx, section.sync_every, section.outer_lr,
                        section.outer_momentum)
  return _outer_built(tx, outer_lib.SyncSchedule(section.sync_every), inner,
                      section.offload)


def _build_pier(cfg, section: PierConfig, lr, ctx) -> Built:
  steps = ctx.total_steps
  lazy_steps = outer_lib.lazy_start_steps(section.lazy_start, steps)
  inner, lazy = _inner_method(cfg, section, lr, ctx, lazy=lazy_steps > 0)
  tx = outer_lib.pier(
      inner.tx, lazy.tx if lazy else None, steps, section.sync_every,
      lazy_start=section.lazy_start,
      momentum_warmup=section.momentum_warmup,
      outer_momentum=(None if section.momentum_decay
                      else section.outer_momentum),
      outer_lr=None if section.outer_lr_schedule else section.outer_lr)
  schedule = outer_lib.sync_schedule(steps, section.sync_every,
                                     section.lazy_start,
                                     section.momentum_warmup)
  return _outer_built(tx, schedule, inner, section.offload)


def _no_sync(section, total_steps: int) -> list:
  if section.sync_every <= total_steps:
    return []
  return [f'sync_every={section.sync_every} > steps={total_steps}: the '
          'replica groups would never synchronise (each trains alone on its '
          'share of the data, and group 0 is evaluated and saved); lower '
          'sync_every']


def _diloco_no_effect(cfg, section: DiLoCoConfig, total_steps: int) -> list:
  del cfg
  return _no_sync(section, total_steps)


def _pier_no_effect(cfg, section: PierConfig, total_steps: int) -> list:
  del cfg
  problems = _no_sync(section, total_steps)
  lazy = outer_lib.lazy_start_steps(section.lazy_start, total_steps)
  r = section.sync_every
  if not problems and lazy and (lazy // r + 1) * r > total_steps:
    problems.append(
        f'lazy_start={section.lazy_start}, sync_every={r}: no sync after '
        f'the lazy start (steps 1-{lazy} of {total_steps}), so the groups '
        'train apart to the end and group 0 is evaluated and saved; lower '
        'lazy_start or sync_every')
  for key, switch in (('outer_momentum', 'momentum_decay'),
                      ('outer_lr', 'outer_lr_schedule')):
    if getattr(section, switch) and changed(section, key):
      problems.append(f'{key}={getattr(section, key)} has no effect while '
                      f'{switch}=True (its schedule sets it); set {switch}='
                      'False to use it')
  return problems


register(MethodSpec('diloco', _build_diloco, section=DiLoCoConfig,
                    per_replica=True, no_effect=_diloco_no_effect,
                    summary='DiLoCo: an inner method per replica group, an '
                    'outer Nesterov step every sync_every steps'))
register(MethodSpec('pier', _build_pier, section=PierConfig,
                    per_replica=True, no_effect=_pier_no_effect,
                    summary='Pier: DiLoCo with a lazy start, momentum warmup '
                    'and decay, an outer lr schedule and host offload'))
