"""python export.py SRC OUT.gguf, checked by readers we did not write: transformers loads the file
(from_pretrained(gguf_file=...), dequantized to torch) and continues prompts as sample.py does, and the
gguf package's GGUFReader lists exactly what llama.cpp's gpt2 loader reads. That list is taken from
llama.cpp's source (repository ggml-org/llama.cpp):
- src/llama-model.cpp, llama_model::load_hparams: the general keys (context_length, embedding_length,
  block_count required; feed_forward_length, attention.head_count; general.name) and the LLM_ARCH_GPT2
  case (attention.layer_norm_epsilon, required);
- src/models/gpt2.cpp, load_arch_tensors (load_tensors' LLM_ARCH_GPT2 case in older src/llama-model.cpp):
  every tensor and its ggml shape; output.weight is optional, token_embd stands in for it;
- src/llama-arch.cpp: the names ("token_embd", "position_embd", "output_norm", "blk.%d.attn_qkv", ...);
- src/llama-vocab.cpp, llama_vocab::impl::load: tokenizer.ggml.model "gpt2" needs tokenizer.ggml.merges
  and tokenizer.ggml.tokens; tokenizer.ggml.pre "gpt-2" (missing: "GENERATION QUALITY WILL BE DEGRADED");
  token_type, bos/eos ids optional (a BPE vocabulary's default BOS/EOS is id 11, hence written);
- src/llama-model-loader.cpp: general.architecture, and general.file_type (optional);
- convert_hf_to_gguf.py, GPT2Model: Hugging Face's Conv1D weights are transposed, i.e. stored as
  (out, in) like our nn.Linear; the position embedding stays F32 (gguf-py/gguf/constants.py: the names).
The checkpoints are tiny runs of train_gpt2.py (AdamW and Muon) with GPT-2's padded 50304 vocabulary."""
import contextlib
import copy
import io
import os
import sys

import pytest
import torch

from gpt2train import checkpoint
import export as export_py
import sample
from conftest import cpu_plan, one_line, random_model, save_ckpt, tiny_args
from model import GPT, GPTConfig
from gpt2train.tokenizer import EOT, get_encoding
from train_gpt2 import main as train

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers reads .gguf files only with it

PROMPTS = ["Hello, I'm a language model,", "def main():", "The meaning of life is", " 1 2 3 4"]
# max |logit difference| from our fp32 model over PROMPTS, all 50257 logits at every position; measured on
# both runs: f32 3.6e-7, f16 3.5e-4, q8_0 7.4e-3 (the logits themselves reach 1.8)
TOLERANCE = {"f32": 1e-5, "f16": 2e-3, "q8_0": 3e-2}
KEYS = {  # what we write: each read by llama.cpp's gpt2 loader (see above)
    "general.architecture", "general.name", "general.file_type",
    "gpt2.context_length", "gpt2.embedding_length", "gpt2.block_count", "gpt2.feed_forward_length",
    "gpt2.attention.head_count", "gpt2.attention.layer_norm_epsilon",
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"}


def llama_cpp_gpt2_tensors(n_layer, n_embd, n_ctx, n_vocab=50257):
    """{name: ggml shape (ne0, ne1)} as llama.cpp's gpt2 load_arch_tensors creates them (n_ff = 4 n_embd)."""
    n_ff = 4 * n_embd
    t = {"token_embd.weight": (n_embd, n_vocab), "position_embd.weight": (n_embd, n_ctx),
         "output_norm.weight": (n_embd,), "output_norm.bias": (n_embd,)}
    for i in range(n_layer):
        t.update({f"blk.{i}.{k}": v for k, v in {
            "attn_norm.weight": (n_embd,), "attn_norm.bias": (n_embd,),
            "attn_qkv.weight": (n_embd, 3 * n_embd), "attn_qkv.bias": (3 * n_embd,),
            "attn_output.weight": (n_embd, n_embd), "attn_output.bias": (n_embd,),
            "ffn_norm.weight": (n_embd,), "ffn_norm.bias": (n_embd,),
            "ffn_down.weight": (n_ff, n_embd), "ffn_down.bias": (n_embd,),
            "ffn_up.weight": (n_embd, n_ff), "ffn_up.bias": (n_ff,)}.items()})
    return t


def quiet(fn, *args):
    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*args)


