"""
Token shards to (B, T) batches for the trainer, and the shards it makes for itself: your own text
(`--data=...`) and the quickstart's corpus, both tokenized by fineweb.py.

    from gpt2train.data import TokenLoader
    loader = TokenLoader("edu_fineweb10B", "train", B=64, T=1024, sampling=Sampling(seed=1337))
    x, y = loader.next_batch()  # (B, T) int64 inputs, and their targets: the same rows one token on

    python train_gpt2.py configs/quickstart.py --data=my_book.txt  # or a folder, a glob, .jsonl

Shards are fineweb.py's 1-D uint16 .npy files, memory-mapped; a split is the files with "train" or
"val" in their names.
"""
import bisect
import contextlib
import dataclasses
import functools
import glob
import hashlib
import io
import json
import os
import re
import sysconfig

import numpy as np
import torch

from gpt2train import shards
from gpt2train.fileio import UserError, missing_dirs, remove_empty_dirs, replacing_dir, write_json
from gpt2train.logger import print0

# -----------------------------------------------------------------------------
# shards


def shard_paths(data_dir, split):
    """Sorted .npy shards of a split ('train' or 'val'), or UserError telling how to make them."""
    how = making_hint(data_dir)
    if os.path.isfile(data_dir):
        raise UserError(f"data_dir {data_dir!r} is a file; data_dir is a folder of token shards: "
                        f"to train on the text in that file, use --data={data_dir}")
    if not os.path.isdir(data_dir):
        raise UserError(f"data_dir {data_dir!r} does not exist: {how}")
    names = [f for f in os.listdir(data_dir) if f.endswith(".npy") and split in f]
    paths = sorted(os.path.join(data_dir, f) for f in names)
    if not paths:
        raise UserError(f"data_dir {data_dir!r} has no {split} shards (*{split}*.npy): {how}")
    return paths


def making_hint(data_dir):
    """How to make the shards data_dir lacks: a fineweb.py command that runs on that folder (the one
    that made it, with --val_fraction when shard 0 was its only val, so that both splits come out),
    or --data."""
    text = "or train on your text with --data=PATH"
    try:
        manifest = shards.load_manifest(data_dir) if os.path.isdir(data_dir) else None
    except UserError:  # not fineweb.py's manifest: fineweb.py refuses that folder
        manifest = None
    if manifest is not None:
        fix = {"val_fraction": 0.1} if manifest["settings"].get("val_fraction") is None else {}
        return f"make them with `{shards.repair_command(data_dir, **fix)}`, {text}"
    if shards.loose_shards(data_dir) or os.path.exists(os.path.join(data_dir, shards.MANIFEST)):
        return ("make the shards in a new folder with `python fineweb.py --source YOUR_FILES "
                f"--val_fraction 0.1 --out_dir NEW_FOLDER`, {text}")
    return f"make the token shards with `python fineweb.py --out_dir {data_dir}`, {text}"


def has_shards(data_dir):
    return os.path.isdir(data_dir) and any(f.endswith(".npy") for f in os.listdir(data_dir))


def check_shards(data_dir):
    """At start-up: UserError naming a shard data_dir's manifest lists that is missing or damaged (a
    partial copy), with the ways to repair it; nothing without a manifest."""
    problems = shards.startup_problems(data_dir)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UserError(f"data_dir {data_dir!r}: {problems[0]}{more}, listed in its "
                        f"{shards.MANIFEST}: copy it "
                        "again if data_dir is a copy, or run the command that made it again, "
                        f"which redoes the shards from there: {shards.repair_command(data_dir)}")


def shard_maxima(data_dir):
    """{shard name: its largest token id} from data_dir's manifest (fineweb.py writes it), {}
    without one."""
    if not os.path.isfile(os.path.join(data_dir, shards.MANIFEST)):
        return {}
    manifest = shards.load_manifest(data_dir)
    if not manifest:
        return {}
    return {s["name"]: s["max_token"] for s in manifest["shards"] if "max_token" in s}

