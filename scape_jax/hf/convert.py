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
* GPT-2 ties the output layer to `wte`, so `lm_head.weight` is not written
  (an untied GPT-2 is refused); our Llama never ties it, and a Llama whose
  config.json ties it (`tie_word_embeddings`) is read by copying the
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

from scape_jax import models

CONFIG_FILE = 'config.json'
WEIGHTS_FILE = 'model.safetensors'
INDEX_FILE = 'model.safetensors.index.json'

# Non-parameter buffers some GPT-2 checkpoints carry (causal masks).
_GPT2_BUFFERS = ('.attn.bias', '.attn.masked_bias')


# At most this many tensor problems are listed in one error.
_SHOWN = 12


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
  for path, value in _flatten(models.unstack_blocks(cfg, params)).items():
    x = np.asarray(value)
    state[hf_name(cfg, path)] = np.ascontiguousarray(
        x.T if _transposed(cfg, path) else x)
  return state


def _canonical_names(cfg: models.Config, tensors: Mapping) -> dict:
  """Adds the `transformer.` prefix some GPT-2 files omit; drops buffers and
  a GPT-2 `lm_head.weight` that is `wte`'s copy (refuses one that is not)."""
  if _is_llama(cfg):
    return dict(tensors)
  out = {}
  for name, x in tensors.items():
    if name.endswith(_GPT2_BUFFERS) or name == 'lm_head.weight':
      continue
    out[name if name.startswith('transformer.') else
        f'transformer.{name}'] = x
  head, wte = tensors.get('lm_head.weight'), out.get('transformer.wte.weight')
  if head is not None and wte is not None and not np.array_equal(head, wte):
    raise ConversionError(
        'lm_head.weight differs from wte.weight: this GPT-2 has its own '
        'output layer (untied); supported: GPT-2 with lm_head tied to wte')
  return out


def tied_embeddings(hf: Mapping) -> bool:
  """Whether a `config.json` ties the output layer to the embedding: its
  `tie_word_embeddings`, else transformers' default for its model type
  (GPT-2 ties it, Llama does not)."""
  tied = hf.get('tie_word_embeddings')
  return hf.get('model_type') == 'gpt2' if tied is None else bool(tied)


def from_hf_state(cfg: models.Config, tensors: Mapping,
                  abstract_params: Mapping, dtype: Any = None, *,
                  tie_word_embeddings: bool | None = None) -> dict:
  """Our params (a pure dict of numpy arrays) from a `transformers` state.

  Args:
    cfg: the model config (`from_hf_config`).
    tensors: name -> array (numpy), e.g. from `read_safetensors`.
    abstract_params: our params' pure dict of shapes (arrays or
      ShapeDtypeStructs); it fixes the names and shapes expected.
    dtype: cast every array to this dtype (default: keep).
    tie_word_embeddings: the checkpoint's `tied_embeddings(config)`. A Llama
      state without `lm_head.weight` takes the embedding only when True;
      default: transformers' (GPT-2 tied, Llama not).

  Raises:
    ConversionError: a tensor is missing, unexpected or of the wrong shape;
      a GPT-2 whose `lm_head.weight` is not `wte`'s.
  """
  tensors = _canonical_names(cfg, tensors)
  if tie_word_embeddings is None:
    tie_word_embeddings = not _is_llama(cfg)
  if (_is_llama(cfg) and 'lm_head.weight' not in tensors and
      tie_word_embeddings and 'model.embed_tokens.weight' in tensors):
    tensors['lm_head.weight'] = tensors['model.embed_tokens.weight']
  problems, flat, used = [], {}, set()
  abstract_params = models.unstack_blocks(cfg, abstract_params)
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
    more = len(problems) - _SHOWN
    raise ConversionError(
        'the checkpoint does not fit the model:\n  ' +
        '\n  '.join(problems[:_SHOWN]) +
        (f'\n  ... and {more} more' if more > 0 else ''))
  return models.stack_blocks(cfg, _unflatten(flat))


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
  """Each (key, supported, default): `supported` is a value or a tuple of
  names for the same function (transformers' `ACT2FN` aliases)."""
  bad = []
  for key, want, default in checks:
    value, names = hf.get(key, default), (
        want if isinstance(want, tuple) else (want,))
    if value is not None and value not in names:
      bad.append(f'{key}={value!r} (supported: '
                 f'{" or ".join(map(repr, names))})')
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


