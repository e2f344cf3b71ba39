"""
FineWeb-Edu -> GPT-2 token shards for the trainer.

    python fineweb.py                                  # sample-10BT -> edu_fineweb10B/, 100M tokens a shard
    python fineweb.py --max_tokens 200000000           # a trial: stop after 200M tokens
    python fineweb.py --source a.txt b.jsonl.gz c.parquet --out_dir data/mine --shard_size 1000000
    python fineweb.py --source notes/*.md --out_dir data/notes --shard_size 100000 --val_fraction 0.01
    python fineweb.py --source my_texts/ --out_dir data/mine     # a folder: its text files, at any depth
    python fineweb.py --verify                         # re-check every shard against manifest.json
    python fineweb.py --bench                          # our tokenizer pipeline vs. the straightforward one

The token stream is [EOT] + encode_ordinary(doc) for every document, in source order (EOT = 50256,
<|endoftext|>). It is cut into shards of exactly --shard_size tokens, the remainder in the last one:
{out_dir}/{prefix}_{split}_{index:06d}.npy, 1-D uint16 written with np.save (np.load / mmap_mode="r"),
shard 0 is "val", the rest "train". With --val_fraction F instead, every shard-sized chunk i of the
stream is split in two: its first ceil(F x n) tokens are {prefix}_val_{i:06d}.npy, the rest
{prefix}_train_{i:06d}.npy, so the val split is F of the tokens, sampled evenly along the stream.
manifest.json beside them records the tokenizer, the source and settings, and each shard's token
count and sha256 (of the whole .npy file).

Every shard is written under a temp name and renamed, and the manifest is rewritten (atomically)
after each one. Run the same command again after an interruption: shards the manifest vouches for
are kept, the rest is redone, and the output is byte-identical to an uninterrupted run. A run that
differs from the manifest only in --shard_size or --val_fraction (the same tokens, cut differently)
deletes the old shards and rebuilds; any other difference is refused, and the folder left alone.

A .txt, .md or .py source (also .gz/.bz2/.xz) is one document; .jsonl/.json/.parquet sources have one document
per row (--text_column), .jsonl/.json also compressed (.gz, .bz2, .xz, .zst) as `datasets` reads them.
A folder stands for those files in it, at any depth, in sorted order (hidden and empty ones skipped), as
the trainer's --data=FOLDER reads it.
"""
import argparse
import bz2
import collections
import gzip
import hashlib
import json
import lzma
import math
import multiprocessing
import os
import shlex
import signal
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np

from gpt2train.fileio import ArgumentParser, UserError, fail, replacing, write_json
from gpt2train.tokenizer import EOT, get_encoding, vocab_hashes

EOT_TEXT = "<|endoftext|>"
BATCH_CHARS = 1 << 20  # documents go to the workers in batches of about this many characters
MANIFEST = "manifest.json"


class FineWebError(UserError):
    """A user error: main() prints it as one line and returns 2."""


def parse_args(argv):
    p = ArgumentParser(prog="fineweb.py", description="Tokenize FineWeb-Edu (or local files) into GPT-2 uint16 shards.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dataset", default="HuggingFaceFW/fineweb-edu", help="Hugging Face dataset to stream")
    p.add_argument("--name", default="sample-10BT", help="the dataset's subset (config)")
    p.add_argument("--split", default="train", help="the dataset's split")
    p.add_argument("--text_column", default="text", help="the column that holds the documents (hub, .jsonl, .parquet)")
    p.add_argument("--source", nargs="+", metavar="PATH",
                   help="local .txt/.md/.py/.jsonl/.json/.parquet files or folders of them, instead of the hub")
    p.add_argument("--out_dir", default="edu_fineweb10B", help="where the shards and manifest.json go")
    p.add_argument("--prefix", default="edufineweb", help="shard names: {prefix}_{val|train}_{index:06d}.npy")
    p.add_argument("--shard_size", type=int, default=10**8, help="tokens per shard")
    p.add_argument("--val_fraction", type=float, default=None,
                   help="the first F of every shard-sized chunk is val (instead of shard 0 being val)")
    p.add_argument("--max_tokens", type=int, default=None, help="stop after this many tokens (for trials)")
    p.add_argument("--num_proc", type=int, default=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                   else os.cpu_count() or 1, help="tokenizer processes (1: no pool); the default is every core")
    p.add_argument("--verify", action="store_true", help="re-check the shards in --out_dir against its manifest")
    p.add_argument("--bench", action="store_true", help="benchmark the tokenizer pipeline against a naive one")
    args = p.parse_args(argv)
    for key in ("shard_size", "max_tokens", "num_proc"):
        if getattr(args, key) is not None and getattr(args, key) < 1:
            p.error(f"--{key} must be at least 1, got {getattr(args, key)}")
    if args.val_fraction is not None and not 0 < args.val_fraction < 1:
        p.error(f"--val_fraction must be between 0 and 1 (exclusive), got {args.val_fraction}")
    return args

