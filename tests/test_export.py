"""`python -m scape_jax.export_hf`: what it refuses, and what a failure leaves.

No safetensors or transformers needed: `hf.save_pretrained` is replaced by a
stand-in that writes the same two files (test_hf.py checks the real files).
"""

import os
import stat

import models
from scape_jax import export_hf
from scape_jax import hf
from scape_jax.data import prepare
from scape_jax.train import config as config_lib
from scape_jax.train.checkpoint import Checkpointer
from tests.tiny_runs import tiny_tokenizer_json


def _run(tmp_path, tokenizer='byte', recorded=None):
  """A run directory whose checkpoint holds llama-tiny's parameters."""
  cfg = config_lib.load(None, [f'--config.data.tokenizer={tokenizer}'])
  params = models.build(models.get_config(cfg.model.preset),
                        rngs=models.rngs(0))
  from flax import nnx  # pylint: disable=g-import-not-at-top
  params = nnx.to_pure_dict(nnx.state(params, nnx.Param))
  run = tmp_path / 'run'
  extras = {'config': config_lib.to_dict(cfg)}
  if recorded is not None:
    extras['tokenizer'] = {'spec': tokenizer, 'sha256': recorded}
  with Checkpointer(str(run / 'ckpt')) as ckpt:
    ckpt.save(1, {'params': params}, extras)
  return run


def _fake_save(directory, cfg, params, **kw):  # pylint: disable=unused-argument
  for name in (hf.convert.CONFIG_FILE, hf.convert.WEIGHTS_FILE):
    with open(os.path.join(directory, name), 'w') as f:
      f.write('new')


def _export(run, out, *flags):
  return export_hf.main(['--run', str(run), '--out', str(out), *flags])


def test_a_non_empty_out_is_refused_unless_forced(tmp_path, capsys,
                                                  monkeypatch):
  monkeypatch.setattr(hf, 'save_pretrained', _fake_save)
  run, out = _run(tmp_path), tmp_path / 'model'
  out.mkdir()
  (out / 'config.json').write_text('another model')
  (out / 'model.safetensors.index.json').write_text('{}')
  assert _export(run, out) == 2
  assert 'is not empty (2 entries)' in capsys.readouterr().err
  assert (out / 'config.json').read_text() == 'another model'
  # --force replaces the directory whole: no stale shard index is left.
  assert _export(run, out, '--force') == 0
  assert sorted(os.listdir(out)) == sorted(
      ['config.json', 'model.safetensors', 'tokenizer.json',
       'tokenizer_config.json', 'special_tokens_map.json'])
  assert (out / 'config.json').read_text() == 'new'
  umask = os.umask(0)
  os.umask(umask)  # the files are as readable as any the user writes
  assert stat.S_IMODE(os.stat(out / 'model.safetensors').st_mode) == (
      0o666 & ~umask)
  assert sorted(os.listdir(tmp_path)) == ['model', 'run']  # no temp dirs


def test_an_out_that_would_replace_the_run_is_refused(tmp_path, capsys,
                                                      monkeypatch):
  monkeypatch.setattr(hf, 'save_pretrained', _fake_save)
  run = _run(tmp_path)
  for out in (run, tmp_path, run / 'ckpt' / 'hf'):
    assert _export(run, out, '--force') == 2
    assert 'replace the run\'s checkpoints' in capsys.readouterr().err
    assert sorted(os.listdir(run)) == ['ckpt']
  assert _export(run, run / 'hf') == 0  # inside the run, beside ckpt/: fine
  assert capsys.readouterr().out.startswith('wrote LlamaForCausalLM of step 1')
  assert sorted(os.listdir(run)) == ['ckpt', 'hf']


def test_a_failed_export_leaves_out_as_it_was(tmp_path, capsys, monkeypatch):
  def failing_save(directory, cfg, params, **kw):
    _fake_save(directory, cfg, params, **kw)
    raise OSError(28, 'No space left on device')
  monkeypatch.setattr(hf, 'save_pretrained', failing_save)
  run, out = _run(tmp_path), tmp_path / 'model'
  out.mkdir()
  (out / 'config.json').write_text('the old export')
  assert _export(run, out, '--force') == 2
  assert 'No space left on device' in capsys.readouterr().err
  assert os.listdir(out) == ['config.json']
  assert (out / 'config.json').read_text() == 'the old export'
  assert sorted(os.listdir(tmp_path)) == ['model', 'run']


def test_a_tokenizer_not_found_is_an_error(tmp_path, capsys, monkeypatch):
  monkeypatch.setattr(hf, 'save_pretrained', _fake_save)
  run = _run(tmp_path, tokenizer='moved/tokenizer.json')
  assert _export(run, tmp_path / 'a') == 2
  err = capsys.readouterr().err
  assert "'moved/tokenizer.json' is not found from here" in err
  assert '--tokenizer PATH' in err and '--no-tokenizer' in err
  assert not (tmp_path / 'a').exists()
  assert _export(run, tmp_path / 'b', '--no-tokenizer') == 0
  assert sorted(os.listdir(tmp_path / 'b')) == ['config.json',
                                                'model.safetensors']
  path = tiny_tokenizer_json(tmp_path / 'tok.json', 'to be or not to be')
  assert _export(run, tmp_path / 'c', '--tokenizer', str(path)) == 0
  assert (tmp_path / 'c' / 'tokenizer.json').read_bytes() == path.read_bytes()
  not_json = tmp_path / 'config.json'
  not_json.write_text('{"model_type": "llama"}')
  assert _export(run, str(tmp_path / 'c') + '/', '--force', '--tokenizer',
                 str(not_json)) == 2  # one line, no traceback
  err = capsys.readouterr().err
  assert 'is not a tokenizers tokenizer.json' in err, err
  assert (tmp_path / 'c' / 'tokenizer.json').read_bytes() == path.read_bytes()


def test_a_tokenizer_changed_since_training_is_refused(tmp_path, capsys,
                                                       monkeypatch):
  monkeypatch.setattr(hf, 'save_pretrained', _fake_save)
  path = tiny_tokenizer_json(tmp_path / 'tok.json', 'to be or not to be')
  original = tmp_path / 'original.json'
  original.write_bytes(path.read_bytes())
  run = _run(tmp_path, tokenizer=str(path),
             recorded=prepare.sha256_file(str(path)))
  tiny_tokenizer_json(path, 'all the world is a stage')  # replaced in place
  assert _export(run, tmp_path / 'a') == 2
  assert 'is not the tokenizer the run trained with' in (
      capsys.readouterr().err)
  assert _export(run, tmp_path / 'b', '--tokenizer', str(original)) == 0
  assert _export(run, tmp_path / 'd', '--no-tokenizer') == 0
  # A run on a tokenizer.json corpus has no byte tokenizer to write.
  byte_run = _run(tmp_path / 'x', recorded=prepare.sha256_file(str(path)))
  assert _export(byte_run, tmp_path / 'c') == 2
  assert "not 'byte': give it with --tokenizer PATH" in (
      capsys.readouterr().err)
  assert sorted(os.listdir(tmp_path)) == ['b', 'd', 'original.json', 'run',
                                          'tok.json', 'x']
