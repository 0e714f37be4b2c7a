"""One config line -> one optimizer: every method as an optax transformation.

Each method is called inside `shard_map` with each worker's local gradients
and owns the data-parallel exchange: dense methods start with
`pmean_gradients`, SCAPE does its sparse exchange itself.
"""

import dataclasses
from typing import Optional

import optax

from scape_jax.adams import adams, pmean_gradients
from scape_jax.config import OptimizerConfig
from scape_jax.scape import DensitySchedule, scape


@dataclasses.dataclass(frozen=True)
class Method:
  """An optimizer plus what the train loop needs to drive it."""
  name: str
  tx: optax.GradientTransformation
  learning_rate: optax.Schedule
  density: Optional[DensitySchedule] = None  # SCAPE: static level per step.

  def level(self, step: int) -> Optional[int]:
    """The static `density_level` of the update after `step` updates."""
    return None if self.density is None else self.density.level(step)

  def update_kwargs(self, step: int) -> dict:
    level = self.level(step)
    return {} if level is None else {'density_level': level}


def learning_rate(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
  """Linear warmup from 0, then cosine decay to `min_lr_ratio * lr` or flat."""
  warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
  if cfg.decay == 'constant':
    return optax.join_schedules(
        [optax.linear_schedule(0.0, cfg.lr, warmup), optax.constant_schedule(
            cfg.lr)], [warmup])
  return optax.warmup_cosine_decay_schedule(
      0.0, cfg.lr, warmup, max(total_steps, warmup + 1),
      end_value=cfg.lr * cfg.min_lr_ratio)


def build(cfg: OptimizerConfig, total_steps: int,
          axis_name: Optional[str] = 'data') -> Method:
  """The method named by `cfg.name`, exchanging over `axis_name`."""
  lr = learning_rate(cfg, total_steps)
  clip = cfg.clip_norm if cfg.clip_norm > 0 else None
  dense_clip = [optax.clip_by_global_norm(clip)] if clip else []
  if cfg.name == 'adamw':
    tx = optax.chain(pmean_gradients(axis_name), *dense_clip,
                     optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                                 weight_decay=cfg.weight_decay))
    return Method(cfg.name, tx, lr)
  if cfg.name == 'adams':
    tx = optax.chain(pmean_gradients(axis_name), *dense_clip,
                     adams(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                           weight_decay=cfg.weight_decay))
    return Method(cfg.name, tx, lr)
  if cfg.name == 'scape':
    tx = scape(lr, density=cfg.density, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
               weight_decay=cfg.weight_decay, clip_norm=clip,
               axis_name=axis_name,
               density_warmup_steps=cfg.density_warmup_steps,
               mask_encoding=cfg.mask_encoding)
    return Method(cfg.name, tx, lr,
                  DensitySchedule(cfg.density, cfg.density_warmup_steps))
  raise ValueError(f'optimizer.name={cfg.name!r}; allowed: adamw, adams, '
                   'scape.')
