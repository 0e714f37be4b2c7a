"""Pre-train a GPT-2 or Llama model: `python train.py --help` (the same
command as `scape-train`; the code is in `scape_jax/train/cli.py`)."""

import sys

from scape_jax.train.cli import main

if __name__ == '__main__':
  sys.exit(main())
