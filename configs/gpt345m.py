# GPT-2 345M (the paper's GPT-345M) with SCAPE at 1% density, 32 workers.
# Tokenizer: GPT-2's tokenizer.json, given with --config.data.tokenizer.
model = dict(preset='gpt345m')
optimizer = dict(name='scape', lr=3e-4, warmup_steps=2000, density=0.01,
                 density_warmup_steps=1000)
data = dict(seq_len=1024, batch_size=256)
mesh = dict(data=32)
steps = 100_000
eval_every = 1000
ckpt_every = 1000
out_dir = 'runs/gpt345m'
