"""Model zoo: GPT-2 and Llama families (Flax NNX), presets and helpers."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .gpt import GPT, GPTConfig
from .layers import (LOGICAL_AXES, SHARDING_KEY, count_params, logical_axes,
                     matrices)
from .llama import Llama, LlamaConfig
from .lora import LoraSpec, rngs

__all__ = [
    'GPT', 'GPTConfig', 'Llama', 'LlamaConfig', 'LOGICAL_AXES', 'LoraSpec',
    'PRESETS', 'SHARDING_KEY', 'build', 'get_config', 'logical_axes',
    'blocks_key', 'matrices', 'pad_vocab', 'param_count', 'rngs',
    'stack_blocks', 'unstack_blocks',
]

Config = GPTConfig | LlamaConfig


def pad_vocab(vocab_size: int, multiple: int = 128) -> int:
  """Rounds `vocab_size` up to a multiple of `multiple`."""
  return -(-vocab_size // multiple) * multiple


PRESETS: dict[str, Config] = {
    'gpt-tiny': GPTConfig(
        vocab_size=256, max_seq_len=128, d_model=64, n_layers=2, n_heads=4,
        d_ff=256),
    'gpt345m': GPTConfig(
        vocab_size=pad_vocab(50257), max_seq_len=1024, d_model=1024,
        n_layers=24, n_heads=16, d_ff=4096),
    'llama-tiny': LlamaConfig(
        vocab_size=256, max_seq_len=128, d_model=64, n_layers=2, n_heads=4,
        n_kv_heads=2, d_ff=192),
    # Larger small models for studies on CPU (docs/results.md): about
    # 1M and 10M parameters at the byte vocabulary, still trainable on CPU.
    'llama-1m': LlamaConfig(
        vocab_size=256, max_seq_len=256, d_model=128, n_layers=5, n_heads=4,
        n_kv_heads=2, d_ff=384),
    'llama-10m': LlamaConfig(
        vocab_size=256, max_seq_len=256, d_model=320, n_layers=8, n_heads=8,
        n_kv_heads=4, d_ff=960),
    # 19.1M parameters, byte vocabulary: bench/network.py's model, sized so
    # that its dense gradient exchange outlasts a CPU worker's step at 1 Gb/s.
    'llama20m': LlamaConfig(
        vocab_size=256, max_seq_len=128, d_model=512, n_layers=6, n_heads=8,
        n_kv_heads=4, d_ff=1536),
    # H2O-Danube3-500M shape.
    'llama500m': LlamaConfig(
        vocab_size=32000, max_seq_len=8192, d_model=1536, n_layers=16,
        n_heads=16, n_kv_heads=8, d_ff=4096),
    # H2O-Danube-1.8B shape.
    'llama1.8b': LlamaConfig(
        vocab_size=32000, max_seq_len=2048, d_model=2560, n_layers=24,
        n_heads=32, n_kv_heads=8, d_ff=6912),
}


def get_config(name: str, **overrides: Any) -> Config:
  """Returns preset `name` with dataclass fields replaced by `overrides`."""
  if name not in PRESETS:
    raise ValueError(
        f'unknown model {name!r}; allowed: {", ".join(sorted(PRESETS))}')
  cfg = PRESETS[name]
  fields = {f.name for f in dataclasses.fields(cfg)}
  unknown = sorted(set(overrides) - fields)
  if unknown:
    raise ValueError(
        f'unknown config field(s) {unknown} for {name!r}; allowed: '
        f'{sorted(fields)}')
  if isinstance(cfg, GPTConfig) and 'n_heads' in overrides:
    overrides.setdefault('n_kv_heads', overrides['n_heads'])
  return dataclasses.replace(cfg, **overrides)


def build(cfg: Config, *, rngs: nnx.Rngs, dtype: Any = jnp.bfloat16,
          param_dtype: Any = jnp.float32) -> nnx.Module:
  """Instantiates the model for `cfg` (params in `param_dtype`)."""
  if isinstance(cfg, GPTConfig):
    return GPT(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
  if isinstance(cfg, LlamaConfig):
    return Llama(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
  raise TypeError(f'unsupported config type {type(cfg).__name__}')


def blocks_key(cfg: Config) -> str:
  """The name of the model's list of blocks: 'h' (GPT), 'layers' (Llama)."""
  return 'h' if isinstance(cfg, GPTConfig) else 'layers'


def unstack_blocks(cfg: Config, params: dict) -> dict:
  """A pure dict of a scanned model's parameters as the unrolled model's:
  its stacked blocks as blocks {0: ..., n_layers - 1: ...} (arrays sliced,
  `jax.ShapeDtypeStruct`s reshaped). Any other model's is returned as is."""
  if not cfg.scan_layers:
    return params

  def layer(x, i):
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
    return x[i]

  key = blocks_key(cfg)
  return {**params, key: {i: jax.tree.map(lambda x: layer(x, i), params[key])
                          for i in range(cfg.n_layers)}}


def stack_blocks(cfg: Config, params: dict) -> dict:
  """The inverse of `unstack_blocks` (numpy arrays stacked)."""
  if not cfg.scan_layers:
    return params
  key = blocks_key(cfg)
  blocks = [params[key][i] for i in range(cfg.n_layers)]
  return {**params, key: jax.tree.map(lambda *xs: np.stack(xs), *blocks)}


@functools.lru_cache(maxsize=None)
def param_count(cfg: Config) -> int:
  """Number of parameters, from abstract shapes only (nothing allocated)."""
  model = nnx.eval_shape(lambda: build(cfg, rngs=nnx.Rngs(0)))
  return count_params(nnx.state(model, nnx.Param))
