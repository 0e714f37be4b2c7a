"""scape-jax: communication-efficient LLM pre-training in JAX.

Optimizers are optax transformations called inside `jax.shard_map` with each
worker's local gradients; the sparse ones do the data-parallel exchange
themselves.

Layout: `optim/` (one module per method), `outer/` (methods that wrap an
inner optimizer), `comm/` (the exchange's building blocks), `kernels/`
(Pallas), `sharding/` (mesh, specs, layouts), `train/` (config, step,
trainer, checkpoints, metrics), `data/` and `analysis/` (bytes read from
compiled programs).
"""

from scape_jax.comm.collectives import pmean_gradients
from scape_jax.optim import DensitySchedule
from scape_jax.optim import RadiusSchedule
from scape_jax.optim import ScaleByAdamSState
from scape_jax.optim import ScaleByDemoState
from scape_jax.optim import ScaleByRadiusState
from scape_jax.optim import ScaleByScapeDistState
from scape_jax.optim import ScaleByScapeLocalAdamState
from scape_jax.optim import ScaleByScapeState
from scape_jax.optim import adams
from scape_jax.optim import compress_except
from scape_jax.optim import demo
from scape_jax.optim import demo_stats
from scape_jax.optim import interleave_chunks
from scape_jax.optim import radius
from scape_jax.optim import radius_stats
from scape_jax.optim import scale_by_adams
from scape_jax.optim import scale_by_demo
from scape_jax.optim import scale_by_radius
from scape_jax.optim import scale_by_scape
from scape_jax.optim import scale_by_scape_dist
from scape_jax.optim import scale_by_scape_local_adam
from scape_jax.optim import scape
from scape_jax.optim import scape_dist
from scape_jax.optim import scape_local_adam
from scape_jax.optim import scape_stats
from scape_jax.optim import with_fp32_replica
from scape_jax.sharding.memory import state_shardings
from scape_jax.sharding.placement import init_sharded
from scape_jax.sharding.placement import place
from scape_jax.sharding.specs import state_partition_specs

__all__ = [
    'DensitySchedule',
    'RadiusSchedule',
    'ScaleByAdamSState',
    'ScaleByDemoState',
    'ScaleByRadiusState',
    'ScaleByScapeDistState',
    'ScaleByScapeLocalAdamState',
    'ScaleByScapeState',
    'adams',
    'compress_except',
    'demo',
    'demo_stats',
    'init_sharded',
    'interleave_chunks',
    'place',
    'pmean_gradients',
    'radius',
    'radius_stats',
    'scale_by_adams',
    'scale_by_demo',
    'scale_by_radius',
    'scale_by_scape',
    'scale_by_scape_dist',
    'scale_by_scape_local_adam',
    'scape',
    'scape_dist',
    'scape_local_adam',
    'scape_stats',
    'state_partition_specs',
    'state_shardings',
    'with_fp32_replica',
]
