"""train.py as a user runs it: clear errors, no traceback, no lost data."""

import os
import subprocess
import sys

import pytest

from scape_jax.train import config as config_lib
from scape_jax import train as trainer
from scape_jax.data.prepare import make_synthetic_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, timeout=300):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS='cpu')
  return subprocess.run([sys.executable, os.path.join(ROOT, 'train.py'),
                         *args], capture_output=True, text=True, env=env,
                        timeout=timeout, cwd=ROOT, check=False)


@pytest.mark.parametrize('args, message', [
    (['--config.optimizer.lrr=1'], "unknown config key 'optimizer.lrr'"),
    (['--config.steps=abc'], "'steps': expected int, got 'abc'"),
    (['--config.optimizer.scape.density=1.5'], 'density'),
    (['--config', 'configs/nope.py'], 'configs/nope.py'),
])
def test_bad_config_is_a_clear_error(args, message):
  proc = _run(*args)
  assert proc.returncode == 2, proc.stderr
  assert message in proc.stderr
  assert 'Traceback' not in proc.stderr


def test_corrupt_checkpoint_is_reported_and_left_alone(tmp_path):
  corpus = tmp_path / 'corpus'
  make_synthetic_corpus(str(corpus), num_tokens=1 << 15)
  args = [f'--config.data.corpus={corpus}', f'--config.out_dir={tmp_path}/run',
          '--config.model.dtype=float32', '--config.data.seq_len=16',
          '--config.data.batch_size=8', '--config.eval_batches=1',
          '--config.eval_every=0']
  trainer.train(config_lib.load(None, args + ['--config.steps=2']))
  ckpt = tmp_path / 'run' / 'ckpt'
  files = sorted(p for p in ckpt.rglob('*') if p.is_file())
  biggest = max(files, key=lambda p: p.stat().st_size)
  data = bytearray(biggest.read_bytes())
  data[len(data) // 2] ^= 0xFF
  biggest.write_bytes(bytes(data))
  before = {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in files}

  proc = _run(*args, '--config.steps=4')
  assert proc.returncode == 2, proc.stdout + proc.stderr
  assert 'corrupt' in proc.stderr and 'Traceback' not in proc.stderr
  after = sorted(p for p in ckpt.rglob('*') if p.is_file())
  assert {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in after} == before
