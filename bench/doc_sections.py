"""Generated sections of a Markdown file, each owned by one script.

A section is the text between `<!-- begin NAME -->` and `<!-- end NAME -->`.
`replace_section` rewrites that text only, so that several scripts can
generate parts of one document (docs/results.md) without undoing each other.
"""

import os


def _markers(name: str) -> tuple:
  return f'<!-- begin {name} -->', f'<!-- end {name} -->'


def replace_section(path: str, name: str, text: str) -> None:
  """Puts `text` in section `name` of `path`, appending the section if new."""
  begin, end = _markers(name)
  block = f'{begin}\n{text.rstrip()}\n{end}\n'
  old = ''
  if os.path.exists(path):
    with open(path) as f:
      old = f.read()
  if begin in old and end in old:
    head, rest = old.split(begin, 1)
    tail = rest.split(end, 1)[1].lstrip('\n')
    new = head + block + ('\n' + tail if tail else '')
  else:
    new = old.rstrip() + ('\n\n' if old.strip() else '') + block
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  with open(path, 'w') as f:
    f.write(new)
