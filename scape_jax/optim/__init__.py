"""Optimizers as optax transformations, one module per method.

Each module holds its state `NamedTuple`, its `scale_by_*` primitive and its
user-facing alias. Shared defaults, type aliases and bias correction live in
`_common`.
"""

from scape_jax.optim._adams import ScaleByAdamSState
from scape_jax.optim._adams import adams
from scape_jax.optim._adams import scale_by_adams
from scape_jax.optim._demo import ScaleByDemoState
from scape_jax.optim._demo import demo
from scape_jax.optim._demo import demo_stats
from scape_jax.optim._demo import scale_by_demo
from scape_jax.optim._radius import RadiusSchedule
from scape_jax.optim._radius import ScaleByRadiusState
from scape_jax.optim._radius import radius
from scape_jax.optim._radius import radius_stats
from scape_jax.optim._radius import scale_by_radius
from scape_jax.optim._scape import DensitySchedule
from scape_jax.optim._scape import ScaleByScapeState
from scape_jax.optim._scape import scale_by_scape
from scape_jax.optim._scape import scape
from scape_jax.optim._scape import scape_stats

__all__ = [
    'DensitySchedule', 'RadiusSchedule', 'ScaleByAdamSState',
    'ScaleByDemoState', 'ScaleByRadiusState', 'ScaleByScapeState', 'adams',
    'demo', 'demo_stats', 'radius', 'radius_stats', 'scale_by_adams',
    'scale_by_demo', 'scale_by_radius', 'scale_by_scape', 'scape',
    'scape_stats',
]
