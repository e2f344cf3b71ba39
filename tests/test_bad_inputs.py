"""Bad input never ends in a traceback: every script, every family of mistake a user makes by hand.

Each case runs a script's main(argv) in-process and asserts the exit code (2: bad input or usage),
that nothing printed a traceback, that the one `error:` line on stderr names the offending input, and that
every --option it names is one the command has (its --help's; after `python X.py`, X's).
A few run through the real entry point (`python script.py ...`) in a subprocess. The files the cases
point at (good and broken) are made once, in the `paths` fixture; a case names them as {key}.
"""
import contextlib
import functools
import gzip
import io
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import bench
import export as export_py
import fineweb
import hellaswag
import plot
import sample
import train_gpt2
from conftest import ROOT, one_line, tiny_args, write_shards

SCRIPTS = {"train": train_gpt2.main, "fineweb": fineweb.main, "hellaswag": hellaswag.main, "bench": bench.main,
           "sample": sample.main, "plot": plot.main, "export": export_py.main}
ROW = {"ctx": "A man plays", "endings": ["a", "b", "c", "d"], "label": 2}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """{name: path} of every file and folder the cases use."""
    d = str(tmp_path_factory.mktemp("bad"))
    p = {"d": d, "missing": os.path.join(d, "missing"), "folder": os.path.join(d, "folder"),
         "data": write_shards(os.path.join(d, "data"))}
    os.makedirs(p["folder"])

    def put(name, content, mode="w"):  # the key: the name with _ for . (truncated.pt -> {truncated_pt})
        p[name.replace(".", "_")] = path = os.path.join(d, name)
        with open(path, mode) as f:
            f.write(content)
    put("file.txt", "just some text\n")

    # token shards: a data_dir whose val shard is broken in each way
    good_val = open(os.path.join(p["data"], "toy_val_000000.npy"), "rb").read()
    for kind, content in [("garbage", b"\x93NUMPY\x07\x00 not a header"), ("empty", b""),
                          ("truncated", good_val[:len(good_val) // 2]), ("int32", None)]:
        dst = p[f"shards_{kind}"] = os.path.join(d, f"shards_{kind}")
        shutil.copytree(p["data"], dst)
        val = os.path.join(dst, "toy_val_000000.npy")
        if content is None:
            np.save(val, np.arange(600, dtype=np.int32))
        else:
            open(val, "wb").write(content)

    # checkpoints: a real one (a 1-step run: vocab 64), and broken ones
    p["run"] = os.path.join(d, "run")
    assert train_gpt2.main(tiny_args(p["data"], p["run"], max_steps=1, eval_interval=0, checkpoint_interval=1)) == 0
    p["ckpt"] = os.path.join(p["run"], "ckpt_000001.pt")
    raw = open(p["ckpt"], "rb").read()
    put("truncated.pt", raw[:len(raw) // 2], "wb")
    put("text.pt", "this is not a checkpoint\n")
    ckpt = torch.load(p["ckpt"], weights_only=True)
    p["foreign"] = os.path.join(d, "foreign.pt")
    torch.save({**ckpt, "model_args": {**ckpt["model_args"], "n_layer": 3}}, p["foreign"])

    # configs
    put("syntax.py", "n_layer = = 4\n")
    put("binary.py", b"\x89PNG\r\n\x1a\n\x00\x00", "wb")
    put("wrongtype.py", "n_layer = '12'\n")

    # HellaSwag rows
    put("rows.jsonl", json.dumps(ROW) + "\n")
    put("norows.jsonl", "\n\n")
    put("notjson.jsonl", json.dumps(ROW) + "\n{'ctx': 'single quotes'}\n")
    put("three.jsonl", json.dumps({**ROW, "endings": ["a", "b", "c"]}) + "\n")
    put("binrows.jsonl", b"\xff\xfe\x00 binary \x80\n", "wb")

    # fineweb sources
    put("empty.txt", "")
    put("doc.txt", "A document of plain text.\n")
    put("corrupt.parquet", b"PAR1 this is not a parquet file PAR1", "wb")
    put("corrupt.jsonl", '{"text": "fine"}\n{"text": unquoted}\n')
    put("nocolumn.jsonl", '{"body": "the text is in another column"}\n')
    put("truncated.txt.gz", gzip.compress(b"x" * 10000)[:40], "wb")
    put("corrupt.txt.bz2", b"BZh9 not bzip2 data at all", "wb")
    p["badmanifest"] = os.path.join(d, "badmanifest")
    os.makedirs(p["badmanifest"])
    open(os.path.join(p["badmanifest"], "manifest.json"), "w").write('{"tokenizer": ')
    p["shardsfrom"] = os.path.join(d, "shardsfrom")  # shards made from doc.txt: another source is refused
    assert fineweb.main(["--source", p["doc_txt"], "--out_dir", p["shardsfrom"], "--num_proc", "1",
                         "--val_fraction", "0.1"]) == 0

    # a run that has written no checkpoint yet: its config.json (as the trainer writes it) and log.jsonl
    p["nockpt"] = os.path.join(d, "nockpt")
    os.makedirs(p["nockpt"])
    open(os.path.join(p["nockpt"], "config.json"), "w").write(json.dumps({"asked": {}, "resolved": {}, "decided": []}))
    open(os.path.join(p["nockpt"], "log.jsonl"), "w").write('{"step": 0, "loss": 10.9}\n')

    # plot runs
    for name, config in [("badjson", "{not json"), ("badsize", json.dumps({"total_batch_size": "abc"})),
                         ("infsize", '{"total_batch_size": Infinity}')]:
        p[name] = os.path.join(d, name)
        os.makedirs(p[name])
        open(os.path.join(p[name], "config.json"), "w").write(config)
        open(os.path.join(p[name], "log.jsonl"), "w").write('{"step": 0, "loss": 4.0}\n')
    return p


def train(**over):
    """The trainer's tiny run with these overrides (data_dir {data}, out_dir {out}: a new folder per case)."""
    kw = {"data_dir": "{data}", "out_dir": "{out}", **over}
    return tiny_args(kw.pop("data_dir"), kw.pop("out_dir"), **kw)


ONE_PROC = ["--num_proc", "1"]  # fineweb.py in this process: no pool to start for one bad file
# family, script, argv ({name} from the paths fixture), the text the error line must contain
CASES = [
    # missing files and folders
    ("missing", "train", ["{missing}/config.py"], "{missing}/config.py"),
    ("missing", "train", train(data_dir="{missing}"), "{missing}"),
    ("missing", "train", train(init_from="{missing}.pt"), "{missing}.pt"),
    ("missing", "train", train(hellaswag_interval=1, hellaswag_file="{missing}.jsonl", vocab_size=50304),
     "{missing}.jsonl"),
    ("missing", "train", train(resume="true", out_dir="{folder}"), "{folder}"),
    ("missing", "fineweb", ["--source", "{missing}.txt", "--out_dir", "{d}/fw"], "{missing}.txt"),
    ("missing", "fineweb", ["--verify", "--out_dir", "{folder}"], "{folder}/manifest.json"),
    ("missing", "hellaswag", ["--data", "{missing}.jsonl"], "{missing}.jsonl"),
    ("missing", "sample", ["--model", "{missing}.pt"], "{missing}.pt"),
    ("missing", "sample", ["--model", "{ckpt}", "--prompt_file", "{missing}.txt"], "{missing}.txt"),
    ("missing", "plot", ["{missing}"], "{missing}"),
    ("missing", "export", ["{missing}.pt", "{d}/hf"], "{missing}.pt"),
    ("missing", "sample", ["--model", "{nockpt}"], "no checkpoint in {nockpt} yet"),
    ("missing", "hellaswag", ["--data", "{rows_jsonl}", "--model", "{nockpt}"], "no checkpoint in {nockpt} yet"),
    ("missing", "export", ["{nockpt}", "{d}/hf"], "no checkpoint in {nockpt} yet"),
    # issue 44 item 4: a folder with neither (it was the hub's "no file named model.safetensors ... network")
    ("missing", "sample", ["--model", "{folder}"], "no ckpt_*.pt and no save_pretrained files in {folder}"),
    ("missing", "export", ["{folder}", "{d}/hf"], "no ckpt_*.pt and no save_pretrained files in {folder}"),
    ("missing", "hellaswag", ["--data", "{rows_jsonl}", "--model", "{folder}"],
     "no ckpt_*.pt and no save_pretrained files in {folder}"),
    # files where folders are expected, folders where files are
    ("file/folder", "train", train(out_dir="{file_txt}"), "{file_txt}"),
    ("file/folder", "train", train(data_dir="{file_txt}"), "{file_txt}"),
    ("file/folder", "train", ["{folder}"], "{folder}"),
    ("file/folder", "train", train(init_from="{run}"), "{run} is a training run's out_dir"),
    ("file/folder", "fineweb", ["--source", "{folder}", "--out_dir", "{d}/fw"], "{folder}"),
    ("file/folder", "fineweb", ["--source", "{doc_txt}", "--out_dir", "{file_txt}"], "{file_txt}"),
    ("file/folder", "hellaswag", ["--data", "{folder}"], "{folder}"),
    ("file/folder", "hellaswag", ["--data", "{rows_jsonl}", "--json", "{folder}"], "{folder}"),
    ("file/folder", "hellaswag", ["--data", "{rows_jsonl}", "--json", "{missing}/out.json"], "{missing}/out.json"),
    ("file/folder", "sample", ["--model", "{folder}"], "{folder}"),
    ("file/folder", "sample", ["--model", "{ckpt}", "--prompt_file", "{folder}"], "{folder}"),
    ("file/folder", "plot", ["{file_txt}"], "{file_txt}"),
    ("file/folder", "plot", ["{badsize}", "--out", "{folder}"], "{badsize}"),
    ("file/folder", "export", ["{ckpt}", "{file_txt}"], "{file_txt}"),
    ("file/folder", "export", ["{run}", "{d}/hf"], "{run}"),
    ("file/folder", "bench", ["--quick", "--json", "{folder}"], "{folder}"),
    ("file/folder", "bench", ["--quick", "--plot", "{missing}/a.png"], "{missing}/a.png"),
    # empty, truncated, corrupt and wrong-dtype files
    ("corrupt", "train", train(data_dir="{shards_garbage}"), "{shards_garbage}/toy_val_000000.npy"),
    ("corrupt", "train", train(data_dir="{shards_empty}"), "{shards_empty}/toy_val_000000.npy"),
    ("corrupt", "train", train(data_dir="{shards_truncated}"), "{shards_truncated}/toy_val_000000.npy"),
    ("corrupt", "train", train(data_dir="{shards_int32}"), "{shards_int32}/toy_val_000000.npy"),
    ("corrupt", "train", train(init_from="{text_pt}"), "{text_pt}"),
    ("corrupt", "train", train(init_from="{truncated_pt}"), "{truncated_pt}"),
    ("corrupt", "train", ["{syntax_py}"], "{syntax_py}"),
    ("corrupt", "train", ["{binary_py}"], "{binary_py}"),
    ("corrupt", "hellaswag", ["--data", "{norows_jsonl}"], "{norows_jsonl}"),
    ("corrupt", "hellaswag", ["--data", "{notjson_jsonl}"], "{notjson_jsonl} row 2"),
    ("corrupt", "hellaswag", ["--data", "{three_jsonl}"], "{three_jsonl} row 1"),
    ("corrupt", "hellaswag", ["--data", "{binrows_jsonl}"], "{binrows_jsonl}"),
    ("corrupt", "hellaswag", ["--data", "{rows_jsonl}", "--model", "{truncated_pt}"], "{truncated_pt}"),
    ("corrupt", "fineweb", ["--source", "{empty_txt}", "--out_dir", "{d}/fw"], "{empty_txt}"),
    ("corrupt", "fineweb", ["--source", "{corrupt_parquet}", "--out_dir", "{d}/fw"], "{corrupt_parquet}"),
    ("corrupt", "fineweb", ["--source", "{corrupt_jsonl}", "--out_dir", "{d}/fw", *ONE_PROC], "{corrupt_jsonl}"),
    ("corrupt", "fineweb", ["--source", "{nocolumn_jsonl}", "--out_dir", "{d}/fw", *ONE_PROC], "{nocolumn_jsonl}"),
    ("corrupt", "fineweb", ["--source", "{truncated_txt_gz}", "--out_dir", "{d}/fw", *ONE_PROC], "{truncated_txt_gz}"),
    ("corrupt", "fineweb", ["--source", "{corrupt_txt_bz2}", "--out_dir", "{d}/fw", *ONE_PROC], "{corrupt_txt_bz2}"),
    ("corrupt", "fineweb", ["--verify", "--out_dir", "{badmanifest}"], "{badmanifest}/manifest.json"),
    ("corrupt", "train", train(data="{corrupt_parquet}", out_dir="{out}"), "{corrupt_parquet}"),
    ("corrupt", "sample", ["--model", "{truncated_pt}"], "{truncated_pt}"),
    ("corrupt", "sample", ["--model", "{foreign}"], "{foreign}"),
    ("corrupt", "export", ["{text_pt}", "{d}/hf"], "{text_pt}"),
    ("corrupt", "plot", ["{badjson}"], "{badjson}/config.json"),
    ("corrupt", "plot", ["{badsize}"], "{badsize}/config.json"),
    ("corrupt", "plot", ["{infsize}"], "{infsize}/config.json"),
    # values out of range or of the wrong type
    ("value", "train", train(n_layer="abc"), "n_layer"),
    ("value", "train", train(max_steps=0), "max_steps"),
    ("value", "train", train(weight_decay="nan"), "weight_decay"),
    ("value", "train", train(grad_clip=-1), "grad_clip"),
    ("value", "train", ["{wrongtype_py}"], "n_layer"),
    ("value", "train", train(total_batch_size=100), "total_batch_size=100"),
    ("value", "fineweb", ["--source", "{doc_txt}", "--shard_size", "0"], "--shard_size"),
    ("value", "fineweb", ["--source", "{doc_txt}", "--shard_size", "1e6"], "--shard_size"),
    ("value", "hellaswag", ["--data", "{rows_jsonl}", "--limit", "0"], "--limit"),
    ("value", "hellaswag", ["--data", "{rows_jsonl}", "--batch_size", "many"], "--batch_size"),
    ("value", "bench", ["--quick", "--steps", "0"], "--steps"),
    ("value", "bench", ["--quick", "--headroom", "1.5"], "--headroom"),
    ("value", "sample", ["--model", "{ckpt}", "--temperature", "nan"], "--temperature"),
    ("value", "sample", ["--model", "{ckpt}", "--num_samples", "0"], "--num_samples"),
    ("value", "sample", ["--model", "{ckpt}"], "vocab_size 64"),
    # names that do not exist
    ("name", "train", train(device="tpu"), "tpu"),
    ("name", "train", train(precision="fp8"), "fp8"),
    ("name", "train", train(init_from="gpt3"), "gpt3"),
    ("name", "train", ["--n_layers=4"], "n_layers"),
    ("name", "train", ["--n_layer"], "--n_layer"),
    ("name", "hellaswag", ["--data", "{rows_jsonl}", "--precision", "fp8"], "fp8"),
    ("name", "hellaswag", ["--data", "{rows_jsonl}", "--model", "gpt3"], "gpt3"),
    ("name", "hellaswag", ["--split", "test"], "test"),
    ("name", "sample", ["--model", "{ckpt}", "--device", "tpu"], "tpu"),
    ("name", "bench", ["--quick", "--model", "huge"], "huge"),
    ("name", "bench", ["--device", "tpu"], "tpu"),
    ("name", "fineweb", ["--bogus"], "--bogus"),
    ("name", "plot", ["{badsize}", "--bogus"], "--bogus"),
    ("name", "export", ["{ckpt}"], "export"),
    # options that contradict each other
    ("contradiction", "train", train(fsdp="true"), "fsdp"),
    ("contradiction", "train", train(seq_len=64), "seq_len=64"),
    ("contradiction", "train", train(out_dir="{run}"), "{run}"),
    ("contradiction", "train", train(out_dir="{run}", resume="true", n_layer=2), "n_layer"),
    ("contradiction", "sample", ["--model", "{ckpt}", "--prompt", "hi", "--prompt_file", "{file_txt}"],
     "--prompt_file"),
    ("contradiction", "fineweb", ["--source", "{file_txt}", "--out_dir", "{shardsfrom}", *ONE_PROC], "{shardsfrom}"),
]
if not torch.cuda.is_available():
    CASES += [("name", "train", train(device="cuda"), "cuda"), ("name", "hellaswag", ["--device", "cuda"], "cuda")]


@functools.cache
def options(script):
    """The --options a command has: those its --help lists (the trainer's: every config key)."""
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()):
        try:
            SCRIPTS[script](["--help"])
        except SystemExit:  # argparse's --help
            pass
    return set(re.findall(r"--(\w+)", out.getvalue())) | {"help"}


FILES = {"train_gpt2.py": "train", "fineweb.py": "fineweb", "hellaswag.py": "hellaswag", "bench.py": "bench",
         "sample.py": "sample", "plot.py": "plot", "export.py": "export"}


def foreign_options(line, script, argv=()):
    """The --options an error line of script names that their command lacks: script's own, and after
    `python X.py` X's (a command the line recommends, up to a closing backquote); after `torchrun` or `pip`
    nothing is checked; nor an option argv holds (the user's own, e.g. a mistyped one the line quotes)."""
    bad, owner, typed = [], script, " ".join(argv)
    for piece in re.split(r"(python \S+\.py|torchrun|pip install|`)", line):
        if piece == "`":
            owner = script
        elif piece.startswith(("python ", "torchrun", "pip install")):
            owner = FILES.get(os.path.basename(piece.split()[-1])) if piece.startswith("python ") else None
        elif owner is not None:
            bad += [f"--{o}" for o in re.findall(r"(?<![\w-])--(\w+)", piece)
                    if o not in options(owner) and f"--{o}" not in typed]
    return bad


def test_the_sweep_finds_another_commands_option():
    assert options("train") >= {"data", "hellaswag_file", "out_dir"} and "source" not in options("train")
    assert foreign_options("error: x.txt is empty; leave it out of --source", "train") == ["--source"]
    assert foreign_options("error: x is empty; leave it out of --source", "fineweb") == []
    assert foreign_options("error: make them with `python fineweb.py --source a`, or --data=X", "train") == []
    assert foreign_options("error: make them with `python fineweb.py --source a`, or --source", "train") != []
    assert foreign_options("error: HellaSwag missing: pass --data FILE.jsonl", "train") == []  # the trainer's --data
    assert foreign_options("error: cannot load HellaSwag: pass --data FILE.jsonl", "sample") == ["--data"]


@pytest.mark.parametrize("family, script, argv, names", CASES,
                         ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_bad_input_is_one_line_naming_it(family, script, argv, names, paths, tmp_path, capsys):
    paths = {**paths, "out": str(tmp_path / "out")}
    argv = [a.format(**paths) for a in argv]
    code = SCRIPTS[script](argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert code == 2, (argv, out, err)
    assert names.format(**paths) in one_line(err), (argv, err)
    assert not foreign_options(one_line(err), script, argv), (argv, err)


def test_the_trainers_hellaswag_download_error_names_its_own_option(paths, tmp_path, monkeypatch, capsys):
    """Offline, no cached split: the trainer's error says --hellaswag_file (its --data is the training text)."""
    def offline(url, timeout):
        raise hellaswag.urllib.error.URLError("Name or service not known")
    monkeypatch.setattr(hellaswag.urllib.request, "urlopen", offline)
    monkeypatch.setattr(hellaswag, "load_examples", functools.partial(hellaswag.load_examples,
                                                                      data_dir=str(tmp_path / "cache")))
    assert train_gpt2.main(tiny_args(paths["data"], str(tmp_path / "out"), hellaswag_interval=1,
                                     vocab_size=50304)) == 2
    line = one_line(capsys.readouterr().err)
    assert "could not download" in line and "--hellaswag_file=FILE.jsonl" in line, line
    assert not foreign_options(line, "train"), line


def test_the_table_covers_every_script_and_family():
    assert len(CASES) >= 40
    assert {c[1] for c in CASES} == set(SCRIPTS)
    assert {c[0] for c in CASES} == {"missing", "file/folder", "corrupt", "value", "name", "contradiction"}

# -----------------------------------------------------------------------------
# the real entry points: `python script.py ...`, as a user or a scheduler runs them


@pytest.mark.parametrize("script, argv, names", [
    ("train_gpt2.py", tiny_args("{shards_garbage}", "{d}/out_sub"), "{shards_garbage}/toy_val_000000.npy"),
    ("fineweb.py", ["--source", "{doc_txt}", "--shard_size", "lots"], "--shard_size"),
    ("plot.py", ["{missing}"], "{missing}"),
    ("export.py", ["{text_pt}", "{d}/hf_sub"], "{text_pt}"),
])
def test_entry_point_exits_2_with_one_line(script, argv, names, paths):
    argv = [a.format(**paths) for a in argv]
    r = subprocess.run([sys.executable, os.path.join(ROOT, script), *argv], cwd=paths["d"], capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert "Traceback" not in r.stdout + r.stderr
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and names.format(**paths) in one_line(r.stderr)


def test_nothing_is_written_on_bad_input(paths, capsys):
    """A refused command leaves no trace: no out_dir, no shards, no export."""
    d = paths["d"]
    assert train_gpt2.main(tiny_args(paths["shards_garbage"], os.path.join(d, "out_none"))) == 2
    assert fineweb.main(["--source", paths["empty_txt"], "--out_dir", os.path.join(d, "fw_none")]) == 2
    assert export_py.main([paths["text_pt"], os.path.join(d, "hf_none")]) == 2
    capsys.readouterr()
    assert not {"out_none", "fw_none", "hf_none"} & set(os.listdir(d))
