"""The Hugging Face name/layout mapping, checked without torch.

Parity with `transformers` itself (logits) is in test_hf.py (`make test-hf`).
"""

import json

import jax
import numpy as np
import pytest
from flax import nnx

import models
from scape_jax import hf
from scape_jax.hf import convert
from scape_jax.train.checkpoint import Checkpointer, CheckpointError

PRESETS = ('llama-tiny', 'gpt-tiny')


def _params(preset, seed=0):
  cfg = models.get_config(preset)
  model = models.build(cfg, rngs=nnx.Rngs(seed))
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  rng = np.random.default_rng(seed)
  return cfg, jax.tree.map(
      lambda x: np.asarray(x) + rng.normal(size=x.shape).astype(np.float32),
      params)


def test_llama_names_and_layouts():
  cfg, params = _params('llama-tiny')
  state = hf.to_hf_state(cfg, params)
  q = params['layers'][1]['self_attn']['q_proj']['kernel']
  np.testing.assert_array_equal(
      state['model.layers.1.self_attn.q_proj.weight'], q.T)  # torch: [out, in]
  np.testing.assert_array_equal(state['lm_head.weight'],
                                params['lm_head']['kernel'].T)
  np.testing.assert_array_equal(state['model.norm.weight'],
                                params['norm']['scale'])
  assert state['model.layers.0.self_attn.k_proj.weight'].shape == (
      cfg.n_kv_heads * cfg.head_dim, cfg.d_model)
  assert len(state) == 2 + 1 + 9 * cfg.n_layers


def test_gpt2_names_and_layouts():
  cfg, params = _params('gpt-tiny')
  state = hf.to_hf_state(cfg, params)
  kernel = params['h'][0]['attn']['c_attn']['kernel']
  np.testing.assert_array_equal(  # Conv1D stores [in, out], as flax does
      state['transformer.h.0.attn.c_attn.weight'], kernel)
  np.testing.assert_array_equal(state['transformer.ln_f.bias'],
                                params['ln_f']['bias'])
  assert 'lm_head.weight' not in state  # tied to wte
  assert state['transformer.wpe.weight'].shape == (cfg.max_seq_len,
                                                   cfg.d_model)


@pytest.mark.parametrize('preset', PRESETS)
def test_round_trip_is_exact(preset):
  cfg, params = _params(preset)
  back = hf.from_hf_state(cfg, hf.to_hf_state(cfg, params), params)
  jax.tree.map(np.testing.assert_array_equal, back, params)
  assert hf.from_hf_config(hf.to_hf_config(cfg)) == cfg


def test_gpt2_files_without_prefix_and_with_buffers():
  cfg, params = _params('gpt-tiny')
  state = {k.removeprefix('transformer.'): v
           for k, v in hf.to_hf_state(cfg, params).items()}
  state['h.0.attn.bias'] = np.ones((1, 1, 4, 4))  # an old causal-mask buffer
  state['lm_head.weight'] = state['wte.weight']
  back = hf.from_hf_state(cfg, state, params)
  jax.tree.map(np.testing.assert_array_equal, back, params)


def test_tied_llama_copies_the_embedding():
  cfg, params = _params('llama-tiny')
  state = hf.to_hf_state(cfg, params)
  del state['lm_head.weight']
  config = {**hf.to_hf_config(cfg), 'tie_word_embeddings': True}
  back = hf.from_hf_state(cfg, state, params,
                          tie_word_embeddings=hf.tied_embeddings(config))
  np.testing.assert_array_equal(back['lm_head']['kernel'],
                                params['embed_tokens']['embedding'].T)


@pytest.mark.parametrize('tie', [False, None])  # None: transformers' default
def test_an_untied_llama_without_its_head_is_refused(tie):
  cfg, params = _params('llama-tiny')
  state = hf.to_hf_state(cfg, params)
  del state['lm_head.weight']
  config = hf.to_hf_config(cfg)
  if tie is None:
    del config['tie_word_embeddings']
  assert hf.tied_embeddings(config) is False
  with pytest.raises(hf.ConversionError, match='lm_head.weight: missing'):
    hf.from_hf_state(cfg, state, params,
                     tie_word_embeddings=hf.tied_embeddings(config))


