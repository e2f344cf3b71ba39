import os
import shutil

import pytest

from gpt2train.tokenizer import EOT, TokenizerError, get_encoding, vocab_files, write_hf_tokenizer


def test_known_ids():
    enc = get_encoding()
    assert enc.encode_ordinary("Hello, I'm a language model,") == [15496, 11, 314, 1101, 257, 3303, 2746, 11]
    assert enc.encode("<|endoftext|>", allowed_special={"<|endoftext|>"}) == [EOT] == [enc.eot_token]
    assert enc.n_vocab == 50257


def test_round_trip_unicode():
    enc = get_encoding()
    text = "Grüße, 世界! \n\n  tabs\tand  spaces 12345 don't"
    assert enc.decode(enc.encode_ordinary(text)) == text


def test_altered_file_is_refused(tmp_path):
    bpe, enc_json = vocab_files()
    shutil.copy(bpe, tmp_path / "vocab.bpe")
    shutil.copy(enc_json, tmp_path / "encoder.json")
    with open(tmp_path / "vocab.bpe", "ab") as f:
        f.write(b"x")
    with pytest.raises(TokenizerError, match="altered"):
        get_encoding(str(tmp_path))


def test_missing_file_is_refused(tmp_path):
    with pytest.raises(TokenizerError, match="missing"):
        get_encoding(str(tmp_path))


def test_hf_tokenizer_files_encode_as_tiktoken(tmp_path):
    from transformers import AutoTokenizer
    write_hf_tokenizer(str(tmp_path), model_max_length=256)
    assert sorted(os.listdir(tmp_path)) == ["merges.txt", "special_tokens_map.json", "tokenizer_config.json",
                                            "vocab.json"]
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    enc = get_encoding()
    text = "Grüße, 世界! \n\n  tabs\tand  spaces 12345 don't ,spaces before , punctuation .<|endoftext|>next"
    ids = tok(text)["input_ids"]
    assert ids == enc.encode(text, allowed_special="all") and ids[-2] == EOT
    assert tok.decode(ids) == text  # no clean-up of " ," or " ."
    assert len(tok) == 50257 and tok.eos_token_id == tok.bos_token_id == EOT and tok.model_max_length == 256