# -----------------------------------------------------------------------------
# reading documents: one str each, always in the same order


COMPRESSIONS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
TEXT_EXTENSIONS = (".txt", ".md", ".py")  # one plain-text document a file
DATASET_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def file_kind(path):
    """'txt', 'json' or 'parquet', from the name with any compression suffix removed."""
    stem, ext = os.path.splitext(path.lower())
    compression = None
    if ext in (".gz", ".bz2", ".xz", ".zst"):  # .txt: the ones in COMPRESSIONS; json: whatever datasets reads
        (stem, ext), compression = os.path.splitext(stem), ext
    if ext in TEXT_EXTENSIONS and compression in (None, *COMPRESSIONS):
        return "txt"
    if ext in DATASET_BUILDERS:
        return DATASET_BUILDERS[ext]
    raise FineWebError(f"{path}: unsupported file type; --source takes .txt, .md, .py, .jsonl, .json or .parquet "
                       "files, optionally compressed (.txt.gz/.bz2/.xz, .jsonl.gz/.bz2/.xz/.zst)")


def known_kind(path):
    """file_kind(path), or None for a file --source does not read."""
    try:
        return file_kind(path)
    except FineWebError:
        return None


def folder_files(folder):
    """The files a folder source stands for: every file of a known_kind in it, at any depth, sorted (a
    folder's files before its subfolders'); hidden files and folders, and empty files, skipped."""
    paths = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        paths += [os.path.join(root, f) for f in sorted(files) if not f.startswith(".") and known_kind(f)]
    return [p for p in paths if os.path.getsize(p) > 0]


def expand_sources(paths):
    """--source's paths as files: each folder replaced by its folder_files()."""
    files = []
    for path in paths:
        if not os.path.isdir(path):
            files.append(path)
        elif not (found := folder_files(path)):
            raise FineWebError(f"{path}: the folder holds no non-empty .txt, .md, .py, .jsonl, .json or .parquet files")
        else:
            files += found
    return files


def check_sources(paths):
    for path in paths:
        if not os.path.exists(path):
            raise FineWebError(f"{path}: no such file")
        if not os.path.isfile(path):
            raise FineWebError(f"{path}: not a file or folder")
        if os.path.getsize(path) == 0:
            raise FineWebError(f"{path} is empty; leave it out of --source")
        if file_kind(path) == "parquet":
            import pyarrow.parquet as pq
            try:
                rows = pq.ParquetFile(path).metadata.num_rows
            except Exception as e:  # pyarrow's errors: a truncated or foreign file
                raise FineWebError(f"{path} is not a readable parquet file ({one_line(e)}); fix it or leave it out "
                                   "of --source") from None
            if rows == 0:  # datasets trips over these
                raise FineWebError(f"{path} holds no rows; leave it out of --source")


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def source_spec(args):
    """What the documents come from, as recorded in (and compared with) the manifest."""
    if args.source:
        return {"files": [{"path": os.path.abspath(p), "sha256": sha256_file(p)} for p in args.source],
                "text_column": args.text_column}
    return {"dataset": args.dataset, "name": args.name, "split": args.split, "text_column": args.text_column}


