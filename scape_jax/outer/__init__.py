"""Methods that wrap an inner optimizer and synchronise every few steps.

They run on the replica layout (`scape_jax.sharding`): each replica group
holds its own parameters between synchronisations.

* `diloco`: the inner method per group, an outer Nesterov step on the
  groups' mean change every `sync_every` steps (`_diloco`);
* `pier`: DiLoCo with Pier's lazy start, momentum warmup and decay, and
  outer learning-rate schedule (`_pier`).

From a user's own loop (docs/examples.md): the groups' parameters from
`scape_jax.place_replicas`, the state from `scape_jax.init_sharded(tx,
params, mesh, replica_axis='replica')`, and inside `jax.shard_map`
`enter_group` / `leave_group` around the step; `SyncSchedule.phase` (or
`sync_schedule` for Pier) names each step's phase.
"""

from scape_jax.outer._diloco import PHASES
from scape_jax.outer._diloco import DiLoCoState
from scape_jax.outer._diloco import SyncSchedule
from scape_jax.outer._diloco import diloco
from scape_jax.outer._diloco import offload_memory_kinds
from scape_jax.outer._groups import enter_group
from scape_jax.outer._groups import leave_group
from scape_jax.outer._pier import lazy_start_steps
from scape_jax.outer._pier import pier
from scape_jax.outer._pier import pier_momentum
from scape_jax.outer._pier import pier_outer_lr
from scape_jax.outer._pier import sync_schedule

__all__ = [
    'DiLoCoState', 'PHASES', 'SyncSchedule', 'diloco', 'enter_group',
    'lazy_start_steps', 'leave_group', 'offload_memory_kinds', 'pier',
    'pier_momentum', 'pier_outer_lr', 'sync_schedule',
]