def _size(hf: Mapping, *keys: str) -> int:
  """The first of `keys` that `hf` holds (later ones: older spellings), which
  must be a positive integer."""
  for key in keys:
    if hf.get(key) is not None:
      value = hf[key]
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConversionError(f'{key}={value!r} in the {hf.get("model_type")}'
                              ' config.json; expected a positive integer')
      return value
  raise ConversionError(
      f'the {hf.get("model_type")} config.json has no {" or ".join(keys)}; '
      'expected a positive integer there')


def from_hf_config(hf: Mapping, **overrides: Any) -> models.Config:
  """Our model config from a `transformers` GPT-2 or Llama `config.json`."""
  kind = hf.get('model_type')
  if kind == 'llama':
    _require(hf, [('hidden_act', ('silu', 'swish'), 'silu'),
                  ('attention_bias', False, False), ('mlp_bias', False, False)])
    d, h = _size(hf, 'hidden_size'), _size(hf, 'num_attention_heads')
    if hf.get('head_dim') not in (None, d // h):
      raise ConversionError(f'head_dim={hf["head_dim"]} != hidden_size / '
                            f'num_attention_heads = {d // h} is not supported')
    kv = 'num_key_value_heads'
    fields = dict(
        vocab_size=_size(hf, 'vocab_size'),
        max_seq_len=_size(hf, 'max_position_embeddings'),
        d_model=d, n_layers=_size(hf, 'num_hidden_layers'), n_heads=h,
        n_kv_heads=h if hf.get(kv) is None else _size(hf, kv),
        d_ff=_size(hf, 'intermediate_size'),
        norm_eps=hf.get('rms_norm_eps', 1e-6), rope_theta=_rope_theta(hf),
        init_std=hf.get('initializer_range', 0.02))
    return models.LlamaConfig(**{**fields, **overrides})
  if kind == 'gpt2':
    _require(hf, [('activation_function', ('gelu_new', 'gelu_pytorch_tanh'),
                   'gelu_new'),
                  ('scale_attn_weights', True, True),
                  ('scale_attn_by_inverse_layer_idx', False, False),
                  ('reorder_and_upcast_attn', False, False),
                  ('tie_word_embeddings', True, True)])
    d = _size(hf, 'n_embd')
    fields = dict(
        vocab_size=_size(hf, 'vocab_size'),
        max_seq_len=_size(hf, 'n_positions', 'n_ctx'),
        d_model=d, n_layers=_size(hf, 'n_layer'), n_heads=_size(hf, 'n_head'),
        d_ff=d * 4 if hf.get('n_inner') is None else _size(hf, 'n_inner'),
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
    try:
      config = json.load(f)
    except ValueError as e:
      raise ConversionError(f'{path}: not valid JSON ({e})') from None
  if not isinstance(config, dict):
    raise ConversionError(f'{path}: expected a JSON object, got '
                          f'{type(config).__name__}')
  return config


def read_safetensors(directory: str) -> dict[str, np.ndarray]:
  """Every tensor of `model.safetensors` (or its sharded index) as numpy."""
  st = _safetensors()
  index = os.path.join(directory, INDEX_FILE)
  if os.path.isfile(index):
    with open(index, encoding='utf-8') as f:
      try:
        weight_map = json.load(f).get('weight_map')
      except (ValueError, AttributeError) as e:
        raise ConversionError(f'{index}: not a JSON object ({e})') from None
    if not isinstance(weight_map, dict):
      raise ConversionError(f'{index}: no "weight_map" object (tensor name '
                            '-> file name)')
    files = sorted(set(weight_map.values()))
  elif os.path.isfile(os.path.join(directory, WEIGHTS_FILE)):
    files = [WEIGHTS_FILE]
  else:
    raise FileNotFoundError(
        f'no {WEIGHTS_FILE} or {INDEX_FILE} in {directory}; a PyTorch-only '
        'checkpoint (pytorch_model.bin) can be converted with transformers: '
        'AutoModelForCausalLM.from_pretrained(d).save_pretrained(d)')
  tensors = {}
  for name in files:
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
      raise FileNotFoundError(f'{path} not found (named by {INDEX_FILE})')
    try:
      tensors.update(st.numpy.load_file(path))
    except Exception as e:  # pylint: disable=broad-except
      # safetensors' own error type is no OSError/ValueError.
      raise ConversionError(f'{path}: not a readable safetensors file, '
                            f'perhaps cut short ({e})') from None
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
