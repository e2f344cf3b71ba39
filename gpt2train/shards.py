"""
fineweb.py's library: documents -> GPT-2 token shards with a manifest, resumable, verifiable.

    from gpt2train import shards
    shards.build("data/mine", source=["a.txt", "notes/"], prefix="text", shard_size=10**6,
                 val_fraction=0.01)
    problems = shards.startup_problems("data/mine")  # [] when every shard matches manifest.json
    shards.verify("data/mine")  # every shard's sha256 against the manifest

fineweb.py (the command a user runs) parses the flags and calls build() or verify(); data.py
calls build() for --data and the quickstart's corpus. The format and the resume rules are in
fineweb.py's docstring.
"""
import dataclasses
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
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from gpt2train.fileio import UserError, replacing, write_json
from gpt2train.tokenizer import EOT, get_encoding, vocab_hashes

EOT_TEXT = "<|endoftext|>"
BATCH_CHARS = 1 << 20  # documents go to the workers in batches of about this many characters
MANIFEST = "manifest.json"


class FineWebError(UserError):
    """A user error: main() prints it as one line and returns 2."""


# -----------------------------------------------------------------------------
# reading documents: one str each, always in the same order


COMPRESSIONS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
TEXT_EXTENSIONS = (".txt", ".md", ".py")  # one plain-text document a file
DATASET_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def file_kind(path):
    """'txt', 'json' or 'parquet', from the name with any compression suffix removed."""
    stem, ext = os.path.splitext(path.lower())
    compression = None
    # .txt: the ones in COMPRESSIONS; json: whatever datasets reads
    if ext in (".gz", ".bz2", ".xz", ".zst"):
        (stem, ext), compression = os.path.splitext(stem), ext
    if ext in TEXT_EXTENSIONS and compression in (None, *COMPRESSIONS):
        return "txt"
    if ext in DATASET_BUILDERS:
        return DATASET_BUILDERS[ext]
    raise FineWebError(f"{path}: unsupported file type; the text read is .txt, .md, .py, .jsonl, "
                       ".json or .parquet files, optionally compressed (.txt.gz/.bz2/.xz, "
                       ".jsonl.gz/.bz2/.xz/.zst)")


def known_kind(path):
    """file_kind(path), or None for a file --source does not read."""
    try:
        return file_kind(path)
    except FineWebError:
        return None


def folder_files(folder, empty=None):
    """The files a folder source stands for: every file of a known_kind in it, at any depth, sorted
    (a folder's files before its subfolders'); hidden files and folders, and empty files,
    skipped (the empty ones appended to the list empty when given)."""
    paths = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        kept = [f for f in sorted(files) if not f.startswith(".") and known_kind(f)]
        paths += [os.path.join(root, f) for f in kept]
    if empty is not None:
        empty += [p for p in paths if os.path.getsize(p) == 0]
    return [p for p in paths if os.path.getsize(p) > 0]


def expand_sources(paths):
    """--source's paths as files: each folder replaced by its folder_files()."""
    files = []
    for path in paths:
        if not os.path.isdir(path):
            files.append(path)
        elif not (found := folder_files(path)):
            raise FineWebError(f"{path}: the folder holds no non-empty .txt, .md, .py, .jsonl, "
                               ".json or .parquet files")
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
            raise FineWebError(f"{path} is empty; leave it out of the files passed")
        if file_kind(path) == "parquet":
            import pyarrow.parquet as pq
            try:
                rows = pq.ParquetFile(path).metadata.num_rows
            except Exception as e:  # pyarrow's errors: a truncated or foreign file
                raise FineWebError(f"{path} is not a readable parquet file ({one_line(e)}); fix it "
                                   "or leave it out of the files passed") from None
            if rows == 0:  # datasets trips over these
                raise FineWebError(f"{path} holds no rows; leave it out of the files passed")


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def source_spec(args):
    """What the documents come from, as recorded in (and compared with) the manifest."""
    if args.source:
        return {"files": [{"path": os.path.abspath(p), "sha256": sha256_file(p)}
                          for p in args.source],
                "text_column": args.text_column}
    return {"dataset": args.dataset, "name": args.name, "split": args.split,
            "text_column": args.text_column}


