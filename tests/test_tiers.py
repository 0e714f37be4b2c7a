"""Every test file has a tier in tests/tier_map.py, every per-test entry
names a test that exists, and each collected test carries exactly one tier
marker."""

import ast
import pathlib

import pytest

import tier_map

TESTS = pathlib.Path(__file__).resolve().parent


def _test_functions(module: str) -> set:
  tree = ast.parse((TESTS / f'{module}.py').read_text())
  return {n.name for n in ast.walk(tree)
          if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
          and n.name.startswith('test')}


def test_every_test_file_has_a_tier():
  files = {p.stem for p in TESTS.glob('test_*.py')}
  missing = sorted(files - set(tier_map.MODULE_TIERS))
  assert not missing, (
      f'add {missing} to MODULE_TIERS in tests/tier_map.py (unit, '
      'integration or system: see its docstring; a file that starts '
      'processes is system); until then its tests are marked system')
  stale = sorted(set(tier_map.MODULE_TIERS) - files)
  assert not stale, f'MODULE_TIERS names files that are gone: {stale}'
  assert set(tier_map.MODULE_TIERS.values()) <= set(tier_map.TIERS)
  scheduled = sorted(set(tier_map.SPLIT + tier_map.SLOW_FIRST) - files)
  assert not scheduled, f'SPLIT/SLOW_FIRST name files that are gone: {scheduled}'


def test_every_per_test_tier_names_a_test_of_its_file():
  for (module, function), tier in tier_map.TEST_TIERS.items():
    assert tier in tier_map.TIERS, (module, function, tier)
    assert tier != tier_map.MODULE_TIERS.get(module), (
        f'{module}::{function} is already {tier} by its module')
    path = TESTS / f'{module}.py'
    if not path.exists():
      continue  # reported by test_every_test_file_has_a_tier
    assert function in _test_functions(module), (
        f'TEST_TIERS names {module}::{function}, which is not a test there')


def test_tier_of():
  assert tier_map.tier_of('test_train', 'test_x') == tier_map.INTEGRATION
  module, function = next(iter(tier_map.TEST_TIERS))
  assert tier_map.tier_of(module, function) == tier_map.TEST_TIERS[
      module, function]
  assert tier_map.tier_of('test_not_in_the_map', 'test_x') == (
      tier_map.UNKNOWN_TIER)
  assert tier_map.tier_of('test_train', 'test_x', ('unit',)) == 'unit'
  with pytest.raises(ValueError, match='exactly one'):
    tier_map.tier_of('test_train', 'test_x', ('unit', 'system'))


def test_each_collected_test_has_exactly_one_tier(request):
  """Over whatever this session collected (the whole suite under
  `make test`)."""
  for item in request.session.items:
    tiers = [m.name for m in item.iter_markers() if m.name in tier_map.TIERS]
    assert len(tiers) == 1, (item.nodeid, tiers)
  own = [m.name for m in request.node.iter_markers()
         if m.name in tier_map.TIERS]
  assert own == [tier_map.UNIT]
