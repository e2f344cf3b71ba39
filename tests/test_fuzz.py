"""The parsers that read what users hand us, fuzzed with hypothesis: arbitrary strings and bytes are
either accepted or refused with our one error type (fileio.UserError, one line), never anything else;
and valid input, drawn beside the hostile input, is always accepted and read as written (a parser that
refused everything would pass the hostile half alone).

    the --key=value and config-file parser   config.parse_args / read_config_file
    the HellaSwag row loader                 hellaswag.parse_row / load_examples
    the shard loader                         data.TokenLoader (load_shard)
    the checkpoint loader                    model.read_checkpoint / GPT.from_checkpoint
    fineweb.py's manifest                    shards.verify (load_manifest)

Bounded (max_examples 60-80, no deadline) so that the suite stays fast: ~20 s on 2 cores.
"""
import glob
import hashlib
import io
import json
import os
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from gpt2train import shards
from gpt2train import config
import hellaswag
from conftest import ROOT, make_rows, write_shards
from gpt2train.data import Sampling, TokenLoader
from gpt2train.fileio import UserError
from model import GPT, GPTConfig
from gpt2train.checkpoint import read_checkpoint
from gpt2train.tokenizer import get_encoding

FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def accepted_or_user_error(fn, *args):
    """fn(*args), or None when it raised UserError with a message of one line; anything else raised fails the test."""
    try:
        return fn(*args)
    except UserError as e:
        message = str(e).strip()
        assert len(message.splitlines()) == 1, f"not a one-line message: {message!r}"
        return None


def accepted(fn, *args):
    """fn(*args) on input built to be valid: a refusal fails the test, naming what it said."""
    try:
        return fn(*args)
    except UserError as e:
        raise AssertionError(f"valid input refused: {e}") from None

# -----------------------------------------------------------------------------
# the trainer's config: --key=value arguments and config files

KEYS = sorted(config.FIELDS)
key = st.one_of(st.sampled_from(KEYS), st.text(max_size=12))
value_text = st.one_of(st.text(max_size=20), st.sampled_from(["0", "-1", "1e999", "nan", "inf", "-inf", "auto", "true",
                                                              "yes", "1.5", "0x10", "1_000", "9" * 5000, ""]))
argument = st.one_of(st.builds(lambda k, v: f"--{k}={v}", key, value_text), st.builds(lambda k: f"--{k}", key),
                     st.text(max_size=20))


@FUZZ
@given(argv=st.lists(argument, max_size=5))
@example(argv=["--n_layer=1\n2"])  # the user's line break, quoted: the message stays one line
@example(argv=["--max_steps\u2028"])
def test_command_line_is_parsed_or_refused(argv, tmp_path_factory, monkeypatch):
    monkeypatch.chdir(tmp_path_factory.getbasetemp())  # a bare word is a config file path: none of ours
    result = accepted_or_user_error(config.parse_args, argv)
    if result is not None:
        cfg, given_keys = result
        assert set(given_keys) <= set(config.FIELDS)
        assert isinstance(cfg, config.Config)


python_value = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=10)),
                            lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                    st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                            max_leaves=5)
assignment = st.builds(lambda k, v: f"{k} = {v!r}",
                       st.one_of(st.sampled_from(KEYS), st.from_regex(r"[a-z_]{1,8}", fullmatch=True)), python_value)
config_text = st.one_of(st.lists(assignment, max_size=4).map("\n".join), st.text(max_size=80))


@FUZZ
@given(text=config_text)
@example(text="raise ValueError('one line\\nand another')")
def test_config_file_is_read_or_refused(text, tmp_path_factory):
    path = os.path.join(tempfile.mkdtemp(dir=tmp_path_factory.getbasetemp()), "config.py")
    with open(path, "w", encoding="utf-8", errors="surrogatepass") as f:
        f.write(text)
    accepted_or_user_error(config.parse_args, [path])


@FUZZ
@given(data=st.binary(max_size=200))
def test_config_file_of_bytes_is_read_or_refused(data, tmp_path_factory):
    path = os.path.join(tempfile.mkdtemp(dir=tmp_path_factory.getbasetemp()), "config.py")
    with open(path, "wb") as f:
        f.write(data)
    accepted_or_user_error(config.parse_args, [path])