def read_text_file(path):
    opener = COMPRESSIONS.get(os.path.splitext(path)[1].lower(), open)
    try:
        # newline="": the text as it is, \r\n too
        with opener(path, "rt", encoding="utf-8", newline="") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise FineWebError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); convert it to "
                           "UTF-8") from None
    except (OSError, EOFError, lzma.LZMAError) as e:  # a truncated or corrupt .gz/.bz2/.xz
        raise FineWebError(f"{path} cannot be read ({one_line(e)}); fix it or leave it out of the "
                           "files passed") from None


def iter_rows(ds, text_column, where):
    """The text_column of every row of a (streaming) datasets.IterableDataset, checked."""
    if ds.features is not None and not ds.features:
        raise FineWebError(f"{where} holds no rows; leave it out of the files passed")
    if ds.features is not None and text_column not in ds.features:
        raise FineWebError(f"{where} has no column {text_column!r} (columns: "
                           f"{', '.join(ds.features)}); pass --text_column=NAME")
    row = 1  # rows count from 1, as hellaswag.py's and an editor's lines do
    for batch in ds.iter(batch_size=1000):
        texts = batch.get(text_column)
        if texts is None:
            raise FineWebError(f"{where}: row {row} has no column {text_column!r} (columns: "
                               f"{', '.join(batch)}); pass --text_column=NAME")
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
        # a malformed file (exit 2), or the hub's network (exit 1): the shards so far are kept
        except Exception as e:
            if kind == "hub":
                raise ConnectionError(f"reading {where} failed ({one_line(e)}); the shards so far "
                                      "are kept") from None
            raise FineWebError(f"reading {where} failed ({one_line(e)}); fix it and run the same "
                               "command again") from None


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
    # a document that spells "<|endoftext|>" keeps it as plain text
    if not any(EOT_TEXT in doc for doc in docs):
        try:
            # (N,) uint32
            tokens = enc.encode_to_numpy(EOT_TEXT + EOT_TEXT.join(docs), allowed_special={EOT_TEXT})
        except UnicodeEncodeError:  # lone surrogates: encode_ordinary knows how to repair them
            pass
    if tokens is None:
        tokens = np.array([t for doc in docs for t in [EOT] + enc.encode_ordinary(doc)],
                          dtype=np.uint32)
    if tokens.size and tokens.max() >= 2**16:
        bad = int(tokens.max())
        raise FineWebError(f"token {bad} does not fit in uint16 (< 65536): these shards need a "
                           "tokenizer with a vocabulary of at most 65536 tokens")
    return tokens.astype(np.uint16)


def worker_init():
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is handled once, by the main process
    get_encoding()


def start_pool(num_proc):
    """Worker processes for tokenize(), or None for num_proc 1 (encode in this process). Spawned,
    not forked: the same on every OS, and safe when the caller has threads (torch, the trainer)."""
    if num_proc == 1:
        return None
    return ProcessPoolExecutor(num_proc, mp_context=multiprocessing.get_context("spawn"),
                               initializer=worker_init)


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
    """The shards chunk `index` of the stream (n tokens) is saved as: [(name, split, start,
    end)]."""
    if val_fraction is None:  # shard 0 is val, the rest train
        split = "val" if index == 0 else "train"
        return [(f"{prefix}_{split}_{index:06d}.npy", split, 0, n)]
    v = math.ceil(val_fraction * n)
    parts = [(f"{prefix}_val_{index:06d}.npy", "val", 0, v),
             (f"{prefix}_train_{index:06d}.npy", "train", v, n)]
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
    except (ValueError, RecursionError, IsADirectoryError) as e:  # ValueError: not JSON, not UTF-8
        raise FineWebError(f"{path} is not valid JSON ({one_line(e)}); move {out_dir} aside or "
                           "delete it") from None
    ok = isinstance(manifest, dict) and {"tokenizer", "settings", "shards"} <= manifest.keys()
    ok = ok and isinstance(manifest["settings"], dict) and isinstance(manifest["shards"], list)
    if not ok or not all(map(is_shard_entry, manifest["shards"])):
        raise FineWebError(f"{path} is not a manifest this script wrote; move {out_dir} aside or "
                           "delete it")
    return manifest


