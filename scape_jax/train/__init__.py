"""The trainer: config, the one train step, the loop, checkpoints, metrics.

`train(cfg)` runs or resumes a run; `dry_run(cfg)` compiles it from abstract
shapes; `build_program(cfg)` builds everything short of arrays.
"""

from scape_jax.train.guard import DivergedError
from scape_jax.train.preemption import Interrupted
from scape_jax.train.program import Program
from scape_jax.train.program import build_program
from scape_jax.train.program import dry_run
from scape_jax.train.program import param_count
from scape_jax.train.program import required_devices
from scape_jax.train.trainer import train

__all__ = ['DivergedError', 'Interrupted', 'Program', 'build_program',
           'dry_run', 'param_count', 'required_devices', 'train']
