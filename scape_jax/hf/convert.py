"""Our models' parameters <-> `transformers` GPT-2 and Llama checkpoints.

The models in `models/` use Hugging Face's module names, so the mapping is a
renaming rule, not a table:

* a path `h.0.attn.c_attn.kernel` becomes `transformer.h.0.attn.c_attn.weight`
  (GPT-2) and `layers.0.self_attn.q_proj.kernel` becomes
  `model.layers.0.self_attn.q_proj.weight` (Llama; `lm_head` has no prefix);
* `kernel`, `scale` and `embedding` are called `weight`;
* a Llama kernel is transposed (flax `Linear` stores [in, out], torch
  `nn.Linear` [out, in]); GPT-2's `Conv1D` stores [in, out] like flax, so its
  kernels are not;
* GPT-2 ties the output layer to `wte`, so `lm_head.weight` is not written;
  our Llama never ties it, and a tied Llama is read by copying the
  embedding.

The vocabulary is written as allocated (padded rows included), so logits
agree on every id. RoPE needs no permutation: both sides use the rotate-half
convention. Only `numpy` is needed here; files are read and written with
`safetensors`.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import numpy as np

import models

CONFIG_FILE = 'config.json'
WEIGHTS_FILE = 'model.safetensors'
INDEX_FILE = 'model.safetensors.index.json'

# Non-parameter buffers some GPT-2 checkpoints carry (causal masks).
_GPT2_BUFFERS = ('.attn.bias', '.attn.masked_bias')


class ConversionError(ValueError):
  """A checkpoint this model family cannot represent, or a missing tensor."""


def _flatten(tree: Mapping, prefix: str = '') -> dict[str, Any]:
  out = {}
  for key, value in tree.items():
    name = f'{prefix}{key}'
    if isinstance(value, Mapping):
      out.update(_flatten(value, name + '.'))
    else:
      out[name] = value
  return out


def _unflatten(flat: Mapping[str, Any]) -> dict:
  tree: dict = {}
  for name, value in flat.items():
    node = tree
    *parents, leaf = name.split('.')
    for part in parents:
      node = node.setdefault(int(part) if part.isdigit() else part, {})
    node[leaf] = value
  return tree


def _is_llama(cfg: models.Config) -> bool:
  if isinstance(cfg, models.LlamaConfig):
    return True
  if isinstance(cfg, models.GPTConfig):
    return False
  raise TypeError(f'unsupported model config {type(cfg).__name__}')


_RENAME = {'kernel': 'weight', 'scale': 'weight', 'embedding': 'weight',
           'bias': 'bias'}


def hf_name(cfg: models.Config, path: str) -> str:
  """The `transformers` name of our parameter `path` (dotted)."""
  module, leaf = path.rsplit('.', 1)
  if leaf not in _RENAME:
    raise ConversionError(
        f'{path}: transformers has no tensor for our {leaf!r} (LoRA '
        'adapters are merged into the base weights first: '
        'models.lora.merge_adapters)')
  name = f'{module}.{_RENAME[leaf]}'
  if _is_llama(cfg):
    return name if module == 'lm_head' else f'model.{name}'
  return f'transformer.{name}'


def _transposed(cfg: models.Config, path: str) -> bool:
  return _is_llama(cfg) and path.endswith('.kernel')


def to_hf_state(cfg: models.Config, params: Mapping) -> dict[str, np.ndarray]:
  """`transformers` state dict (numpy) from our params (a pure dict)."""
  state = {}
  for path, value in _flatten(params).items():
    x = np.asarray(value)
    state[hf_name(cfg, path)] = np.ascontiguousarray(
        x.T if _transposed(cfg, path) else x)
  return state


def _canonical_names(cfg: models.Config, tensors: Mapping) -> dict:
  """Adds the `transformer.` prefix some GPT-2 files omit; drops buffers."""
  if _is_llama(cfg):
    return dict(tensors)
  out = {}
  for name, x in tensors.items():
    if name.endswith(_GPT2_BUFFERS) or name == 'lm_head.weight':
      continue  # lm_head is tied to wte
    out[name if name.startswith('transformer.') else
        f'transformer.{name}'] = x
  return out


def from_hf_state(cfg: models.Config, tensors: Mapping,
                  abstract_params: Mapping, dtype: Any = None) -> dict:
  """Our params (a pure dict of numpy arrays) from a `transformers` state.

  Args:
    cfg: the model config (`from_hf_config`).
    tensors: name -> array (numpy), e.g. from `read_safetensors`.
    abstract_params: our params' pure dict of shapes (arrays or
      ShapeDtypeStructs); it fixes the names and shapes expected.
    dtype: cast every array to this dtype (default: keep).

  Raises:
    ConversionError: a tensor is missing, unexpected or of the wrong shape.
  """
  tensors = _canonical_names(cfg, tensors)
  tied = 'model.embed_tokens.weight' in tensors
  if _is_llama(cfg) and 'lm_head.weight' not in tensors and tied:
    tensors['lm_head.weight'] = tensors['model.embed_tokens.weight']
  problems, flat, used = [], {}, set()
  for path, want in _flatten(abstract_params).items():
    name = hf_name(cfg, path)
    x = tensors.get(name)
    if x is None:
      problems.append(f'{name}: missing')
      continue
    used.add(name)
    flip = _transposed(cfg, path)
    expected = tuple(want.shape)[::-1] if flip else tuple(want.shape)
    if tuple(np.shape(x)) != expected:
      problems.append(f'{name}: shape {tuple(np.shape(x))}, expected '
                      f'{expected}')
      continue
    x = np.asarray(x).T if flip else np.asarray(x)
    flat[path] = x if dtype is None else x.astype(dtype)
  problems += [f'{n}: not a parameter of this model'
               for n in sorted(set(tensors) - used)]
  if problems:
    raise ConversionError('the checkpoint does not fit the model:\n  ' +
                          '\n  '.join(problems[:12]))
  return _unflatten(flat)


# ----------------------------------------------------------------------------
# config.json


def to_hf_config(cfg: models.Config, dtype: str = 'float32',
                 **extra: Any) -> dict[str, Any]:
  """The `config.json` of `cfg` as `transformers` reads it."""
  if _is_llama(cfg):
    out = {
        'architectures': ['LlamaForCausalLM'], 'model_type': 'llama',
        'vocab_size': cfg.vocab_size, 'hidden_size': cfg.d_model,
        'intermediate_size': cfg.d_ff, 'num_hidden_layers': cfg.n_layers,
        'num_attention_heads': cfg.n_heads,
        'num_key_value_heads': cfg.n_kv_heads, 'head_dim': cfg.head_dim,
        'max_position_embeddings': cfg.max_seq_len, 'hidden_act': 'silu',
        'rms_norm_eps': cfg.norm_eps, 'rope_theta': cfg.rope_theta,
        'rope_parameters': {'rope_type': 'default',
                            'rope_theta': cfg.rope_theta},
        'attention_bias': False, 'mlp_bias': False,
        'tie_word_embeddings': False, 'initializer_range': cfg.init_std,
    }
  else:
    out = {
        'architectures': ['GPT2LMHeadModel'], 'model_type': 'gpt2',
        'vocab_size': cfg.vocab_size, 'n_embd': cfg.d_model,
        'n_layer': cfg.n_layers, 'n_head': cfg.n_heads, 'n_inner': cfg.d_ff,
        'n_positions': cfg.max_seq_len, 'n_ctx': cfg.max_seq_len,
        'activation_function': 'gelu_new',
        'layer_norm_epsilon': cfg.norm_eps, 'tie_word_embeddings': True,
        'initializer_range': cfg.init_std, 'scale_attn_weights': True,
        'resid_pdrop': 0.0, 'embd_pdrop': 0.0, 'attn_pdrop': 0.0,
    }
  out.update(dtype=dtype, torch_dtype=dtype, use_cache=True,
             bos_token_id=None, eos_token_id=None)
  out.update(extra)
  return out


def _require(hf: Mapping, checks: list[tuple[str, Any, Any]]) -> None:
  bad = [f'{key}={hf.get(key, default)!r} (supported: {want!r})'
         for key, want, default in checks
         if hf.get(key, default) != want and hf.get(key, default) is not None]
  if bad:
    raise ConversionError(f'unsupported {hf.get("model_type")} config: ' +
                          ', '.join(bad))


def _rope_theta(hf: Mapping) -> float:
  rope = hf.get('rope_parameters') or hf.get('rope_scaling') or {}
  kind = rope.get('rope_type', rope.get('type', 'default'))
  if kind != 'default':
    raise ConversionError(f'unsupported RoPE type {kind!r} (rope_parameters '
                          f'{rope!r}); supported: plain RoPE (default)')
  return float(rope.get('rope_theta', hf.get('rope_theta', 10000.0)))


def from_hf_config(hf: Mapping, **overrides: Any) -> models.Config:
  """Our model config from a `transformers` GPT-2 or Llama `config.json`."""
  kind = hf.get('model_type')
  if kind == 'llama':
    _require(hf, [('hidden_act', 'silu', 'silu'),
                  ('attention_bias', False, False), ('mlp_bias', False, False)])
    d, h = hf['hidden_size'], hf['num_attention_heads']
    if hf.get('head_dim') not in (None, d // h):
      raise ConversionError(f'head_dim={hf["head_dim"]} != hidden_size / '
                            f'num_attention_heads = {d // h} is not supported')
    fields = dict(
        vocab_size=hf['vocab_size'], max_seq_len=hf['max_position_embeddings'],
        d_model=d, n_layers=hf['num_hidden_layers'], n_heads=h,
        n_kv_heads=hf.get('num_key_value_heads') or h,
        d_ff=hf['intermediate_size'], norm_eps=hf.get('rms_norm_eps', 1e-6),
        rope_theta=_rope_theta(hf),
        init_std=hf.get('initializer_range', 0.02))
    return models.LlamaConfig(**{**fields, **overrides})
  if kind == 'gpt2':
    _require(hf, [('activation_function', 'gelu_new', 'gelu_new'),
                  ('scale_attn_weights', True, True),
                  ('scale_attn_by_inverse_layer_idx', False, False),
                  ('reorder_and_upcast_attn', False, False)])
    d = hf['n_embd']
    fields = dict(
        vocab_size=hf['vocab_size'], max_seq_len=hf['n_positions'],
        d_model=d, n_layers=hf['n_layer'], n_heads=hf['n_head'],
        d_ff=hf.get('n_inner') or 4 * d,
        norm_eps=hf.get('layer_norm_epsilon', 1e-5),
        init_std=hf.get('initializer_range', 0.02))
    return models.GPTConfig(**{**fields, **overrides})
  raise ConversionError(f'model_type={kind!r} is not supported; supported: '
                        "'gpt2' (GPT2LMHeadModel), 'llama' (LlamaForCausalLM)")


# ----------------------------------------------------------------------------
# Files.


def _safetensors():
  try:
    import safetensors.numpy  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError('reading and writing Hugging Face checkpoints needs '
                      "safetensors: pip install 'scape-jax[hf]'") from e
  return safetensors


def read_config(directory: str) -> dict[str, Any]:
  path = os.path.join(directory, CONFIG_FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(f'{path} not found: expected a transformers '
                            'model directory (config.json + '
                            'model.safetensors)')
  with open(path, encoding='utf-8') as f:
    return json.load(f)


def read_safetensors(directory: str) -> dict[str, np.ndarray]:
  """Every tensor of `model.safetensors` (or its sharded index) as numpy."""
  st = _safetensors()
  index = os.path.join(directory, INDEX_FILE)
  if os.path.isfile(index):
    with open(index, encoding='utf-8') as f:
      files = sorted(set(json.load(f)['weight_map'].values()))
  elif os.path.isfile(os.path.join(directory, WEIGHTS_FILE)):
    files = [WEIGHTS_FILE]
  else:
    raise FileNotFoundError(
        f'no {WEIGHTS_FILE} or {INDEX_FILE} in {directory}; a PyTorch-only '
        'checkpoint (pytorch_model.bin) can be converted with transformers: '
        'AutoModelForCausalLM.from_pretrained(d).save_pretrained(d)')
  tensors = {}
  for name in files:
    tensors.update(st.numpy.load_file(os.path.join(directory, name)))
  return tensors


def save_pretrained(directory: str, cfg: models.Config, params: Mapping,
                    **config_extra: Any) -> None:
  """Writes `config.json` and `model.safetensors` of `params` to `directory`."""
  st = _safetensors()
  state = to_hf_state(cfg, params)
  dtypes = {str(x.dtype) for x in state.values()}
  dtype = dtypes.pop() if len(dtypes) == 1 else 'float32'
  os.makedirs(directory, exist_ok=True)
  st.numpy.save_file(state, os.path.join(directory, WEIGHTS_FILE),
                     metadata={'format': 'pt'})
  with open(os.path.join(directory, CONFIG_FILE), 'w', encoding='utf-8') as f:
    json.dump(to_hf_config(cfg, dtype, **config_extra), f, indent=2)
    f.write('\n')
