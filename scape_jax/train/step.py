"""The one train step every method and every layout uses, and the eval step.

The whole step runs inside `jax.shard_map`. Each worker computes its local
gradient on its part of the batch and hands it to the method's optax
transformation, which owns the data-parallel exchange. The `Layout` says
where parameters live: replicated, split over the fsdp group (gathered per
unit, with FCDP's switches), or one copy per replica group, and which are
frozen (`scape_jax.sharding.layout`).

A step whose loss or gradient norm is not finite on any worker is skipped:
the update does not run, the step returns the incoming parameters and
optimizer state (every method's, per-worker state included) and reports
`skipped = 1`. The decision comes out of the metrics' `pmean` before the
update, so it is the same on every worker, and the update is a branch
(`lax.cond`) that writes into the donated buffers.
"""

from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from scape_jax.analysis.hlo import TAKEN_SCOPE
from scape_jax.comm.collectives import global_norm, varying
from scape_jax.comm.masks import following
from scape_jax.sharding.layout import Layout
from scape_jax.sharding.mesh import DATA, FSDP_AXES


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean next-token cross entropy in fp32."""
  logits = logits.astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits,
                                                         targets).mean()


def local_value_and_grad(loss_fn, params, batch, micro_batches: int = 1,
                         batch_axes: Sequence[str] = (DATA,)):
  """This worker's mean loss and gradient over `micro_batches` sequential parts.

  Inside `shard_map`. Accumulation happens locally in fp32 (the mean goes
  on in the parameters' dtype, as one part's gradient would); no collective
  runs inside the loop other than those of `loss_fn` itself.

  Args:
    loss_fn: `(params, batch) -> scalar loss`.
    params: the parameters as this worker holds them.
    batch: this worker's part of the batch.
    micro_batches: sequential parts the batch is split into.
    batch_axes: the mesh axes the batch is split over.
  """
  # Varying params make grad return this worker's gradient, not the psum.
  local = jax.tree.map(lambda x: varying(x, batch_axes), params)
  grad_fn = jax.value_and_grad(loss_fn)
  if micro_batches == 1:
    return grad_fn(local, batch)
  parts = jax.tree.map(
      lambda x: x.reshape(micro_batches, -1, *x.shape[1:]), batch)

  def accumulate(carry, part):
    loss, grads = grad_fn(local, part)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    return jax.tree.map(jnp.add, carry, (loss, grads)), None

  zero = varying(jnp.zeros([], jnp.float32), batch_axes)
  init = (zero, jax.tree.map(lambda x: jnp.zeros_like(x, jnp.float32),
                             local))
  (loss, grads), _ = jax.lax.scan(accumulate, init, parts)
  # The mean in fp32, handed on in the parameters' dtype (as one part's).
  grads = jax.tree.map(lambda g, p: (g / micro_batches).astype(p.dtype),
                       grads, local)
  return loss / micro_batches, grads


def _unchanged(params, opt_state):
  """A skipped step's branch: what came in goes out."""
  return params, opt_state


def apply_if_finite(ok: jax.Array, tx: optax.GradientTransformation, grads,
                    params, opt_state, update_kwargs: Optional[dict] = None,
                    *, state_after_params: bool = False):
  """`tx`'s update applied to `params` where `ok`, else both unchanged.

  A branch (`lax.cond`), not a select of the new and the old values: the
  update runs in the donated buffers, where a select would keep both and
  copy. Its collectives count as an applied step's bytes (`TAKEN_SCOPE`).

  Args:
    ok: a scalar bool, the same on every worker.
    tx: the method's transformation.
    grads: the gradients `tx.update` gets.
    params: the parameters.
    opt_state: `tx`'s state.
    update_kwargs: static extra arguments of `tx.update`.
    state_after_params: write the state fields that `tx`'s states name in
      `WRITTEN_AFTER_PARAMS` after the new parameters (`written_after`).

  Returns:
    `(params, opt_state)`, updated where `ok`.
  """
  update_kwargs = update_kwargs or {}

  def apply(params, opt_state):
    updates, new_state = tx.update(grads, opt_state, params, **update_kwargs)
    new_params = optax.apply_updates(params, updates)
    if state_after_params:
      new_state = written_after(new_state, new_params)
    return new_params, new_state

  with jax.named_scope(TAKEN_SCOPE):
    return jax.lax.cond(ok, apply, _unchanged, params, opt_state)


