"""docs/results.md is written by several scripts: each owns one part.

`bench/convergence.py` writes the top of the file; other scripts own a
section between `<!-- begin NAME -->` and `<!-- end NAME -->` markers, which
`write_top` keeps and `replace_section` replaces (or appends).
"""

import os
import re

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
