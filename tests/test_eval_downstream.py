"""bench/eval_downstream.py: its export goes to a directory of its own, and
its lm-eval task configs state every metric's aggregation and direction.

lm-eval warns for each metric of a task's `metric_list` that lacks
`aggregation` or `higher_is_better` (lm_eval/api/task.py, 0.4.13: 8 warnings
for the two local tasks). lm-eval is not installed for the suite (it needs
torch): the configs are checked against its schema and its defaults here.
"""

import importlib.util
import pathlib

import pytest

yaml = pytest.importorskip('yaml')

ROOT = pathlib.Path(__file__).resolve().parents[1]
# lm-eval's own defaults (lm_eval/api/metrics.py), which the configs state.
WANT = {'acc': ('mean', True), 'acc_norm': ('mean', True),
        'perplexity': ('perplexity', False)}


@pytest.fixture(scope='module')
def script():
  spec = importlib.util.spec_from_file_location(
      'eval_downstream', ROOT / 'bench' / 'eval_downstream.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize('task', ['shakespeare_next_line',
                                  'shakespeare_last_word'])
def test_every_metric_has_its_aggregation_and_direction(script, task):
  config = yaml.safe_load(script._task_yaml(task, '/data/x.jsonl'))
  assert config['task'] == task
  metrics = config['metric_list']
  assert metrics, config
  for entry in metrics:
    assert set(entry) == {'metric', 'aggregation', 'higher_is_better'}, entry
    assert (entry['aggregation'], entry['higher_is_better']) == WANT[
        entry['metric']], entry


def _stub(script, monkeypatch, tmp_path):
  """Records the export and lm-eval calls instead of running them."""
  calls = {}
  from scape_jax import export_hf  # pylint: disable=g-import-not-at-top

  def export(argv):
    calls['export'] = argv
    return 0

  monkeypatch.setattr(export_hf, 'main', export)
  monkeypatch.setattr(script, 'write_tasks', lambda d: None)

  def run_lm_eval(model_dir, *args):
    calls['model_dir'] = model_dir
    return {'results': {}}

  monkeypatch.setattr(script, 'run_lm_eval', run_lm_eval)
  (tmp_path / 'run' / 'hf').mkdir(parents=True)
  return calls


def test_the_export_goes_to_its_own_directory(script, monkeypatch, tmp_path):
  """RUN/hf (a user's export, made with --tokenizer say) is not replaced:
  the script exports to RUN/lm_eval/hf."""
  calls = _stub(script, monkeypatch, tmp_path)
  run = str(tmp_path / 'run')
  assert script.main(['--run', run]) == 0
  own = str(tmp_path / 'run' / 'lm_eval' / 'hf')
  assert calls['export'][calls['export'].index('--out') + 1] == own
  assert calls['model_dir'] == own


def test_model_evaluates_an_existing_export(script, monkeypatch, tmp_path):
  calls = _stub(script, monkeypatch, tmp_path)
  mine = str(tmp_path / 'run' / 'hf')
  assert script.main(['--run', str(tmp_path / 'run'), '--model', mine]) == 0
  assert 'export' not in calls and calls['model_dir'] == mine
