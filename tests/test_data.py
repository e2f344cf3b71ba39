"""data.py: the loader's rows, seeded order, DDP shares and resume state; --data's own-text cache.

    python -m pytest -q tests/test_data.py
"""
import json
import math
import os
import time

import numpy as np
import pytest
import torch

from gpt2train import data
from gpt2train.data import Sampling, TokenLoader
from conftest import one_line
from gpt2train.fileio import UserError
from gpt2train.tokenizer import EOT, get_encoding

SIZES = [37, 50, 23, 64, 41]  # odd sizes: every shard has a tail shorter than a row
T = 4


@pytest.fixture
def shards(tmp_path):
    """Train shards holding 0, 1, 2, ... (a token is its own position in the stream), and a val shard."""
    stream = np.arange(sum(SIZES), dtype=np.uint16)
    start = 0
    for i, n in enumerate(SIZES):
        np.save(tmp_path / f"edufineweb_train_{i + 1:06d}.npy", stream[start:start + n])
        start += n
    np.save(tmp_path / "edufineweb_val_000000.npy", np.arange(1000, 1100, dtype=np.uint16))
    return str(tmp_path)


def all_rows():
    """Every row of the train split, by the definition: shard by shard, row j is tokens j*T .. j*T+T."""
    rows, start = [], 0
    for n in SIZES:
        rows += [list(range(start + j * T, start + j * T + T + 1)) for j in range((n - 1) // T)]
        start += n
    return rows


def read_rows(loader):
    x, y = loader.next_batch()
    assert x.shape == y.shape == (loader.B, T) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # the targets are the inputs one token on
    return [xr + [yr[-1]] for xr, yr in zip(x.tolist(), y.tolist())]


def global_order(data_dir, B, world_size, calls, **kw):
    """The rows W ranks read in `calls` steps, in the order of the global sequence (step, rank, row)."""
    loaders = [TokenLoader(data_dir, "train", B, T, Sampling(r, world_size, **kw)) for r in range(world_size)]
    return [row for _ in range(calls) for loader in loaders for row in read_rows(loader)]


def test_unshuffled_rows_tile_each_shard_in_order(shards):
    rows = all_rows()
    n = len(rows)  # 50: the tails (37-1)%4=0, 49%4=1, 22%4=2, 63%4=3, 40%4=0 tokens are left out
    assert n == sum((s - 1) // T for s in SIZES) == TokenLoader(shards, "train", 2, T).n_rows
    got = global_order(shards, 2, 1, n, shuffle=False)  # two epochs
    assert got == rows + rows


@pytest.mark.parametrize("B,world_size", [(1, 1), (3, 1), (2, 2), (3, 3)])
def test_every_row_exactly_once_per_epoch(shards, B, world_size):
    rows = all_rows()
    n = len(rows)
    got = global_order(shards, B, world_size, -(-3 * n // (B * world_size)), seed=5)  # 3 epochs and a bit
    epochs = [got[e * n:(e + 1) * n] for e in range(3)]
    for epoch in epochs:
        assert sorted(epoch) == sorted(rows)  # each row once: none skipped, none twice
    assert epochs[0] != rows and epochs[0] != epochs[1] != epochs[2]  # shuffled, afresh each epoch
    # both levels are shuffled: the shards' order, and the rows inside a shard
    shard_of = lambda row: np.searchsorted(np.cumsum(SIZES), row[0], side="right")  # noqa: E731
    shard_seq = [int(shard_of(r)) for r in epochs[0]]
    assert [k for i, k in enumerate(shard_seq) if i == 0 or k != shard_seq[i - 1]] != sorted(set(shard_seq))
    firsts = [[r[0] for r in epoch if shard_of(r) == 3] for epoch in epochs]
    assert firsts[0] != sorted(firsts[0]) and firsts[0] != firsts[1] != firsts[2]


def test_order_comes_from_seed_and_epoch_alone(shards):
    n = len(all_rows())
    a = global_order(shards, 2, 1, n, seed=7)
    assert a == global_order(shards, 2, 1, n, seed=7)  # same seed: same order
    assert a != global_order(shards, 2, 1, n, seed=8)
    data.permutation.cache_clear()  # nothing is remembered between loaders but the pure function's cache
    assert a == global_order(shards, 2, 1, n, seed=7)


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_share_the_single_process_order(shards, world_size):
    """W ranks x B rows: disjoint shares whose union, step by step, is what one process reads with
    W*B rows, or with B rows over W micro-steps (the same global batch)."""
    B, steps = 2, 12
    loaders = [TokenLoader(shards, "train", B, T, Sampling(r, world_size, seed=3)) for r in range(world_size)]
    one_big = TokenLoader(shards, "train", B * world_size, T, Sampling(seed=3))
    one_small = TokenLoader(shards, "train", B, T, Sampling(seed=3))
    for _ in range(steps):
        per_rank = [read_rows(loader) for loader in loaders]
        union = [row for rows in per_rank for row in rows]
        assert union == read_rows(one_big)
        assert union == [row for _ in range(world_size) for row in read_rows(one_small)]


def test_resume_mid_epoch_is_bit_exact(shards):
    n = len(all_rows())
    a = TokenLoader(shards, "train", 3, T, Sampling(1, 2, seed=11))
    for _ in range(5):  # 30 of the 50 rows: mid-epoch
        a.next_batch()
    state = a.state_dict()
    assert (state["epoch"], state["pos"]) == (0, 30)
    b = TokenLoader(shards, "train", 3, T, Sampling(1, 2, seed=11))
    b.load_state_dict(state)
    for _ in range(2 * n):  # on through several epoch boundaries
        xa, ya = a.next_batch()
        xb, yb = b.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    # the state counts rows, so another split of the same global batch continues the same sequence
    c = [TokenLoader(shards, "train", 1, T, Sampling(r, 6, seed=11)) for r in range(6)]
    ref = global_order(shards, 3, 2, 5, seed=11)
    for loader in c:
        loader.load_state_dict(state)
    rest = [row for _ in range(4) for loader in c for row in read_rows(loader)]
    assert rest == global_order(shards, 3, 2, 9, seed=11)[len(ref):]


def test_state_from_other_data_or_order_is_refused(shards):
    state = TokenLoader(shards, "train", 2, T, Sampling(seed=1)).state_dict()
    with pytest.raises(UserError, match="seed=1, this run 2"):
        TokenLoader(shards, "train", 2, T, Sampling(seed=2)).load_state_dict(state)
    with pytest.raises(UserError, match="seq_len=4, this run 5"):
        TokenLoader(shards, "train", 2, 5, Sampling(seed=1)).load_state_dict(state)
    os.remove(os.path.join(shards, "edufineweb_train_000004.npy"))
    with pytest.raises(UserError, match=r"\(the checkpoint's train split: 5 shard\(s\), 215 tokens; this run's: "
                                        r"4 shard\(s\), 151 tokens; not here: edufineweb_train_000004.npy\): resume"):
        TokenLoader(shards, "train", 2, T, Sampling(seed=1)).load_state_dict(state)


def test_val_split_is_sequential_and_reset(shards):
    loader = TokenLoader(shards, "val", 2, 5, Sampling(shuffle=False))
    first = loader.next_batch()
    assert first[0].tolist() == [[1000, 1001, 1002, 1003, 1004], [1005, 1006, 1007, 1008, 1009]]
    loader.next_batch()
    loader.reset()
    assert torch.equal(loader.next_batch()[0], first[0])


def test_shards_are_memory_mapped(shards):
    loader = TokenLoader(shards, "train", 2, T)
    assert all(isinstance(s, np.memmap) and s.dtype == np.uint16 for s in loader.shards)
    assert loader.n_tokens == sum(SIZES)


def test_too_little_data(shards):
    with pytest.raises(UserError, match="fewer than one micro-batch"):
        TokenLoader(shards, "val", 10, 10)  # 9 rows of 11 tokens in 100
    TokenLoader(shards, "val", 9, 10)
    with pytest.raises(UserError, match="fewer than one micro-batch"):
        TokenLoader(shards, "val", 5, 10, Sampling(world_size=2))


def test_tokens_beyond_vocab_checked_at_start_up(shards):
    """Before the first batch (issue 31: the scan ran inside the training loop, ~0.1-2 s a shard on first use)."""
    with pytest.raises(UserError, match="edufineweb_train_000002.npy holds token id 86 but vocab_size is 64"):
        TokenLoader(shards, "train", 2, T, Sampling(shuffle=False), vocab_size=64)
    TokenLoader(shards, "train", 2, T, Sampling(shuffle=False), vocab_size=sum(SIZES))  # (toy shards count 0, 1, ...)

# -----------------------------------------------------------------------------
# --data: your own text, tokenized once into a cache


BOOK = "".join(f"Chapter {i}. It was a dark and stormy night, and the rain fell in torrents. " * 30 + "\n\n"
               for i in range(60))


def test_own_text_cache_is_made_reused_and_rebuilt(tmp_path, capsys):
    book = tmp_path / "book.txt"
    book.write_text(BOOK)
    cache = data.own_text_dir(str(book), str(tmp_path / "out" / "run"))
    assert cache.startswith(str(tmp_path / "out" / "data_cache" / "book.txt-"))
    data.prepare_own_text(str(book), cache, 32, rows=4)
    assert "tokenizing 1 file(s)" in capsys.readouterr().out
    stream = np.array([EOT] + get_encoding().encode_ordinary(BOOK), dtype=np.uint16)
    val, train = TokenLoader(cache, "val", 4, 32, Sampling(shuffle=False)), TokenLoader(cache, "train", 4, 32)
    assert val.n_tokens + train.n_tokens == len(stream)
    assert val.n_tokens == math.ceil(0.1 * len(stream))  # a short text: 10% val (32K tokens, within 1% .. 10%)
    assert val.n_rows >= 4 and len(val.paths) == len(train.paths) == 1  # one chunk: val its head
    stamps = {f: os.path.getmtime(os.path.join(cache, f)) for f in os.listdir(cache)}

    data.prepare_own_text(str(book), cache, 32, rows=4)  # same file: reused, nothing written
    assert "as tokenized before" in capsys.readouterr().out
    assert stamps == {f: os.path.getmtime(os.path.join(cache, f)) for f in os.listdir(cache)}

    book.write_text(BOOK.replace("stormy", "calm"))  # changed: rebuilt from the new text
    os.utime(book, ns=(time.time_ns(), time.time_ns() + 10**9))
    data.prepare_own_text(str(book), cache, 32, rows=4)
    assert "tokenizing" in capsys.readouterr().out
    loader = TokenLoader(cache, "train", 4, 32, Sampling(shuffle=False))
    text = get_encoding().decode(np.concatenate([s for s in loader.shards]).tolist())
    assert "calm" in text and "stormy" not in text


def test_an_edited_text_never_replaces_the_tokens_a_resumed_run_trained_on(tmp_path, capsys):
    """Issue 39 item 9: editing a --data file rewrote its token cache and only then refused the resume (numbers without
    saying whose), so the old run could not continue. Now the refusal comes before the cache is touched, says whose
    numbers are whose and the ways on, and the first of them (--data_dir=<the cache>) continues the run; a text only
    touched (same tokens) resumes as before."""
    from train_gpt2 import main
    book = tmp_path / "book.txt"
    book.write_text(BOOK)
    run = str(tmp_path / "out" / "run")
    args = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=32", "--seq_len=32", "--micro_batch_size=2",
            "--total_batch_size=64", "--eval_interval=0", "--hellaswag_interval=0", "--sample_interval=0",
            f"--out_dir={run}", "--resume=auto"]
    assert main([*args, f"--data={book}", "--max_steps=2"]) == 0
    cache = data.own_text_dir(str(book), run)
    made = {f: open(os.path.join(cache, f), "rb").read() for f in os.listdir(cache)}
    os.utime(book, ns=(time.time_ns(), time.time_ns() + 10**9))  # touched, not changed: resumes
    assert main([*args, f"--data={book}", "--max_steps=3"]) == 0
    made.pop(data.CACHE_FILE)
    capsys.readouterr()

    book.write_text(BOOK.replace("stormy", "calm") + BOOK[:2000])  # edited: other tokens, more of them
    os.utime(book, ns=(time.time_ns(), time.time_ns() + 2 * 10**9))
    assert main([*args, f"--data={book}", "--max_steps=4"]) == 2
    line = one_line(capsys.readouterr().err)
    ckpt = os.path.join(run, "ckpt_000003.pt")
    state = torch.load(ckpt, weights_only=True)["loader"]
    assert line.startswith(f"error: --data={book} changed since {ckpt} (step 3) was trained on it: the checkpoint's "
                           f"train split is 1 shard(s), {state['n_tokens']:,} tokens (the earlier text, still "
                           f"tokenized in {cache}), the text now gives 1 shard(s), "), line
    assert line.endswith(f"to continue that run, put the earlier text back or resume on its tokens with "
                         f"--data_dir={cache} in place of --data; to train on the new text, start a new run from its "
                         f"weights: --init_from={ckpt} --out_dir=<a new folder>"), line
    assert {f: open(os.path.join(cache, f), "rb").read() for f in os.listdir(cache) if f != data.CACHE_FILE} == made
    assert sorted(os.listdir(os.path.dirname(cache))) == [os.path.basename(cache)]  # no temp folder left
    assert main([*args, f"--data_dir={cache}", "--max_steps=4"]) == 0  # the way offered continues the run
    assert "resuming from" in capsys.readouterr().out and os.path.exists(os.path.join(run, "ckpt_000004.pt"))


def test_the_split_is_fixed_by_the_text():
    """Small or large, the val fraction comes from the text's size alone: 32K tokens, within 1% .. 10%,
    in ~8 chunks of at least MIN_CHUNK tokens; no seq_len or batch size goes in."""
    assert data.split_plan(6000) == (data.MIN_CHUNK, 0.1)
    assert data.split_plan(4 * 10**6) == (data.MIN_CHUNK, 2**15 / 10**6)
    assert data.split_plan(4 * 10**8) == (10**8 // 8, 0.01)
    assert data.split_plan(4 * 10**10) == (10**8, 0.01)


def test_a_bigger_seq_len_never_moves_the_val_split(tmp_path, capsys):
    """The issue's case: a run at a larger seq_len re-split the cache (34% val) and later runs reused it.
    Now every run reads the split the text was given; one it does not fit is refused, the cache as it was."""
    book = tmp_path / "book.txt"
    book.write_text(BOOK)  # 36K tokens: 3.6K val
    cache = str(tmp_path / "cache")
    data.prepare_own_text(str(book), cache, 32, rows=4)
    before = {f: open(os.path.join(cache, f), "rb").read() for f in os.listdir(cache)}
    capsys.readouterr()
    data.prepare_own_text(str(book), cache, 256, rows=8)  # 14 val rows of 257: fits, as it is
    assert "as tokenized before" in capsys.readouterr().out
    with pytest.raises(UserError, match=r"val split is 3,618 tokens \(the split is fixed by the text\), 3 row\(s\) "
                                        r"of 1024 \+ 1, fewer than the 4 of one batch: add text, or lower"):
        data.prepare_own_text(str(book), cache, 1024, rows=4)
    assert before == {f: open(os.path.join(cache, f), "rb").read() for f in os.listdir(cache)}
    # a cache split by the old rule (sources.json without "split") is made again, once
    stamp = json.load(open(os.path.join(cache, data.CACHE_FILE)))
    del stamp["split"]
    json.dump(stamp, open(os.path.join(cache, data.CACHE_FILE), "w"))
    data.prepare_own_text(str(book), cache, 64, rows=2)
    assert "tokenizing" in capsys.readouterr().out
    assert before == {f: open(os.path.join(cache, f), "rb").read() for f in os.listdir(cache)}


def test_a_text_too_small_for_the_run_leaves_nothing_behind(tmp_path):
    book = tmp_path / "short.txt"
    book.write_text(BOOK[:6000])  # 1.6K tokens: 163 val
    cache = str(tmp_path / "out" / "data_cache" / "short")
    with pytest.raises(UserError, match=r"val split is 163 tokens .* 1 row\(s\) of 128 \+ 1, fewer than the 8"):
        data.prepare_own_text(str(book), cache, 128, rows=8)
    assert os.listdir(tmp_path) == ["short.txt"]  # no cache, no temp, no folders made for it
    data.prepare_own_text(str(book), cache, 16, rows=8)  # 10 val rows of 17
    assert TokenLoader(cache, "val", 8, 16, Sampling(shuffle=False)).n_rows == 10
    stale = {f: os.path.getmtime(os.path.join(cache, f)) for f in os.listdir(cache)}
    book.write_text(BOOK[:5000])  # changed, and now too small for this run: the old cache stays as it was
    os.utime(book, ns=(time.time_ns(), time.time_ns() + 10**9))
    with pytest.raises(UserError, match="val split"):
        data.prepare_own_text(str(book), cache, 16, rows=9)
    assert stale == {f: os.path.getmtime(os.path.join(cache, f)) for f in os.listdir(cache)}
    assert sorted(os.listdir(os.path.dirname(cache))) == ["short"]


def test_folders_globs_and_formats(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    d = tmp_path / "texts"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text("alpha " * 50)
    (d / "sub" / "b.md").write_text("# beta\n" * 50)
    (d / "c.jsonl").write_text('{"text": "gamma"}\n{"text": "delta"}\n')
    pq.write_table(pa.table({"text": ["epsilon"]}), d / "sub" / "d.parquet")
    (d / "notes.pdf").write_bytes(b"%PDF")  # not text: skipped in a folder
    (d / "empty.txt").write_text("")  # skipped in a folder
    (d / ".hidden.txt").write_text("x")
    expect = [str(d / "a.txt"), str(d / "c.jsonl"), str(d / "sub" / "b.md"), str(d / "sub" / "d.parquet")]
    assert data.source_files(str(d)) == expect
    assert data.source_files(str(d / "**" / "*.md")) == [str(d / "sub" / "b.md")]
    cache = str(tmp_path / "cache")
    data.prepare_own_text(str(d), cache, 8, rows=1)
    text = get_encoding().decode(np.concatenate([np.load(os.path.join(cache, f)) for f in sorted(os.listdir(cache))
                                                 if f.endswith(".npy")]).tolist())
    assert all(w in text for w in ("alpha", "beta", "gamma", "delta", "epsilon"))


@pytest.mark.parametrize("spec,message", [
    ("nope.txt", "--data=nope.txt: no such file or folder"),
    ("*.nothing", "no files match that pattern"),
    ("emptydir", "the folder holds no non-empty .txt"),
    ("notes.pdf", "is not .txt, .md, .py, .jsonl, .json or .parquet"),
    ("empty.txt", "empty.txt is empty"),
])
def test_bad_data_paths(tmp_path, monkeypatch, spec, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "emptydir").mkdir()
    (tmp_path / "emptydir" / "x.pdf").write_bytes(b"%PDF")
    (tmp_path / "notes.pdf").write_bytes(b"%PDF")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(UserError, match=message.replace(".", r"\.").replace("*", r"\*")):
        data.prepare_own_text(spec, str(tmp_path / "cache"), 8, rows=1)
    assert not (tmp_path / "cache").exists()


def test_a_stale_cache_holding_foreign_files_is_left_alone(tmp_path):
    book = tmp_path / "book.txt"
    book.write_text(BOOK)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "mine.txt").write_text("keep me")
    with pytest.raises(UserError, match="holds files this trainer did not write"):
        data.prepare_own_text(str(book), str(cache), 32, rows=4)
    assert (cache / "mine.txt").read_text() == "keep me"


def test_text_column_is_an_option_of_the_trainer(tmp_path, monkeypatch, capsys):
    """Issue 31: a .jsonl without a "text" field said "pass --text_column", which the trainer refused as an
    unknown key. It is the trainer's key now, for .jsonl and .parquet alike; a cache made from another column
    is made again."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from train_gpt2 import main
    monkeypatch.chdir(tmp_path)
    chapters = BOOK.split("\n\n")
    with open("book.jsonl", "w") as f:
        f.writelines(json.dumps({"body": c, "text": "not this"}) + "\n" for c in chapters)
    pq.write_table(pa.table({"body": chapters}), "book.parquet")
    small = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=32", "--seq_len=32", "--micro_batch_size=2",
             "--total_batch_size=64", "--max_steps=1", "--eval_interval=0", "--hellaswag_interval=0",
             "--sample_interval=0"]
    assert main(["--data=book.parquet", *small]) == 2
    line = one_line(capsys.readouterr().err)
    assert "has no column 'text' (columns: body); pass --text_column=NAME" in line
    for name in ("book.parquet", "book.jsonl"):
        assert main([f"--data={name}", "--text_column=body", f"--out_dir=out/{name}", *small]) == 0
        cache = json.load(open(os.path.join("out", name, "config.json")))["resolved"]["data_dir"]
        loader = TokenLoader(cache, "train", 2, 32, Sampling(shuffle=False))
        text = get_encoding().decode(np.concatenate(loader.shards).tolist())
        assert "stormy" in text and "not this" not in text


def small_build(tmp_path):
    """A fineweb.py folder of several shards (with its manifest) from a local text."""
    from gpt2train.shards import build
    (tmp_path / "book.txt").write_text(BOOK)
    out = str(tmp_path / "shards")
    build(out, source=[str(tmp_path / "book.txt")], prefix="book", shard_size=8000, val_fraction=0.1, num_proc=1)
    return out


def test_the_manifest_holds_each_shards_largest_token_and_the_loader_reads_it(tmp_path):
    """fineweb.py's build writes max_token per shard; the trainer's vocab check reads it instead of scanning."""
    out = small_build(tmp_path)
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    assert all(s["max_token"] == int(np.load(os.path.join(out, s["name"])).max()) for s in manifest["shards"])
    TokenLoader(out, "train", 2, 32, vocab_size=50304)
    manifest["shards"][1]["max_token"] = 60000  # what the manifest says is what is checked: no scan
    json.dump(manifest, open(os.path.join(out, "manifest.json"), "w"))
    with pytest.raises(UserError, match=f"{manifest['shards'][1]['name']} holds token id 60000 but vocab_size"):
        TokenLoader(out, "train", 2, 32, vocab_size=50304)


def test_a_missing_or_cut_shard_is_named_at_start_up_with_the_repair(tmp_path, capsys):
    """Issue 31: a data_dir missing a shard its manifest lists (a partial copy) trained on the rest, exit 0; a
    resume then said "data order differs" without naming the file."""
    from train_gpt2 import main
    out = small_build(tmp_path)
    names = sorted(f for f in os.listdir(out) if "train" in f)
    args = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=32", "--seq_len=32", "--micro_batch_size=2",
            "--total_batch_size=64", "--max_steps=2", "--eval_interval=0", "--hellaswag_interval=0",
            "--sample_interval=0", f"--data_dir={out}", "--resume=auto"]
    run = str(tmp_path / "run")
    assert main([*args, f"--out_dir={run}"]) == 0
    os.remove(os.path.join(out, names[1]))
    assert main([*args, f"--out_dir={run}", "--max_steps=3"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"error: data_dir {out!r}: {names[1]} is missing, listed in its manifest.json: copy it "
                           "again if data_dir is a copy, or run the command that made it again")
    assert line.endswith(f"python fineweb.py --source {tmp_path / 'book.txt'} --prefix book --shard_size 8000 "
                         f"--val_fraction 0.1 --out_dir {out}")
    data = open(os.path.join(out, names[2]), "rb").read()
    open(os.path.join(out, names[1]), "wb").write(data[:100])  # cut short
    assert main([*args, f"--out_dir={tmp_path / 'fresh'}"]) == 2
    assert f"{names[1]} is not a readable .npy" in one_line(capsys.readouterr().err)
    state = torch.load(os.path.join(run, "ckpt_000002.pt"), weights_only=True)["loader"]
    os.remove(os.path.join(out, names[1]))
    with pytest.raises(UserError, match=f"not here: {names[1]}"):  # the loader's own refusal names what is gone
        TokenLoader(out, "train", 2, 32).load_state_dict(state)


def test_a_deleted_shard_in_a_data_cache_is_made_again(tmp_path, capsys):
    """Issue 31: the --data cache was reused with a shard deleted, then refused with advice that also failed."""
    book = tmp_path / "book.txt"
    book.write_text(BOOK)
    cache = str(tmp_path / "cache")
    data.prepare_own_text(str(book), cache, 32, rows=4)
    made = {f: open(os.path.join(cache, f), "rb").read() for f in os.listdir(cache) if f.endswith(".npy")}
    gone = sorted(made)[-1]
    os.remove(os.path.join(cache, gone))
    capsys.readouterr()
    data.prepare_own_text(str(book), cache, 32, rows=4)
    assert f"{gone} is missing: tokenizing {book} again" in capsys.readouterr().out
    assert made == {f: open(os.path.join(cache, f), "rb").read() for f in os.listdir(cache) if f.endswith(".npy")}
