"""Analysis tools: bytes on the wire read from compiled programs, each
method's bytes predicted from its parameter shapes (`cost`), and what a
finished run's log and metrics say (`runs`).

Nothing in the optimizers imports this package, and the train step only its
name for the update branch (`hlo.TAKEN_SCOPE`); the trainer and the
benchmarks use it to report what a compiled step sends.
"""

from scape_jax.analysis.cost import ring_all_gather_bytes
from scape_jax.analysis.cost import ring_all_reduce_bytes
from scape_jax.analysis.cost import ring_reduce_scatter_bytes
from scape_jax.analysis.hlo import KINDS
from scape_jax.analysis.hlo import NOTE_IN_BRANCH
from scape_jax.analysis.hlo import NOTE_TRIP_UNKNOWN
from scape_jax.analysis.hlo import NOTE_UNREACHABLE
from scape_jax.analysis.hlo import Collective
from scape_jax.analysis.hlo import bytes_sent
from scape_jax.analysis.hlo import collectives
from scape_jax.analysis.hlo import collectives_from_hlo
from scape_jax.analysis.hlo import dtype_bytes
from scape_jax.analysis.hlo import format_table
from scape_jax.analysis.hlo import replica_groups
from scape_jax.analysis.memory import argument_bytes_by_kind
from scape_jax.analysis.memory import host_argument_bytes
from scape_jax.analysis.memory import offloaded_bytes
from scape_jax.analysis import cost
from scape_jax.analysis import runs
from scape_jax.analysis import traffic

__all__ = [
    'KINDS', 'NOTE_IN_BRANCH', 'NOTE_TRIP_UNKNOWN', 'NOTE_UNREACHABLE',
    'Collective', 'argument_bytes_by_kind', 'bytes_sent', 'collectives',
    'collectives_from_hlo', 'dtype_bytes', 'format_table',
    'host_argument_bytes', 'offloaded_bytes', 'replica_groups',
    'ring_all_gather_bytes', 'ring_all_reduce_bytes',
    'ring_reduce_scatter_bytes', 'cost', 'runs', 'traffic',
]