def read_text_file(path):
    opener = COMPRESSIONS.get(os.path.splitext(path)[1].lower(), open)
    try:
        with opener(path, "rt", encoding="utf-8", newline="") as f:  # newline="": the text as it is, \r\n too
            return f.read()
    except UnicodeDecodeError as e:
        raise FineWebError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8") from None
    except (OSError, EOFError, lzma.LZMAError) as e:  # a truncated or corrupt .gz/.bz2/.xz
        raise FineWebError(f"{path} cannot be read ({one_line(e)}); fix it or leave it out of --source") from None


def iter_rows(ds, text_column, where):
    """The text_column of every row of a (streaming) datasets.IterableDataset, checked."""
    if ds.features is not None and not ds.features:
        raise FineWebError(f"{where} holds no rows; leave it out of --source")
    if ds.features is not None and text_column not in ds.features:
        raise FineWebError(f"{where} has no column {text_column!r} (columns: {', '.join(ds.features)}); "
                           "pass --text_column=NAME")
    row = 0
    for batch in ds.iter(batch_size=1000):
        texts = batch.get(text_column)
        if texts is None:
            raise FineWebError(f"{where}: row {row} has no column {text_column!r} (columns: {', '.join(batch)}); "
                               "pass --text_column=NAME")
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise FineWebError(f"{where}: row {row + i} has no text in column {text_column!r} "
                                   f"(found {type(text).__name__}); fix or drop that row")
        yield from texts
        row += len(texts)


def load_stream(path, where, **kwargs):
    import datasets  # slow to import: only when needed
    try:
        return datasets.load_dataset(path, streaming=True, **kwargs)
    except Exception as e:
        raise FineWebError(f"could not open {where}: {one_line(e)}") from None


def one_line(e):
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300]}" if lines else type(e).__name__


def iter_documents(args, skip=0):
    """Every document of the source, in order, after the first `skip`."""
    n = 0
    for path in args.source or [None]:
        kind = file_kind(path) if path else "hub"
        if kind == "txt":
            if n >= skip:
                yield read_text_file(path)
            n += 1
            continue
        if kind == "hub":
            where = f"{args.dataset} ({args.name}, {args.split})"
            ds = load_stream(args.dataset, where, name=args.name, split=args.split)
        else:
            where = path
            ds = load_stream(kind, where, data_files=[path], split="train")
        if ds.features is not None and args.text_column in ds.features:
            ds = ds.select_columns([args.text_column])  # don't decode the other columns
        try:
            for text in iter_rows(ds, args.text_column, where):
                if n >= skip:
                    yield text
                n += 1
        except FineWebError:
            raise
        except Exception as e:  # a malformed file (exit 2), or the hub's network (exit 1): the shards so far are kept
            if kind == "hub":
                raise ConnectionError(f"reading {where} failed ({one_line(e)}); the shards so far are kept") from None
            raise FineWebError(f"reading {where} failed ({one_line(e)}); fix it and run the same command "
                               "again") from None


def batches(docs):
    """Lists of consecutive documents of about BATCH_CHARS characters."""
    batch, chars = [], 0
    for doc in docs:
        batch.append(doc)
        chars += len(doc)
        if chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch

# -----------------------------------------------------------------------------
# tokenizing: [EOT] + encode_ordinary(doc) for each document, batches in parallel, results in order


def encode_docs(docs):
    """[EOT] + encode_ordinary(doc) for each doc, concatenated, as (N,) uint16.
    Fast path: one tiktoken call on the documents joined by "<|endoftext|>" with that special token
    allowed. tiktoken encodes the text between special tokens independently, so this equals encoding
    each document alone, and the tokens come back as a numpy buffer, not as Python ints."""
    enc = get_encoding()
    tokens = None
    if not any(EOT_TEXT in doc for doc in docs):  # a document that spells "<|endoftext|>" keeps it as plain text
        try:
            tokens = enc.encode_to_numpy(EOT_TEXT + EOT_TEXT.join(docs), allowed_special={EOT_TEXT})  # (N,) uint32
        except UnicodeEncodeError:  # lone surrogates: encode_ordinary knows how to repair them
            pass
    if tokens is None:
        tokens = np.array([t for doc in docs for t in [EOT] + enc.encode_ordinary(doc)], dtype=np.uint32)
    if tokens.size and tokens.max() >= 2**16:
        bad = int(tokens.max())
        raise FineWebError(f"token {bad} does not fit in uint16 (< 65536): these shards need a tokenizer "
                           "with a vocabulary of at most 65536 tokens")
    return tokens.astype(np.uint16)