def is_shard_entry(s):
    """Whether s is a manifest's shard entry: {"name": a file name, "tokens", "sha256",
    "next": [doc, offset]}."""
    return (isinstance(s, dict) and isinstance(s.get("name"), str) and s["name"].isprintable()
            and s["name"] == os.path.basename(s["name"]) != ""
            and type(s.get("tokens")) is int and isinstance(s.get("sha256"), str)
            and isinstance(s.get("next"), list)
            and len(s["next"]) == 2 and all(type(v) is int for v in s["next"]))


def check_shard(out_dir, shard):
    """None if the file matches its manifest entry, else what is wrong."""
    path = os.path.join(out_dir, shard["name"])
    if not os.path.exists(path):
        return f"{shard['name']} is missing"
    sha = sha256_file(path)
    if sha != shard["sha256"]:
        return (f"{shard['name']} has sha256 {sha[:16]}..., the manifest says "
                f"{shard['sha256'][:16]}...")
    tokens = np.load(path, mmap_mode="r")
    if tokens.dtype != np.uint16 or tokens.shape != (shard["tokens"],):
        return (f"{shard['name']} holds {tokens.dtype} {tokens.shape}, the manifest says uint16 "
                f"({shard['tokens']},)")
    return None


def startup_problems(out_dir):
    """What a trainer starting on out_dir can check in a moment against its manifest (no sha256):
    the listed shards missing, unreadable or of another length. [] without a manifest."""
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
            problems.append(f"{shard['name']} holds {tokens.dtype} {tokens.shape}, the manifest "
                            f"says uint16 ({shard['tokens']},)")
    return problems


def repair_command(out_dir, **changed):
    """The fineweb.py command that made out_dir's shards, from its manifest: run again, it redoes
    them from the first one missing or damaged. changed: settings to run it with instead
    (val_fraction=0.1: the same tokens cut differently, which rebuilds the folder)."""
    settings = {**load_manifest(out_dir)["settings"], **changed}
    source, opts = settings["source"], []
    if "files" in source:
        more = " ..." if len(source["files"]) > 1 else ""
        opts += ["--source", shlex.quote(source["files"][0]["path"]) + more]
    else:
        opts += ["--dataset", source["dataset"], "--name", source["name"],
                 "--split", source["split"]]
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
    names = [f for f in os.listdir(out_dir) if f.endswith(".npy")]
    return sorted(f for f in names if "train" in f or "val" in f)


def describe_source(source):
    if "files" in source:
        return ", ".join(os.path.basename(f["path"]) for f in source["files"])
    return (f"{source['dataset']} ({source['name']}, {source['split']}, "
            f"column {source['text_column']!r})")


LAYOUT = {"shard_size", "val_fraction"}  # settings that cut the same tokens differently


def difference(old, new, ignore=()):
    """The first setting that differs between two manifests' settings, in words, or None."""
    for key in sorted((set(old) | set(new)) - set(ignore)):
        if old.get(key) != new.get(key):
            if key != "source":
                return f"{key}={old.get(key)} (this run: {key}={new.get(key)})"
            was, now = describe_source(old[key]), describe_source(new[key])
            same = " with other contents" if was == now else ""
            return f"a different source ({was}{same}; this run: {now})"
    return None


