"""
The tokenizer pipeline of fineweb.py (gpt2train/shards.py) against the straightforward one, on the same documents.

    python dev/fineweb_bench.py                    # the built-in corpus (Python's help topics and stdlib)
    python dev/fineweb_bench.py --source FILES...  # your own documents
    python dev/fineweb_bench.py --num_proc 4

Results and the machine they came from: dev/fineweb_bench.md.
"""
import json
import multiprocessing
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from gpt2train import shards  # noqa: E402
from gpt2train.fileio import ArgumentParser, UserError, fail  # noqa: E402
from gpt2train.shards import EOT, FineWebError, iter_documents, start_pool, tokenize, worker_init  # noqa: E402
from gpt2train.tokenizer import get_encoding  # noqa: E402

def encode_one(doc):
    return get_encoding().encode_ordinary(doc)


def naive_tokens(docs, pool):
    """The straightforward way: one document per task through a process pool, encode_ordinary,
    append to a list; then the uint16 array a shard is written from."""
    tokens = []
    for toks in pool.imap(encode_one, docs):
        tokens.append(EOT)
        tokens.extend(toks)
    return np.array(tokens, dtype=np.uint16)


def our_tokens(docs, pool, num_proc):
    return np.concatenate(list(tokenize(iter(docs), pool, num_proc)))


def cpu_seconds():
    """CPU seconds used so far by this process and its live children (worker pools); None off Linux."""
    try:
        total = 0
        for pid in [os.getpid()] + [p.pid for p in multiprocessing.active_children()]:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        return total / os.sysconf("SC_CLK_TCK")
    except OSError:
        return None


def timed(fn, *args):
    """(result, wall seconds, CPU seconds or None)"""
    c0, t0 = cpu_seconds(), time.perf_counter()
    out = fn(*args)
    t1, c1 = time.perf_counter(), cpu_seconds()
    return out, t1 - t0, None if c0 is None else c1 - c0


def bench_corpus(mb=16):
    """About `mb` MB of documents from Python's own help topics and standard library sources, each .py
    file cut at its top-level blank-line breaks: sizes like web pages' (hundreds to thousands of tokens)."""
    import sysconfig
    from pydoc_data.topics import topics
    docs = list(topics.values())
    chars = sum(map(len, docs))
    for root, dirs, files in os.walk(sysconfig.get_paths()["stdlib"]):  # top-down, in sorted order
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "test", "tests", "idlelib"))
        for f in sorted(f for f in files if f.endswith(".py")):
            try:
                with open(os.path.join(root, f), encoding="utf-8") as fh:
                    parts = [p for p in fh.read().split("\n\n\n") if p.strip()]
            except (UnicodeDecodeError, OSError):
                continue
            docs += parts
            chars += sum(map(len, parts))
            if chars > mb * 1e6:
                return docs
    return docs


def bench(args):
    """Both pipelines on the same documents, their worker processes started and tokenizers loaded
    before the clock starts (a one-off cost). Wall-clock tokens/s, and CPU seconds per million tokens
    summed over the main process and the workers: the steadier number on a busy machine."""
    job = shards.Job("", source=args.source, text_column=args.text_column)
    docs = list(iter_documents(shards.checked_args(job))) if args.source else bench_corpus()
    n = args.num_proc
    print(f"corpus: {len(docs):,} documents, {sum(map(len, docs)) / 1e6:.1f} MB of text, num_proc={n}")
    naive_pool = multiprocessing.get_context("spawn").Pool(n, initializer=worker_init)
    naive_pool.map(time.sleep, [1] * n, chunksize=1)  # one task a worker: all started, tokenizers loaded
    our_pool = start_pool(n)
    if our_pool is not None:
        list(our_pool.map(time.sleep, [1] * n))  # (workers start as tasks arrive)
    try:
        for rep in range(2):
            naive, naive_s, naive_cpu = timed(naive_tokens, docs, naive_pool)
            ours, our_s, our_cpu = timed(our_tokens, docs, our_pool, n)
            if not np.array_equal(ours, naive):
                raise FineWebError("the fast path's tokens differ from encode_ordinary's: a bug, please report it")
            line = f"run {rep + 1}: {len(ours):,} tokens, identical; naive {len(ours) / naive_s / 1e6:.2f}M tok/s, " \
                   f"ours {len(ours) / our_s / 1e6:.2f}M tok/s, ratio {naive_s / our_s:.2f}x"
            if naive_cpu and our_cpu:  # None off Linux; 0 when the corpus is too small for the clock ticks
                line += f"; CPU s per 1M tokens: naive {naive_cpu / len(ours) * 1e6:.3f}, " \
                        f"ours {our_cpu / len(ours) * 1e6:.3f}, ratio {naive_cpu / our_cpu:.2f}x"
            print(line)
    finally:
        naive_pool.terminate()
        if our_pool is not None:
            our_pool.shutdown()
    # end to end: the documents as a .jsonl -> datasets -> shards, sha256, manifest
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "corpus.jsonl")
        with open(path, "w") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
        t0 = time.perf_counter()
        shards.build(os.path.join(tmp, "out"), source=[path], shard_size=10**6, num_proc=n)
        print(f"end to end: shards.build() on it as one .jsonl took {time.perf_counter() - t0:.1f} s, importing "
              "datasets and starting the pool included")


def main(argv=None):
    p = ArgumentParser(prog="dev/fineweb_bench.py", description="fineweb.py's tokenizer pipeline vs. a naive one")
    p.add_argument("--source", nargs="+", metavar="PATH", help="documents to use instead of the built-in corpus")
    p.add_argument("--text_column", default="text", help="the column that holds the documents (.jsonl, .parquet)")
    p.add_argument("--num_proc", type=int, default=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                   else os.cpu_count() or 1, help="tokenizer processes")
    args = p.parse_args(argv)
    try:
        bench(args)
    except (UserError, OSError) as e:
        return fail(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
