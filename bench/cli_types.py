"""argparse `type=` functions shared by the bench scripts.

Each turns a bad value into argparse's usage error (exit 2, the option and
the value named) before any work is done, where a traceback would otherwise
come late, after minutes of compiling:

  p.add_argument('--repeats', type=cli_types.positive_int)
  p.add_argument('--densities', nargs='+', type=cli_types.density)
"""

import argparse
import math
import os


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


def seeds(text: str) -> tuple:
  """Comma-separated integer seeds >= 0: '0,1,4' -> (0, 1, 4)."""
  try:
    values = tuple(int(x) for x in text.split(','))
  except ValueError:
    raise argparse.ArgumentTypeError(
        f'{text!r} is not a comma-separated list of integer seeds') from None
  if min(values) < 0:
    raise argparse.ArgumentTypeError(f'{text!r}: seeds must be >= 0')
  return values


def positive_floats(text: str) -> tuple:
  """Comma-separated finite numbers > 0: '0.25,2' -> (0.25, 2.0)."""
  return tuple(positive_float(x) for x in text.split(','))


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


def write_markdown(out_dir: str, name: str, lines) -> str:
  """Writes `lines` as the file `name` in `out_dir`, prints them, and
  returns the text."""
  text = '\n'.join(lines) + '\n'
  with open(os.path.join(out_dir, name), 'w') as f:
    f.write(text)
  print(text)
  return text