@pytest.fixture(scope="module")
def runs(data_dir, tmp_path_factory):
    """Two tiny trained runs with GPT-2's padded vocabulary, AdamW and Muon, and their .gguf exports
    (from the run folder: its newest checkpoint): {optimizer: (run folder, {type: path})}."""
    d = tmp_path_factory.mktemp("gguf")
    out = {}
    for opt, types, steps in (("adamw", ("f32", "f16", "q8_0"), 8), ("muon", ("f32",), 2)):
        run = str(d / opt)
        assert quiet(train, tiny_args(data_dir, run, vocab_size=50304, n_layer=2, max_steps=steps, eval_interval=0,
                                      checkpoint_interval=0, optimizer=opt)) == 0
        files = {t: str(d / f"{opt}_{t}.gguf") for t in types}
        for t, path in files.items():
            assert quiet(export_py.main, [run, path, "--type", t]) == 0
        out[opt] = (run, files)
    return out


def read_gguf(path):
    """(keys {name: value}, tensors {name: (ggml type name, shape, bytes)}) as gguf's GGUFReader lists them."""
    r = gguf.GGUFReader(path)
    keys = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    return keys, {t.name: (t.tensor_type.name, tuple(int(n) for n in t.shape), int(t.n_bytes)) for t in r.tensors}


@pytest.fixture(scope="module")
def listed(runs):
    return {t: read_gguf(path) for t, path in runs["adamw"][1].items()}


def load_hf(path, config=None):
    """transformers' GPT2LMHeadModel from a .gguf file (each read parses the file's 100k tokenizer strings:
    seconds). n_positions: transformers 5 maps gpt2.context_length to `n_ctx`, which GPT2Config does not
    read (its wpe would get 1024 rows); our context is 32. config: another file's, its metadata not re-read."""
    from transformers import AutoModelForCausalLM
    kw = {"n_positions": 32}
    if config is not None:
        kw = {"config": copy.deepcopy(config)}
        del kw["config"].quantization_config  # set by the first read, refused by a second
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), **kw).eval()


@pytest.fixture(scope="module")
def hf_f32(runs):
    return load_hf(runs["adamw"][1]["f32"])


def newest_model(run):
    return GPT.load(checkpoint.newest_checkpoint(run)).eval()


def max_logit_diff(ours, hf):
    enc, worst = get_encoding(), 0.0
    for p in PROMPTS:
        idx = torch.tensor([enc.encode_ordinary(p)])
        with torch.no_grad():
            worst = max(worst, (ours(idx)[0][..., :50257] - hf(idx).logits).abs().max().item())
    return worst


def assert_greedy_equals_sample_py(ours, hf, n=16):
    """hf.generate(do_sample=False) continues each prompt with the tokens sample.py's loop picks; the
    distinct tokens of those continuations."""
    enc, seen = get_encoding(), set()
    for p in PROMPTS:
        ids = enc.encode_ordinary(p)
        mine = list(sample.generate_tokens(ours, ids, n, cpu_plan(torch.float32), temperature=0.0))
        theirs = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=EOT,
                             pad_token_id=EOT)[0, len(ids):].tolist()
        assert theirs == mine, p
        seen |= set(mine)
    return seen


def test_reader_lists_what_llama_cpp_gpt2_loads(listed):
    n_layer, n_embd, n_ctx = 2, 32, 32
    expected = llama_cpp_gpt2_tensors(n_layer, n_embd, n_ctx)
    for t, (keys, tensors) in listed.items():
        assert set(keys) == KEYS, t
        assert {k: v[1] for k, v in tensors.items()} == expected, t  # names and ggml shapes, no output.weight
        assert keys["general.architecture"] == "gpt2" and keys["general.file_type"] == {"f32": 0, "f16": 1,
                                                                                        "q8_0": 7}[t]
        matrices = {k for k, v in expected.items() if len(v) == 2 and k != "position_embd.weight"}
        assert {k for k, v in tensors.items() if v[0] != "F32"} == (set() if t == "f32" else matrices)
        assert {v[0] for k, v in tensors.items() if k in matrices} == {t.upper()}
    keys = listed["q8_0"][0]
    assert (keys["gpt2.context_length"], keys["gpt2.embedding_length"], keys["gpt2.block_count"],
            keys["gpt2.feed_forward_length"], keys["gpt2.attention.head_count"]) == (n_ctx, n_embd, n_layer, 128, 2)
    assert abs(keys["gpt2.attention.layer_norm_epsilon"] - 1e-5) < 1e-10
    assert all(listed[t][0][k] == keys[k] for t in listed for k in KEYS - {"general.file_type", "general.name"})