def resume(out_dir, settings):
    """(shards to keep, start position) for a run with these settings in out_dir; None if it is
    done."""
    manifest = load_manifest(out_dir)
    if manifest is None:
        if loose_shards(out_dir):
            raise FineWebError(f"{out_dir} holds shards ({loose_shards(out_dir)[0]}, ...) but no "
                               f"{MANIFEST}: they are not from this script; use another --out_dir")
        return [], (0, 0)
    old = {"tokenizer": manifest["tokenizer"], **manifest["settings"]}
    new = {"tokenizer": tokenizer_info(), **settings}
    diff = difference(old, new, ignore=LAYOUT)
    if diff:
        raise FineWebError(f"{out_dir} holds shards made from {diff}: use another --out_dir, "
                           f"or delete {out_dir} to start over")
    # the same tokens, cut differently: remove the old shards, then start over
    if difference(old, new):
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
            # the whole chunk: all its parts end there
            kept = [s for s in kept if s["next"] != shard["next"]]
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
            raise FineWebError(f"{out_dir}: {problem}; run the same command that made it again to "
                               "redo it")
    unlisted = sorted(set(loose_shards(out_dir)) - {s["name"] for s in manifest["shards"]})
    if unlisted:
        raise FineWebError(f"{out_dir}: {unlisted[0]} is not in {MANIFEST}; the trainer would read "
                           "it, move it away")
    total = sum(s["tokens"] for s in manifest["shards"])
    state = "complete"
    if not manifest.get("complete"):
        state = "INCOMPLETE (run the same command again to finish)"
    print(f"ok: {len(manifest['shards'])} shards, {total:,} tokens match {MANIFEST}; "
          f"the run is {state}")

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
    # the manifest stays incomplete: nothing a trainer can use
    if not any(s["split"] == "train" for s in shards):
        if args.val_fraction is not None and args.val_fraction <= 0.1:  # (a source of one token)
            raise FineWebError(f"the source is {total:,} token(s), too few for a train split; "
                               "add text")
        why = f"and --val_fraction {args.val_fraction} makes all of it val"
        if args.val_fraction is None:
            size = "less than" if total < args.shard_size else "exactly"
            why = f"{size} one --shard_size chunk ({args.shard_size:,}), and shard 0 is val"
        raise FineWebError(f"the source is {total:,} tokens, {why}: no train shard, so "
                           f"{args.out_dir} is left incomplete; run again with --val_fraction 0.1 "
                           "(the first 10% of every chunk is val): "
                           f"{repair_command(args.out_dir, val_fraction=0.1)}")
    write_json(os.path.join(args.out_dir, MANIFEST), make_manifest(settings, shards, complete=True))
    print(f"wrote {len(shards)} shards ({total:,} tokens) to {args.out_dir}")


def checked_args(args):
    """args with each source folder replaced by its files, all checked (a file as out_dir is
    refused)."""
    if args.source:
        args = dataclasses.replace(args, source=expand_sources(args.source))
        check_sources(args.source)
    if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        raise FineWebError(f"--out_dir {args.out_dir} is a file, not a folder")
    return args


CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass(frozen=True)
class Job:
    """What one build tokenizes and how it cuts the shards (fineweb.py's flags, the same names)."""
    out_dir: str
    source: tuple = None  # local files or folders; None: the hub dataset below
    dataset: str = "HuggingFaceFW/fineweb-edu"
    name: str = "sample-10BT"
    split: str = "train"
    text_column: str = "text"
    prefix: str = "edufineweb"
    shard_size: int = 10**8
    val_fraction: float = None
    max_tokens: int = None
    num_proc: int = CPUS


def build(out_dir, **settings):
    """Tokenize the source into shards in out_dir, resuming a run that was cut short there.
    settings: Job's fields by name (source=[...], prefix=..., shard_size=..., ...)."""
    run(Job(out_dir, **settings))