def test_an_untied_gpt2_is_refused():
  cfg, params = _params('gpt-tiny')
  config = {**hf.to_hf_config(cfg), 'tie_word_embeddings': False}
  with pytest.raises(hf.ConversionError,
                     match=r"tie_word_embeddings=False \(supported: True\)"):
    hf.from_hf_config(config)
  state = hf.to_hf_state(cfg, params)  # a head of its own, config or not
  state['lm_head.weight'] = state['transformer.wte.weight'] + 1
  with pytest.raises(hf.ConversionError,
                     match='lm_head.weight differs from wte.weight'):
    hf.from_hf_state(cfg, state, params)


@pytest.mark.parametrize('preset, key, value, message', [
    ('llama-tiny', 'hidden_size', None, 'has no hidden_size'),
    ('llama-tiny', 'num_hidden_layers', '2', "num_hidden_layers='2'"),
    ('llama-tiny', 'num_key_value_heads', 0, 'num_key_value_heads=0'),
    ('gpt-tiny', 'n_embd', None, 'has no n_embd'),
    ('gpt-tiny', 'n_head', 2.5, 'n_head=2.5'),
])
def test_a_missing_or_bad_size_is_named(preset, key, value, message):
  config = hf.to_hf_config(models.get_config(preset))
  if value is None:
    del config[key]
  else:
    config[key] = value
  with pytest.raises(hf.ConversionError) as e:
    hf.from_hf_config(config)
  assert message in str(e.value)
  assert 'positive integer' in str(e.value)


def test_an_old_gpt2_config_with_only_n_ctx():
  cfg = models.get_config('gpt-tiny')
  config = hf.to_hf_config(cfg)
  del config['n_positions']
  assert hf.from_hf_config(config) == cfg


def test_unreadable_files_are_named(tmp_path):
  pytest.importorskip('safetensors.numpy',
                      reason="needs safetensors: pip install '.[hf]'")
  cfg, params = _params('gpt-tiny')
  hf.save_pretrained(str(tmp_path), cfg, params)
  weights = tmp_path / convert.WEIGHTS_FILE
  weights.write_bytes(weights.read_bytes()[:1000])  # a download cut short
  with pytest.raises(hf.ConversionError) as e:
    hf.read_safetensors(str(tmp_path))
  assert f'{weights}: not a readable safetensors file' in str(e.value)
  (tmp_path / convert.INDEX_FILE).write_text('{"metadata": {}}')
  with pytest.raises(hf.ConversionError, match='no "weight_map" object'):
    hf.read_safetensors(str(tmp_path))


@pytest.mark.parametrize('text, message', [
    ('{"model_type": "gpt2",', 'config.json: not valid JSON'),
    ('[1, 2]', 'config.json: expected a JSON object, got list')])
def test_an_unreadable_config_json_is_named(tmp_path, text, message):
  (tmp_path / convert.CONFIG_FILE).write_text(text)
  with pytest.raises(hf.ConversionError, match=message):
    hf.read_config(str(tmp_path))


def test_missing_extra_and_misshapen_tensors_are_named():
  cfg, params = _params('llama-tiny')
  state = hf.to_hf_state(cfg, params)
  del state['model.layers.0.mlp.up_proj.weight']
  state['model.layers.0.mlp.gate_proj.weight'] = np.zeros((3, 3))
  state['model.extra.weight'] = np.zeros(3)
  with pytest.raises(hf.ConversionError) as e:
    hf.from_hf_state(cfg, state, params)
  text = str(e.value)
  assert 'model.layers.0.mlp.up_proj.weight: missing' in text
  assert 'gate_proj.weight: shape (3, 3), expected (192, 64)' in text
  assert 'model.extra.weight: not a parameter' in text
  for name in list(state)[:20]:
    del state[name]
  with pytest.raises(hf.ConversionError, match=r'\.\.\. and \d+ more$'):
    hf.from_hf_state(cfg, state, params)


@pytest.mark.parametrize('change, message', [
    ({'model_type': 'mistral'}, "model_type='mistral' is not supported"),
    ({'rope_parameters': {'rope_type': 'llama3', 'rope_theta': 5e5}},
     "unsupported RoPE type 'llama3'"),
    ({'hidden_act': 'gelu'},
     "hidden_act='gelu' (supported: 'silu' or 'swish')"),
    ({'attention_bias': True}, 'attention_bias=True'),
    ({'head_dim': 32}, 'head_dim=32'),
])
def test_unsupported_llama_configs_are_refused(change, message):
  config = hf.to_hf_config(models.get_config('llama-tiny'))
  config.update(change)
  with pytest.raises(hf.ConversionError, match=None) as e:
    hf.from_hf_config(config)
  assert message in str(e.value)


