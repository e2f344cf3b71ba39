"""
FineWeb-Edu -> GPT-2 token shards for the trainer.

    python fineweb.py                             # sample-10BT -> edu_fineweb10B/, 100M a shard
    python fineweb.py --max_tokens 200000000      # a trial: stop after 200M tokens
    python fineweb.py --source a.txt b.jsonl.gz c.parquet --out_dir data/mine --shard_size 1000000
    python fineweb.py --source notes/*.md --out_dir notes --shard_size 100000 --val_fraction 0.01
    python fineweb.py --source my_texts/ --out_dir data/mine  # a folder: its text files, any depth
    python fineweb.py --verify                    # re-check every shard against manifest.json

The token stream is [EOT] + encode_ordinary(doc) for every document, in source order (EOT = 50256,
<|endoftext|>). It is cut into shards of exactly --shard_size tokens, the remainder in the last one:
{out_dir}/{prefix}_{split}_{index:06d}.npy, 1-D uint16 written with np.save (np.load /
mmap_mode="r"), shard 0 is "val", the rest "train" (a source under one shard, all val, is refused:
use --val_fraction). With --val_fraction F instead, every shard-sized chunk i of the
stream is split in two: its first ceil(F x n) tokens are {prefix}_val_{i:06d}.npy, the rest
{prefix}_train_{i:06d}.npy, so the val split is F of the tokens, sampled evenly along the stream.
manifest.json beside them records the tokenizer, the source and settings, and each shard's token
count and sha256 (of the whole .npy file).

Every shard is written under a temp name and renamed, and the manifest is rewritten (atomically)
after each one. Run the same command again after an interruption: shards the manifest vouches for
are kept, the rest is redone, and the output is byte-identical to an uninterrupted run. A run that
differs from the manifest only in --shard_size or --val_fraction (the same tokens, cut differently)
deletes the old shards and rebuilds; any other difference is refused, and the folder left alone.

The library is gpt2train/shards.py; `python dev/fineweb_bench.py` times its tokenizer pipeline.

A .txt, .md or .py source (also .gz/.bz2/.xz) is one document; .jsonl/.json/.parquet sources have
one document per row (--text_column), .jsonl/.json also compressed (.gz, .bz2, .xz, .zst) as
`datasets` reads them. A folder stands for those files in it, at any depth, in sorted order (hidden
and empty ones skipped), as the trainer's --data=FOLDER reads it.
"""
import argparse
import os
import sys
from concurrent.futures.process import BrokenProcessPool

from gpt2train import shards
from gpt2train.fileio import ArgumentParser, UserError, fail


def parse_args(argv):
    p = ArgumentParser(prog="fineweb.py",
                       description="Tokenize FineWeb-Edu (or local files) into GPT-2 uint16 "
                                   "shards.",

                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dataset", default="HuggingFaceFW/fineweb-edu",
                   help="Hugging Face dataset to stream")
    p.add_argument("--name", default="sample-10BT", help="the dataset's subset (config)")
    p.add_argument("--split", default="train", help="the dataset's split")
    p.add_argument("--text_column", default="text",
                   help="the column that holds the documents (hub, .jsonl, .parquet)")
    p.add_argument("--source", nargs="+", metavar="PATH",
                   help="local .txt/.md/.py/.jsonl/.json/.parquet files or folders of them, "
                        "instead of the hub")
    p.add_argument("--out_dir", default="edu_fineweb10B",
                   help="where the shards and manifest.json go")
    p.add_argument("--prefix", default="edufineweb",
                   help="shard names: {prefix}_{val|train}_{index:06d}.npy")
    p.add_argument("--shard_size", type=int, default=10**8, help="tokens per shard")
    p.add_argument("--val_fraction", type=float, default=None,
                   help="the first F of every shard-sized chunk is val (instead of shard 0 being "
                        "val)")
    p.add_argument("--max_tokens", type=int, default=None,
                   help="stop after this many tokens (for trials)")
    p.add_argument("--num_proc", type=int,
                   default=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                   else os.cpu_count() or 1,
                   help="tokenizer processes (1: no pool); the default is every core")
    p.add_argument("--verify", action="store_true",
                   help="re-check the shards in --out_dir against its manifest")
    args = p.parse_args(argv)
    for key in ("shard_size", "max_tokens", "num_proc"):
        if getattr(args, key) is not None and getattr(args, key) < 1:
            p.error(f"--{key} must be at least 1, got {getattr(args, key)}")
    if args.val_fraction is not None and not 0 < args.val_fraction < 1:
        p.error(f"--val_fraction must be between 0 and 1 (exclusive), got {args.val_fraction}")
    return args

# -----------------------------------------------------------------------------


def main(argv=None):
    try:
        args = parse_args(argv)
        if args.verify:
            shards.verify(args.out_dir)
        else:
            shards.build(**{k: v for k, v in vars(args).items() if k != "verify"})
    # bad input: 2; disk full, ...: 1 (the shards written so far are kept)
    except (UserError, OSError) as e:
        return fail(e)
    except BrokenProcessPool:
        print("error: a tokenizer process died (out of memory?): run the same command again, "
              "perhaps with a smaller --num_proc, to resume", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: run the same command again to resume", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
