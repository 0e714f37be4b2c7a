"""What the bench scripts share: argparse `type=` functions, and writers of
their tables (a markdown file; docs/results.md's sections).

Each turns a bad value into argparse's usage error (exit 2, the option and
the value named) before any work is done, where a traceback would otherwise
come late, after minutes of compiling:

  p.add_argument('--repeats', type=cli_types.positive_int)
  p.add_argument('--densities', nargs='+', type=cli_types.density)
"""

import argparse
import math
import os
import re


def _number(text: str, kind):
  try:
    value = kind(text)
  except ValueError:
    raise argparse.ArgumentTypeError(
        f'{text!r} is not {"an integer" if kind is int else "a number"}'
    ) from None
  if kind is float and not math.isfinite(value):
    raise argparse.ArgumentTypeError(f'{text!r}: must be finite')
  return value


def _bounded(text: str, kind, low, strict: bool = False):
  """`text` as `kind`, at least `low` (above it if `strict`)."""
  value = _number(text, kind)
  if value < low or (strict and value == low):
    raise argparse.ArgumentTypeError(
        f'{value}: must be {"an integer " if kind is int else ""}'
        f'{">" if strict else ">="} {low}')
  return value


def positive_int(text: str) -> int:
  """An integer >= 1 (a count of samples, calls, workers, steps)."""
  return _bounded(text, int, 1)


def non_negative_int(text: str) -> int:
  """An integer >= 0."""
  return _bounded(text, int, 0)


def positive_float(text: str) -> float:
  """A finite number > 0."""
  return _bounded(text, float, 0, strict=True)


def non_negative_float(text: str) -> float:
  """A finite number >= 0."""
  return _bounded(text, float, 0)


def density(text: str) -> float:
  """A SCAPE density: a finite number in (0, 1]."""
  value = _number(text, float)
  if not 0 < value <= 1:
    raise argparse.ArgumentTypeError(f'density {value}: must be in (0, 1]')
  return value


def check_out_dir(parser: argparse.ArgumentParser, path: str) -> str:
  """Creates the output folder `path` now, or ends with a usage error.

  A benchmark writes its results at the end; a folder that cannot be made
  (a file in the way, no permission) should fail before the timing, not
  after it.
  """
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    parser.error(f'--out {path!r}: cannot create it ({e.strerror})')
  return path


# docs/results.md is written by several scripts, each owning one part:
# `bench/convergence.py` writes the top of the file (`write_top`, which keeps
# the marked sections); the others own a section between
# `<!-- begin NAME -->` and `<!-- end NAME -->` (`replace_section`).
_SECTION = re.compile(r'<!-- begin (\S+) -->\n.*?<!-- end \1 -->\n', re.S)


def _read(path: str) -> str:
  if not os.path.exists(path):
    return ''
  with open(path, encoding='utf-8') as f:
    return f.read()


def sections(text: str) -> dict[str, str]:
  """The marked sections of `text`, by name, markers included."""
  return {m.group(1): m.group(0) for m in _SECTION.finditer(text)}


def write_top(path: str, lines: list[str]) -> None:
  """Writes `lines` as the top of `path`, keeping its marked sections."""
  kept = ''.join('\n' + s for s in sections(_read(path)).values())
  with open(path, 'w', encoding='utf-8') as f:
    f.write('\n'.join(lines) + '\n' + kept)


def replace_section(path: str, name: str, lines: list[str]) -> None:
  """Replaces (or appends) the section `name` of `path` with `lines`."""
  text = _read(path)
  block = '\n'.join([f'<!-- begin {name} -->', *lines,
                     f'<!-- end {name} -->']) + '\n'
  old = sections(text).get(name)
  if old is not None:
    text = text.replace(old, block)
  else:
    text = text.rstrip('\n') + '\n\n' + block if text else block
  with open(path, 'w', encoding='utf-8') as f:
    f.write(text)