@pytest.mark.parametrize('preset, key, alias', [
    ('llama-tiny', 'hidden_act', 'swish'),  # both nn.SiLU in ACT2FN
    ('gpt-tiny', 'activation_function', 'gelu_pytorch_tanh'),  # tanh GELU
])
def test_activation_aliases_are_accepted(preset, key, alias):
  cfg = models.get_config(preset)
  assert hf.from_hf_config({**hf.to_hf_config(cfg), key: alias}) == cfg
  with pytest.raises(hf.ConversionError, match=f"{key}='relu'"):
    hf.from_hf_config({**hf.to_hf_config(cfg), key: 'relu'})


def test_gpt2_config_defaults():
  cfg = hf.from_hf_config({'model_type': 'gpt2', 'vocab_size': 50257,
                           'n_embd': 768, 'n_layer': 12, 'n_head': 12,
                           'n_positions': 1024, 'n_inner': None})
  assert (cfg.d_ff, cfg.norm_eps, cfg.vocab_size) == (3072, 1e-5, 50257)


def test_byte_tokenizer_ids_are_the_utf8_bytes():
  tok = hf.byte_tokenizer()
  text = 'To be, or not\n\tto be:  ¿über 日本? \x00\x7f end '
  ids = tok.encode(text).ids
  assert ids == list(text.encode('utf-8'))
  assert tok.decode(ids) == text
  assert tok.get_vocab_size() == 256


def test_partial_restore_reads_only_the_params(tmp_path):
  params = {'w': np.arange(6, dtype=np.float32).reshape(2, 3)}
  state = {'params': params, 'opt': {'residual': np.ones((8, 5), np.float32)}}
  with Checkpointer(str(tmp_path)) as ckpt:
    ckpt.save(7, state, {'config': {'steps': 7}})
  ckpt = Checkpointer(str(tmp_path))
  assert ckpt.read_extras(None) == (7, {'config': {'steps': 7}})
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = {'params': {'w': jax.ShapeDtypeStruct((2, 3), np.float32,
                                                 sharding=device)}}
  with pytest.raises(CheckpointError, match="'opt'.*not in abstract_state"):
    ckpt.restore(7, target)
  restored, extras = ckpt.restore(None, target, partial=True)
  np.testing.assert_array_equal(restored['params']['w'], params['w'])
  assert set(restored) == {'params'} and extras['config'] == {'steps': 7}
  with pytest.raises(CheckpointError, match='no checkpoint for step 3'):
    ckpt.read_extras(3)


def test_save_pretrained_writes_config_and_weights(tmp_path):
  st = pytest.importorskip('safetensors.numpy',
                           reason="needs safetensors: pip install '.[hf]'")
  cfg, params = _params('gpt-tiny')
  hf.save_pretrained(str(tmp_path), cfg, params)
  config = hf.read_config(str(tmp_path))
  assert config['architectures'] == ['GPT2LMHeadModel']
  assert hf.from_hf_config(config) == cfg
  saved = st.load_file(str(tmp_path / convert.WEIGHTS_FILE))
  back = hf.from_hf_state(cfg, saved, params)
  jax.tree.map(np.testing.assert_array_equal, back, params)


def test_a_runs_tokenizer_json_is_copied_with_its_eos(tmp_path):
  from scape_jax import export_hf  # pylint: disable=g-import-not-at-top
  from scape_jax.train import config as config_lib  # pylint: disable=g-import-not-at-top
  from tests.tiny_runs import tiny_tokenizer_json  # pylint: disable=g-import-not-at-top
  path = tiny_tokenizer_json(tmp_path / 'tokenizer.json')
  tok = pytest.importorskip('tokenizers').Tokenizer.from_file(str(path))
  cfg = config_lib.load(None, [f'--config.data.tokenizer={path}'])
  spec = export_hf._tokenizer_spec(cfg, {}, None)  # pylint: disable=protected-access
  out = tmp_path / 'out'
  files, eos_id = export_hf._tokenizer_files(spec, str(out), 128)  # pylint: disable=protected-access
  assert eos_id == tok.token_to_id('<|endoftext|>') == 0
  assert (out / 'tokenizer.json').read_bytes() == path.read_bytes()
  config = json.loads((out / 'tokenizer_config.json').read_text())
  assert config['eos_token'] == '<|endoftext|>'
  assert config['model_max_length'] == 128 and 'tokenizer.json' in files
