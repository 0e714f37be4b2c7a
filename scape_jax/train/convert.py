"""Restoring a SCAPE checkpoint saved in the other mode (Algorithm 1 <->
the distributed-optimizer mode, `optimizer.scape.distributed`).

The two states hold the same numbers in different layouts (m whole or cut
into the workers' chunks; the residual whole or in a local and a
synchronized part), so a checkpoint of one restores into the other: it is
read with the other mode's layout and converted (`optim.scape_to_dist`,
`optim.dist_to_scape`). Anything else that differs (another data-axis size,
`fp32_replica`, the model) is not converted, and the error says so.
"""

import dataclasses

import jax
import optax

from scape_jax.optim import _memory
from scape_jax.optim import _scape
from scape_jax.optim import _scape_dist
from scape_jax.train.checkpoint import (CheckpointError, Checkpointer,
                                        CorruptCheckpointError)


def _is_scape_state(x) -> bool:
  return isinstance(x, (_scape.ScaleByScapeState,
                        _scape_dist.ScaleByScapeDistState))


def _flipped(cfg):
  """`cfg` with `optimizer.scape.distributed` negated."""
  section = cfg.optimizer.scape
  optimizer = dataclasses.replace(cfg.optimizer, scape=dataclasses.replace(
      section, distributed=not section.distributed))
  return dataclasses.replace(cfg, optimizer=optimizer)


def _compressed(state):
  """The `compress` tree a SCAPE state was made with: its dense leaves hold
  `optax.MaskedNode()` in `mask` (`dense_leaves`, a scanned model's stacked
  norm scales: not the default rank rule)."""
  return jax.tree.map(lambda m: not isinstance(m, optax.MaskedNode),
                      state.mask,
                      is_leaf=lambda m: isinstance(m, optax.MaskedNode))


def convert_opt_state(opt_state, params, to_dist: bool):
  """Every SCAPE state inside `opt_state` converted to the other mode."""
  convert = _scape_dist.scape_to_dist if to_dist else _scape_dist.dist_to_scape
  return jax.tree.map(
      lambda s: convert(s, params, _compressed(s)) if _is_scape_state(s)
      else s, opt_state, is_leaf=_is_scape_state)


def converts_modes(optimizer_name: str) -> bool:
  """Whether a checkpoint of the other SCAPE mode is converted on restore
  for this method: SCAPE itself, not an outer method over it."""
  return optimizer_name == 'scape'


def restore_other_mode(program, ckpt: Checkpointer, step: int,
                       error: CheckpointError) -> tuple:
  """(state, extras) of `step` saved in the other SCAPE mode, converted.

  Raises `error`, with the reason added, when the checkpoint is not one of
  the other mode either (or the run is not SCAPE's).
  """
  cfg = program.cfg
  if not converts_modes(cfg.optimizer.name) or program.layout.per_replica:
    raise error
  from scape_jax.train import program as program_lib  # pylint: disable=g-import-not-at-top
  other = program_lib.build_program(_flipped(cfg),
                                    list(program.mesh.devices.flat))
  target = {'params': program.abstract_params, 'opt': other.abstract_opt}
  to_dist = cfg.optimizer.scape.distributed
  saved_as = f'optimizer.scape.distributed={not to_dist}'
  try:
    state, extras = ckpt.restore(step, target)
  except CorruptCheckpointError:
    raise  # of the other mode but damaged: resume falls back to an older one
  except CheckpointError as e:
    raise CheckpointError(
        f'{error}\nIt is not a checkpoint of {saved_as} either (which would '
        f'be converted): {e}') from error
  params = program.layout.split(program.abstract_params)[0]
  opt = jax.jit(
      lambda s: convert_opt_state(_memory.to_device(s), params, to_dist),
      out_shardings=program.state_shardings()[1])(state['opt'])
  print(f'restored step {step} saved with {saved_as}, converted to '
        f'optimizer.scape.distributed={to_dist}')
  return {'params': state['params'], 'opt': opt}, extras
