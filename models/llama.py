"""Llama (Flax NNX) with HF-compatible parameter names.

RMSNorm, RoPE (rotate-half), SwiGLU MLP, grouped-query attention, no biases,
untied input/output embeddings.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from . import layers
from . import lora as lora_lib

# The linear layers of a decoder layer: the LoRA targets (or their suffixes).
LINEARS = ('self_attn.q_proj', 'self_attn.k_proj', 'self_attn.v_proj',
           'self_attn.o_proj', 'mlp.gate_proj', 'mlp.up_proj', 'mlp.down_proj')


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Llama shape. `vocab_size` is the padded size actually allocated."""

  vocab_size: int
  max_seq_len: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  d_ff: int
  norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  init_std: float = 0.02
  remat: bool = False
  # The layers as one module of stacked parameters, run by `nnx.scan`:
  # traced and compiled once, not once per layer.
  scan_layers: bool = False
  attn_impl: str = 'xla'  # one of layers.ATTN_IMPLS.
  lora: lora_lib.LoraSpec | None = None  # adapters on these layers
  family: str = 'llama'

  def __post_init__(self):
    if self.family != 'llama':
      raise ValueError(
          f"LlamaConfig.family must be 'llama', got {self.family!r}")
    if self.d_model % self.n_heads:
      raise ValueError(
          f'd_model={self.d_model} not divisible by n_heads={self.n_heads}')
    if self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
      raise ValueError(
          f'n_heads={self.n_heads} not a multiple of '
          f'n_kv_heads={self.n_kv_heads}')
    if self.head_dim % 2:
      raise ValueError(f'RoPE needs an even head_dim, got {self.head_dim}')
    if self.attn_impl not in layers.ATTN_IMPLS:
      raise ValueError(
          f'attn_impl={self.attn_impl!r} not in {layers.ATTN_IMPLS}')
    lora_lib.check_targets(self.lora, LINEARS, 'llama')

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads


class Attention(nnx.Module):
  """Grouped-query causal self-attention with RoPE on q and k."""

  def __init__(self, cfg: LlamaConfig, *, dtype: Any, param_dtype: Any,
               rngs: nnx.Rngs):
    d, hd = cfg.d_model, cfg.head_dim
    kw = dict(std=cfg.init_std, use_bias=False, dtype=dtype,
              param_dtype=param_dtype, rngs=rngs, spec=cfg.lora)
    linear = lora_lib.linear
    self.n_heads = cfg.n_heads
    self.n_kv_heads = cfg.n_kv_heads
    self.head_dim = hd
    self.rope_theta = cfg.rope_theta
    self.attn_impl = cfg.attn_impl
    self.q_proj = linear('self_attn.q_proj', d, cfg.n_heads * hd,
                         ('embed', 'heads'), **kw)
    self.k_proj = linear('self_attn.k_proj', d, cfg.n_kv_heads * hd,
                         ('embed', 'kv'), **kw)
    self.v_proj = linear('self_attn.v_proj', d, cfg.n_kv_heads * hd,
                         ('embed', 'kv'), **kw)
    self.o_proj = linear('self_attn.o_proj', cfg.n_heads * hd, d,
                         ('heads', 'embed'), **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, _ = x.shape
    hd = self.head_dim
    q = self.q_proj(x).reshape(b, t, self.n_heads, hd)
    k = self.k_proj(x).reshape(b, t, self.n_kv_heads, hd)
    v = self.v_proj(x).reshape(b, t, self.n_kv_heads, hd)
    cos, sin = layers.rope_cos_sin(jnp.arange(t), hd, self.rope_theta)
    q = layers.apply_rope(q, cos, sin)
    k = layers.apply_rope(k, cos, sin)
    y = layers.causal_attention(q, k, v, impl=self.attn_impl)
    return self.o_proj(y.reshape(b, t, self.n_heads * hd))


class MLP(nnx.Module):
  """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

  def __init__(self, cfg: LlamaConfig, *, dtype: Any, param_dtype: Any,
               rngs: nnx.Rngs):
    d, f = cfg.d_model, cfg.d_ff
    kw = dict(std=cfg.init_std, use_bias=False, dtype=dtype,
              param_dtype=param_dtype, rngs=rngs, spec=cfg.lora)
    linear = lora_lib.linear
    self.gate_proj = linear('mlp.gate_proj', d, f, ('embed', 'mlp'), **kw)
    self.up_proj = linear('mlp.up_proj', d, f, ('embed', 'mlp'), **kw)
    self.down_proj = linear('mlp.down_proj', f, d, ('mlp', 'embed'), **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
  """Pre-RMSNorm decoder layer."""

  def __init__(self, cfg: LlamaConfig, *, dtype: Any, param_dtype: Any,
               rngs: nnx.Rngs):
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.input_layernorm = _rms_norm(cfg, **kw)
    self.self_attn = Attention(cfg, **kw)
    self.post_attention_layernorm = _rms_norm(cfg, **kw)
    self.mlp = MLP(cfg, **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.self_attn(self.input_layernorm(x))
    return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nnx.Module):
  """Llama language model: int32 tokens [B, T] -> fp32 logits [B, T, V]."""

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs,
               dtype: Any = jnp.bfloat16, param_dtype: Any = jnp.float32):
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.cfg = cfg
    self.dtype = dtype
    self.embed_tokens = nnx.Embed(
        cfg.vocab_size, cfg.d_model,
        embedding_init=layers.normal(cfg.init_std, ('vocab', 'embed')), **kw)
    block = functools.partial(DecoderLayer, cfg, dtype=dtype,
                              param_dtype=param_dtype)
    self.layers = (
        layers.stack(block, cfg.n_layers, rngs) if cfg.scan_layers else
        nnx.List([block(rngs=rngs) for _ in range(cfg.n_layers)]))
    self.norm = _rms_norm(cfg, **kw)
    self.lm_head = layers.linear(
        cfg.d_model, cfg.vocab_size, ('embed', 'vocab'), std=cfg.init_std,
        use_bias=False, **kw)

  def __call__(self, tokens: jax.Array, *,
               param_hook: layers.ParamHook | None = None) -> jax.Array:
    """Logits; `param_hook` supplies each unit's parameters (`run_unit`)."""
    layers.check_seq_len(tokens, self.cfg.max_seq_len)
    x = layers.run_unit(_embed, (self.embed_tokens,), tokens,
                        hook=param_hook)
    x = layers.run_blocks(self.layers, x, self.cfg.remat, param_hook)
    return layers.run_unit(functools.partial(_head, dtype=self.dtype),
                           (self.norm, self.lm_head), x, hook=param_hook)


def _embed(embed_tokens: nnx.Embed, tokens: jax.Array) -> jax.Array:
  return embed_tokens(tokens)


def _head(norm: nnx.RMSNorm, lm_head: nnx.Linear, x: jax.Array, *,
          dtype: Any) -> jax.Array:
  """Output layer: bf16 inputs, fp32 accumulation and result."""
  x = norm(x).astype(dtype)
  kernel = lm_head.kernel.get_value().astype(dtype)
  return jnp.einsum(
      'btd,dv->btv', x, kernel, preferred_element_type=jnp.float32)


def _rms_norm(cfg: LlamaConfig, *, dtype: Any, param_dtype: Any,
              rngs: nnx.Rngs) -> nnx.RMSNorm:
  return nnx.RMSNorm(
      cfg.d_model, epsilon=cfg.norm_eps, dtype=dtype, param_dtype=param_dtype,
      scale_init=layers.ones(('embed',)), rngs=rngs)