def worker_init():
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is handled once, by the main process
    get_encoding()


def start_pool(num_proc):
    """Worker processes for tokenize(), or None for num_proc 1 (encode in this process). Spawned, not
    forked: the same on every OS, and safe when the caller has threads (torch, the trainer)."""
    if num_proc == 1:
        return None
    return ProcessPoolExecutor(num_proc, mp_context=multiprocessing.get_context("spawn"), initializer=worker_init)


def tokenize(docs, pool, num_proc):
    """Yields encode_docs(batch) for consecutive batches of docs, in order, with at most 2 batches a
    worker in flight (so a 10B-token stream is never read ahead into memory)."""
    if pool is None:
        yield from map(encode_docs, batches(docs))
        return
    pending = collections.deque()
    for batch in batches(docs):
        pending.append(pool.submit(encode_docs, batch))
        if len(pending) >= 2 * num_proc:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()

# -----------------------------------------------------------------------------
# shards and the manifest


def chunk_parts(prefix, index, n, val_fraction):
    """The shards chunk `index` of the stream (n tokens) is saved as: [(name, split, start, end)]."""
    if val_fraction is None:  # shard 0 is val, the rest train
        split = "val" if index == 0 else "train"
        return [(f"{prefix}_{split}_{index:06d}.npy", split, 0, n)]
    v = math.ceil(val_fraction * n)
    parts = [(f"{prefix}_val_{index:06d}.npy", "val", 0, v), (f"{prefix}_train_{index:06d}.npy", "train", v, n)]
    return [p for p in parts if p[3] > p[2]]


def write_shard(path, tokens):
    """np.save under a temp name, then rename; returns the file's sha256."""
    with replacing(path) as tmp:
        with open(tmp, "wb") as f:
            np.save(f, tokens)  # a real file: numpy writes the array's buffer directly, no copy
        sha = sha256_file(tmp)
    return sha