# valid: every key at its default, each choice of a key that has choices, and values a user writes
VALID = [(k, f.default) for k, f in config.FIELDS.items()] + [(k, c) for k, cs in config.CHOICES.items() for c in cs]
VALID += [("n_layer", 1), ("n_layer", 48), ("max_steps", 10), ("micro_batch_size", 8), ("micro_batch_size", "auto"),
          ("max_lr", 1e-3), ("max_lr", 1), ("min_lr", 0.0), ("min_lr", 1e-5), ("cooldown_frac", 1.0),
          ("muon_momentum", 0), ("shuffle", False), ("fsdp", True), ("resume", True), ("seed", 0),
          ("time_limit", 0.5), ("out_dir", "runs/my run"), ("data", "my_book.txt"), ("init_from", "gpt2-medium")]
CONFIG_FILES = sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))
assert len(CONFIG_FILES) >= 5  # the repository's own: each must be read


def cli_text(value):
    return str(value).lower() if isinstance(value, bool) else str(value)


def as_parsed(key, value):
    """What Config holds for a valid value of key."""
    if key == "resume" and isinstance(value, bool):
        return cli_text(value)
    if config.FIELDS[key].type is float and isinstance(value, int):
        return float(value)
    return value


def contradicts(values):
    """Valid values that config.validate refuses together: CUDA graphs' fixed memory and FSDP's gathers."""
    return values.get("fsdp") is True and values.get("compile_mode") == "reduce-overhead"


def assert_holds(cfg, pairs):
    """cfg holds the last value given for each key (later ones override earlier ones)."""
    for key, value in dict(pairs).items():
        assert getattr(cfg, key) == as_parsed(key, value), (key, value, getattr(cfg, key))


@FUZZ
@given(pairs=st.lists(st.sampled_from(VALID), max_size=6), in_file=st.lists(st.sampled_from(VALID), max_size=6))
def test_valid_command_lines_and_config_files_are_accepted(pairs, in_file, tmp_path_factory, monkeypatch):
    assume(not contradicts(dict(pairs)) and not contradicts(dict(in_file + pairs)))
    monkeypatch.chdir(tmp_path_factory.getbasetemp())
    argv = [f"--{k}={cli_text(v)}" for k, v in pairs]
    cfg, given_keys = accepted(config.parse_args, argv)
    assert_holds(cfg, pairs)
    assert given_keys == {k: "cli" for k, _ in pairs}
    path = os.path.join(tempfile.mkdtemp(dir=tmp_path_factory.getbasetemp()), "config.py")
    with open(path, "w") as f:
        f.write("import math  # a comment\n_private = 1\n" + "".join(f"{k} = {v!r}\n" for k, v in in_file))
    cfg, given_keys = accepted(config.parse_args, [path, *argv])  # the file, then the flags over it
    assert_holds(cfg, in_file + pairs)
    assert given_keys == {**{k: path for k, _ in in_file}, **{k: "cli" for k, _ in pairs}}


@pytest.mark.parametrize("path", CONFIG_FILES, ids=os.path.basename)
def test_the_repositorys_config_files_are_accepted(path):
    cfg, given_keys = accepted(config.parse_args, [path])
    assert given_keys and set(given_keys.values()) == {path}

# -----------------------------------------------------------------------------
# HellaSwag rows

json_value = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                                    st.text(max_size=10)),
                          lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                  st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                          max_leaves=8)
endings = json_value | st.lists(st.text(max_size=10), min_size=3, max_size=5)
row = st.fixed_dictionaries({}, optional={"ctx": json_value | st.text(max_size=30),
                                          "label": json_value | st.sampled_from([0, 3, "2", " 1", "²"]),
                                          "endings": endings})
line = st.one_of(row.map(json.dumps), json_value.map(json.dumps), st.text(max_size=60), st.just("[" * 100000))


