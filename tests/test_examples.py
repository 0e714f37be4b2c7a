"""docs/examples.md runs as written: every ```python block in a fresh
interpreter on 8 simulated CPU devices, from an empty directory, with only
the checkout on the path; and the DiLoCo block with the Pier lines that the
page says to swap in.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / 'docs' / 'examples.md'


def _fences(text: str) -> list:
  """(language, code) of every fenced block of `text`, in order."""
  blocks, lang, lines = [], None, []
  for line in text.splitlines():
    if lang is None and line.startswith('```'):
      lang, lines = line[3:].strip(), []
    elif lang is not None and line.strip() == '```':
      blocks.append((lang, '\n'.join(lines) + '\n'))
      lang = None
    elif lang is not None:
      lines.append(line)
  return blocks


def _sections() -> dict:
  """Section title -> (its ```python blocks, its plain ``` blocks)."""
  out = {}
  for section in re.split(r'\n## ', PAGE.read_text())[1:]:
    title = section.split('\n', 1)[0]
    fences = _fences(section)
    out[title] = ([c for lang, c in fences if lang == 'python'],
                  [c for lang, c in fences if not lang])
  return out


def _blocks() -> list:
  return [(t, b) for t, (blocks, _) in _sections().items() for b in blocks]


def _pier_variant() -> str:
  """The DiLoCo block with its `tx = ...` and `schedule = ...` lines
  replaced by the Pier lines of the same section."""
  (code,), (swap,) = _sections()['DiLoCo over 2 groups of 4 workers']
  tx = swap[:swap.index('schedule =')]
  schedule = swap[swap.index('schedule ='):]
  code, n = re.subn(r'tx = scape_jax\.diloco\(.*?\)\n', lambda _: tx, code)
  code, m = re.subn(r'schedule = outer\.SyncSchedule\(.*?\)\n',
                    lambda _: schedule, code)
  assert n == m == 1, 'the lines the Pier paragraph swaps are not in the block'
  return code


def _run(code: str, tmp_path) -> str:
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS='cpu',
             XLA_FLAGS=os.environ['XLA_FLAGS'])  # conftest's: 8 devices
  proc = subprocess.run([sys.executable, '-c', code], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout


def test_the_page_has_the_examples():
  titles = [t for t, _ in _blocks()]
  assert titles == ['A Flax NNX model', 'DiLoCo over 2 groups of 4 workers']


@pytest.mark.parametrize('index', range(len(_blocks())))
def test_example_runs(tmp_path, index):
  title, code = _blocks()[index]
  out = _run(code, tmp_path)
  _check(out, title)


def test_the_pier_variant_runs(tmp_path):
  _check(_run(_pier_variant(), tmp_path), 'Pier')


def _check(out: str, title: str) -> None:
  loss = re.search(r'loss after 20 steps: ([0-9.]+)', out)
  assert loss and float(loss.group(1)) < 0.2, (title, out)  # first: ~0.5
  apart = re.search(r'groups apart by ([0-9.e+-]+)', out)
  if 'DiLoCo' in title or title == 'Pier':  # the last step synchronised
    assert apart and float(apart.group(1)) < 1e-5, (title, out)
