"""Logit parity with `transformers` (PyTorch, CPU), export and import.

Export: a run's checkpoint -> `python -m scape_jax.export_hf` -> loaded by
`AutoModelForCausalLM`, whose logits must equal the JAX model's. Import:
a `transformers` checkpoint -> `--config.model.init_from=DIR` -> the run's
first parameters, whose logits must equal transformers'. Both in fp32, for
GPT-2 and Llama. Needs the `[hf]` extra (`make test-hf`).
"""

import os
import pathlib
import re

import jax
import numpy as np
import pytest

torch = pytest.importorskip(
    'torch', reason="the Hugging Face tests need the [hf] extra: pip install "
    "'.[hf]' (torch, transformers, safetensors); run them with make test-hf")
transformers = pytest.importorskip(
    'transformers', reason="needs the [hf] extra: pip install '.[hf]'")
pytest.importorskip('safetensors',
                    reason="needs the [hf] extra: pip install '.[hf]'")

# pylint: disable=g-import-not-at-top,wrong-import-position
from scape_jax import export_hf
from scape_jax import train as trainer
from scape_jax.train import config as config_lib
from scape_jax.train.checkpoint import Checkpointer

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOL = 1e-4
TOKENS = np.random.default_rng(0).integers(0, 256, size=(2, 24))


def _config(*overrides):
  return config_lib.load(None, ['--config.model.dtype=float32',
                                '--config.data.corpus=synthetic',
                                '--config.data.batch_size=8', *overrides])


def _hf_logits(directory, tokens=TOKENS):
  model = transformers.AutoModelForCausalLM.from_pretrained(
      directory, dtype=torch.float32)
  model.eval()
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.numpy()


def _perturbed(params, seed=1):
  """Every parameter moved off its init (LayerNorm ones, zero biases)."""
  keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(
      params))))
  return jax.tree.map(
      lambda x: x + 0.2 * jax.random.normal(next(keys), x.shape, x.dtype),
      params)


def _write_run(tmp_path, preset):
  """A checkpoint as the trainer writes it (SCAPE on 8 workers)."""
  run = tmp_path / 'runs' / preset
  cfg = _config(f'--config.model.preset={preset}', '--config.mesh.data=8',
                '--config.optimizer.name=scape', f'--config.out_dir={run}')
  program = trainer.build_program(cfg)
  params, opt_state = program.init_state()
  params = jax.jit(_perturbed, out_shardings=program.state_shardings()[0])(
      params)
  with Checkpointer(str(run / 'ckpt')) as ckpt:
    ckpt.save(5, {'params': params, 'opt': opt_state},
              {'config': config_lib.to_dict(cfg)})
  return run, program, params


@pytest.mark.parametrize('preset', ['llama-tiny', 'gpt-tiny'])
def test_export_parity(tmp_path, preset):
  run, program, params = _write_run(tmp_path, preset)
  out = run / 'hf'
  assert export_hf.main(['--run', str(run), '--out', str(out)]) == 0
  want = np.asarray(jax.jit(program.apply_fn)(params, TOKENS))
  got = _hf_logits(out)
  assert got.shape == want.shape == (2, 24, 256)
  np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
  tok = transformers.AutoTokenizer.from_pretrained(out)
  assert tok('Who is there?')['input_ids'] == list(b'Who is there?')
  if preset == 'llama-tiny':
    _run_readme_block(tmp_path, run)


def _run_readme_block(tmp_path, run):
  """README's "Use the trained model" Python block, on this export."""
  readme = (ROOT / 'README.md').read_text()
  section = readme.split('## Use the trained model', 1)[1].split('\n## ')[0]
  blocks = re.findall(r'```python\n(.*?)```', section, re.S)
  assert len(blocks) == 1, 'expected one Python block in the section'
  where = tmp_path / 'readme'
  (where / 'runs').mkdir(parents=True)
  os.symlink(run, where / 'runs' / 'shakespeare_llama_tiny')
  cwd = os.getcwd()
  try:
    os.chdir(where)
    exec(compile(blocks[0], 'README.md', 'exec'), {})  # pylint: disable=exec-used
  finally:
    os.chdir(cwd)


def _hf_model(kind, tied=False, act=None):
  torch.manual_seed(0)
  if kind == 'llama':
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=160,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, rms_norm_eps=1e-5,
        tie_word_embeddings=tied, hidden_act=act or 'silu')
    model = transformers.LlamaForCausalLM(config)
  else:
    config = transformers.GPT2Config(
        vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=128,
        n_inner=None, activation_function=act or 'gelu_new')
    model = transformers.GPT2LMHeadModel(config)
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.2 * torch.randn_like(p))
  return model


@pytest.mark.parametrize('kind, tied, act', [
    ('llama', False, None), ('llama', True, None), ('gpt2', True, None),
    ('llama', False, 'swish'), ('gpt2', True, 'gelu_pytorch_tanh')])
def test_import_parity(tmp_path, kind, tied, act):
  model = _hf_model(kind, tied, act)
  model.save_pretrained(tmp_path / 'hf')
  cfg = _config(f'--config.model.init_from={tmp_path / "hf"}',
                '--config.mesh.data=1')
  program = trainer.build_program(cfg, jax.devices()[:1])
  assert program.model_cfg.vocab_size == 300
  params, _ = program.init_state()
  got = np.asarray(jax.jit(program.apply_fn)(params, TOKENS))
  np.testing.assert_allclose(got, _hf_logits(tmp_path / 'hf'), atol=TOL,
                             rtol=0)


def test_continue_pretraining_from_a_transformers_model(tmp_path):
  """The trainer starts from the imported weights and trains on; the export
  of that run loads back into transformers with the trained logits."""
  _hf_model('gpt2').save_pretrained(tmp_path / 'hf')
  run = tmp_path / 'run'
  cfg = _config(f'--config.model.init_from={tmp_path / "hf"}',
                '--config.mesh.data=2', '--config.steps=2',
                '--config.eval_batches=1', '--config.log_every=1',
                f'--config.out_dir={run}',
                f'--config.data.data_dir={tmp_path / "data"}')
  trainer.train(cfg, jax.devices()[:2])
  program = trainer.build_program(cfg, jax.devices()[:2])
  state, _ = Checkpointer(str(run / 'ckpt')).restore(
      None, {'params': program.abstract_params}, partial=True)
  trained = jax.device_get(state['params'])
  imported = program.load_params()
  fresh = jax.device_get(program.init_params())
  # Two warmup steps move the imported weights by about 1e-5; a fresh init
  # is 0.2 away (the perturbation).
  moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), trained, imported)
  assert 0 < max(jax.tree.leaves(moved)) < 1e-3
  assert np.abs(trained['wte']['embedding'] -
                fresh['wte']['embedding']).max() > 0.1
  assert export_hf.main(['--run', str(run), '--out', str(tmp_path / 'o')]) == 0
  want = np.asarray(jax.jit(program.apply_fn)(state['params'], TOKENS))
  np.testing.assert_allclose(_hf_logits(tmp_path / 'o'), want, atol=TOL,
                             rtol=0)
