# Llama-500M (H2O-Danube3-500M shape) with SCAPE at 1% density, the paper's
# main setting, on 32 data-parallel GPUs. Tokenizer: any HF tokenizer.json
# with 32000 tokens (e.g. Llama-2's), given with --config.data.tokenizer.
model = dict(preset='llama500m')
optimizer = dict(name='scape', lr=3e-4, warmup_steps=2000, density=0.01,
                 density_warmup_steps=1000)
data = dict(seq_len=2048, batch_size=256)
mesh = dict(data=32)
steps = 100_000
eval_every = 1000
ckpt_every = 1000
out_dir = 'runs/llama500m'
