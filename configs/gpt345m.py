# GPT-345M as in the SCAPE paper, Section V-C: OpenWebText with the GPT-2
# tokenizer, 100k steps, global batch 512 x 1024 tokens on 32 GPUs, cosine lr
# 1.5e-4 -> 1e-5 after 5000 warmup steps, betas (0.9, 0.999), weight decay
# 0.01, SCAPE at 1% density reached by exponential density warmup.
model = dict(preset='gpt345m')
# SCAPE mode: Algorithm 1, the paper's (local_adam=True: per-worker Adam).
optimizer = dict(name='scape', lr=1.5e-4, warmup_steps=5000,
                 min_lr_ratio=1e-5 / 1.5e-4, b2=0.999, weight_decay=0.01,
                 scape=dict(density=0.01, density_warmup_steps=1000))
data = dict(seq_len=1024, batch_size=512, micro_batches=4)
mesh = dict(data=32)
steps = 100_000
eval_every = 1000
ckpt_every = 1000
out_dir = 'runs/gpt345m'
