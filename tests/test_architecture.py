"""The package's layering, read from the source: imports only go downwards.

    train.py -> scape_jax/train/ -> optim/, outer/, sharding/ -> comm/,
    kernels/; models/ (scape_jax.models) imports none of them

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
# `models` is models/ at the top of the checkout, installed as
# scape_jax/models/ (`from scape_jax import models`).
ALLOWED = {
    'comm': {'kernels'},
    'kernels': set(),
    'models': set(),
    'sharding': {'comm', 'models'},
    'optim': {'comm', 'kernels'},
    'outer': {'optim', 'comm', 'kernels', 'sharding'},
    'analysis': set(),
    'data': set(),
    'hf': {'models'},
    'train': {'optim', 'outer', 'sharding', 'comm', 'kernels', 'analysis',
              'data', 'hf', 'models'},
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


def _module_names() -> dict:
  """Dotted module name -> path, for every Python file of the repository
  (bench/ scripts by their bare names: they import each other that way)."""
  out = {}
  for top in ('scape_jax', 'models', 'tests'):
    for path in (ROOT / top).rglob('*.py'):
      parts = path.relative_to(ROOT).with_suffix('').parts
      out['.'.join(parts[:-1] if parts[-1] == '__init__' else parts)] = path
  for path in (ROOT / 'bench').glob('*.py'):
    out[path.stem] = path
  out['train'] = ROOT / 'train.py'
  return out


def _edges(modules: dict) -> dict:
  """Module -> the modules of the repository it imports (the most specific
  one each import names)."""
  edges = {}
  for name, path in modules.items():
    targets = set()
    for imported in _imports(path):
      parts = imported.split('.')
      for n in range(len(parts), 0, -1):
        if '.'.join(parts[:n]) in modules:
          targets.add('.'.join(parts[:n]))
          break
    edges[name] = targets - {name}
  return edges


def test_the_repository_has_no_import_cycle():
  """No module imports itself through others (a package's __init__
  importing its own modules is not a cycle: they do not import it back)."""
  edges = _edges(_module_names())
  state, stack, cycles = {}, [], []

  def visit(node):
    state[node] = 'open'
    stack.append(node)
    for nxt in sorted(edges[node]):
      if state.get(nxt) == 'open':
        cycles.append(stack[stack.index(nxt):] + [nxt])
      elif nxt not in state:
        visit(nxt)
    stack.pop()
    state[node] = 'done'

  for node in sorted(edges):
    if node not in state:
      visit(node)
  assert not cycles, '\n'.join(' -> '.join(c) for c in cycles)