# -----------------------------------------------------------------------------
# the loader: rows of T+1 tokens, in a seeded order that depends on (seed, epoch) alone


@functools.lru_cache(maxsize=8)
def permutation(n, *key):
    """A permutation of range(n) drawn from key, e.g. (seed, epoch) or (seed, epoch, shard): the
    same key always gives the same order, so no generator state has to be saved to resume."""
    return np.random.default_rng([int(k) % 2**63 for k in key]).permutation(n)


def load_shard(path):
    """A token shard, memory-mapped (pages in on demand), or UserError naming it: an empty,
    truncated or foreign file, or one that is not the 1-D uint16 array fineweb.py writes."""
    try:
        shard = np.load(path, mmap_mode="r")
    except Exception as e:  # noqa: BLE001 - numpy's ValueError, EOFError, OSError: not an .npy
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:150]
        raise UserError(f"{path} is not a readable .npy token shard ({why}): make the shards again "
                        "with fineweb.py") from None
    if not isinstance(shard, np.ndarray) or shard.dtype != np.uint16 or shard.ndim != 1:
        what = "an .npz archive"
        if isinstance(shard, np.ndarray):
            what = f"{shard.dtype} {tuple(shard.shape)}"
        raise UserError(f"{path} holds {what}, not the 1-D uint16 tokens fineweb.py writes")
    return shard


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Which rows a TokenLoader reads and in what order (torch's DistributedSampler's rank,
    num_replicas, shuffle, seed): rank r of world_size reads the r-th B rows of every
    world_size * B; the rows come in an order drawn from seed when shuffle, else in file order."""
    rank: int = 0
    world_size: int = 1
    shuffle: bool = True
    seed: int = 0


class TokenLoader:
    """(B, T) batches from the shards of one split.

    A shard of n tokens is cut into (n - 1) // T rows: row j is tokens j*T .. j*T + T, the inputs
    and (one on) the targets, so a row's last token is the next row's first and no token is lost
    between rows. The last (n - 1) % T tokens of a shard (fewer than T: 0.001% of a 100M-token
    shard) are left out rather than joined to another shard's, so that every row lies in one shard.

    An epoch reads every row of the split exactly once. With shuffle, the shards come in an order
    drawn from (seed, epoch) and each shard's rows in an order drawn from (seed, epoch, shard);
    without it (the val split), in file order from the start. The rows of all epochs form one
    sequence, and the k-th call of rank r of W reads its rows k*W*B + r*B .. + B: the ranks' rows
    are disjoint and, together, the rows a single process reads with the same global batch. The
    state is (epoch, pos) only; rows, not B*T windows, are the unit so that the micro-batch size and
    the number of ranks may change without changing which tokens a step sees."""

    def __init__(self, data_dir, split, B, T, sampling=Sampling(), vocab_size=None):
        self.B, self.T, self.rank, self.world_size = B, T, sampling.rank, sampling.world_size
        self.vocab_size = vocab_size
        self.shuffle, self.seed = sampling.shuffle, sampling.seed
        self.paths = shard_paths(data_dir, split)
        # memory-mapped: pages in on demand; one line if corrupt
        self.shards = [load_shard(p) for p in self.paths]
        self.n_tokens = sum(len(s) for s in self.shards)
        self.rows = [max(0, (len(s) - 1) // T) for s in self.shards]  # rows in each shard
        self.n_rows = sum(self.rows)
        if self.n_rows < B * self.world_size:
            raise UserError(f"the {split} split in {data_dir!r} has {self.n_tokens} tokens, fewer "
                            f"than one micro-batch needs ({B} rows of {T} + 1 tokens, x "
                            f"{self.world_size} rank(s)): prepare more data or lower "
                            "micro_batch_size/seq_len")
        # at start-up, never in the loop: the manifest's maxima, else one scan a shard
        if vocab_size is not None:
            maxima = shard_maxima(data_dir)
            for path, shard in zip(self.paths, self.shards):
                top = maxima.get(os.path.basename(path))
                top = int(shard.max()) if top is None else top  # (~0.1-2 s a 100M-token shard)
                if top >= vocab_size:
                    raise UserError(f"{path} holds token id {top} but vocab_size is {vocab_size}: "
                                    "raise vocab_size")
        self._layout = (None,)  # the last epoch's layout()
        self.reset()

    def reset(self):
        self.epoch, self.pos = 0, 0  # the next call reads the epoch's rows pos + rank*B, ...

    def layout(self, epoch):
        """(shard order, index of each one's first row in the epoch) for an epoch."""
        if self._layout[0] != epoch:
            n = len(self.shards)
            order = permutation(n, self.seed, epoch).tolist() if self.shuffle else range(n)
            self._layout = epoch, order, np.cumsum([0] + [self.rows[s] for s in order]).tolist()
        return self._layout[1:]

    def row(self, g):
        """Row g of the sequence over all epochs: T+1 tokens of one shard."""
        epoch, i = divmod(g, self.n_rows)
        order, starts = self.layout(epoch)
        k = bisect.bisect_right(starts, i) - 1
        s, j = order[k], i - starts[k]  # the j-th row of shard s in this epoch's order
        if self.shuffle:
            j = permutation(self.rows[s], self.seed, epoch, s)[j]
        return self.shards[s][j * self.T:(j + 1) * self.T + 1]

    def next_batch(self, device="cpu"):
        """The next inputs and targets (B, T) on device. The B rows are gathered into one host
        buffer (pinned on CUDA), sent in one non-blocking copy, and cut into inputs and targets
        there."""
        B = self.B
        first = self.epoch * self.n_rows + self.pos + self.rank * B
        # (B, T+1)
        buf = torch.from_numpy(np.stack([self.row(first + b) for b in range(B)]).astype(np.int64))
        self.epoch, self.pos = divmod(self.epoch * self.n_rows + self.pos + self.world_size * B,
                                      self.n_rows)
        # the host goes on to the next work while the copy runs
        if torch.device(device).type == "cuda":
            buf = buf.pin_memory().to(device, non_blocking=True)
        return buf[:, :-1].contiguous(), buf[:, 1:].contiguous()  # inputs (B, T), targets (B, T)

    def state_dict(self):
        return {"epoch": self.epoch, "pos": self.pos, **self.identity()}

    def identity(self):
        """What the position means: the rows and their order."""
        return {"seq_len": self.T, "shuffle": self.shuffle, "seed": self.seed,
                "n_tokens": self.n_tokens, "shards": [os.path.basename(p) for p in self.paths]}

    def load_state_dict(self, state, ckpt_path=None):
        """Continue from a checkpoint's position; one it does not describe (other data, another
        order) is refused with the ways on: its own data, or a new run (from scratch or from its
        weights, ckpt_path)."""
        theirs = {k: state.get(k) for k in self.identity()}
        if theirs != self.identity():
            key = next(k for k in theirs if theirs[k] != self.identity()[k])
            missing = [s for s in state.get("shards") or [] if s not in self.identity()["shards"]]
            mine = self.identity()
            what = f"the checkpoint's {key}={theirs[key]!r}, this run {mine[key]!r}"
            if key in ("shards", "n_tokens"):
                what = (f"the checkpoint's train split: {len(state.get('shards') or [])} shard(s), "
                        f"{state.get('n_tokens') or 0:,} tokens; this run's: "
                        f"{len(mine['shards'])} shard(s), {mine['n_tokens']:,} tokens")
            if missing:
                more = " ..." if len(missing) > 3 else ""
                what += f"; not here: {', '.join(missing[:3])}{more}"
            raise UserError(f"the checkpoint's data order differs from this run's ({what}): "
                            "resume with the data and the seq_len, shuffle and seed it was trained "
                            "with, or train on this data in a new run: --out_dir=<a new folder>, "
                            f"from its weights with --init_from={ckpt_path or '<its ckpt_*.pt>'} "
                            "--out_dir=<a new folder>")
        self.epoch, self.pos = state["epoch"], state["pos"]

# -----------------------------------------------------------------------------
# your own text: --data=PATH tokenized once into a cache beside out_dir


# what the cache was made from: its files' sizes and mtimes, and the split rule
CACHE_FILE = "sources.json"
# recorded in CACHE_FILE: a cache split by the old rule (by a run's seq_len) is made again
SPLIT = "v2: per text"
# val: 32K tokens, but at least 1% and at most 10% of the text
VAL_TOKENS, VAL_FRACTIONS = 2**15, (0.01, 0.1)
MIN_CHUNK = 2**20  # tokens: a text under ~4 MB is one chunk, its val split one shard


def source_files(data, empty=None):
    """The files --data names: a file, a folder (every .txt/.md/.py/.jsonl/.json/.parquet file in
    it, at any depth, sorted; hidden ones skipped) or a glob pattern. A folder's and a glob's empty
    files are skipped alike (appended to the list empty when given: the data line counts them); a
    file named alone that is empty is refused."""
    empty = [] if empty is None else empty
    if glob.has_magic(data):
        paths = sorted(p for p in glob.glob(os.path.expanduser(data),
                                            recursive=True) if os.path.isfile(p))
        if not paths:
            raise UserError(f"--data={data}: no files match that pattern")
        empty += [p for p in paths if os.path.getsize(p) == 0]  # (__init__.py in a source tree)
        paths = [p for p in paths if os.path.getsize(p) > 0]
        if not paths:
            raise UserError(f"--data={data}: every file that matches is empty")
    elif os.path.isdir(data):
        paths = shards.folder_files(data, empty)  # the files fineweb.py --source=FOLDER reads
        skipped = unknown_files(data)
        # named, so that a file the user meant to train on is not left out without a word
        if skipped:
            print0(f"data: skipping {len(skipped)} file(s) in {data} that are not .txt, .md, .py, "
                   ".jsonl, .json or "
                  f".parquet: {', '.join(skipped[:5])}{' ...' if len(skipped) > 5 else ''}")
        if not paths:
            raise UserError(f"--data={data}: the folder holds no non-empty .txt, .md, .py, .jsonl, "
                            ".json or .parquet files")
    elif os.path.isfile(data):
        paths = [data]
    else:
        raise UserError(f"--data={data}: no such file or folder")
    for p in paths:
        if not shards.known_kind(p):
            raise UserError(f"--data: {p} is not .txt, .md, .py, .jsonl, .json or .parquet "
                            "(optionally compressed)")
        if os.path.getsize(p) == 0:
            raise UserError(f"--data: {p} is empty")
    return [os.path.abspath(p) for p in paths]


def unknown_files(folder):
    """The files of a folder (hidden ones aside) that --data leaves out for their kind (.csv, .png,
    none)."""
    found = []
    for root, dirs, files in os.walk(folder):
        # as shards.folder_files walks it
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [os.path.relpath(os.path.join(root, f), folder) for f in sorted(files)
                  if not f.startswith(".") and not shards.known_kind(f)]
    return found


def own_text_dir(data, out_dir):
    """Where --data is tokenized: data_cache/<name>-<hash of the path> in out_dir's parent folder,
    e.g. out/data_cache/my_book.txt-1a2b3c4d for out_dir=out/quickstart; runs on the same --data
    share it."""
    spec = os.path.abspath(os.path.expanduser(data))
    name = re.sub(r"[^\w.-]+", "_", os.path.basename(spec.rstrip(os.sep))).strip("_.") or "data"
    parent = os.path.dirname(os.path.normpath(out_dir)) or "."
    return os.path.join(parent, "data_cache",
                        f"{name[:40]}-{hashlib.sha256(spec.encode()).hexdigest()[:8]}")


def split_rows(cache, T):
    """{split: rows of T+1 tokens} of a finished fineweb.py folder, from its manifest."""
    with open(os.path.join(cache, shards.MANIFEST)) as f:
        listed = json.load(f)["shards"]
    return {split: sum(max(0, (s["tokens"] - 1) // T) for s in listed if s["split"] == split)
            for split in ("train", "val")}


def split_plan(size):
    """(shard_size, val_fraction) for a text of size bytes: ~8 chunks of at least MIN_CHUNK tokens,
    the head of each val. Decided by the text alone, never by a run's seq_len or batch, so that
    every run on the cache reads the same val tokens and its val losses compare."""
    # tokens, about (4 bytes a token in English; fewer in code, more in parquet)
    est = max(1, size // 4)
    low, high = VAL_FRACTIONS
    return min(10**8, max(est // 8, MIN_CHUNK)), max(low, min(high, VAL_TOKENS / est))


def check_rows(data, cache, T, rows):
    """UserError unless each split of the cache holds a batch of `rows` rows of T+1 tokens."""
    have = split_rows(cache, T)
    for split in ("val", "train"):
        if have[split] < rows:
            with open(os.path.join(cache, shards.MANIFEST)) as f:
                tokens = sum(s["tokens"] for s in json.load(f)["shards"] if s["split"] == split)
            raise UserError(f"--data={data}: its {split} split is {tokens:,} tokens (the split is "
                            "fixed by the text), "
                            f"{have[split]} row(s) of {T} + 1, fewer than the {rows} of one batch: "
                            "add text, or lower micro_batch_size or seq_len")


def prepare_own_text(data, cache, T, rows, text_column="text", resume=None):
    """Tokenizes --data into the cache folder unless it holds it already (files of the same sizes
    and mtimes, split by this SPLIT rule), then checks that each split holds `rows` rows of T+1
    tokens. A new cache is built aside and swapped in only when this run can use it: an error leaves
    nothing behind. resume: the checkpoint this run continues ({"path", "step", "loader"}), whose
    tokens are never replaced by other ones (an edited text: text_changed)."""
    empty = []
    files = source_files(data, empty)
    skipped = f" ({len(empty)} empty, skipped)" if empty else ""
    stamp = {"data": data, "files": [[p, os.path.getsize(p),
                                      os.stat(p).st_mtime_ns] for p in files], "split": SPLIT,
             "text_column": text_column}
    try:
        with open(os.path.join(cache, CACHE_FILE)) as f:
            old = json.load(f)
        same = old["files"] == stamp["files"] and old.get("split") == SPLIT \
            and old.get("text_column", "text") == text_column
    except (OSError, ValueError, KeyError, TypeError):
        same = False
    broken = same and shards.startup_problems(cache)  # a shard deleted or cut short: made again
    if broken:
        print0(f"data: {cache}: {broken[0]}: tokenizing {data} again")
    elif same:  # reused as it is, even when too small for this run: never split again for a seq_len
        check_rows(data, cache, T, rows)
        print0(f"data: {data} as tokenized before{skipped}, in {cache}")
        return
    # ours (made here) but stale: replaced as a whole rather than mixed with old shards
    if os.path.isdir(cache):
        ours = {CACHE_FILE, shards.MANIFEST, *shards.loose_shards(cache)}
        if any(f not in ours and not f.endswith(".tmp") for f in os.listdir(cache)):
            raise UserError(f"{cache} holds files this trainer did not write: move it away, then "
                            "run again")
    size = sum(s for _, s, _ in stamp["files"])
    print0(f"data: tokenizing {len(files)} file(s){skipped}, {size / 1e6:.1f} MB, into {cache}")
    # the folders above cache: removed on a failure
    made = missing_dirs(os.path.dirname(os.path.abspath(cache)))
    if made:
        os.makedirs(made[0])
    try:
        with replacing_dir(cache) as tmp:
            said = io.StringIO()
            # fineweb.py's lines name the temp folder: the cache's name
            with contextlib.redirect_stdout(said):
                tokenize_into(files, tmp, *split_plan(size), text_column)
            print0(said.getvalue().replace(tmp, cache), end="")
            check_rows(data, tmp, T, rows)
            if resume is not None:
                text_changed(data, cache, tmp, resume)
            write_json(os.path.join(tmp, CACHE_FILE), stamp)
    except BaseException:
        remove_empty_dirs(made)
        raise


def text_changed(data, cache, new, resume):
    """UserError, before the cache is replaced, when the checkpoint a run resumes from was trained
    on the cache's tokens and the text now tokenizes to others (it was edited): the old tokens stay,
    so the run can still continue on them. A text that tokenizes the same (only touched), or a cache
    the checkpoint was not trained on, passes."""
    try:
        old = shards.load_manifest(cache)
    except UserError:
        return
    if old is None:
        return
    made = shards.load_manifest(new)
    if [(s["name"], s["sha256"]) for s in old["shards"]] == [(s["name"],
                                                              s["sha256"]) for s in made["shards"]]:
        return
    state = resume["loader"]

    def train_split(manifest):
        listed = [s for s in manifest["shards"] if s["split"] == "train"]
        return sorted(s["name"] for s in listed), sum(s["tokens"] for s in listed)
    (names, tokens), (new_names, new_tokens) = train_split(old), train_split(made)
    if state.get("shards") != names or state.get("n_tokens") != tokens:
        return  # the checkpoint's tokens are not the cache's: nothing of it to keep
    raise UserError(f"--data={data} changed since {resume['path']} (step {resume['step']}) was "
                    f"trained on it: the checkpoint's train split is {len(names)} shard(s), "
                    f"{tokens:,} tokens (the earlier text, "
                    f"still tokenized in {cache}), the text now gives {len(new_names)} shard(s), "
                    f"{new_tokens:,} tokens: to continue that run, put the earlier text back or "
                    "resume on its tokens with "
                    f"--data_dir={cache} in place of --data; to train on the new text, start a new "
                    f"run from its weights: --init_from={resume['path']} --out_dir=<a new folder>")


def tokenize_into(files, out_dir, shard_size, val_fraction, text_column="text"):
    shards.build(out_dir, source=files, prefix="text", shard_size=shard_size,
                 val_fraction=val_fraction, text_column=text_column)

# -----------------------------------------------------------------------------
# the quickstart corpus: Python's own help pages and standard library, offline


# tokens a chunk: 6 on Python 3.11, each full one's val head 2 rows of seq_len 1024
PYTHON_SHARD_SIZE = 820_000
# 2,050 val tokens a chunk, 10.7K in all (10 rows of 1025, 83 of 129), along the corpus
PYTHON_VAL_FRACTION = 0.0025
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "encodings",
             "pydoc_data", "__pycache__"}


def python_sources():
    """The standard library's .py files, sorted; without its tests, IDLE, the codec tables and the
    help topics' module (those come as text) and installed packages."""
    stdlib, paths = sysconfig.get_paths()["stdlib"], []
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        paths += [os.path.join(root, f) for f in sorted(files) if f.endswith(".py")]
    return [p for p in paths if os.path.getsize(p) > 0]


def prepare_python_corpus(data_dir):
    """The quickstart's corpus in data_dir: the topic pages of Python's help() (pydoc_data.topics)
    and the standard library's own .py sources, 4.27M GPT-2 tokens on Python 3.11, through
    fineweb.py; val is the head of each chunk, 0.25% in all, in pieces that hold rows of seq_len
    1024 (10 on 3.11). Only into a folder that is missing or empty (or holds an unfinished build of
    it); one with shards is left as it is."""
    if os.path.exists(data_dir) and not os.path.isdir(data_dir):
        return  # a file: shard_paths() says what to do instead
    manifest = os.path.join(data_dir, shards.MANIFEST)
    if has_shards(data_dir) and (not os.path.exists(manifest)
                                 or shards.load_manifest(data_dir).get("complete")):
        broken = os.path.exists(manifest) and shards.startup_problems(data_dir)
        if not broken:
            return
        print0(f"{data_dir}: {broken[0]}: building the quickstart corpus again from there")
    foreign = os.path.isdir(data_dir) and set(os.listdir(data_dir)) - {"source", shards.MANIFEST}
    if foreign and not has_shards(data_dir):
        raise UserError(f"data_dir {data_dir!r} holds no token shards, and it is not empty, so the "
                        "quickstart corpus is not built into it: to train on the text in it, use "
                        f"--data={data_dir}")
    try:
        from pydoc_data.topics import topics
    except ImportError as e:
        raise UserError(f"cannot build the quickstart corpus: {e} (Python's pydoc_data is "
                        "needed)") from None
    src = os.path.join(data_dir, "source")
    os.makedirs(src, exist_ok=True)
    files = []
    for name, text in sorted(topics.items()):
        files.append(os.path.join(src, re.sub(r"[^\w.-]", "_", name) + ".txt"))
        with open(files[-1], "w", encoding="utf-8") as f:
            f.write(text)
    files += python_sources()
    print0(f"building the quickstart corpus in {data_dir} from {len(topics)} help topics and "
          f"{len(files) - len(topics)} standard library modules")
    shards.build(data_dir, source=files, prefix="python", shard_size=PYTHON_SHARD_SIZE,
                 val_fraction=PYTHON_VAL_FRACTION)

# -----------------------------------------------------------------------------


def prepare(cfg, out_dir, seq_len, rows, build=True, resume=None):
    """The shard folder the trainer reads, made first when build (rank 0 only): --data's cache (each
    split checked to hold `rows` rows of seq_len + 1 tokens; never rewritten under the checkpoint
    resumed from, when the text changed), the quickstart corpus (data_source="python"), or data_dir
    as it is. cfg: the config's data keys (data, data_dir, data_source, text_column)."""
    if cfg.data:
        cache = own_text_dir(cfg.data, out_dir)
        if build:
            prepare_own_text(cfg.data, cache, seq_len, rows, cfg.text_column, resume)
        return cache
    if build and cfg.data_source == "python":
        prepare_python_corpus(cfg.data_dir)
    if os.path.isdir(cfg.data_dir):
        check_shards(cfg.data_dir)  # every rank: the shards it will read, against the manifest
    return cfg.data_dir


def prepare_run_data(cfg, out_dir, B, T, env, ckpt=None):
    """The shard folder the run reads (prepare: rank 0 builds, the others check they see it), each
    split holding a batch of the chosen B x T on every rank; a --data cache the checkpoint trained
    on is kept when the text changed."""
    resume = None
    if ckpt is not None and isinstance(ckpt.get("loader"), dict):
        resume = {"path": ckpt["path"], "step": ckpt["step"], "loader": ckpt["loader"]}
    data_dir = prepare(cfg, out_dir, T, env.world_size * B, build=env.master, resume=resume)
    for split in ("train", "val"):
        shard_paths(data_dir, split)  # (one line if not)
    return data_dir


def make_loaders(cfg, data_dir, B, T, env, vocab_size):
    """(the train loader, the val loader or None when evals are off, the val_steps an eval runs):
    val_steps is capped to the val split, said in one line, so that no row counts twice (a mistyped
    --val_steps=100000 read the split over and over)."""
    world = env.world_size
    train = TokenLoader(data_dir, "train", B, T, Sampling(env.rank, world, cfg.shuffle, cfg.seed),
                        vocab_size)
    if cfg.eval_interval == 0:
        return train, None, cfg.val_steps
    val = TokenLoader(data_dir, "val", B, T, Sampling(env.rank, world, shuffle=False), vocab_size)
    rows, most = cfg.val_steps * B * world, max(1, val.n_rows // (B * world))
    if cfg.val_steps > most:
        print0(f"note: val_steps={cfg.val_steps} asks for {rows:,} rows of {T} + 1 tokens, the val "
               f"split holds {val.n_rows:,}: evaluating val_steps={most} instead "
               f"({most * B * world:,} rows, each at most once)")
    return train, val, min(cfg.val_steps, most)