@FUZZ
@given(line=line)
def test_hellaswag_row_is_parsed_or_refused(line):
    ex = accepted_or_user_error(hellaswag.parse_row, line, "row 1", get_encoding())
    if ex is not None:
        assert ex["label"] in (0, 1, 2, 3) and len(ex["ending_tokens"]) == 4 and ex["ctx_tokens"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(st.binary(max_size=300),
                      st.lists(line, max_size=4).map(lambda ls: "\n".join(ls).encode("utf-8", "surrogatepass"))))
def test_hellaswag_file_is_loaded_or_refused(data, tmp_path_factory):
    path = os.path.join(tempfile.mkdtemp(dir=tmp_path_factory.getbasetemp()), "rows.jsonl")
    with open(path, "wb") as f:
        f.write(data)
    accepted_or_user_error(hellaswag.load_examples, "val", path)


# valid: a context with a word in it, four endings, a label 0..3 (as the Hugging Face copy's "0".."3" too), and
# whatever other fields the dataset's rows carry
words = st.text(min_size=1, max_size=30).filter(str.strip)
valid_row = st.fixed_dictionaries({"ctx": words, "endings": st.lists(words, min_size=4, max_size=4),
                                   "label": st.sampled_from([0, 1, 2, 3, "0", "1", "2", "3"])},
                                  optional={"ind": st.integers(), "split": st.sampled_from(["val", "train"]),
                                            "activity_label": st.text(max_size=10), "ctx_a": st.text(max_size=10)})
ROWS = make_rows(3)  # rows as HellaSwag writes them


@FUZZ
@given(row=valid_row, ascii_only=st.booleans())
@example(row=ROWS[0], ascii_only=True)
def test_valid_hellaswag_rows_are_parsed_as_written(row, ascii_only):
    enc = get_encoding()
    ex = accepted(hellaswag.parse_row, json.dumps(row, ensure_ascii=ascii_only), "row 1", enc)
    assert ex["label"] == int(row["label"]) and ex["ctx_tokens"] == enc.encode_ordinary(row["ctx"])
    assert ex["ending_tokens"] == [enc.encode_ordinary(" " + e) for e in row["endings"]]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(valid_row, min_size=1, max_size=4), newline=st.sampled_from(["\n", "\r\n", "\n\n"]),
       last=st.sampled_from(["", "\n"]))
@example(rows=ROWS, newline="\n", last="\n")
def test_valid_hellaswag_files_are_loaded_whole(rows, newline, last, tmp_path_factory):
    path = os.path.join(tempfile.mkdtemp(dir=tmp_path_factory.getbasetemp()), "rows.jsonl")
    with open(path, "wb") as f:
        f.write((newline.join(json.dumps(r, ensure_ascii=False) for r in rows) + last).encode("utf-8"))
    examples = accepted(hellaswag.load_examples, "val", path)
    assert [(e["index"], e["label"]) for e in examples] == [(i, int(r["label"])) for i, r in enumerate(rows)]

# -----------------------------------------------------------------------------
# token shards: the trainer's loader over a data_dir whose val shard is anything


@pytest.fixture(scope="module")
def good_shards(tmp_path_factory):
    return write_shards(str(tmp_path_factory.mktemp("fuzz_shards")))


def npy_bytes(array):
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


arrays = hnp.arrays(st.sampled_from([np.dtype(t) for t in ("<u2", ">u2", "<i4", "u1", "<f4", "<i8")]),
                    hnp.array_shapes(min_dims=0, max_dims=2, max_side=40))
shard_bytes = st.one_of(st.binary(max_size=200), arrays.map(npy_bytes),
                        st.tuples(arrays.map(npy_bytes), st.integers(0, 400)).map(lambda t: t[0][:t[1]]),  # truncated
                        st.lists(st.integers(0, 2**16 - 1), max_size=800).map(
                            lambda v: npy_bytes(np.array(v, np.uint16))))


@FUZZ
@given(data=shard_bytes)
def test_shard_is_loaded_or_refused(data, good_shards, tmp_path_factory):
    d = tempfile.mkdtemp(dir=tmp_path_factory.getbasetemp())
    with open(os.path.join(d, "toy_val_000000.npy"), "wb") as f:
        f.write(data)
    loader = accepted_or_user_error(TokenLoader, d, "val", 2, 16, Sampling(), 64)
    if loader is not None:
        for _ in range(3):
            if accepted_or_user_error(loader.next_batch) is None:
                break



