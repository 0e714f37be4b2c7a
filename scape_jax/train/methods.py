"""The method registry: one config line (`optimizer.name`) -> one optimizer.

Each method declares, in one `MethodSpec` registered here:

* `section`: its config section, a dataclass of its own keys, set in a config
  file as `optimizer = dict(name='scape', scape=dict(density=0.01))` or on the
  command line as `--config.optimizer.scape.density=0.01`;
* `build`: how its optax transformation is made from the common optimizer
  keys, its section and the learning-rate schedule, and which static keyword
  arguments `tx.update` takes at each step (SCAPE's density level; later
  Radius's dense/sparse step and DiLoCo's inner/outer step). Each distinct
  value is one compiled program;
* `supports_fsdp` and `per_replica`: the parameter layouts it runs on
  (`scape_jax.sharding.Layout`);
* `stats`: what it reports in the metrics besides loss and gradient norm.

Every method is called inside `shard_map` with each worker's local gradients
and owns the data-parallel exchange over `Context.axis_name`. See
docs/design.md, "Adding a method".
"""

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import optax

from scape_jax.comm import collectives
from scape_jax.optim import _adams as adams_lib
from scape_jax.optim import _scape as scape_lib
from scape_jax.sharding.mesh import DATA, FSDP

DECAYS = ('cosine', 'constant')  # Learning-rate schedules after warmup.


@dataclasses.dataclass(frozen=True)
class Context:
  """What building a method needs to know about the layout."""
  axis_name: Optional[str] = DATA  # the data-parallel exchange axis
  fsdp: bool = False  # parameters and gradients split over 'fsdp'


class Built(NamedTuple):
  """A method's transformation and its per-step static arguments."""
  tx: optax.GradientTransformation
  # step (updates completed) -> static keyword arguments of `tx.update`.
  static_args: Optional[Callable[[int], dict]] = None


@dataclasses.dataclass(frozen=True)
class MethodSpec:
  """One registry entry (see the module docstring)."""
  name: str
  build: Callable[[Any, Any, optax.Schedule, Context], Built]
  section: Optional[type] = None
  supports_fsdp: bool = False
  per_replica: bool = False
  stats: Callable[[Any], dict] = lambda opt_state: {}
  summary: str = ''  # one line for `--help`-style listings


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

  @property
  def name(self) -> str:
    return self.spec.name

  def update_kwargs(self, step: int) -> dict:
    """Static keyword arguments of the update after `step` updates."""
    return {} if self.static_args is None else self.static_args(step)

  def stats(self, opt_state) -> dict:
    return self.spec.stats(opt_state)


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
  built = spec.build(cfg, section, lr, ctx)
  return Method(spec, built.tx, lr, built.static_args)


# ----------------------------------------------------------------------------
# Dense methods: the mean gradient over the data axis, clip, then the update.


def _clip(cfg, ctx: Context) -> list:
  if cfg.clip_norm <= 0:
    return []
  return [collectives.clip_by_global_norm(cfg.clip_norm,
                                          FSDP if ctx.fsdp else None)]


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


register(MethodSpec('adamw', _build_adamw, supports_fsdp=True,
                    summary='dense AdamW (optax), the reference baseline'))
register(MethodSpec('adams', _build_adams, supports_fsdp=True,
                    summary='dense AdamS: Adam normalised by its momentum'))


# ----------------------------------------------------------------------------
# SCAPE.


@dataclasses.dataclass(slots=True)
class ScapeConfig:
  density: float = 0.01  # Fraction of each compressed leaf sent, in (0, 1].
  density_warmup_steps: int = 0  # Exponential warmup from density 1.
  mask_encoding: str = 'auto'  # One of comm.masks.ENCODINGS.
  variant: str = 'faithful'  # 'faithful' (Alg. 1) or 'fresh' (docs/design.md).


def _build_scape(cfg, section: ScapeConfig, lr, ctx) -> Built:
  schedule = scape_lib.DensitySchedule(section.density,
                                       section.density_warmup_steps)
  tx = scape_lib.scape(
      lr, density=schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
      weight_decay=cfg.weight_decay,
      clip_norm=cfg.clip_norm if cfg.clip_norm > 0 else None,
      axis_name=ctx.axis_name, mask_encoding=section.mask_encoding,
      variant=section.variant)
  return Built(tx, lambda step: {'density_level': schedule.level(step)})


register(MethodSpec('scape', _build_scape, section=ScapeConfig,
                    stats=scape_lib.scape_stats,
                    summary='AdamS with a top-k sparsified, error-fed first '
                    'moment (SCAPE Algorithm 1)'))
