"""Methods that wrap an inner optimizer and synchronise every few steps.

They run on the replica layout (`scape_jax.sharding`): each replica group
holds its own parameters between synchronisations.

* `diloco`: the inner method per group, an outer Nesterov step on the
  groups' mean change every `sync_every` steps (`_diloco`);
* `pier`: DiLoCo with Pier's lazy start, momentum warmup and decay, and
  outer learning-rate schedule (`_pier`).
"""

from scape_jax.outer._diloco import PHASES
from scape_jax.outer._diloco import DiLoCoState
from scape_jax.outer._diloco import SyncSchedule
from scape_jax.outer._diloco import diloco
from scape_jax.outer._diloco import offload_memory_kinds
from scape_jax.outer._pier import lazy_start_steps
from scape_jax.outer._pier import pier
from scape_jax.outer._pier import pier_momentum
from scape_jax.outer._pier import pier_outer_lr
from scape_jax.outer._pier import sync_schedule

__all__ = [
    'DiLoCoState', 'PHASES', 'SyncSchedule', 'diloco', 'lazy_start_steps',
    'offload_memory_kinds', 'pier', 'pier_momentum', 'pier_outer_lr',
    'sync_schedule',
]
