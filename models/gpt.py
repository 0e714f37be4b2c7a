"""GPT-2 (Flax NNX) with HF-compatible parameter names.

Learned positional embeddings, pre-LayerNorm blocks, GELU (tanh) MLP, fused
qkv projection, biases everywhere, input/output embeddings tied.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from . import layers
from . import lora as lora_lib

# The linear layers of a block: the LoRA targets (or their suffixes).
LINEARS = ('attn.c_attn', 'attn.c_proj', 'mlp.c_fc', 'mlp.c_proj')


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """GPT-2 shape. `vocab_size` is the padded size actually allocated."""

  vocab_size: int
  max_seq_len: int
  d_model: int
  n_layers: int
  n_heads: int
  d_ff: int
  n_kv_heads: int | None = None  # None -> n_heads (GPT has no GQA).
  norm_eps: float = 1e-5
  init_std: float = 0.02
  remat: bool = False
  # The layers as one module of stacked parameters, run by `nnx.scan`:
  # traced and compiled once, not once per layer.
  scan_layers: bool = False
  attn_impl: str = 'xla'  # one of layers.ATTN_IMPLS.
  lora: lora_lib.LoraSpec | None = None  # adapters on these layers
  family: str = 'gpt'

  def __post_init__(self):
    if self.n_kv_heads is None:
      object.__setattr__(self, 'n_kv_heads', self.n_heads)
    if self.family != 'gpt':
      raise ValueError(f"GPTConfig.family must be 'gpt', got {self.family!r}")
    if self.n_kv_heads != self.n_heads:
      raise ValueError(
          f'GPT has no GQA: n_kv_heads={self.n_kv_heads} != '
          f'n_heads={self.n_heads}')
    if self.d_model % self.n_heads:
      raise ValueError(
          f'd_model={self.d_model} not divisible by n_heads={self.n_heads}')
    if self.attn_impl not in layers.ATTN_IMPLS:
      raise ValueError(
          f'attn_impl={self.attn_impl!r} not in {layers.ATTN_IMPLS}')
    lora_lib.check_targets(self.lora, LINEARS, 'gpt')

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads


class CausalSelfAttention(nnx.Module):
  """Multi-head causal self-attention with fused qkv (`c_attn`)."""

  def __init__(self, cfg: GPTConfig, *, dtype: Any, param_dtype: Any,
               rngs: nnx.Rngs):
    d = cfg.d_model
    kw = dict(use_bias=True, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
              spec=cfg.lora)
    self.n_heads = cfg.n_heads
    self.attn_impl = cfg.attn_impl
    self.c_attn = lora_lib.linear(
        'attn.c_attn', d, 3 * d, ('embed', 'heads'), std=cfg.init_std, **kw)
    self.c_proj = lora_lib.linear(
        'attn.c_proj', d, d, ('heads', 'embed'), std=_resid_std(cfg), **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, d = x.shape
    q, k, v = jnp.split(self.c_attn(x), 3, axis=-1)  # HF order: q, k, v.
    shape = (b, t, self.n_heads, d // self.n_heads)
    y = layers.causal_attention(
        q.reshape(shape), k.reshape(shape), v.reshape(shape),
        impl=self.attn_impl)
    return self.c_proj(y.reshape(b, t, d))


class MLP(nnx.Module):
  """GELU (tanh approximation) feed-forward."""

  def __init__(self, cfg: GPTConfig, *, dtype: Any, param_dtype: Any,
               rngs: nnx.Rngs):
    kw = dict(use_bias=True, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
              spec=cfg.lora)
    self.c_fc = lora_lib.linear('mlp.c_fc', cfg.d_model, cfg.d_ff,
                                ('embed', 'mlp'), std=cfg.init_std, **kw)
    self.c_proj = lora_lib.linear('mlp.c_proj', cfg.d_ff, cfg.d_model,
                                  ('mlp', 'embed'), std=_resid_std(cfg), **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.c_proj(jax.nn.gelu(self.c_fc(x), approximate=True))


class Block(nnx.Module):
  """Pre-LayerNorm transformer block."""

  def __init__(self, cfg: GPTConfig, *, dtype: Any, param_dtype: Any,
               rngs: nnx.Rngs):
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.ln_1 = _layer_norm(cfg, **kw)
    self.attn = CausalSelfAttention(cfg, **kw)
    self.ln_2 = _layer_norm(cfg, **kw)
    self.mlp = MLP(cfg, **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.ln_1(x))
    return x + self.mlp(self.ln_2(x))


class GPT(nnx.Module):
  """GPT-2 language model: int32 tokens [B, T] -> fp32 logits [B, T, V]."""

  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs,
               dtype: Any = jnp.bfloat16, param_dtype: Any = jnp.float32):
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.cfg = cfg
    self.dtype = dtype
    self.wte = nnx.Embed(
        cfg.vocab_size, cfg.d_model,
        embedding_init=layers.normal(cfg.init_std, ('vocab', 'embed')), **kw)
    self.wpe = nnx.Embed(
        cfg.max_seq_len, cfg.d_model,
        embedding_init=layers.normal(cfg.init_std, ('pos', 'embed')), **kw)
    block = functools.partial(Block, cfg, dtype=dtype,
                              param_dtype=param_dtype)
    self.h = (
        layers.stack(block, cfg.n_layers, rngs) if cfg.scan_layers else
        nnx.List([block(rngs=rngs) for _ in range(cfg.n_layers)]))
    self.ln_f = _layer_norm(cfg, **kw)

  def __call__(self, tokens: jax.Array, *,
               param_hook: layers.ParamHook | None = None) -> jax.Array:
    """Logits; `param_hook` supplies each unit's parameters (`run_unit`)."""
    layers.check_seq_len(tokens, self.cfg.max_seq_len)
    x = layers.run_unit(_embed, (self.wte, self.wpe), tokens, hook=param_hook)
    x = layers.run_blocks(self.h, x, self.cfg.remat, param_hook)
    return layers.run_unit(functools.partial(_head, dtype=self.dtype),
                           (self.ln_f, self.wte), x, hook=param_hook)


def _embed(wte: nnx.Embed, wpe: nnx.Embed, tokens: jax.Array) -> jax.Array:
  t = tokens.shape[1]
  return wte(tokens) + wpe(jnp.arange(t, dtype=jnp.int32))[None]


def _head(ln_f: nnx.LayerNorm, wte: nnx.Embed, x: jax.Array, *,
          dtype: Any) -> jax.Array:
  """Tied output layer: logits = h @ wte.T, bf16 inputs, fp32 accumulation."""
  x = ln_f(x)
  kernel = wte.embedding.get_value().astype(dtype)
  return jnp.einsum(
      'btd,vd->btv', x.astype(dtype), kernel,
      preferred_element_type=jnp.float32)


def _resid_std(cfg: GPTConfig) -> float:
  """GPT-2 scaled init for projections that write into the residual."""
  return cfg.init_std / math.sqrt(2 * cfg.n_layers)


def _layer_norm(cfg: GPTConfig, *, dtype: Any, param_dtype: Any,
                rngs: nnx.Rngs) -> nnx.LayerNorm:
  return nnx.LayerNorm(
      cfg.d_model, epsilon=cfg.norm_eps, dtype=dtype, param_dtype=param_dtype,
      scale_init=layers.ones(('embed',)), bias_init=layers.zeros(('embed',)),
      rngs=rngs)
