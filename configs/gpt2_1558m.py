# GPT-2 1558M (gpt2-xl's shape) on FineWeb-Edu 10B tokens. Learning rate and batch from the GPT-3
# paper's table 2.1 (GPT-3 XL, 1.3B: 2.0e-4 with 1M-token batches); warmup over 375M tokens as there,
# so 358 steps of 2**20 tokens, and 9537 steps for the 10B tokens.
#   torchrun --standalone --nproc_per_node=8 train_gpt2.py configs/gpt2_1558m.py
# micro_batch_size 8 fits an 80 GB GPU (weights + AdamW state alone are ~25 GB).
data_dir = "edu_fineweb10B"
out_dir = "out/gpt2_1558m"
n_layer = 48
n_head = 25
n_embd = 1600
vocab_size = 50304
micro_batch_size = 8
total_batch_size = 1048576
max_steps = 9537
warmup_steps = 358
max_lr = 2e-4
min_lr = 2e-5
eval_interval = 250
hellaswag_interval = 500
sample_interval = 500
checkpoint_interval = 1000
checkpoint_minutes = 60  # and after each hour of training (5000 steps of 124M take ~1 day on a T4)
keep_last = 2  # older checkpoints are deleted once a newer one is in place
resume = "auto"  # the same command continues the run in out_dir after Ctrl-C, a kill or a time_limit
