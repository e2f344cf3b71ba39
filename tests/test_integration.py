"""The scripts together, as a user chains them: fineweb.py -> train_gpt2.py -> hellaswag.py, and the
trainer's in-training HellaSwag under torchrun against one process."""
import json
import os
import subprocess
import sys

import numpy as np

import fineweb
import hellaswag
from conftest import ROOT, load_ckpt, make_rows, read_log, write_rows
from gpt2train.tokenizer import EOT, get_encoding
from gpt2train.data import Sampling, TokenLoader
from train_gpt2 import main

DOCS = [f"Document {i}: " + " ".join(["the quick brown fox jumps over the lazy dog"] * (5 + i % 7)) for i in range(40)]


def gpt2_tiny_args(data_dir, out_dir, **over):
    """A 1-layer model with GPT-2's real vocabulary (padded), so HellaSwag and sampling run."""
    args = dict(data_dir=data_dir, out_dir=out_dir, n_layer=1, n_head=2, n_embd=32, block_size=64, vocab_size=50304,
                micro_batch_size=2, seq_len=32, total_batch_size=128, max_steps=2, warmup_steps=1, max_lr=1e-3,
                min_lr=1e-4, eval_interval=2, val_steps=1, sample_interval=0, checkpoint_interval=0, seed=0)
    args.update(over)
    return [f"--{k}={v}" for k, v in args.items()]


def make_shards(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    paths = []
    for i, doc in enumerate(DOCS):
        paths.append(str(src / f"doc{i:02d}.txt"))
        with open(paths[-1], "w") as f:
            f.write(doc)
    data = str(tmp_path / "shards")
    assert fineweb.main(["--source", *paths, "--out_dir", data, "--shard_size", "500", "--num_proc", "1"]) == 0
    return data


def test_trainer_reads_fineweb_shards_and_hellaswag_agrees(tmp_path):
    data = make_shards(tmp_path)
    enc = get_encoding()
    stream = np.concatenate([[EOT] + enc.encode_ordinary(d) for d in DOCS])
    # the loader's train split is the stream after the first (val) shard, token for token, across shards
    loader = TokenLoader(data, "train", 2, 32, Sampling(shuffle=False))
    x, y = loader.next_batch()
    assert x.flatten().tolist() == stream[500:564].tolist() and y.flatten().tolist() == stream[501:565].tolist()
    assert loader.n_tokens == len(stream) - 500 and len(loader.paths) >= 2

    rows = write_rows(tmp_path / "rows.jsonl", make_rows(12, seed=3))
    out = str(tmp_path / "out")
    assert main(gpt2_tiny_args(data, out, hellaswag_interval=2, hellaswag_file=rows)) == 0
    log = read_log(out)
    assert [e["step"] for e in log if "loss" in e] == [0, 1]
    hs = [e for e in log if "hellaswag_acc" in e]
    assert [e["step"] for e in hs] == [0, 2]
    # the in-training number at the last step equals the standalone script on the final checkpoint
    assert hellaswag.main(["--model", os.path.join(out, "ckpt_000002.pt"), "--data", rows, "--device", "cpu",
                           "--json", str(tmp_path / "hs.json")]) == 0
    with open(tmp_path / "hs.json") as f:
        standalone = json.load(f)
    assert standalone["n"] == 12
    assert (hs[-1]["hellaswag_acc"], hs[-1]["hellaswag_acc_norm"]) == (standalone["acc"], standalone["acc_norm"])


def test_hellaswag_in_training_two_ranks_match_one(tmp_path):
    data = make_shards(tmp_path)
    rows = write_rows(tmp_path / "rows.jsonl", make_rows(13, seed=5))  # odd: ranks get 7 and 6 examples
    common = dict(max_steps=1, hellaswag_interval=1, hellaswag_file=rows, eval_interval=0)
    one = str(tmp_path / "one")
    assert main(gpt2_tiny_args(data, one, **common)) == 0
    two = str(tmp_path / "two")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train_gpt2.py",
           *gpt2_tiny_args(data, two, **common, micro_batch_size=1)]  # same global batch: 2 ranks x 1 x 32 x 2
    r = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]

    def pick(out_dir):
        rows = [e for e in read_log(out_dir) if "hellaswag_acc" in e]
        return [(e["step"], e["hellaswag_acc"], e["hellaswag_acc_norm"]) for e in rows]
    assert len(pick(one)) == 2 and pick(one)[0] == pick(two)[0]  # step 0: identical weights, split examples
    # after one step the weights agree to float rounding; the counts must agree exactly
    assert pick(one)[1] == pick(two)[1]
    assert load_ckpt(os.path.join(one, "ckpt_000001.pt"))["step"] == 1
