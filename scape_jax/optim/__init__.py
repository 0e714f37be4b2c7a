"""Optimizers as optax transformations, one module per method.

Each module holds its state `NamedTuple`, its `scale_by_*` primitive and its
user-facing alias. Shared defaults, type aliases and bias correction live in
`_common`.
"""

from scape_jax.optim._adams import ScaleByAdamSState
from scape_jax.optim._adams import adams
from scape_jax.optim._adams import scale_by_adams
from scape_jax.optim._common import compress_except
from scape_jax.optim._demo import ScaleByDemoState
from scape_jax.optim._demo import demo
from scape_jax.optim._demo import demo_stats
from scape_jax.optim._demo import scale_by_demo
from scape_jax.optim._interleave import interleave_chunks
from scape_jax.optim._radius import RadiusSchedule
from scape_jax.optim._radius import ScaleByRadiusState
from scape_jax.optim._radius import radius
from scape_jax.optim._radius import radius_stats
from scape_jax.optim._radius import scale_by_radius
from scape_jax.optim._replica import Fp32ReplicaState
from scape_jax.optim._replica import with_fp32_replica
from scape_jax.optim._scape import DensitySchedule
from scape_jax.optim._scape import ScaleByScapeState
from scape_jax.optim._scape import scale_by_scape
from scape_jax.optim._scape import scape
from scape_jax.optim._scape import scape_stats
from scape_jax.optim._scape_local_adam import ScaleByScapeLocalAdamState
from scape_jax.optim._scape_local_adam import scale_by_scape_local_adam
from scape_jax.optim._scape_local_adam import scape_local_adam
from scape_jax.optim._scape_local_adam import scape_local_adam_stats
from scape_jax.optim._scape_dist import ScaleByScapeDistState
from scape_jax.optim._scape_dist import dist_to_scape
from scape_jax.optim._scape_dist import scale_by_scape_dist
from scape_jax.optim._scape_dist import scape_dist
from scape_jax.optim._scape_dist import scape_dist_stats
from scape_jax.optim._scape_dist import scape_to_dist

__all__ = [
    'DensitySchedule', 'Fp32ReplicaState', 'RadiusSchedule',
    'ScaleByAdamSState', 'ScaleByDemoState', 'ScaleByRadiusState',
    'ScaleByScapeDistState', 'ScaleByScapeLocalAdamState', 'ScaleByScapeState',
    'adams', 'compress_except', 'demo', 'demo_stats', 'interleave_chunks',
    'dist_to_scape', 'radius', 'radius_stats', 'scale_by_adams',
    'scale_by_demo', 'scale_by_radius', 'scale_by_scape', 'scale_by_scape_dist',
    'scale_by_scape_local_adam', 'scape', 'scape_dist', 'scape_dist_stats',
    'scape_local_adam', 'scape_local_adam_stats', 'scape_stats',
    'scape_to_dist', 'with_fp32_replica',
]
