"""The package's layering, read from the source: imports only go downwards.

    train.py -> scape_jax/train/ -> optim/, outer/, sharding/ -> comm/,
    kernels/ -> models/

`analysis/` (the HLO parser), `data/` and `hf/` (Hugging Face checkpoints)
are used by the trainer only.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / 'scape_jax'

# Which subpackages each may import (besides itself and the top level
# `scape_jax`, which nothing inside imports).
ALLOWED = {
    'comm': {'kernels'},
    'kernels': set(),
    'sharding': {'comm'},
    'optim': {'comm', 'kernels'},
    'outer': {'optim', 'comm', 'kernels', 'sharding'},
    'analysis': set(),
    'data': set(),
    'hf': set(),
    'train': {'optim', 'outer', 'sharding', 'comm', 'kernels', 'analysis',
              'data', 'hf'},
}


def _imports(path: pathlib.Path) -> set:
  tree = ast.parse(path.read_text())
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      # `from scape_jax import x` imports scape_jax.x (a module or a name).
      names.update(f'{node.module}.{alias.name}' for alias in node.names)
  return names


@pytest.mark.parametrize('subpackage', sorted(ALLOWED))
def test_imports_only_go_downwards(subpackage):
  bad = []
  for path in sorted((PACKAGE / subpackage).rglob('*.py')):
    for name in _imports(path):
      parts = name.split('.')
      if parts[0] != 'scape_jax':
        continue
      if len(parts) == 1 or (len(parts) == 2 and parts[1] not in ALLOWED):
        bad.append(f'{path.relative_to(ROOT)} imports {name} (top level)')
      elif parts[1] != subpackage and parts[1] not in ALLOWED[subpackage]:
        bad.append(f'{path.relative_to(ROOT)} imports {name}')
  assert not bad, '\n'.join(bad)


def test_models_do_not_import_the_library():
  for path in sorted((ROOT / 'models').rglob('*.py')):
    assert not any(n.split('.')[0] == 'scape_jax' for n in _imports(path)), (
        path)


def test_no_source_file_over_600_lines():
  files = list(PACKAGE.rglob('*.py')) + list((ROOT / 'models').glob('*.py'))
  files += [ROOT / 'train.py'] + list((ROOT / 'bench').glob('*.py'))
  long = {str(p.relative_to(ROOT)): n for p in files
          if (n := len(p.read_text().splitlines())) > 600}
  assert not long, long
