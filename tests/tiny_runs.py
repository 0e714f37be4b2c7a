"""Shared pieces of the tests that run the trainer on a tiny model: the
config of a short run on a synthetic corpus, random token batches, and the
XLA flags of a subprocess."""

import os

import numpy as np

from scape_jax.train import config as config_lib


def run_config(corpus, out_dir, *overrides, lr: str = '3e-3',
               eval_batches: int = 1):
  """A short float32 run: 32-token sequences, 16 per batch, constant lr,
  metrics every step; `overrides` are `--config.KEY=VALUE` strings."""
  base = [f'--config.data.corpus={corpus}', f'--config.out_dir={out_dir}',
          '--config.model.dtype=float32', '--config.data.seq_len=32',
          '--config.data.batch_size=16',
          f'--config.eval_batches={eval_batches}', '--config.log_every=1',
          '--config.optimizer.decay=constant',
          '--config.optimizer.warmup_steps=0', f'--config.optimizer.lr={lr}']
  return config_lib.load(None, base + list(overrides))


def random_batches(steps, batch=16, seq=16, vocab=256, seed=0) -> list:
  """`steps` batches of uniform random tokens: {'inputs', 'targets'}."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(steps):
    tokens = rng.integers(0, vocab, size=(batch, seq + 1), dtype=np.int32)
    out.append({'inputs': tokens[:, :-1], 'targets': tokens[:, 1:]})
  return out


def tiny_tokenizer_json(path, words: str = 'to be or not to be'):
  """Writes a 40-token BPE tokenizer.json trained on `words` (with the end
  of text token '<|endoftext|>', id 0) to `path`; returns `path`."""
  import pytest  # pylint: disable=g-import-not-at-top
  tokenizers = pytest.importorskip('tokenizers')
  from tokenizers import models  # pylint: disable=g-import-not-at-top
  from tokenizers import trainers  # pylint: disable=g-import-not-at-top
  tok = tokenizers.Tokenizer(models.BPE())
  tok.train_from_iterator([words] * 10, trainers.BpeTrainer(
      vocab_size=40, special_tokens=['<|endoftext|>'], show_progress=False))
  tok.save(str(path))
  return path


def xla_flags(devices=None) -> str:
  """XLA_FLAGS for a subprocess: conftest's flags that only speed up the
  compile, and `devices` simulated CPU devices (None: the subprocess's own
  choice)."""
  flags = [f for f in os.environ.get('XLA_FLAGS', '').split()
           if not f.startswith('--xla_force_host_platform_device_count')]
  if devices:
    flags.append(f'--xla_force_host_platform_device_count={devices}')
  return ' '.join(flags)
