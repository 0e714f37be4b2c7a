"""Exports a run's checkpoint as a `transformers` model directory.

  python -m scape_jax.export_hf --run runs/NAME --out DIR [--step N]

DIR gets `config.json` and `model.safetensors` (`LlamaForCausalLM` or
`GPT2LMHeadModel`) and the tokenizer files (`tokenizer.json`,
`tokenizer_config.json`), so that

  AutoModelForCausalLM.from_pretrained(DIR)
  AutoTokenizer.from_pretrained(DIR)

load it. The byte tokenizer is written as a byte-level BPE without merges
(ids are the UTF-8 bytes). The run's own config, saved in the checkpoint,
gives the model; only the parameters are read (of replica group 0 for
methods that keep one copy per group, as the trainer evaluates). They are
written in the run's parameter dtype; a run that computed in bfloat16 was
evaluated in bfloat16, which transformers' float32 forward pass does not
reproduce bit for bit. A LoRA run's adapters are merged into the base
weights (W + alpha / rank * A @ B, as PEFT's `merge_and_unload`), so DIR
holds a plain model that computes what the adapted one did.
"""

import argparse
import os
import sys
from typing import Optional

import jax

import models
from scape_jax import hf
from scape_jax.train import config as config_lib
from scape_jax.train import methods
from scape_jax.train import program as program_lib
from scape_jax.train.checkpoint import Checkpointer, CheckpointError


def _abstract_params(cfg: config_lib.Config):
  """(model config, params target of the checkpoint on one device, replicas)."""
  model_cfg, shapes = program_lib.param_shapes(cfg)
  per_replica = methods.get(cfg.optimizer.name).per_replica
  lead = (cfg.mesh.replica,) if per_replica else ()
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  target = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(lead + tuple(x.shape), x.dtype,
                                     sharding=device), shapes)
  return model_cfg, target, bool(lead)


def _tokenizer_files(cfg: config_lib.Config, out: str,
                     max_len: int) -> tuple[list[str], Optional[int]]:
  """Writes the run's tokenizer to `out`; (files, end-of-document id)."""
  spec = cfg.data.tokenizer
  eos_id, eos_token = None, None
  if spec != 'byte':
    if not os.path.isfile(spec):
      print(f'warning: the run\'s tokenizer {spec!r} is not found from here; '
            'no tokenizer files written (copy its tokenizer.json into '
            f'{out})', file=sys.stderr)
      return [], None
    from scape_jax.data.tokenizer import HFTokenizer  # pylint: disable=g-import-not-at-top
    tok = HFTokenizer(spec)
    eos_id = tok.eos_id
    eos_token = None if eos_id is None else tok.decode([eos_id])
  files = hf.save_tokenizer(out, spec, max_len=max_len, eos_token=eos_token)
  return files, eos_id


def export(run_dir: str, out_dir: str, step: Optional[int] = None) -> dict:
  """Writes the model of `run_dir`'s checkpoint (latest, or `step`) to
  `out_dir`; returns a summary."""
  ckpt = Checkpointer(os.path.join(run_dir, 'ckpt'))
  step, extras = ckpt.read_extras(step)
  if 'config' not in extras:
    raise CheckpointError(f'checkpoint step {step} in {ckpt.directory} has no '
                          'saved config (extras["config"])')
  cfg = config_lib.from_dict(extras['config'])
  model_cfg, target, per_replica = _abstract_params(cfg)
  state, _ = ckpt.restore(step, {'params': target}, partial=True)
  params = jax.device_get(state['params'])
  if per_replica:
    params = jax.tree.map(lambda x: x[0], params)
  lora = cfg.model.lora
  if lora.targets:  # transformers gets the merged weights (PEFT's merge)
    params = models.lora.merge_adapters(params, lora.alpha / lora.rank)
  files, eos_id = _tokenizer_files(cfg, out_dir, model_cfg.max_seq_len)
  hf.save_pretrained(out_dir, model_cfg, params, bos_token_id=eos_id,
                     eos_token_id=eos_id)
  return {'step': step, 'model': type(model_cfg).__name__,
          'files': [hf.convert.CONFIG_FILE, hf.convert.WEIGHTS_FILE] + files,
          'compute_dtype': cfg.model.dtype}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument('--run', required=True,
                      help='the run directory (its out_dir, with ckpt/)')
  parser.add_argument('--out', required=True, help='the output directory')
  parser.add_argument('--step', type=int, default=None,
                      help='the checkpoint step (default: the latest)')
  args = parser.parse_args(argv)
  try:
    summary = export(args.run, args.out, args.step)
  except (CheckpointError, config_lib.ConfigError, hf.ConversionError,
          ImportError, OSError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  print(f'wrote {summary["model"]} of step {summary["step"]} to {args.out}: '
        f'{", ".join(summary["files"])}')
  if summary['compute_dtype'] != 'float32':
    print(f'note: the run computed in {summary["compute_dtype"]}; '
          'transformers will compute in the saved dtype', file=sys.stderr)
  return 0


if __name__ == '__main__':
  sys.exit(main())
