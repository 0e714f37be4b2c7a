"""Hugging Face interchange: GPT-2 and Llama checkpoints and tokenizers.

`save_pretrained` writes what `transformers.AutoModelForCausalLM` loads;
`from_hf_config` and `from_hf_state` read a `transformers` checkpoint back
into our models (`model.init_from`). Needs `safetensors` for the files
(`pip install 'scape-jax[hf]'`), not torch.
"""

from scape_jax.hf.convert import ConversionError
from scape_jax.hf.convert import from_hf_config
from scape_jax.hf.convert import from_hf_state
from scape_jax.hf.convert import read_config
from scape_jax.hf.convert import read_safetensors
from scape_jax.hf.convert import save_pretrained
from scape_jax.hf.convert import tied_embeddings
from scape_jax.hf.convert import to_hf_config
from scape_jax.hf.convert import to_hf_state
from scape_jax.hf.tokenizer import byte_tokenizer
from scape_jax.hf.tokenizer import save_tokenizer

__all__ = [
    'ConversionError', 'byte_tokenizer', 'from_hf_config', 'from_hf_state',
    'read_config', 'read_safetensors', 'save_pretrained', 'save_tokenizer',
    'tied_embeddings', 'to_hf_config', 'to_hf_state',
]
