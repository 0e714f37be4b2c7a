"""The one train step every method uses, and the eval step.

Local gradients are computed per data shard inside `jax.shard_map` over
'data' and handed to the method's optax transformation, which owns the
data-parallel exchange. Parameters are replicated over 'data'.
"""

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

DATA = 'data'


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean next-token cross entropy in fp32."""
  logits = logits.astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits,
                                                         targets).mean()


def local_value_and_grad(loss_fn, params, batch, micro_batches: int = 1):
  """This worker's mean loss and gradient over `micro_batches` sequential parts.

  Inside `shard_map` over 'data'. Accumulation happens locally in fp32; no
  collective runs inside the loop.
  """
  # Varying params make grad return this worker's gradient, not the psum.
  local = jax.lax.pcast(params, DATA, to='varying')
  grad_fn = jax.value_and_grad(loss_fn)
  if micro_batches == 1:
    return grad_fn(local, batch)
  parts = jax.tree.map(
      lambda x: x.reshape(micro_batches, -1, *x.shape[1:]), batch)

  def accumulate(carry, part):
    loss, grads = grad_fn(local, part)
    return jax.tree.map(jnp.add, carry, (loss, grads)), None

  zero = jax.lax.pcast(jnp.zeros([], jnp.float32), DATA, to='varying')
  init = (zero, jax.tree.map(jnp.zeros_like, local))
  (loss, grads), _ = jax.lax.scan(accumulate, init, parts)
  return jax.tree.map(lambda x: x / micro_batches, (loss, grads))


def make_train_step(apply_fn: Callable[[Any, jax.Array], jax.Array],
                    tx: optax.GradientTransformation, mesh, opt_specs,
                    update_kwargs: Optional[dict] = None,
                    micro_batches: int = 1):
  """Builds `step(params, opt_state, batch) -> (params, opt_state, metrics)`.

  Args:
    apply_fn: `(params, tokens) -> logits`.
    tx: the method's transformation, called with local gradients.
    mesh: a mesh with a 'data' axis.
    opt_specs: PartitionSpecs of the optimizer state over the mesh.
    update_kwargs: static extra arguments of `tx.update` (SCAPE's
      `density_level`); each distinct value is one compiled program.
    micro_batches: gradient accumulation over this many sequential parts of
      each worker's batch before the one optimizer update.

  Returns:
    A jitted function; params and optimizer state are donated.
  """
  update_kwargs = update_kwargs or {}

  def loss_fn(p, batch):
    return cross_entropy(apply_fn(p, batch['inputs']), batch['targets'])

  def local_step(params, opt_state, batch):
    loss, grads = local_value_and_grad(loss_fn, params, batch, micro_batches)
    updates, opt_state = tx.update(grads, opt_state, params, **update_kwargs)
    params = optax.apply_updates(params, updates)
    local_stats = jnp.stack([loss, optax.tree.norm(grads, squared=True)])
    stats = jax.lax.pmean(local_stats, DATA)
    metrics = {'loss': stats[0], 'grad_norm': jnp.sqrt(stats[1])}
    return params, opt_state, metrics

  step = jax.shard_map(local_step, mesh=mesh,
                       in_specs=(P(), opt_specs, P(DATA)),
                       out_specs=(P(), opt_specs, P()))
  return jax.jit(step, donate_argnums=(0, 1))


def make_eval_step(apply_fn, mesh):
  """`(params, batch) -> mean loss`, batch sharded over 'data'."""

  def eval_step(params, batch):
    return cross_entropy(apply_fn(params, batch['inputs']), batch['targets'])

  return jax.jit(eval_step, in_shardings=(NamedSharding(mesh, P()),
                                          NamedSharding(mesh, P(DATA))))
