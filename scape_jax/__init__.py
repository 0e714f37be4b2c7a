"""scape-jax: communication-efficient LLM pre-training in JAX.

Optimizers are optax transformations called inside `jax.shard_map` with each
worker's local gradients; the sparse ones do the data-parallel exchange
themselves.
"""

from scape_jax.adams import ScaleByAdamSState
from scape_jax.adams import adams
from scape_jax.adams import pmean_gradients
from scape_jax.adams import scale_by_adams
from scape_jax.scape import DensitySchedule
from scape_jax.scape import ScaleByScapeState
from scape_jax.scape import scale_by_scape
from scape_jax.scape import scape
from scape_jax.scape import scape_stats
from scape_jax.scape import state_partition_specs

__all__ = [
    'DensitySchedule',
    'ScaleByAdamSState',
    'ScaleByScapeState',
    'adams',
    'pmean_gradients',
    'scale_by_adams',
    'scale_by_scape',
    'scape',
    'scape_stats',
    'state_partition_specs',
]