@FUZZ
@given(tokens=st.lists(st.integers(0, 63), min_size=2 * 16 + 1, max_size=400),
       version=st.sampled_from([None, (1, 0), (2, 0), (3, 0)]))
def test_valid_shards_are_loaded_and_read_as_written(tokens, version, tmp_path_factory):
    """Any 1-D uint16 .npy of token ids below vocab_size, with any of numpy's header versions (np.save's own
    by default), holding at least one micro-batch of rows: every batch's rows are windows of those tokens."""
    d = tempfile.mkdtemp(dir=tmp_path_factory.getbasetemp())
    array = np.array(tokens, dtype=np.uint16)
    with open(os.path.join(d, "toy_val_000000.npy"), "wb") as f:
        np.save(f, array) if version is None else np.lib.format.write_array(f, array, version=version)
    loader = accepted(TokenLoader, d, "val", 2, 16, Sampling(), 64)
    rows = {tuple(tokens[j * 16:j * 16 + 17]) for j in range((len(tokens) - 1) // 16)}
    for _ in range(3):
        x, y = accepted(loader.next_batch)
        assert x.shape == y.shape == (2, 16)
        assert all(tuple(xi) + (yi[-1],) in rows and xi[1:] == yi[:-1] for xi, yi in zip(x.tolist(), y.tolist()))

# -----------------------------------------------------------------------------
# checkpoints: bytes, a real one cut or with bytes flipped, dicts of anything


@pytest.fixture(scope="module")
def real_checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    config = GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=2, n_embd=8)
    path = str(tmp_path_factory.mktemp("fuzz_ckpt") / "ckpt_000001.pt")
    torch.save({"model": GPT(config).state_dict(), "model_args": vars(config), "step": 1}, path)
    return open(path, "rb").read()


def load_model(data, base):
    path = os.path.join(tempfile.mkdtemp(dir=base), "ckpt.pt")
    with open(path, "wb") as f:
        f.write(data)
    return accepted_or_user_error(GPT.from_checkpoint, path)


@FUZZ
@given(cut=st.integers(0, 10**6), flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), max_size=3),
       junk=st.binary(max_size=64), kind=st.sampled_from(["cut", "flip", "junk"]))
def test_checkpoint_bytes_are_loaded_or_refused(cut, flips, junk, kind, real_checkpoint, tmp_path_factory):
    data = bytearray(real_checkpoint)
    if kind == "cut":
        data = data[:cut % len(data)]
    elif kind == "flip":
        for at, x in flips:
            data[at % len(data)] ^= x
    else:
        data = junk
    model = load_model(bytes(data), tmp_path_factory.getbasetemp())
    assert model is None or isinstance(model, GPT)


def saved(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


some_value = st.one_of(st.sampled_from([0, 1, 2, 3, 5, 8, 16, 64, -1, 4096]), st.booleans(), st.floats(0, 8),
                       st.text(max_size=3), st.none())
ARG_KEYS = ["block_size", "vocab_size", "n_layer", "n_head", "n_embd", "ce_chunk_rows", "attn_impl", "loss_impl",
            "activation_checkpointing", "bogus"]


@FUZZ
@given(args=st.dictionaries(st.sampled_from(ARG_KEYS), some_value, max_size=2),
       drop=st.sets(st.integers(0, 20), max_size=2),
       shapes=st.dictionaries(st.integers(0, 20), st.lists(st.integers(0, 9), max_size=2), max_size=2))
def test_checkpoint_with_changed_contents_is_loaded_or_refused(args, drop, shapes, real_checkpoint, tmp_path_factory):
    """A real checkpoint with model_args values replaced, weights dropped or reshaped."""
    ckpt = torch.load(io.BytesIO(real_checkpoint), weights_only=True)
    ckpt["model_args"].update(args)
    names = sorted(ckpt["model"])
    for i in drop:
        ckpt["model"].pop(names[i % len(names)], None)
    for i, shape in shapes.items():
        ckpt["model"][names[i % len(names)]] = torch.zeros(shape)
    model = load_model(saved(ckpt), tmp_path_factory.getbasetemp())
    assert model is None or isinstance(model, GPT)


anything = st.recursive(some_value | st.lists(st.integers(0, 4), max_size=2).map(torch.zeros),
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                            st.sampled_from(["model", "model_args", "step"] + ARG_KEYS), inner, max_size=4),
                        max_leaves=8)


