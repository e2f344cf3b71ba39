"""fineweb.py on local files: the token stream, shard layout, manifest, resume, --verify, bad input.

    python -m pytest -q tests/test_fineweb.py
"""
import gzip
import hashlib
import json
import os

import numpy as np

from gpt2train import shards
import fineweb
from conftest import DOCS, one_line, snapshot, write_txt
from gpt2train.tokenizer import EOT, get_encoding


def reference(docs):
    """The stream as the issue defines it, built with tiktoken's own per-document path."""
    enc = get_encoding()
    out = []
    for doc in docs:
        out += [EOT] + enc.encode_ordinary(doc)
    return np.array(out, dtype=np.uint16)


def shards_in(out):
    return sorted(f for f in os.listdir(out) if f.endswith(".npy"))


def concat(out):
    names = shards_in(out)
    order = [n for n in names if "_val_" in n] + [n for n in names if "_train_" in n]  # val first
    return np.concatenate([np.load(os.path.join(out, n)) for n in order])


def recording(write_shard, calls):
    """write_shard that notes each file's name in calls first."""
    def write(path, tokens):
        calls.append(os.path.basename(path))
        return write_shard(path, tokens)
    return write


def run_error(capsys, argv, code=2):
    """fineweb.main(argv) refused with exit code `code` (2: bad input; 1: the machine's failure), its stderr nothing
    but the tokenizing bar and one_line's error line; that line."""
    assert fineweb.main(argv) == code
    err = capsys.readouterr().err
    assert all("tokenizing" in x for x in [x for x in err.splitlines() if x.strip()][:-1]), err
    return one_line(err)

# -----------------------------------------------------------------------------


