# GPT-2 124M on FineWeb-Edu 10B tokens: build-nanogpt's recipe (the defaults in train_gpt2.py's Config,
# spelled out). ~0.5M tokens per step for 19073 steps = 1 epoch of the 10B-token sample.
#   python train_gpt2.py configs/gpt2_124m.py
#   torchrun --standalone --nproc_per_node=8 train_gpt2.py configs/gpt2_124m.py
# micro_batch_size and seq_len are left to the defaults (64 x 1024) so that the sm7x preset can
# shrink them on a T4/V100; set them here or on the command line to fit your GPU.
data_dir = "edu_fineweb10B"
out_dir = "out/gpt2_124m"
n_layer = 12
n_head = 12
n_embd = 768
vocab_size = 50304
total_batch_size = 524288
max_steps = 19073
warmup_steps = 715
max_lr = 6e-4
min_lr = 6e-5
lr_schedule = "cosine"  # build-nanogpt's, kept: the published recipe every comparison is made against
weight_decay = 0.1
grad_clip = 1.0
eval_interval = 250
hellaswag_interval = 250
sample_interval = 250
checkpoint_interval = 5000
checkpoint_minutes = 60  # and after each hour of training (5000 steps of 124M take ~1 day on a T4)
keep_last = 2  # older checkpoints are deleted once a newer one is in place
resume = "auto"  # the same command continues the run in out_dir after Ctrl-C, a kill or a time_limit
