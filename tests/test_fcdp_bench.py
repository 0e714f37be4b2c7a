"""bench/fcdp_volume.py's columns and claim checks on hand-made rows."""

import importlib.util
import os

_PATH = os.path.join(os.path.dirname(os.path.dirname(__file__)), 'bench',
                     'fcdp_volume.py')
_spec = importlib.util.spec_from_file_location('fcdp_volume', _PATH)
fv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fv)


def _row(overrides, trainable=1000, axes=('fsdp,node',), **nbytes):
  return {'overrides': list(overrides), 'trainable': trainable,
          'inter_all_gather_axes': list(axes),
          'bytes': {k.replace('__', '/'): v for k, v in nbytes.items()}}


ZERO3 = _row((), **{'forward__all-gather__inter': 700.0,
                    'backward__all-gather__inter': 600.0,
                    'backward__reduce-scatter__inter': 700.0,
                    'update__all-reduce__inter': 10.0,
                    'boundary__all-gather__forward': 175.0})


def test_figures_sum_by_pass_kind_and_level():
  f = fv.figures(ZERO3)
  assert (f['forward_ag_inter'], f['backward_ag_inter'], f['rs_inter'],
          f['other_inter']) == (700.0, 600.0, 700.0, 10.0)
  assert f['inter'] == 2010.0 and f['intra'] == 0.0
  assert f['boundary'] == 175.0


def test_claims_are_checked_not_assumed():
  cached = _row((fv.HOST,), **{'forward__all-gather__inter': 700.0,
                               'backward__reduce-scatter__inter': 700.0})
  assert fv.claim_holds(cached, ZERO3) == 'bwd inter-node AG = 0: yes'
  leaky = _row((fv.HOST,), **{'backward__all-gather__inter': 1.0})
  assert 'NO' in fv.claim_holds(leaky, ZERO3)
  hier = _row((fv.HIER,), axes=('node',))
  assert fv.claim_holds(hier, ZERO3).endswith('yes')
  assert 'NO' in fv.claim_holds(_row((fv.HIER,)), ZERO3)
  # LoRA-aware: inter-node gathers bounded by the adapters (1000 elements).
  aware = _row((fv.AWARE,), **{'forward__all-gather__inter': 3500.0})
  assert fv.claim_holds(aware, ZERO3).endswith('yes')
  frozen = _row((fv.AWARE,), **{'forward__all-gather__inter': 1e6})
  assert 'NO' in fv.claim_holds(frozen, ZERO3)