def test_stream_and_shard_layout(corpus, built):
    ref = reference(DOCS)
    assert np.array_equal(concat(built), ref)
    names = shards_in(built)
    n = -(-len(ref) // 37)
    assert names == sorted([f"edufineweb_val_{0:06d}.npy"] + [f"edufineweb_train_{i:06d}.npy" for i in range(1, n)])
    sizes = [np.load(os.path.join(built, f"edufineweb_{'val' if i == 0 else 'train'}_{i:06d}.npy")).size
             for i in range(n)]
    assert sizes == [37] * (n - 1) + [len(ref) - 37 * (n - 1)]  # exact, the remainder in the last shard
    shard = np.load(os.path.join(built, names[0]), mmap_mode="r")  # memory-mappable, 1-D uint16
    assert shard.dtype == np.uint16 and shard.ndim == 1

    manifest = json.load(open(os.path.join(built, "manifest.json")))
    assert manifest["complete"] and manifest["total_tokens"] == len(ref) and manifest["documents"] == len(DOCS)
    assert manifest["tokenizer"]["name"] == "gpt2" and manifest["tokenizer"]["vocab_bpe_sha256"]
    assert [f["path"] for f in manifest["settings"]["source"]["files"]] == [os.path.abspath(p) for p in corpus]
    for s in manifest["shards"]:
        data = open(os.path.join(built, s["name"]), "rb").read()
        assert hashlib.sha256(data).hexdigest() == s["sha256"]
        assert s["tokens"] == np.load(os.path.join(built, s["name"])).size
        assert s["split"] == ("val" if s["name"].startswith("edufineweb_val") else "train")


def test_encode_docs_matches_encode_ordinary():
    docs = ["plain", "", "has <|endoftext|> inside", "lone surrogate \ud800 here"]
    for batch in ([docs[0], docs[1]], docs, [docs[3]]):  # fast path, marker fallback, surrogate fallback
        assert np.array_equal(shards.encode_docs(batch), reference(batch))


def test_num_proc_2_is_byte_identical(corpus, built, tmp_path, monkeypatch):
    monkeypatch.setattr(shards, "BATCH_CHARS", 100)  # many small batches through the pool
    started = []
    real_start_pool = shards.start_pool
    monkeypatch.setattr(shards, "start_pool", lambda n: (started.append(n), real_start_pool(n))[1])
    out = str(tmp_path / "out")
    assert fineweb.main(["--source", *corpus, "--out_dir", out, "--shard_size", "37", "--num_proc", "2"]) == 0
    assert started == [2]
    assert snapshot(out) == snapshot(built)


def test_small_local_source_needs_no_pool(corpus, built, tmp_path, monkeypatch):
    started = []
    real_start_pool = shards.start_pool
    monkeypatch.setattr(shards, "start_pool", lambda n: (started.append(n), real_start_pool(n))[1])
    out = str(tmp_path / "out")
    assert fineweb.main(["--source", *corpus, "--out_dir", out, "--shard_size", "37", "--num_proc", "8"]) == 0
    assert started == [1] and snapshot(out) == snapshot(built)


def test_jsonl_parquet_and_compressed(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [f"row {i}: " + "some words here " * (i % 5) for i in range(30)]
    with gzip.open(tmp_path / "a.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"id": i, "body": t}) + "\n" for i, t in enumerate(rows[:12]))
    pq.write_table(pa.table({"body": rows[12:25], "n": list(range(13))}), tmp_path / "b.parquet")
    with open(tmp_path / "c.json", "w") as f:
        f.writelines(json.dumps({"body": t}) + "\n" for t in rows[25:])
    txt = write_txt(tmp_path, ["and a text file"])
    with gzip.open(tmp_path / "d.txt.gz", "wt", encoding="utf-8", newline="") as f:
        f.write("a gzipped\r\ntext file, one document\n\n")
    out = str(tmp_path / "out")
    srcs = [str(tmp_path / "a.jsonl.gz"), str(tmp_path / "b.parquet"), *txt, str(tmp_path / "c.json"),
            str(tmp_path / "d.txt.gz")]
    assert fineweb.main(["--source", *srcs, "--text_column", "body", "--out_dir", out, "--shard_size", "50",
                         "--num_proc", "1"]) == 0
    expected = rows[:25] + ["and a text file"] + rows[25:] + ["a gzipped\r\ntext file, one document\n\n"]
    assert np.array_equal(concat(out), reference(expected))


def test_max_tokens_stops_early(corpus, built, tmp_path):
    out = str(tmp_path / "out")
    assert fineweb.main(["--source", *corpus, "--out_dir", out, "--shard_size", "37", "--max_tokens", "100",
                         "--num_proc", "1"]) == 0
    assert [np.load(os.path.join(out, n)).size for n in sorted(shards_in(out), key=lambda n: n[-10:])] == [37, 37, 26]
    assert np.array_equal(concat(out), reference(DOCS)[:100])


def test_interrupted_run_resumes_byte_identical(corpus, built, tmp_path, monkeypatch, capsys):
    out = str(tmp_path / "out")
    argv = ["--source", *corpus, "--out_dir", out, "--shard_size", "37", "--num_proc", "1"]
    real_write_shard, real_write_json = shards.write_shard, shards.write_json
    calls = []

    def write_shard_then_stop(path, tokens):
        calls.append(os.path.basename(path))
        if len(calls) == 4:  # the 4th shard is half written when the power goes
            open(path + ".tmp", "wb").write(b"partial")
            raise KeyboardInterrupt
        return real_write_shard(path, tokens)

    monkeypatch.setattr(shards, "write_shard", write_shard_then_stop)
    assert fineweb.main(argv) == 130
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    assert len(shards_in(out)) == 3 and not manifest["complete"]
    assert manifest["shards"][-1]["next"][1] > 0  # resuming mid-document: the harder case
    assert "run the same command again" in capsys.readouterr().err

    # second interruption: a shard renamed into place, then killed before the manifest lists it
    calls.clear()
    monkeypatch.setattr(shards, "write_shard", recording(real_write_shard, calls))

    def write_json_then_stop(path, obj):
        if len(obj["shards"]) == 5:
            raise KeyboardInterrupt
        real_write_json(path, obj)

    monkeypatch.setattr(shards, "write_json", write_json_then_stop)
    assert fineweb.main(argv) == 130
    assert calls[0] == "edufineweb_train_000003.npy"  # the 3 complete shards were kept, not redone

    calls.clear()
    monkeypatch.setattr(shards, "write_json", real_write_json)
    assert fineweb.main(argv) == 0
    assert calls[0] == "edufineweb_train_000004.npy"  # shard 4 was on disk but not in the manifest: redone
    for name in os.listdir(out):
        assert not name.endswith(".tmp")
    assert snapshot(out) == snapshot(built)

    # corrupt a kept shard: the next run redoes it and everything after it, byte-identical again
    path = os.path.join(out, "edufineweb_train_000002.npy")
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 1
    open(path, "wb").write(bytes(data))
    calls.clear()
    assert fineweb.main(argv) == 0
    assert calls[0] == "edufineweb_train_000002.npy"
    assert snapshot(out) == snapshot(built)

    # a complete run is left alone
    calls.clear()
    assert fineweb.main(argv) == 0 and calls == []
    assert "nothing to do" in capsys.readouterr().out


def chunked(out):
    """The stream back from --val_fraction shards: chunk i is val_i then train_i."""
    names = shards_in(out)
    index = sorted({n[-10:-4] for n in names})
    return np.concatenate([np.load(os.path.join(out, f"edufineweb_{split}_{i}.npy")) for i in index
                           for split in ("val", "train") if f"edufineweb_{split}_{i}.npy" in names])


def test_val_fraction_takes_the_head_of_every_chunk(corpus, tmp_path, monkeypatch):
    out, out2 = str(tmp_path / "out"), str(tmp_path / "out2")
    argv = ["--source", *corpus, "--shard_size", "37", "--val_fraction", "0.1", "--num_proc", "1", "--out_dir"]
    assert fineweb.main(argv + [out]) == 0
    ref = reference(DOCS)
    n = -(-len(ref) // 37)
    sizes = [37] * (n - 1) + [len(ref) - 37 * (n - 1)]
    val = {f"edufineweb_val_{i:06d}.npy": -(-sizes[i] // 10) for i in range(n)}  # ceil(0.1 x chunk)
    train = {f"edufineweb_train_{i:06d}.npy": sizes[i] - val[f"edufineweb_val_{i:06d}.npy"] for i in range(n)}
    assert {f: np.load(os.path.join(out, f)).size for f in shards_in(out)} == {**val, **train}
    assert np.array_equal(chunked(out), ref)  # val_i + train_i, chunk after chunk: the stream, nothing lost
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    assert [s["split"] for s in manifest["shards"]] == ["val", "train"] * n
    assert fineweb.main(["--verify", "--out_dir", out]) == 0
    done = snapshot(out)

    # interrupted between a chunk's val and train shard: the whole chunk is redone, byte-identical
    real_write_shard, calls = shards.write_shard, []

    def write_shard_then_stop(path, tokens):
        calls.append(os.path.basename(path))
        if len(calls) == 6:  # chunk 2's train shard
            raise KeyboardInterrupt
        return real_write_shard(path, tokens)

    monkeypatch.setattr(shards, "write_shard", write_shard_then_stop)
    assert fineweb.main(argv + [out2]) == 130
    assert calls[-1] == "edufineweb_train_000002.npy"
    calls.clear()
    monkeypatch.setattr(shards, "write_shard", recording(real_write_shard, calls))
    assert fineweb.main(argv + [out2]) == 0
    assert calls[0] == "edufineweb_val_000002.npy"  # chunks 0 and 1 kept, chunk 2 redone from its val part
    assert snapshot(out2) == done


def test_layout_change_rebuilds_without_deleting_by_hand(corpus, built, tmp_path, capsys):
    """--shard_size or --val_fraction changed: the same tokens cut differently, so no refusal: the old
    shards go, the new ones are byte-identical to a fresh run with the new settings."""
    out = str(tmp_path / "out")
    base = ["--source", *corpus, "--out_dir", out, "--num_proc", "1"]
    assert fineweb.main(base + ["--shard_size", "37"]) == 0
    assert snapshot(out) == snapshot(built)
    assert fineweb.main(base + ["--shard_size", "100"]) == 0
    assert "rebuilding, shard_size=37 (this run: shard_size=100)" in capsys.readouterr().err
    fresh = str(tmp_path / "fresh")
    assert fineweb.main(["--source", *corpus, "--out_dir", fresh, "--num_proc", "1", "--shard_size", "100"]) == 0
    assert snapshot(out) == snapshot(fresh)
    assert fineweb.main(base + ["--shard_size", "100", "--val_fraction", "0.05"]) == 0
    assert "val_fraction=None (this run: val_fraction=0.05)" in capsys.readouterr().err
    assert np.array_equal(chunked(out), reference(DOCS)) and len(shards_in(out)) == 6
    assert fineweb.main(["--verify", "--out_dir", out]) == 0


def test_verify_catches_a_flipped_byte(built, tmp_path, capsys):
    out = str(tmp_path / "out")
    os.makedirs(out)
    for name, data in snapshot(built).items():
        open(os.path.join(out, name), "wb").write(data)
    assert fineweb.main(["--verify", "--out_dir", out]) == 0
    assert "ok:" in capsys.readouterr().out
    path = os.path.join(out, "edufineweb_train_000003.npy")
    data = bytearray(open(path, "rb").read())
    data[len(data) - 20] ^= 0x10  # one bit of one token
    open(path, "wb").write(bytes(data))
    line = run_error(capsys, ["--verify", "--out_dir", out])
    assert "edufineweb_train_000003.npy" in line and "sha256" in line

# -----------------------------------------------------------------------------
# bad input: one line, exit 1, good shards untouched


def test_bad_sources(tmp_path, capsys):
    out = str(tmp_path / "out")
    missing = str(tmp_path / "nope.txt")
    assert "no such file" in run_error(capsys, ["--source", missing, "--out_dir", out])
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert "is empty" in run_error(capsys, ["--source", str(empty), "--out_dir", out])
    (tmp_path / "rows.csv").write_text("text\nhi\n")
    assert "unsupported file type" in run_error(capsys, ["--source", str(tmp_path / "rows.csv"), "--out_dir", out])
    good = write_txt(tmp_path, ["fine"])
    assert "is a file" in run_error(capsys, ["--source", *good, "--out_dir", str(empty)])
    assert not os.path.exists(out)


def test_bad_rows(tmp_path, capsys):
    out = str(tmp_path / "out")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(json.dumps(r) for r in [{"text": "a"}, {"text": "b"}, {"title": "c"}, {"text": "d"}]))
    line = run_error(capsys, ["--source", str(bad), "--out_dir", out, "--num_proc", "1"])
    assert "row 3 has no text in column 'text'" in line  # counted from 1, as hellaswag.py's rows
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"body": "x"}) + "\n")
    assert "--text_column" in run_error(capsys, ["--source", str(other), "--out_dir", out, "--num_proc", "1"])
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n")
    assert "no rows" in run_error(capsys, ["--source", str(blank), "--out_dir", out, "--num_proc", "1"])
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "none.parquet")
    line = run_error(capsys, ["--source", str(tmp_path / "none.parquet"), "--out_dir", out, "--num_proc", "1"])
    assert "no rows" in line
    assert not os.path.exists(out)


def test_token_that_does_not_fit_uint16(corpus, tmp_path, monkeypatch, capsys):
    class BigVocab:  # a tokenizer with ids past 65535
        def encode_to_numpy(self, text, allowed_special):
            return np.array([EOT, 70000], dtype=np.uint32)

    monkeypatch.setattr(shards, "get_encoding", BigVocab)
    out = str(tmp_path / "out")
    assert "70000" in run_error(capsys, ["--source", *corpus[:2], "--out_dir", out, "--num_proc", "1"])
    assert not os.path.exists(out)


def test_out_dir_from_another_source_is_left_alone(corpus, built, tmp_path, capsys):
    out = str(tmp_path / "out")
    os.makedirs(out)
    for name, data in snapshot(built).items():
        open(os.path.join(out, name), "wb").write(data)
    before = snapshot(out)
    line = run_error(capsys, ["--source", *corpus[:3], "--out_dir", out, "--shard_size", "37", "--num_proc", "1"])
    assert "different source" in line and "another --out_dir" in line
    line = run_error(capsys, ["--source", *corpus, "--out_dir", out, "--shard_size", "37", "--max_tokens", "50",
                              "--num_proc", "1"])
    assert "max_tokens=None (this run: max_tokens=50)" in line
    assert snapshot(out) == before

    other = str(tmp_path / "other")  # same settings, another tokenizer; then a manifest that is not one
    os.makedirs(other)
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    manifest["tokenizer"]["vocab_bpe_sha256"] = "0" * 64
    json.dump(manifest, open(os.path.join(other, "manifest.json"), "w"))
    argv = ["--source", *corpus, "--out_dir", other, "--shard_size", "37", "--num_proc", "1"]
    assert "tokenizer=" in run_error(capsys, argv)
    open(os.path.join(other, "manifest.json"), "w").write("{not json")
    assert "not valid JSON" in run_error(capsys, argv)

    foreign = str(tmp_path / "foreign")  # build-nanogpt's shards, no manifest
    os.makedirs(foreign)
    np.save(os.path.join(foreign, "edufineweb_train_000001.npy"), np.arange(10, dtype=np.uint16))
    before = snapshot(foreign)
    assert "no manifest.json" in run_error(capsys, ["--source", *corpus, "--out_dir", foreign, "--num_proc", "1"])
    assert snapshot(foreign) == before


def test_dataset_path_streams_and_resumes(tmp_path, monkeypatch):
    """The hub code path (load_dataset(--dataset, --name, streaming=True)), on a local parquet folder."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [f"document {i}: " + "text " * (i % 7) for i in range(60)]
    os.makedirs(tmp_path / "hub" / "data")
    for f in range(3):
        pq.write_table(pa.table({"id": list(range(20)), "text": rows[20 * f:20 * f + 20]}),
                       tmp_path / "hub" / "data" / f"train-{f:05d}-of-00003.parquet")
    argv = ["--dataset", str(tmp_path / "hub"), "--name", "default", "--shard_size", "64", "--num_proc", "1"]
    assert fineweb.main(argv + ["--out_dir", str(tmp_path / "a")]) == 0
    assert np.array_equal(concat(tmp_path / "a"), reference(rows))

    real_write_shard = shards.write_shard
    calls = []

    def write_shard_then_stop(path, tokens):
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_write_shard(path, tokens)

    monkeypatch.setattr(shards, "write_shard", write_shard_then_stop)
    assert fineweb.main(argv + ["--out_dir", str(tmp_path / "b")]) == 130
    monkeypatch.setattr(shards, "write_shard", real_write_shard)
    assert fineweb.main(argv + ["--out_dir", str(tmp_path / "b")]) == 0
    assert snapshot(tmp_path / "b") == snapshot(tmp_path / "a")


def test_dataset_that_cannot_be_opened(tmp_path, capsys):
    os.makedirs(tmp_path / "empty")
    line = run_error(capsys, ["--dataset", str(tmp_path / "empty"), "--out_dir", str(tmp_path / "out"),
                              "--num_proc", "1"])
    assert "could not open" in line and "empty" in line


def test_a_folder_source_reads_its_text_files(corpus, built, tmp_path, capsys):
    """--source FOLDER: the folder's text files at any depth in sorted order (hidden, empty and other files
    skipped), the very files and shards that naming them gives, as the trainer's --data=FOLDER reads them."""
    folder = os.path.dirname(corpus[0])  # doc00.txt .. doc07.txt and nothing else
    d = tmp_path / "texts"
    (d / "sub").mkdir(parents=True)
    (d / ".git").mkdir()
    for i, path in enumerate(corpus):
        with open(path, "rb") as f:
            (d / ("sub" if i >= 5 else "") / f"doc{i:02d}.txt").write_bytes(f.read())
    (d / "notes.pdf").write_bytes(b"%PDF")
    (d / "empty.md").write_text("")
    (d / ".hidden.txt").write_text("secret")
    (d / ".git" / "HEAD.txt").write_text("ref")
    assert shards.folder_files(folder) == sorted(corpus)
    assert shards.folder_files(str(d)) == [str(d / f"doc{i:02d}.txt") for i in range(5)] + \
        [str(d / "sub" / f"doc{i:02d}.txt") for i in range(5, 8)]
    out = str(tmp_path / "out")
    assert fineweb.main(["--source", str(d), "--out_dir", out, "--shard_size", "37", "--num_proc", "1"]) == 0
    assert {f: b for f, b in snapshot(out).items() if f.endswith(".npy")} == \
        {f: b for f, b in snapshot(built).items() if f.endswith(".npy")}
    manifest = json.load(open(os.path.join(out, shards.MANIFEST)))
    assert [os.path.basename(f["path"]) for f in manifest["settings"]["source"]["files"]] == \
        [f"doc{i:02d}.txt" for i in range(8)]
    (d / "nothing").mkdir()
    assert "holds no non-empty .txt" in run_error(capsys, ["--source", str(d / "nothing"), "--out_dir",
                                                            str(tmp_path / "out2")])


