"""What a run shows: the banner, log lines that never share a terminal line
with the progress bar, and the figures of metrics.jsonl (step time, MFU
against a hand count of the model's FLOPs, ETA, tokens, memory)."""

import fcntl
import os
import pathlib
import pty
import re
import struct
import subprocess
import sys
import termios

import pytest

from scape_jax import train as trainer
from scape_jax.train import flops
from scape_jax.train.metrics import read_jsonl
from tests.tiny_runs import run_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
LLAMA_TINY_PARAMS = 131_392


def test_flops_of_llama_tiny_by_hand():
  # 6 N + 12 L d T: 6 * 131,392 + 12 * 2 layers * 64 wide * 128 tokens.
  assert flops.train_flops_per_token(LLAMA_TINY_PARAMS, 2, 64, 128) == (
      788_352 + 196_608)
  assert flops.mfu(1000.0, 984_960.0, 1e12, 8) == pytest.approx(
      1000 * 984_960 / 8e12)
  assert flops.mfu(1000.0, 984_960.0, None, 8) is None
  assert flops.peak_flops('NVIDIA H100 80GB HBM3') == 989e12
  assert flops.peak_flops('NVIDIA H100 PCIe') == 756e12
  assert flops.peak_flops('TPU v5 lite') == 197e12
  assert flops.peak_flops('cpu') is None
  assert flops.peak_flops('cpu', override=2e12) == 2e12


def test_metrics_have_the_run_figures(corpus, tmp_path):
  """Per step tokens_seen; on each log line's step its interval's step_ms,
  tokens_per_s, elapsed_s, eta_s and the MFU of the given peak (None where
  no peak is known, like the CPU's); peak memory None on the CPU."""
  summary = trainer.train(run_config(
      corpus, tmp_path, '--config.optimizer.name=adams', '--config.steps=4',
      '--config.log_every=2', '--config.eval_every=0',
      '--config.peak_tflops=0.5'))
  train = [r for r in read_jsonl(str(tmp_path / 'metrics.jsonl'))
           if r['split'] == 'train']
  assert [r['tokens_seen'] for r in train] == [16 * 32 * s for s in
                                               (1, 2, 3, 4)]
  assert 'step_ms' not in train[0] and 'step_ms' in train[1]
  last = train[-1]
  assert last['eta_s'] == 0 and train[1]['eta_s'] > 0
  assert last['step_ms'] > 0 and last['elapsed_s'] > train[1]['elapsed_s']
  assert last['tokens_per_s'] == pytest.approx(16 * 32 * 1e3 /
                                               last['step_ms'])
  # The model's FLOPs by hand: llama-tiny, 32-token sequences.
  per_token = 6 * LLAMA_TINY_PARAMS + 12 * 2 * 64 * 32
  assert last['mfu'] == pytest.approx(
      last['tokens_per_s'] * per_token / (0.5e12 * 8))
  assert last['peak_memory_bytes'] is None  # the CPU does not report it
  assert summary['first_program_s'] > 0
  again = run_config(corpus, tmp_path / 'b', '--config.optimizer.name=adams',
                     '--config.steps=1', '--config.eval_every=0')
  trainer.train(again)
  rows = read_jsonl(str(tmp_path / 'b' / 'metrics.jsonl'))
  assert [r['mfu'] for r in rows if r['split'] == 'train'] == [None]


def test_log_lines_never_share_a_terminal_line_with_the_bar(corpus,
                                                            tmp_path):
  """The demo config for a few steps under a pseudo-terminal (tqdm draws
  its bar there): every log line stands on a terminal line of its own, and
  the banner names the model and its parameters. Its density warmup made
  long enough that the 6 steps are dense: one program to compile, not the
  3 of the demo's first 6 steps (tests/test_update_count.py runs programs
  compiled in the background)."""
  env = dict(os.environ, JAX_PLATFORMS='cpu')  # conftest's XLA_FLAGS: 8 devices
  primary, secondary = pty.openpty()
  fcntl.ioctl(secondary, termios.TIOCSWINSZ,  # a 24 x 120 terminal
              struct.pack('HHHH', 24, 120, 0, 0))
  proc = subprocess.Popen(
      [sys.executable, str(ROOT / 'train.py'), '--config',
       str(ROOT / 'configs' / 'shakespeare_llama_tiny.py'),
       f'--config.data.corpus={corpus}', f'--config.out_dir={tmp_path}',
       '--config.steps=6', '--config.log_every=2', '--config.eval_every=3',
       '--config.data.seq_len=32', '--config.data.batch_size=16',
       '--config.optimizer.scape.density_warmup_steps=100'],
      stdin=secondary, stdout=secondary, stderr=secondary, cwd=ROOT,
      env=env)
  os.close(secondary)
  chunks = []
  while True:
    try:
      chunk = os.read(primary, 4096)
    except OSError:  # the child closed the terminal
      break
    if not chunk:
      break
    chunks.append(chunk)
  os.close(primary)
  assert proc.wait(timeout=600) == 0, b''.join(chunks).decode()[-3000:]
  text = b''.join(chunks).decode(errors='replace')
  assert f'training llama-tiny ({LLAMA_TINY_PARAMS:,} parameters) with scape' in (
      text)
  logged = 0
  for line in text.replace('\r\n', '\n').split('\n'):
    for piece in line.split('\r'):  # what one redraw of the line shows
      if re.search(r'step +\d+ \| (eval )?loss ', piece):
        logged += 1
        assert re.match(r' *step +\d+ \|', piece), repr(line)
        assert 'it/s' not in piece and '%|' not in piece, repr(line)
  assert logged >= 5  # steps 2, 4, 6 and the evals at 3 and 6
  assert '%|' in text  # the bar was drawn