@FUZZ
@given(ckpt=anything)
def test_checkpoint_of_any_contents_is_loaded_or_refused(ckpt, tmp_path_factory):
    model = load_model(saved(ckpt), tmp_path_factory.getbasetemp())
    assert model is None or isinstance(model, GPT)


def test_the_real_checkpoint_is_accepted(real_checkpoint, tmp_path):
    """The fuzzed loaders are not simply refusing everything."""
    assert isinstance(load_model(real_checkpoint, str(tmp_path)), GPT)
    path = tmp_path / "ckpt.pt"
    path.write_bytes(real_checkpoint)
    assert read_checkpoint(str(path))["step"] == 1

# -----------------------------------------------------------------------------
# fineweb.py's manifest.json


shard_entry = st.fixed_dictionaries({"name": st.text(max_size=8), "tokens": json_value, "sha256": json_value,
                                     "next": json_value})
shard_list = st.lists(json_value | shard_entry, max_size=3)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(manifest=st.one_of(json_value, st.fixed_dictionaries({"tokenizer": json_value, "settings": json_value,
                                                             "shards": shard_list})),
       raw=st.binary(max_size=50), use_raw=st.booleans())
@example(manifest={"tokenizer": "gpt2", "settings": {}, "shards": [{"name": "a\nb", "tokens": 1, "sha256": "0",
                                                                    "next": [0, 0]}]}, raw=b"", use_raw=False)
def test_manifest_is_read_or_refused(manifest, raw, use_raw, tmp_path_factory, capsys):
    d = tempfile.mkdtemp(dir=tmp_path_factory.getbasetemp())
    with open(os.path.join(d, shards.MANIFEST), "wb") as f:
        f.write(raw if use_raw else json.dumps(manifest).encode())
    accepted_or_user_error(shards.verify, d)
    capsys.readouterr()



@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shard_tokens=st.lists(st.lists(st.integers(0, 2**16 - 1), max_size=50), min_size=1, max_size=3),
       tokenizer=json_value, run_settings=st.dictionaries(st.text(max_size=6), json_value, max_size=3),
       nexts=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)), min_size=3, max_size=3),
       complete=st.sampled_from([True, False, None]))
def test_valid_manifests_verify(shard_tokens, tokenizer, run_settings, nexts, complete, tmp_path_factory, capsys):
    """A folder of shards and a manifest listing each with its token count and sha256, as fineweb.py writes
    them (hashed here with hashlib): verified, the count and state said."""
    d = tempfile.mkdtemp(dir=tmp_path_factory.getbasetemp())
    entries = []
    for i, tokens in enumerate(shard_tokens):
        name = f"edu_{'val' if i == 0 else 'train'}_{i:06d}.npy"
        np.save(os.path.join(d, name), np.array(tokens, dtype=np.uint16))
        sha = hashlib.sha256(open(os.path.join(d, name), "rb").read()).hexdigest()
        entries.append({"name": name, "tokens": len(tokens), "sha256": sha, "next": list(nexts[i]),
                        "split": "val" if i == 0 else "train"})
    manifest = {"tokenizer": tokenizer, "settings": run_settings, "shards": entries}
    if complete is not None:
        manifest["complete"] = complete
    with open(os.path.join(d, shards.MANIFEST), "w") as f:
        json.dump(manifest, f)
    capsys.readouterr()
    accepted(shards.verify, d)
    state = "complete" if complete else "INCOMPLETE"
    total = sum(map(len, shard_tokens))
    assert capsys.readouterr().out.startswith(f"ok: {len(entries)} shards, {total:,} tokens match {shards.MANIFEST}; "
                                              f"the run is {state}")
