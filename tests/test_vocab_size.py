"""`model.vocab_size`: a preset trained with a tokenizer larger than its
vocabulary (llama-tiny, 256 ids, with a 600-token tokenizer).

Without the key the run stops with a message that names it and a value; with
it the run trains, and the model's embedding has that many rows.
"""

import json

import pytest

from scape_jax import train as trainer
from scape_jax.data.prepare import CorpusError
from scape_jax.train import config as config_lib
from scape_jax.train import program as program_lib
from tiny_runs import run_config

TOKENS = 600


def _tokenizer_and_corpus(tmp_path):
  """A 600-token word-level tokenizer.json and a corpus that uses it all."""
  tokenizers = pytest.importorskip('tokenizers')
  from tokenizers import models  # pylint: disable=g-import-not-at-top
  from tokenizers import pre_tokenizers  # pylint: disable=g-import-not-at-top
  words = [f'w{i}' for i in range(TOKENS - 2)]
  vocab = {'<|endoftext|>': 0, '[UNK]': 1}
  vocab.update({w: i + 2 for i, w in enumerate(words)})
  tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token='[UNK]'))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  assert tok.get_vocab_size() == TOKENS
  path = tmp_path / 'tokenizer.json'
  tok.save(str(path))
  corpus = tmp_path / 'corpus'
  corpus.mkdir()
  for k in range(4):  # every word, in a different order per document
    text = ' '.join(words[(i * (2 * k + 1)) % len(words)] for i in
                    range(len(words)))
    (corpus / f'{k}.txt').write_text((text + '\n') * 3)
  return path, corpus


def _config(tmp_path, *overrides):
  path, corpus = _tokenizer_and_corpus(tmp_path)
  return run_config(corpus, tmp_path / 'run', f'--config.data.tokenizer={path}',
                    f'--config.data.data_dir={tmp_path / "prepared"}',
                    '--config.steps=3', '--config.eval_every=0',
                    '--config.mesh.data=2', '--config.data.batch_size=4',
                    *overrides)


def test_a_tokenizer_larger_than_the_preset_names_the_key(tmp_path):
  cfg = _config(tmp_path)
  with pytest.raises((config_lib.ConfigError, CorpusError), match=(
      r"the tokenizer has 600 tokens but model 'llama-tiny' only 256: set "
      r'--config.model.vocab_size=640 \(or any value >= 600')):
    trainer.train(cfg)


def test_model_vocab_size_trains_with_a_600_token_tokenizer(tmp_path):
  cfg = _config(tmp_path, '--config.model.vocab_size=640')
  assert program_lib.model_config(cfg).vocab_size == 640
  trainer.train(cfg)
  lines = [json.loads(line) for line in
           (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()]
  losses = [r['loss'] for r in lines if 'loss' in r]
  # (ln 640 = 6.46: the loss of a uniform guess over the 640 ids)
  assert len(losses) >= 3 and all(0 < x < 10 for x in losses), losses


@pytest.mark.parametrize('value, message', [
    ('-1', r"model.vocab_size must be >= 1, or 0 for the preset's, got -1"),
])
def test_bad_vocab_size_is_named(value, message):
  with pytest.raises(config_lib.ConfigError, match=message):
    config_lib.load(None, [f'--config.model.vocab_size={value}'])


def test_vocab_size_with_init_from_is_refused():
  with pytest.raises(config_lib.ConfigError, match=(
      r'model.vocab_size=640 has no effect with model.init_from=.*drop '
      r'model.vocab_size')):
    config_lib.load(None, ['--config.model.vocab_size=640',
                           '--config.model.init_from=/some/hf/dir'])
