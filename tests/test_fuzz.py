"""The parsers that read what users hand us, fuzzed with hypothesis: arbitrary strings and bytes are
either accepted or refused with our one error type (fileio.UserError, one line), never anything else.

    the --key=value and config-file parser   config.parse_args / read_config_file
    the HellaSwag row loader                 hellaswag.parse_row / load_examples
    the shard loader                         data.TokenLoader (load_shard)
    the checkpoint loader                    model.read_checkpoint / GPT.from_checkpoint
    fineweb.py's manifest                    shards.verify (load_manifest)

Bounded (max_examples 60-80, no deadline) so that the suite stays fast: ~20 s on 2 cores.
"""
import io
import json
import os
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from gpt2train import shards
from gpt2train import config
import hellaswag
from conftest import write_shards
from gpt2train.data import Sampling, TokenLoader
from gpt2train.fileio import UserError
from model import GPT, GPTConfig
from gpt2train.checkpoint import read_checkpoint
from gpt2train.tokenizer import get_encoding

FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def accepted_or_user_error(fn, *args):
    """fn(*args), or None when it raised UserError; anything else raised fails the test."""
    try:
        return fn(*args)
    except UserError as e:
        assert str(e).strip(), "an empty message"
        return None

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
def test_manifest_is_read_or_refused(manifest, raw, use_raw, tmp_path_factory, capsys):
    d = tempfile.mkdtemp(dir=tmp_path_factory.getbasetemp())
    with open(os.path.join(d, shards.MANIFEST), "wb") as f:
        f.write(raw if use_raw else json.dumps(manifest).encode())
    accepted_or_user_error(shards.verify, d)
    capsys.readouterr()
