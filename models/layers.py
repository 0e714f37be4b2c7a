"""Shared building blocks: initializers with logical axes, RoPE, attention.

Every parameter is annotated with logical axis names from `LOGICAL_AXES` via
`nnx.with_partitioning`. In flax 0.12.8 the names land in the Variable
metadata under the key `out_sharding`. Eager sharding is switched off for
these parameters, so models build without a mesh; the trainer maps logical
names to mesh axes itself (see `logical_axes`).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

# The logical name of a scanned model's stacked layer axis (`stack`): no
# mesh axis splits it, and it does not count toward a leaf's rank
# (`matrix_rank`).
LAYERS = 'layers'

# The only logical axis names a parameter may carry (besides None).
LOGICAL_AXES = ('vocab', 'embed', 'mlp', 'heads', 'kv', 'pos', LAYERS)

# Metadata key under which flax 0.12.8 stores `with_partitioning` names.
SHARDING_KEY = 'out_sharding'

ATTN_IMPLS = ('xla', 'jax', 'cudnn')

Names = tuple[str | None, ...]


def init(initializer: Any, names: Names) -> Any:
  """Wraps `initializer` so the created Param carries logical axis `names`."""
  for n in names:
    if n is not None and n not in LOGICAL_AXES:
      raise ValueError(f'unknown logical axis {n!r}; allowed: {LOGICAL_AXES}')
  return nnx.with_partitioning(initializer, names, eager_sharding=False)


def normal(std: float, names: Names) -> Any:
  """Normal(0, std) initializer annotated with logical axis `names`."""
  return init(nnx.initializers.normal(std), names)


def zeros(names: Names) -> Any:
  return init(nnx.initializers.zeros_init(), names)


def ones(names: Names) -> Any:
  return init(nnx.initializers.ones_init(), names)


def linear(
    d_in: int,
    d_out: int,
    names: tuple[str | None, str | None],
    *,
    std: float,
    use_bias: bool,
    dtype: Any,
    param_dtype: Any,
    rngs: nnx.Rngs,
) -> nnx.Linear:
  """Dense layer with normal(std) kernel, zero bias and logical axes."""
  return nnx.Linear(
      d_in,
      d_out,
      use_bias=use_bias,
      dtype=dtype,
      param_dtype=param_dtype,
      kernel_init=normal(std, names),
      bias_init=zeros((names[1],)),
      rngs=rngs,
  )


# ----------------------------------------------------------------------------
# Rotary position embeddings (HF Llama "rotate-half" convention).
# ----------------------------------------------------------------------------


def rope_cos_sin(
    positions: jax.Array, head_dim: int, theta: float
) -> tuple[jax.Array, jax.Array]:
  """cos/sin tables, fp32[T, head_dim], for integer `positions` [T]."""
  if head_dim % 2:
    raise ValueError(f'RoPE needs an even head_dim, got {head_dim}')
  exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
  inv_freq = 1.0 / (theta**exponents)  # [D/2]
  freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
  emb = jnp.concatenate([freqs, freqs], axis=-1)  # [T, D]
  return jnp.cos(emb), jnp.sin(emb)


def rotate_half(x: jax.Array) -> jax.Array:
  x1, x2 = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([-x2, x1], axis=-1)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotates x [B, T, H, D] by cos/sin [T, D]; math in fp32, returns x.dtype."""
  xf = x.astype(jnp.float32)
  cos = cos[None, :, None, :]
  sin = sin[None, :, None, :]
  return (xf * cos + rotate_half(xf) * sin).astype(x.dtype)


# ----------------------------------------------------------------------------
# Causal (grouped-query) attention.
# ----------------------------------------------------------------------------


def causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, impl: str = 'xla'
) -> jax.Array:
  """Causal softmax attention with grouped K/V heads.

  Args:
    q: [B, T, H, D] queries.
    k: [B, T, K, D] keys, H % K == 0; query head h uses kv head h // (H // K)
      (the same mapping as HF `repeat_kv`).
    v: [B, T, K, D] values.
    impl: 'xla' (einsum, fp32 softmax), 'jax' (`jax.nn.dot_product_attention`,
      backend picked by JAX) or 'cudnn' (its cuDNN flash kernel, GPU only).

  Returns:
    [B, T, H, D] in q.dtype.
  """
  b, t, h, d = q.shape
  kvh = k.shape[2]
  if h % kvh:
    raise ValueError(f'n_heads={h} is not a multiple of n_kv_heads={kvh}')
  if impl in ('jax', 'cudnn'):
    return jax.nn.dot_product_attention(
        q, k, v, is_causal=True,
        implementation=None if impl == 'jax' else 'cudnn')
  if impl != 'xla':
    raise ValueError(f'unknown attention impl {impl!r}; allowed: {ATTN_IMPLS}')
  qg = q.reshape(b, t, kvh, h // kvh, d)
  scores = jnp.einsum(
      'btkgd,bskd->bkgts', qg, k, preferred_element_type=jnp.float32)
  scores = scores * (d**-0.5)
  mask = jnp.tril(jnp.ones((t, t), dtype=jnp.bool_))
  scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum('bkgts,bskd->btkgd', probs, v)
  return out.reshape(b, t, h, d)


# ----------------------------------------------------------------------------
# Helpers shared by the model families.
# ----------------------------------------------------------------------------


def check_seq_len(tokens: jax.Array, max_seq_len: int) -> None:
  if tokens.ndim != 2:
    raise ValueError(f'tokens must be [B, T], got shape {tokens.shape}')
  if tokens.shape[1] > max_seq_len:
    raise ValueError(
        f'sequence length {tokens.shape[1]} > max_seq_len {max_seq_len}')


# A parameter hook, `hook(fn, modules, args, remat)`, runs `fn(*modules,
# *args)` with the modules' parameters in the form `fn` needs. The models run
# every group of modules that uses parameters (embedding, each block, output
# head) through `run_unit`, so that a layout can supply full parameters from
# shards one unit at a time: the fsdp layout all-gathers a unit's shards right
# before it runs (ZeRO-3, FCDP; `scape_jax.sharding.fcdp`). `remat` says
# whether the unit's activations are rematerialised in the backward pass.
ParamHook = Callable[[Callable[..., Any], tuple, tuple, bool], Any]


def run_unit(fn: Callable[..., Any], modules: Sequence[nnx.Module], *args,
             remat: bool = False, hook: ParamHook | None = None) -> Any:
  """`fn(*modules, *args)`, through `hook` if given, else under `nnx.remat`
  when `remat` is True."""
  if hook is not None:
    return hook(fn, tuple(modules), args, remat)
  if remat:
    return nnx.remat(fn)(*modules, *args)
  return fn(*modules, *args)


def _call(block: nnx.Module, x: jax.Array) -> jax.Array:
  return block(x)


def run_block(block: nnx.Module, x: jax.Array, remat: bool,
              hook: ParamHook | None = None) -> jax.Array:
  """Applies `block` to `x` as one unit (see `run_unit`)."""
  return run_unit(_call, (block,), x, remat=remat, hook=hook)


def stack(make: Callable[..., nnx.Module], n: int,
          rngs: nnx.Rngs) -> nnx.Module:
  """`n` modules `make(rngs=rngs)` as one whose parameters are stacked along
  a leading axis named `LAYERS`: the same initial values as the `n` modules
  made in turn (a list of them), so that a scanned model starts where the
  unrolled one does."""
  blocks = [make(rngs=rngs) for _ in range(n)]
  graphdef = nnx.graphdef(blocks[0])

  def stacked(*variables: nnx.Variable) -> nnx.Variable:
    first = variables[0]
    names = first.get_metadata().get(SHARDING_KEY)
    value = jnp.stack([v.get_value() for v in variables])
    if names is None:
      return first.replace(value)
    return first.replace(value, **{SHARDING_KEY: (LAYERS,) + tuple(names)})

  states = [nnx.state(b) for b in blocks]
  return nnx.merge(graphdef, jax.tree.map(
      stacked, *states, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def run_blocks(blocks: nnx.Module | Sequence[nnx.Module], x: jax.Array,
               remat: bool, hook: ParamHook | None = None) -> jax.Array:
  """Applies the blocks in turn, each as one unit (`run_block`): a list
  unrolled, a `stack` of them as one `nnx.scan` (traced and compiled once;
  inside it each block's parameters and axis names are one layer's)."""
  if isinstance(blocks, nnx.List):
    for block in blocks:
      x = run_block(block, x, remat, hook)
    return x

  @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry,
            transform_metadata={nnx.PARTITION_NAME: LAYERS})
  def body(x: jax.Array, block: nnx.Module) -> jax.Array:
    return run_block(block, x, remat, hook)

  return body(x, blocks)


def matrix_rank(names: Names) -> int:
  """The rank of a parameter with logical axis `names`, its stacked layer
  axis (`LAYERS`) not counted: 2 for a scanned model's [L, d, d] kernel, 1
  for its [L, d] norm scales."""
  return sum(n != LAYERS for n in names)


def matrices(axes: Any) -> Callable[[Any], Any]:
  """`params -> tree of bools`: the leaves of `matrix_rank` >= 2, from the
  logical axis names of every parameter (`axes`, a nested dict as
  `nnx.to_pure_dict(logical_axes(...))` gives); `params` may be any subtree
  of the same nested keys (LoRA's trainable leaves)."""

  def flags(params):
    def flag(path, x):
      names = axes
      for key in path:
        names = names[key.key]
      return matrix_rank(names) >= 2 and math.prod(x.shape) > 0
    return jax.tree_util.tree_map_with_path(flag, params)

  return flags


def _names_of(var: nnx.Variable) -> Names:
  names = var.get_metadata().get(SHARDING_KEY)
  ndim = jnp.ndim(var.get_value())
  if names is None:
    return (None,) * ndim
  names = tuple(names)
  if len(names) != ndim:
    raise ValueError(f'axis names {names} do not match ndim {ndim}')
  return names


def logical_axes(model_or_state: nnx.Module | nnx.State) -> nnx.State:
  """Logical axis names of every Param.

  Args:
    model_or_state: a model, or a State of Variables (e.g. from
      `nnx.state(model, nnx.Param)`, abstract states from `nnx.eval_shape`
      included).

  Returns:
    A State with the structure of `nnx.state(model, nnx.Param)` whose leaves
    are tuples of logical names (None allowed), one entry per array dim.
    Tuples are themselves pytrees, so map over it with
    `jax.tree.map(f, axes, ..., is_leaf=lambda x: isinstance(x, tuple))`.
  """
  if isinstance(model_or_state, nnx.Module):
    state = nnx.state(model_or_state, nnx.Param)
  else:
    state = model_or_state
  return jax.tree.map(
      _names_of, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def count_params(state: Any) -> int:
  """Total number of elements in a (possibly abstract) state."""
  return sum(math.prod(x.shape) for x in jax.tree.leaves(state))
