"""scape-jax: communication-efficient LLM pre-training in JAX.

Optimizers are optax transformations called inside `jax.shard_map` with each
worker's local gradients; the sparse ones do the data-parallel exchange
themselves.

Layout: `optim/` (one module per method), `outer/` (methods that wrap an
inner optimizer), `comm/` (the exchange's building blocks), `kernels/`
(Pallas), `sharding/` (mesh, specs, layouts), `train/` (config, step,
trainer, checkpoints, metrics), `data/` and `analysis/` (bytes read from
compiled programs).

`scape_jax.models` (GPT-2 and Llama in Flax NNX; needs the `[train]` extra)
is `models/` at the top of a checkout, installed by the wheel as
`scape_jax/models/`: import it as `from scape_jax import models`, which
works in both.
"""

import importlib
import importlib.util
import os
import sys

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
from scape_jax import outer
from scape_jax.outer import diloco
from scape_jax.outer import pier
from scape_jax.sharding.memory import state_shardings
from scape_jax.sharding.placement import init_sharded
from scape_jax.sharding.placement import place
from scape_jax.sharding.placement import place_replicas
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
    'diloco',
    'init_sharded',
    'interleave_chunks',
    'place',
    'place_replicas',
    'outer',
    'pier',
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


def __getattr__(name):  # PEP 562: `scape_jax.models`, imported on first use
  if name != 'models':
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
  here = os.path.dirname(os.path.abspath(__file__))
  if os.path.isdir(os.path.join(here, 'models')):  # installed (the wheel)
    return importlib.import_module('scape_jax.models')
  return _checkout_models(os.path.join(os.path.dirname(here), 'models'))


def _checkout_models(directory: str):
  """The checkout's `models/` package, loaded from `directory` by path.

  It is registered as the top-level `models` (so that the tests' and bench
  scripts' `import models` is the same module, with the same classes),
  unless another `models` (a user's own) holds that name: then as
  `scape_jax.models`.
  """
  init = os.path.join(directory, '__init__.py')
  held = sys.modules.get('models')
  if held is not None and os.path.abspath(
      getattr(held, '__file__', None) or '') == init:
    return held
  name = 'models' if held is None else f'{__name__}.models'
  if name in sys.modules:
    return sys.modules[name]
  if not os.path.isfile(init):
    raise ImportError(f'scape_jax.models: no {init} (neither an installed '
                      'scape-jax nor a checkout with models/ beside '
                      'scape_jax/)')
  spec = importlib.util.spec_from_file_location(
      name, init, submodule_search_locations=[directory])
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  try:
    spec.loader.exec_module(module)
  except BaseException:
    del sys.modules[name]
    raise
  globals()['models'] = module
  return module