def run(args):
    """build() for a Job."""
    args = checked_args(args)
    settings = run_settings(args)
    plan = resume(args.out_dir, settings)
    if plan is None:
        print(f"{args.out_dir} is complete already (every shard matches {MANIFEST}); nothing to do")
        return
    shards, (doc, offset) = plan
    manifest_path = os.path.join(args.out_dir, MANIFEST)
    # forget the entries past the last good shard before anything else
    if os.path.exists(manifest_path):
        write_json(manifest_path, make_manifest(settings, shards, complete=False))
    if shards:
        print(f"resuming after {len(shards)} complete shards, at document {doc:,}")
    total = write_shards(args, settings, shards, doc, offset)
    finish_build(args, settings, shards, total)


def open_stream(args, doc):
    """(the worker pool or None, the stream of tokenized documents from document doc on)."""
    # a local source of about one batch is encoded faster here than it takes to start a pool
    small = args.source and sum(os.path.getsize(p) for p in args.source) <= BATCH_CHARS
    num_proc = 1 if small else args.num_proc
    pool = start_pool(num_proc)
    return pool, tokenize(iter_documents(args, skip=doc), pool, num_proc)


def write_shards(args, settings, shards, doc, offset):
    """Tokenize from document doc (its first offset tokens already kept) into shards, appending
    each to shards and the manifest as it is saved; returns the total tokens."""
    from tqdm import tqdm
    manifest_path = os.path.join(args.out_dir, MANIFEST)
    max_tokens = args.max_tokens or float("inf")
    total = sum(s["tokens"] for s in shards)
    # the parts of one chunk share its end position
    chunks = len({tuple(s["next"]) for s in shards})
    buf = np.empty(args.shard_size, dtype=np.uint16)  # the chunk (shard) being filled
    fill = 0
    # shards are saved (np.save, sha256, fsync, rename, manifest) in a thread beside the tokenizing,
    # one at a time and in order: ~0.5 s a 100M-token shard that the workers need not wait for
    writer, writing = ThreadPoolExecutor(1), None

    # writer thread: the chunk's shard files, then the manifest that lists them
    def save(tokens, parts, listed):
        for entry, (_, _, start, end) in zip(listed[len(listed) - len(parts):], parts):
            entry["sha256"] = write_shard(os.path.join(args.out_dir, entry["name"]),
                                          tokens[start:end])
            # the trainer's vocab check, without a scan
            entry["max_token"] = int(tokens[start:end].max())
        write_json(manifest_path, make_manifest(settings, listed, complete=False))

    def finish_shard(position):
        nonlocal buf, writing, chunks
        if writing is not None:
            writing.result()  # the previous chunk is on disk (or its error is raised here)
        os.makedirs(args.out_dir, exist_ok=True)
        parts = chunk_parts(args.prefix, chunks, fill, args.val_fraction)
        for name, split, start, end in parts:
            shards.append({"name": name, "split": split, "tokens": end - start, "sha256": None,
                           # next: (document, token offset) where the next chunk starts
                           "next": list(position)})
        writing = writer.submit(save, buf[:fill], parts, list(shards))
        buf = np.empty(args.shard_size, dtype=np.uint16)
        chunks += 1

    bar = tqdm(total=args.max_tokens, initial=total, unit="tok", unit_scale=True, desc="tokenizing",
               smoothing=0.05)
    pool, stream = open_stream(args, doc)
    try:
        # (n,) uint16: whole documents doc, doc+1, ..., each starting with EOT
        for tokens in stream:
            # after a resume, the first `offset` tokens are in the last kept shard
            pos, offset = offset, 0
            while pos < len(tokens) and total < max_tokens:
                take = int(min(len(tokens) - pos, args.shard_size - fill, max_tokens - total))
                buf[fill:fill + take] = tokens[pos:pos + take]
                fill, pos, total = fill + take, pos + take, total + take
                if fill == args.shard_size or total == max_tokens:
                    # document starts up to position pos
                    starts = np.flatnonzero(tokens[:pos + 1] == EOT)
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
    return total
