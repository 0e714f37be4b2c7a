"""LoRA adapters (Hu et al., 2022) on chosen linear layers of GPT and Llama.

A targeted layer computes

    y = x W + b + (alpha / rank) * (x A) B,   A: [d_in, rank], B: [rank, d_out]

with the base W, b frozen (plain `nnx.Param`) and A, B trainable
(`nnx.LoRAParam`, a subclass of `nnx.Param`, so `nnx.state(model,
nnx.LoRAParam)` selects exactly the adapters). A starts uniform in
+-1/sqrt(d_in) (PEFT's kaiming-uniform with a = sqrt(5)) and B at zero, so a
new adapter leaves the model's function unchanged. A and B carry the logical
axes of W's input and output dimension, so the fsdp layout splits them like
W; the rank dimension is unnamed.

Targets are layer paths inside a block ('self_attn.q_proj', 'mlp.c_fc') or
any dotted suffix of one ('q_proj', 'c_proj' = both of GPT's c_proj). The
adapters draw their keys from the `lora` stream of the model's `nnx.Rngs`
(`models.rngs(seed)` has one), so the base weights are the same as without
LoRA for the same seed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn import dtypes

from . import layers

LORA_STREAM = 'lora'  # the nnx.Rngs stream the adapters are drawn from


@dataclasses.dataclass(frozen=True)
class LoraSpec:
  """Which layers get adapters, and their shape.

  Attributes:
    rank: the inner dimension r of A [d_in, r] and B [r, d_out]; >= 1.
    alpha: the update is scaled by alpha / rank; > 0.
    targets: layer paths inside a block, or dotted suffixes of them.
  """
  rank: int
  alpha: float
  targets: tuple[str, ...]

  def __post_init__(self):
    if isinstance(self.targets, str):
      raise ValueError(f'model.lora.targets={self.targets!r} must be a list '
                       "of layer names, e.g. ['q_proj'].")
    object.__setattr__(self, 'targets', tuple(self.targets))
    if isinstance(self.rank, bool) or not isinstance(self.rank,
                                                     (int, np.integer)):
      raise ValueError(f'model.lora.rank={self.rank!r} must be an int >= 1.')
    if self.rank < 1:
      raise ValueError(f'model.lora.rank={self.rank} must be >= 1.')
    if not 0 < self.alpha < math.inf:
      raise ValueError(f'model.lora.alpha={self.alpha} must be finite and '
                       '> 0.')
    if not self.targets:
      raise ValueError('model.lora.targets is empty: name at least one layer.')

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  def targets_path(self, path: str) -> bool:
    """Whether the layer at `path` (inside a block) gets an adapter."""
    return any(_matches(t, path) for t in self.targets)


def _matches(target: str, path: str) -> bool:
  return path == target or path.endswith('.' + target)


def check_targets(spec: LoraSpec | None, paths: Sequence[str],
                  family: str) -> None:
  """Raises ValueError if a target of `spec` names none of `paths`."""
  if spec is None:
    return
  unknown = [t for t in spec.targets if not any(_matches(t, p) for p in paths)]
  if unknown:
    allowed = sorted({p.split('.', i)[-1] for p in paths for i in range(2)})
    raise ValueError(f'model.lora.targets {unknown} name no layer of '
                     f'{family}; allowed: {", ".join(allowed)}.')


def _a_init(name: str | None) -> Any:
  """Uniform in +-1/sqrt(fan_in): variance_scaling(1/3, fan_in, uniform)."""
  return layers.init(
      nnx.initializers.variance_scaling(1 / 3, 'fan_in', 'uniform'),
      (name, None))


class LoRALinear(nnx.Linear):
  """`nnx.Linear` plus a trainable low-rank update (see the module doc)."""

  def __init__(self, d_in: int, d_out: int,
               names: tuple[str | None, str | None], *, spec: LoraSpec,
               std: float, use_bias: bool, dtype: Any, param_dtype: Any,
               rngs: nnx.Rngs):
    super().__init__(
        d_in, d_out, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
        kernel_init=layers.normal(std, names),
        bias_init=layers.zeros((names[1],)), rngs=rngs)
    self.lora_scale = spec.scale
    key = getattr(rngs, LORA_STREAM)
    self.lora_a = nnx.LoRAParam(
        _a_init(names[0])(key(), (d_in, spec.rank), param_dtype))
    self.lora_b = nnx.LoRAParam(layers.zeros((None, names[1]))(
        key(), (spec.rank, d_out), param_dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    y = super().__call__(x)
    x, a, b = dtypes.promote_dtype(
        (x, self.lora_a.get_value(), self.lora_b.get_value()),
        dtype=self.dtype)
    return y + (self.lora_scale * ((x @ a) @ b)).astype(y.dtype)


def linear(path: str, d_in: int, d_out: int,
           names: tuple[str | None, str | None], *, spec: LoraSpec | None,
           **kwargs) -> nnx.Linear:
  """`layers.linear`, with an adapter when `spec` targets `path`."""
  if spec is not None and spec.targets_path(path):
    return LoRALinear(d_in, d_out, names, spec=spec, **kwargs)
  return layers.linear(d_in, d_out, names, **kwargs)


ADAPTER_LEAVES = ('lora_a', 'lora_b')


def without_adapters(params: dict) -> dict:
  """The pure-dict `params` less every adapter leaf (the base model's)."""
  return {k: without_adapters(v) if isinstance(v, dict) else v
          for k, v in params.items() if k not in ADAPTER_LEAVES}


def merge_adapters(params: dict, scale: float) -> dict:
  """The base model with the adapters folded in (PEFT's merge): each
  adapted kernel becomes W + scale * A @ B, computed in float32 and cast
  back to W's dtype, and the adapter leaves are dropped. The merged model
  computes what the adapted one does, up to rounding."""
  out = {}
  for k, v in params.items():
    if k in ADAPTER_LEAVES:
      continue
    if not isinstance(v, dict):
      out[k] = v
    elif 'lora_a' in v:
      w, a, b = (np.asarray(v[n], np.float32)
                 for n in ('kernel',) + ADAPTER_LEAVES)
      out[k] = merge_adapters(v, scale)
      out[k]['kernel'] = (w + scale * (a @ b)).astype(
          np.asarray(v['kernel']).dtype)
    else:
      out[k] = merge_adapters(v, scale)
  return out


def rngs(seed: int) -> nnx.Rngs:
  """The model's `nnx.Rngs`: the default stream from `seed`, and a separate
  `lora` stream so that adding adapters does not move the base weights."""
  lora_key = jax.random.fold_in(jax.random.key(seed), 0x4C6F5241)
  return nnx.Rngs(seed, **{LORA_STREAM: lora_key})