def test_tokenizer_is_gpt2s(listed):
    keys = listed["f32"][0]
    enc = get_encoding()
    assert (keys["tokenizer.ggml.model"], keys["tokenizer.ggml.pre"]) == ("gpt2", "gpt-2")
    assert keys["tokenizer.ggml.bos_token_id"] == keys["tokenizer.ggml.eos_token_id"] == EOT
    types = keys["tokenizer.ggml.token_type"]
    assert len(types) == 50257 and types[EOT] == gguf.TokenType.CONTROL
    assert set(types[:EOT]) == {gguf.TokenType.NORMAL}
    tokens, merges = keys["tokenizer.ggml.tokens"], keys["tokenizer.ggml.merges"]
    assert len(tokens) == 50257 and len(merges) == 50000 and tokens[EOT] == "<|endoftext|>"
    # GPT-2's byte-level alphabet: printable bytes as themselves, the others shifted past U+0100
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    char = dict(zip(printable, map(chr, printable)))
    char.update({b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in char)})
    byte = {c: b for b, c in char.items()}
    as_bytes = lambda s: bytes(byte[c] for c in s)  # noqa: E731
    assert all(as_bytes(tokens[i]) == enc.decode_single_token_bytes(i) for i in range(EOT))
    # merge i joins two tokens into token 256 + i (GPT-2's ids after the 256 bytes), in rank order
    pairs = [m.split(" ") for m in merges]
    assert all(len(p) == 2 and as_bytes(p[0] + p[1]) == enc.decode_single_token_bytes(256 + i)
               for i, p in enumerate(pairs))


def test_f32_greedy_equals_sample_py_and_logits_agree(runs, hf_f32, capsys):
    run, hf = runs["adamw"][0], hf_f32
    ours = newest_model(run)
    assert max_logit_diff(ours, hf) < TOLERANCE["f32"]
    assert len(assert_greedy_equals_sample_py(ours, hf)) > 5  # continuations, not one token repeated
    # sample.py itself, from the run folder: the text of transformers' continuation, decoded by tiktoken
    ids = get_encoding().encode_ordinary(PROMPTS[0])
    cont = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=EOT)[0, len(ids):]
    capsys.readouterr()
    assert sample.main(["--model", run, "--prompt", PROMPTS[0], "--temperature", "0", "--max_new_tokens", "12",
                        "--device", "cpu", "--precision", "fp32"]) == 0
    assert capsys.readouterr().out == PROMPTS[0] + get_encoding().decode(cont.tolist()) + "\n"


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
def test_f16_and_q8_0_logits_agree_within_tolerance(runs, hf_f32, kind):
    run, files = runs["adamw"]
    diff = max_logit_diff(newest_model(run), load_hf(files[kind], hf_f32.config))  # the same metadata (above)
    assert TOLERANCE["f32"] < diff < TOLERANCE[kind]  # rounded, but not more than measured


def test_muon_checkpoint_exports_and_loads_the_same_way(runs, hf_f32):
    run, files = runs["muon"]
    ours, hf = newest_model(run), load_hf(files["f32"], hf_f32.config)  # the same shape as the AdamW run
    assert max_logit_diff(ours, hf) < TOLERANCE["f32"]  # every logit: 2 Muon steps repeat a token or two
    assert_greedy_equals_sample_py(ours, hf)


