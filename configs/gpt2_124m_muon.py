# GPT-2 124M on FineWeb-Edu with Muon on the blocks' matrices: the same model as gpt2_124m.py (so the
# export, sample.py and HellaSwag read it as any other), aiming at GPT-2 124M's HellaSwag (0.2955) in
# 2.5B tokens instead of build-nanogpt's 10B.
#   python train_gpt2.py configs/gpt2_124m_muon.py
#   torchrun --standalone --nproc_per_node=8 train_gpt2.py configs/gpt2_124m_muon.py
# Why 2.5B tokens (4,768 steps of 524,288): build-nanogpt's AdamW run passes 0.2955 within its 10B tokens and
# ends near 0.30; Muon alone is reported at 1.35-1.5x AdamW's sample efficiency at this size (modded-nanogpt's
# optimizer record), and on our two tiny CPU scales it reached AdamW's final val loss in 0.42x and 0.55x the
# tokens (bench/muon.md). 2.5B is the bet; the fallback is 5B tokens: max_steps = 9537 from the start (raising
# max_steps on a finished run resumes it, but the cosine then jumps back up to mid-schedule).
# A T4 at ~20k tokens/s needs ~1.5 days for 2.5B tokens (~2.9 for 5B); Kaggle's 2xT4 ~0.9 (~1.7).
# Not yet measured on a GPU at 124M: the lrs below are the tiny-scale sweep's ratios carried over.
data_dir = "edu_fineweb10B"
out_dir = "out/gpt2_124m_muon"
n_layer = 12
n_head = 12
n_embd = 768
vocab_size = 50304
total_batch_size = 524288
optimizer = "muon"
max_steps = 4768  # 2.5B tokens
warmup_steps = 250
max_lr = 1.8e-3  # AdamW on the embeddings, lm_head, biases and norms: 3x build-nanogpt's (llm.c's 124M lr)
min_lr = 1.8e-4
muon_lr = 6e-3  # Muon on the blocks' matrices, on AdamW's scale (adjust_lr_fn="match_rms_adamw"); bench/muon.md
muon_momentum = 0.95
weight_decay = 0.1
grad_clip = 1.0
eval_interval = 250
hellaswag_interval = 250
sample_interval = 250
checkpoint_interval = 1000
checkpoint_minutes = 60  # and after each hour of training
keep_last = 2
resume = "auto"
