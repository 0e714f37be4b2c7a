"""Low-precision compute parameters with an fp32 replica in the state.

The SCAPE paper keeps BF16 parameters for the forward and backward passes
and an FP32 copy of the model (Algorithm 2, line 1), in host memory
(Section IV-D). `with_fp32_replica(tx)` does that for any transformation:
its state holds the fp32 replica, which is authoritative; `tx` updates the
replica from fp32 gradients, and the updates returned move the compute
parameters to the replica's value in their own dtype, exactly (the updates
are fp32, so `optax.apply_updates` adds them in fp32 and rounds once). The
compute copy is a cache of the replica: no rounding error accumulates in it.

The replica is listed in `OFFLOADED_FIELDS`: with
`state_shardings(..., offload='pinned_host')` it lives in host memory
between steps and comes to the device for the update.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from scape_jax.optim import _common
from scape_jax.optim import _memory


class Fp32ReplicaState(NamedTuple):
  """State of `with_fp32_replica`."""
  inner: optax.OptState  # The wrapped transformation's state.
  replica: optax.Params  # The fp32 parameters (authoritative).

  OFFLOADED_FIELDS = ('replica',)


def _f32(tree: Any) -> Any:
  return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)


def with_fp32_replica(
    tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """Runs `tx` on an fp32 replica of (low-precision) compute parameters.

  Args:
    tx: the transformation to run in fp32 (its `update` gets the replica as
      `params` and fp32 gradients).

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is
    `Fp32ReplicaState`. `update` needs `params` (the compute copy) and
    returns fp32 updates that take them to the new replica cast to their
    dtype. Extra keyword arguments go to `tx`.

  References:
    SCAPE paper, Algorithm 2 (the FP32 copy) and Section IV-D.
  """
  _common.check_transformation('with_fp32_replica', 'tx', tx)
  tx = optax.with_extra_args_support(tx)

  def init_fn(params):
    replica = _f32(params)
    return Fp32ReplicaState(inner=tx.init(replica), replica=replica)

  def update_fn(updates, state, params=None, **extra):
    if params is None:
      raise ValueError('with_fp32_replica: update needs params (the compute '
                       'copy the returned updates move).')
    replica = _memory.to_device(state.replica)
    inner_updates, inner = tx.update(_f32(updates), state.inner, replica,
                                     **extra)
    new = optax.apply_updates(replica, inner_updates)
    moves = jax.tree.map(
        lambda r, p: r.astype(p.dtype).astype(jnp.float32) - p.astype(
            jnp.float32), new, params)
    return moves, Fp32ReplicaState(inner, _memory.like(new, state.replica))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
