# GPT-345M LoRA fine-tuning with FCDP on 2 nodes x 4 GPUs, after the FCDP
# paper's Section V-D: rank-16 adapters on the attention projections (the
# fused qkv c_attn and attn.c_proj), base weights frozen, the fsdp group over
# all 8 devices in two levels, and all three FCDP switches on. Turn switches
# off one at a time to measure each (bench/fcdp_volume.py does this on the
# compiled step). Give the corpus with --config.data.corpus=DIR and the
# pretrained base with --config.model.init_from=DIR (a transformers GPT-2
# medium directory); without it the frozen base is random (enough to measure
# traffic and speed, as bench/fcdp_volume.py does).
model = dict(preset='gpt345m', remat=True,
             lora=dict(rank=16, alpha=32.0, targets=['c_attn', 'attn.c_proj']))
# Method: dense AdamW (FCDP changes the parameter gathers, not the optimizer).
optimizer = dict(name='adamw', lr=2e-4, warmup_steps=100, weight_decay=0.0)
data = dict(seq_len=1024, batch_size=64, micro_batches=2)
mesh = dict(data=1, fsdp=8, nodes=2)
fcdp = dict(host_cache=True, hierarchical=True, lora_aware=True)
steps = 2000
eval_every = 200
ckpt_every = 500
out_dir = 'runs/gpt345m_fcdp_lora'