def orders_state(platform: str) -> bool:
  """Whether the train step on `platform` writes the `WRITTEN_AFTER_PARAMS`
  fields after the new parameters (`apply_if_finite`). On XLA:CPU it
  removes a copy of AdamS's m from the step (docs/benchmarks.md, section
  2). A GPU may instead fuse the two updates into one kernel, which the
  ordering would forbid: not measured there, so not ordered."""
  return platform == 'cpu'


def _names_late_fields(x) -> bool:
  return isinstance(x, tuple) and hasattr(type(x), 'WRITTEN_AFTER_PARAMS')


def written_after(opt_state, params):
  """`opt_state` with each field that its states name in
  `WRITTEN_AFTER_PARAMS` made to follow `params` (`masks.following`).

  Where the parameters' update reads a field's old value (AdamS's m), XLA
  writes the new value into the donated buffer only after that read if
  the new value depends on the new parameters; otherwise it copies the old
  value aside first. The values are unchanged.
  """
  deps = jax.tree.leaves(params)

  def order(x):
    if not _names_late_fields(x):
      return x
    return x._replace(**{
        name: jax.tree.map(lambda leaf: following(leaf, deps),
                           getattr(x, name))
        for name in type(x).WRITTEN_AFTER_PARAMS})

  return jax.tree.map(order, opt_state, is_leaf=_names_late_fields)


def make_train_step(apply_fn: Callable[[Any, jax.Array], jax.Array],
                    tx: optax.GradientTransformation, layout: Layout,
                    opt_specs, update_kwargs: Optional[dict] = None,
                    micro_batches: int = 1):
  """Builds `step(params, opt_state, batch) -> (params, opt_state, metrics)`.

  Args:
    apply_fn: `(params, tokens) -> logits`.
    tx: the method's transformation, called with local gradients.
    layout: where parameters, state and batch live.
    opt_specs: per-group PartitionSpecs of the optimizer state.
    update_kwargs: static extra arguments of `tx.update` (SCAPE's
      `density_level`); each distinct value is one compiled program.
    micro_batches: gradient accumulation over this many sequential parts of
      each worker's batch before the one optimizer update.

  Returns:
    A jitted function; params and optimizer state are donated. Its metrics
    are `loss`, `grad_norm` (the RMS over the workers of each one's *local*
    gradient norm, not the norm of the mean gradient that a clip compares:
    that would cost a dense all-reduce; it grows with the workers' noise,
    so compare it only between runs of one mesh) and `skipped` (1.0 when
    the update was not applied because something was not finite, else 0.0).
  """
  batch_axes = layout.batch_axes
  state_after_params = orders_state(layout.mesh.devices.flat[0].platform)

  def local_step(params, opt_state, batch):
    params, opt_state = layout.enter(params), layout.enter(opt_state)
    params, frozen = layout.split(params)  # frozen: not differentiated

    def loss_fn(p, batch):
      logits = layout.apply(apply_fn, layout.merge(p, frozen), batch['inputs'])
      return cross_entropy(logits, batch['targets'])

    loss, grads = local_value_and_grad(loss_fn, params, batch, micro_batches,
                                       batch_axes)
    grads = layout.finish_gradients(grads)
    grad_sq = global_norm(grads, FSDP_AXES, squared=True)  # shards combined
    local_stats = jnp.stack([varying(x, batch_axes) for x in (loss, grad_sq)])
    stats = jax.lax.pmean(local_stats, batch_axes)  # the same on every worker
    ok = jnp.isfinite(stats[0]) & jnp.isfinite(stats[1])
    params, opt_state = apply_if_finite(ok, tx, grads, params, opt_state,
                                        update_kwargs,
                                        state_after_params=state_after_params)
    params = layout.merge(params, frozen)
    metrics = {'loss': stats[0], 'grad_norm': jnp.sqrt(stats[1]),
               'skipped': 1 - ok.astype(jnp.float32)}
    return layout.leave(params), layout.leave(opt_state), metrics

  param_specs = layout.global_specs(layout.param_specs)
  state_specs = layout.global_specs(opt_specs)
  step = jax.shard_map(local_step, mesh=layout.mesh,
                       in_specs=(param_specs, state_specs,
                                 layout.batch_spec()),
                       out_specs=(param_specs, state_specs,
                                  jax.sharding.PartitionSpec()))
  return jax.jit(step, donate_argnums=(0, 1))


def make_eval_step(apply_fn, layout: Layout):
  """`(params, batch) -> mean loss`, the batch split over the batch axes."""

  def eval_step(params, batch):
    logits = apply_fn(layout.eval_params(params), batch['inputs'])
    return cross_entropy(logits, batch['targets'])

  return jax.jit(eval_step, in_shardings=(
      layout.param_shardings(),
      NamedSharding(layout.mesh, layout.batch_spec())))