def load_manifest(out_dir):
    path = os.path.join(out_dir, MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (ValueError, RecursionError, IsADirectoryError) as e:  # (ValueError: not JSON, not UTF-8)
        raise FineWebError(f"{path} is not valid JSON ({one_line(e)}); move {out_dir} aside or delete it") from None
    if not isinstance(manifest, dict) or not {"tokenizer", "settings", "shards"} <= manifest.keys() \
            or not isinstance(manifest["settings"], dict) or not isinstance(manifest["shards"], list) \
            or not all(map(is_shard_entry, manifest["shards"])):
        raise FineWebError(f"{path} is not a manifest this script wrote; move {out_dir} aside or delete it")
    return manifest


def is_shard_entry(s):
    """Whether s is a manifest's shard entry: {"name": a file name, "tokens", "sha256", "next": [doc, offset]}."""
    return (isinstance(s, dict) and isinstance(s.get("name"), str) and s["name"] == os.path.basename(s["name"]) != ""
            and type(s.get("tokens")) is int and isinstance(s.get("sha256"), str) and isinstance(s.get("next"), list)
            and len(s["next"]) == 2 and all(type(v) is int for v in s["next"]))


def check_shard(out_dir, shard):
    """None if the file matches its manifest entry, else what is wrong."""
    path = os.path.join(out_dir, shard["name"])
    if not os.path.exists(path):
        return f"{shard['name']} is missing"
    sha = sha256_file(path)
    if sha != shard["sha256"]:
        return f"{shard['name']} has sha256 {sha[:16]}..., the manifest says {shard['sha256'][:16]}..."
    tokens = np.load(path, mmap_mode="r")
    if tokens.dtype != np.uint16 or tokens.shape != (shard["tokens"],):
        return f"{shard['name']} holds {tokens.dtype} {tokens.shape}, the manifest says uint16 ({shard['tokens']},)"
    return None


def startup_problems(out_dir):
    """What a trainer starting on out_dir can check in a moment against its manifest (no sha256): the listed
    shards missing, unreadable or of another length. [] without a manifest."""
    manifest, problems = load_manifest(out_dir), []
    for shard in manifest["shards"] if manifest else []:
        path = os.path.join(out_dir, shard["name"])
        try:
            tokens = np.load(path, mmap_mode="r")
        except FileNotFoundError:
            problems.append(f"{shard['name']} is missing")
            continue
        except Exception as e:  # noqa: BLE001 - a truncated or foreign .npy
            problems.append(f"{shard['name']} is not a readable .npy ({one_line(e)})")
            continue
        if tokens.dtype != np.uint16 or tokens.shape != (shard["tokens"],):
            problems.append(f"{shard['name']} holds {tokens.dtype} {tokens.shape}, the manifest says uint16 "
                            f"({shard['tokens']},)")
    return problems


def repair_command(out_dir):
    """The fineweb.py command that made out_dir's shards, from its manifest: run again, it redoes them from
    the first one missing or damaged."""
    settings = load_manifest(out_dir)["settings"]
    source, opts = settings["source"], []
    if "files" in source:
        opts += ["--source", shlex.quote(source["files"][0]["path"]) + (" ..." if len(source["files"]) > 1 else "")]
    else:
        opts += ["--dataset", source["dataset"], "--name", source["name"], "--split", source["split"]]
    if source.get("text_column", "text") != "text":
        opts += ["--text_column", source["text_column"]]
    for key, default in (("prefix", "edufineweb"), ("shard_size", 10**8), ("val_fraction", None),
                         ("max_tokens", None)):
        if settings.get(key, default) != default:
            opts += [f"--{key}", str(settings[key])]
    return " ".join(["python fineweb.py", *opts, "--out_dir", shlex.quote(out_dir)])


def loose_shards(out_dir):
    """.npy files the trainer would read as shards (names with 'train' or 'val')."""
    if not os.path.isdir(out_dir):
        return []
    return sorted(f for f in os.listdir(out_dir) if f.endswith(".npy") and ("train" in f or "val" in f))


def describe_source(source):
    if "files" in source:
        return ", ".join(os.path.basename(f["path"]) for f in source["files"])
    return f"{source['dataset']} ({source['name']}, {source['split']}, column {source['text_column']!r})"


LAYOUT = {"shard_size", "val_fraction"}  # settings that cut the same tokens differently


def difference(old, new, ignore=()):
    """The first setting that differs between two manifests' settings, in words; None if none does."""
    for key in sorted((set(old) | set(new)) - set(ignore)):
        if old.get(key) != new.get(key):
            if key != "source":
                return f"{key}={old.get(key)} (this run: {key}={new.get(key)})"
            was, now = describe_source(old[key]), describe_source(new[key])
            return f"a different source ({was}{' with other contents' if was == now else ''}; this run: {now})"
    return None


def resume(out_dir, settings):
    """(shards to keep, start position) for a run with these settings in out_dir; None if it is done."""
    manifest = load_manifest(out_dir)
    if manifest is None:
        if loose_shards(out_dir):
            raise FineWebError(f"{out_dir} holds shards ({loose_shards(out_dir)[0]}, ...) but no {MANIFEST}: "
                               "they are not from this script; use another --out_dir")
        return [], (0, 0)
    old, new = {"tokenizer": manifest["tokenizer"], **manifest["settings"]}, {"tokenizer": tokenizer_info(), **settings}
    diff = difference(old, new, ignore=LAYOUT)
    if diff:
        raise FineWebError(f"{out_dir} holds shards made from {diff}: use another --out_dir, "
                           f"or delete {out_dir} to start over")
    if difference(old, new):  # the same tokens, cut differently: remove the old shards, then start over
        print(f"{out_dir}: rebuilding, {difference(old, new)}", file=sys.stderr)
        for shard in manifest["shards"]:
            if os.path.exists(os.path.join(out_dir, shard["name"])):
                os.remove(os.path.join(out_dir, shard["name"]))
        os.remove(os.path.join(out_dir, MANIFEST))
        return [], (0, 0)
    kept = []
    for shard in manifest["shards"]:
        problem = check_shard(out_dir, shard)
        if problem:
            print(f"redoing from {shard['name']}: {problem}", file=sys.stderr)
            kept = [s for s in kept if s["next"] != shard["next"]]  # the whole chunk: all its parts end there
            break
        kept.append(shard)
    if manifest.get("complete") and len(kept) == len(manifest["shards"]):
        return None
    return kept, tuple(kept[-1]["next"]) if kept else (0, 0)


def tokenizer_info():
    return {**vocab_hashes(), "eot": EOT, "dtype": "uint16"}


def make_manifest(settings, shards, complete):
    return {"tokenizer": tokenizer_info(), "settings": settings,
            "shards": shards, "total_tokens": sum(s["tokens"] for s in shards),
            "documents": shards[-1]["next"][0] + (shards[-1]["next"][1] > 0) if shards else 0,
            "complete": complete}


def verify(out_dir):
    manifest = load_manifest(out_dir)
    if manifest is None:
        raise FineWebError(f"{os.path.join(out_dir, MANIFEST)} does not exist: nothing to verify")
    for shard in manifest["shards"]:
        problem = check_shard(out_dir, shard)
        if problem:
            raise FineWebError(f"{out_dir}: {problem}; run the same command that made it again to redo it")
    unlisted = sorted(set(loose_shards(out_dir)) - {s["name"] for s in manifest["shards"]})
    if unlisted:
        raise FineWebError(f"{out_dir}: {unlisted[0]} is not in {MANIFEST}; the trainer would read it, move it away")
    total = sum(s["tokens"] for s in manifest["shards"])
    state = "complete" if manifest.get("complete") else "INCOMPLETE (run the same command again to finish)"
    print(f"ok: {len(manifest['shards'])} shards, {total:,} tokens match {MANIFEST}; the run is {state}")

# -----------------------------------------------------------------------------
# the run: token stream -> shards


def run_settings(args):
    """The manifest's settings of this run: what makes its shards what they are."""
    settings = {"source": source_spec(args), "prefix": args.prefix, "shard_size": args.shard_size,
                "max_tokens": args.max_tokens}
    if args.val_fraction is not None:  # (absent from older manifests, which all had shard 0 as val)
        settings["val_fraction"] = args.val_fraction
    return settings


def finish_build(args, settings, shards, total):
    """The manifest of a finished run, marked complete, and the run's last lines."""
    if not shards:
        raise FineWebError("the source holds no documents")
    write_json(os.path.join(args.out_dir, MANIFEST), make_manifest(settings, shards, complete=True))
    print(f"wrote {len(shards)} shards ({total:,} tokens) to {args.out_dir}")
    if not any(s["split"] == "train" for s in shards):
        print("warning: only val shards were written; lower --shard_size to get train shards too", file=sys.stderr)


def checked_args(args):
    """args with each --source folder replaced by its files, all checked; a file as --out_dir refused."""
    if args.source:
        args = argparse.Namespace(**{**vars(args), "source": expand_sources(args.source)})
        check_sources(args.source)
    if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        raise FineWebError(f"--out_dir {args.out_dir} is a file, not a folder")
    return args


def build(args):
    """Tokenize args' source into shards in args.out_dir, resuming a run that was cut short there."""
    args = checked_args(args)
    settings = run_settings(args)
    plan = resume(args.out_dir, settings)
    if plan is None:
        print(f"{args.out_dir} is complete already (every shard matches {MANIFEST}); nothing to do")
        return
    shards, (doc, offset) = plan
    manifest_path = os.path.join(args.out_dir, MANIFEST)
    if os.path.exists(manifest_path):  # forget the entries past the last good shard before anything else
        write_json(manifest_path, make_manifest(settings, shards, complete=False))
    if shards:
        print(f"resuming after {len(shards)} complete shards, at document {doc:,}")

    from tqdm import tqdm
    max_tokens = args.max_tokens or float("inf")
    total = sum(s["tokens"] for s in shards)
    chunks = len({tuple(s["next"]) for s in shards})  # the parts of one chunk share its end position
    buf = np.empty(args.shard_size, dtype=np.uint16)  # the chunk (shard) being filled
    fill = 0
    # shards are saved (np.save, sha256, fsync, rename, manifest) in a thread beside the tokenizing, one
    # at a time and in order: ~0.5 s a 100M-token shard that the workers need not wait for
    writer, writing = ThreadPoolExecutor(1), None

    def save(tokens, parts, listed):  # writer thread: the chunk's shard files, then the manifest that lists them
        for entry, (_, _, start, end) in zip(listed[len(listed) - len(parts):], parts):
            entry["sha256"] = write_shard(os.path.join(args.out_dir, entry["name"]), tokens[start:end])
            entry["max_token"] = int(tokens[start:end].max())  # the trainer's vocab check, without a scan
        write_json(manifest_path, make_manifest(settings, listed, complete=False))

    def finish_shard(position):
        nonlocal buf, writing, chunks
        if writing is not None:
            writing.result()  # the previous chunk is on disk (or its error is raised here)
        os.makedirs(args.out_dir, exist_ok=True)
        parts = chunk_parts(args.prefix, chunks, fill, args.val_fraction)
        for name, split, start, end in parts:
            shards.append({"name": name, "split": split, "tokens": end - start, "sha256": None,
                           "next": list(position)})  # next: (document, token offset) where the next chunk starts
        writing = writer.submit(save, buf[:fill], parts, list(shards))
        buf = np.empty(args.shard_size, dtype=np.uint16)
        chunks += 1

    bar = tqdm(total=args.max_tokens, initial=total, unit="tok", unit_scale=True, desc="tokenizing", smoothing=0.05)
    # a local source of about one batch is encoded faster here than it takes to start a pool
    small = args.source and sum(os.path.getsize(p) for p in args.source) <= BATCH_CHARS
    num_proc = 1 if small else args.num_proc
    pool = start_pool(num_proc)
    stream = tokenize(iter_documents(args, skip=doc), pool, num_proc)
    try:
        for tokens in stream:  # (n,) uint16: whole documents doc, doc+1, ..., each starting with EOT
            pos, offset = offset, 0  # after a resume, the first `offset` tokens are in the last kept shard
            while pos < len(tokens) and total < max_tokens:
                take = int(min(len(tokens) - pos, args.shard_size - fill, max_tokens - total))
                buf[fill:fill + take] = tokens[pos:pos + take]
                fill, pos, total = fill + take, pos + take, total + take
                if fill == args.shard_size or total == max_tokens:
                    starts = np.flatnonzero(tokens[:pos + 1] == EOT)  # document starts up to position pos
                    finish_shard((doc + len(starts) - 1, pos - int(starts[-1])))
                    fill = 0
            doc += int(np.count_nonzero(tokens == EOT))
            bar.update(total - bar.n)
            bar.set_postfix(docs=f"{doc:,}", refresh=False)
            if total >= max_tokens:
                break
        if fill:
            finish_shard((doc, 0))
        if writing is not None:
            writing.result()
    finally:
        stream.close()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        writer.shutdown(wait=True)  # a shard being saved is finished, even on Ctrl-C
        bar.close()
    finish_build(args, settings, shards, total)

# -----------------------------------------------------------------------------
# benchmark: the straightforward pipeline vs. ours, on the same documents


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
    if args.source:
        args = argparse.Namespace(**{**vars(args), "source": expand_sources(args.source)})
    docs = list(iter_documents(args)) if args.source else bench_corpus()
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
        build(parse_args(["--source", path, "--out_dir", os.path.join(tmp, "out"), "--shard_size", "1000000",
                          "--num_proc", str(n)]))
        print(f"end to end: main() on it as one .jsonl took {time.perf_counter() - t0:.1f} s, importing datasets "
              "and starting the pool included")

# -----------------------------------------------------------------------------


def main(argv=None):
    try:
        args = parse_args(argv)
        if args.verify:
            verify(args.out_dir)
        elif args.bench:
            bench(args)
        else:
            build(args)
    except (UserError, OSError) as e:  # bad input: 2; disk full, ...: 1 (the shards written so far are kept)
        return fail(e)
    except BrokenProcessPool:
        print("error: a tokenizer process died (out of memory?): run the same command again, perhaps with a "
              "smaller --num_proc, to resume", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: run the same command again to resume", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