def test_sources_checkpoint_run_folder_and_save_pretrained_dir(runs, hf_dir, tmp_path):
    """A run folder exports its newest checkpoint; a save_pretrained directory goes through GPT.load like
    a checkpoint of the same weights: the files are byte for byte the same."""
    run, _ = runs["adamw"]
    ckpt = save_ckpt(GPT.load(hf_dir), tmp_path / "hf.pt")
    for a, b in [(run, checkpoint.newest_checkpoint(run)), (hf_dir, ckpt)]:
        files = [str(tmp_path / name / "m.gguf") for name in ("a", "b")]  # the same file name: general.name
        for src, out in zip((a, b), files):
            assert quiet(export_py.main, [src, out, "--type", "q8_0"]) == 0  # (it makes the folder)
        assert open(files[0], "rb").read() == open(files[1], "rb").read()


def test_q8_0_is_smaller_than_f32_by_34_bytes_per_32_weights(tmp_path):
    """The quickstart's shape (configs/quickstart.py), random init: every matrix but the position embedding
    goes from 4 bytes a weight to 34 per block of 32 (3.76x); the rest (header, the ~1.8 MB tokenizer,
    f32 vectors and position embedding) is the same in both files. Measured: f32 15,468,480 bytes, q8_0
    5,442,656 (2.84x for the whole file)."""
    from gpt2train.gguf_export import write_gguf
    torch.manual_seed(0)
    m = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=64, block_size=128, vocab_size=50304))
    f32, q8 = write_gguf(m, str(tmp_path / "a.gguf"), "f32"), write_gguf(m, str(tmp_path / "b.gguf"), "q8_0")
    shapes = llama_cpp_gpt2_tensors(4, 64, 128)
    n = sum(a * b for k, (a, b) in ((k, v) for k, v in shapes.items() if len(v) == 2) if k != "position_embd.weight")
    assert n == 50257 * 64 + 4 * 12 * 64 * 64  # token_embd and the blocks' four matrices
    rest = f32 - 4 * n  # what both files hold unchanged
    assert abs((q8 - rest) - 34 * n // 32) <= 32 * len(shapes)  # each tensor's data is aligned to 32 bytes
    assert abs(4 * n / (q8 - rest) - 128 / 34) < 1e-3
    print(f"quickstart shape: f32 {f32:,} bytes, q8_0 {q8:,} bytes ({f32 / q8:.2f}x; {n:,} weights at 128/34)")


def test_bad_input_is_one_line(runs, tmp_path, capsys, monkeypatch):
    small = save_ckpt(random_model(vocab_size=100), tmp_path / "small.pt")
    run, _ = runs["adamw"]
    os.makedirs(tmp_path / "folder.gguf")
    cases = [([small, str(tmp_path / "a.gguf")], "vocab_size 100"),
             ([run, str(tmp_path / "b.gguf"), "--type", "q4_0"], "--type 'q4_0' is not one of"),
             ([run, str(tmp_path / "hf"), "--type=q8_0"], "--type is for a .gguf file"),
             ([run, str(tmp_path / "folder.gguf")], "is a folder")]
    for argv, message in cases:
        assert export_py.main(argv) == 2, argv
        assert message in one_line(capsys.readouterr().err)
    monkeypatch.setitem(sys.modules, "gguf", None)  # as if not installed: `import gguf` raises ImportError
    assert export_py.main([run, str(tmp_path / "c.gguf")]) == 2
    assert "pip install gguf" in one_line(capsys.readouterr().err)
    assert sorted(os.listdir(tmp_path)) == ["folder.gguf", "small.pt"]


def test_written_temp_then_renamed_with_the_umask(runs, tmp_path, capsys, monkeypatch):
    run, _ = runs["adamw"]
    out = tmp_path / "m.gguf"
    old = os.umask(0o027)
    try:
        assert quiet(export_py.main, [run, str(out), "--type", "q8_0"]) == 0
    finally:
        os.umask(old)
    assert (out.stat().st_mode & 0o777) == 0o640
    before = out.read_bytes()

    def full_disk(self, **kw):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", full_disk)
    assert export_py.main([run, str(out), "--type", "f32"]) == 1  # the machine's failure: exit 1
    assert "m.gguf" in one_line(capsys.readouterr().err)
    assert out.read_bytes() == before and os.listdir(tmp_path) == ["m.gguf"]  # the old file, no temp left


def test_help_lists_the_gguf_format(capsys):
    assert export_py.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "export.py SRC OUT.gguf" in out and "f32, f16 (the default) or q8_0" in out and "pip install gguf" in out
