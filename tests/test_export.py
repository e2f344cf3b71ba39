"""python model.py export: a Hugging Face directory that transformers' own loaders, tokenizer and
text-generation pipeline use offline, checked against our model and tiktoken."""
import os

import pytest
import torch

import model as model_py
from conftest import random_model, save_ckpt
from gpt2train.tokenizer import get_encoding

PROMPT = "Hello, I'm a language model,"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    d = tmp_path_factory.mktemp("export")
    m = random_model()
    assert model_py.main(["export", save_ckpt(m, d / "ckpt_000010.pt"), str(d / "hf")]) == 0
    return m, str(d / "hf")


def test_pipeline_greedy_equals_our_generate(exported):
    from transformers import pipeline
    m, out = exported
    enc = get_encoding()
    pipe = pipeline("text-generation", model=out, device="cpu")  # model and tokenizer, both from out
    ids = pipe(PROMPT, max_new_tokens=24, do_sample=False, return_tensors=True)[0]["generated_token_ids"]
    text = pipe(PROMPT, max_new_tokens=24, do_sample=False)[0]["generated_text"]
    ours = m.generate(torch.tensor([enc.encode_ordinary(PROMPT)]), 24, temperature=0)[0].tolist()
    assert len(set(ours[8:])) > 5  # a real continuation, not one token repeated
    assert list(ids) == ours
    assert text == enc.decode(ours)


def test_auto_classes_load_the_export(exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    m, out = exported
    tok = AutoTokenizer.from_pretrained(out)
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert len(tok) == 50257 and tok.eos_token_id == 50256 and tok.model_max_length == m.config.block_size
    idx = tok(PROMPT, return_tensors="pt")["input_ids"]
    assert idx.tolist() == [get_encoding().encode_ordinary(PROMPT)]
    with torch.no_grad():
        ours, _ = m(idx)
        ref = hf(idx).logits
    assert (ours[..., :50257] - ref).abs().max().item() < 1e-4


def test_export_replaces_a_previous_export_but_not_a_run_dir(tmp_path, capsys):
    ckpt = save_ckpt(random_model(seed=1), tmp_path / "ckpt_000020.pt")
    out = tmp_path / "hf"
    assert model_py.main(["export", ckpt, str(out)]) == 0
    assert model_py.main(["export", ckpt, str(out)]) == 0  # over its own earlier export: fine
    assert sorted(os.listdir(tmp_path)) == ["ckpt_000020.pt", "hf"]  # no temp directory left
    (tmp_path / "log.jsonl").write_text('{"step": 0, "loss": 11.0}\n')
    assert model_py.main(["export", ckpt, str(tmp_path)]) == 2  # a run's out_dir: refused, untouched
    assert "not part of an export" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["ckpt_000020.pt", "hf", "log.jsonl"]


def test_export_refuses_bad_input(tmp_path, capsys):
    small = save_ckpt(random_model(vocab_size=100), tmp_path / "small.pt")
    assert model_py.main(["export", small, str(tmp_path / "a")]) == 2
    assert model_py.main(["export", str(tmp_path / "missing.pt"), str(tmp_path / "b")]) == 2
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    assert model_py.main(["export", str(tmp_path / "junk.pt"), str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") for line in err)
    assert "vocab_size 100" in err[0] and "not found" in err[1] and "not a readable train_gpt2.py checkpoint" in err[2]
    assert sorted(os.listdir(tmp_path)) == ["junk.pt", "small.pt"]


def test_size_table_still_prints(capsys):
    assert model_py.main([]) == 0 and model_py.main(["sizes"]) == 0
    assert capsys.readouterr().out.count("gpt2-xl") == 2
    assert model_py.main(["expor", "a"]) == 2