def test_shards_and_manifest_follow_the_umask(corpus, tmp_path):
    old = os.umask(0o027)
    try:
        out = str(tmp_path / "out")
        assert fineweb.main(["--source", *corpus, "--out_dir", out, "--shard_size", "37", "--num_proc", "1"]) == 0
    finally:
        os.umask(old)
    assert {os.stat(os.path.join(out, f)).st_mode & 0o777 for f in os.listdir(out)} == {0o640}
    assert os.stat(out).st_mode & 0o777 == 0o750


def test_a_source_under_one_shard_is_refused_with_a_command_that_works(tmp_path, capsys):
    """Issue 39 item 10: `fineweb.py --source small.txt --out_dir data/book` exited 0 with only a val shard (shard 0
    is val), and the trainer then recommended `python fineweb.py --out_dir data/book`, which refused that folder.
    Now the build is one line and exit 2, its manifest left incomplete, naming the command that makes both
    splits; the trainer's hint on such a folder is that command; run, it makes a folder the trainer reads."""
    import shlex
    from gpt2train import data
    from gpt2train.fileio import UserError
    text = "It was a dark and stormy night. " * 50
    small, n = write_txt(tmp_path, [text])[0], len(reference([text]))
    out = str(tmp_path / "data" / "book")
    line = run_error(capsys, ["--source", small, "--out_dir", out, "--num_proc", "1"])
    command = f"python fineweb.py --source {small} --val_fraction 0.1 --out_dir {out}"
    assert line.startswith(f"error: the source is {n} tokens, less than one --shard_size chunk (100,000,000), and "
                           f"shard 0 is val: no train shard, so {out} is left incomplete; run again with "
                           "--val_fraction 0.1"), line
    assert line.endswith(f": {command}"), line
    assert json.load(open(os.path.join(out, "manifest.json")))["complete"] is False
    try:
        data.shard_paths(out, "train")
    except UserError as e:
        assert f"has no train shards (*train*.npy): make them with `{command}`" in str(e), e
    else:
        raise AssertionError("no train shards, no error")
    assert fineweb.main(shlex.split(command)[2:] + ["--num_proc", "1"]) == 0  # what both lines offer works
    assert json.load(open(os.path.join(out, "manifest.json")))["complete"] is True
    assert [len(data.shard_paths(out, split)) for split in ("train", "val")] == [1, 1]
    # a folder of shards fineweb.py did not make (no manifest) is not offered a fineweb.py run on it
    loose = tmp_path / "loose"
    loose.mkdir()
    np.save(loose / "mine_val_000000.npy", np.zeros(10, dtype=np.uint16))
    try:
        data.shard_paths(str(loose), "train")
    except UserError as e:
        assert f"--out_dir {loose}" not in str(e) and "--out_dir NEW_FOLDER" in str(e), e
