"""python export.py: a Hugging Face directory that transformers' own loaders, tokenizer and
text-generation pipeline use offline, checked against our model and tiktoken."""
import os
import subprocess
import sys

import pytest
import torch

import export as export_py
import model as model_py
from conftest import ROOT, random_model, save_ckpt
from gpt2train.tokenizer import get_encoding

PROMPT = "Hello, I'm a language model,"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    d = tmp_path_factory.mktemp("export")
    m = random_model()
    assert export_py.main([save_ckpt(m, d / "ckpt_000010.pt"), str(d / "hf")]) == 0
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
    assert export_py.main([ckpt, str(out)]) == 0
    assert export_py.main([ckpt, str(out)]) == 0  # over its own earlier export: fine
    assert sorted(os.listdir(tmp_path)) == ["ckpt_000020.pt", "hf"]  # no temp directory left
    (tmp_path / "log.jsonl").write_text('{"step": 0, "loss": 11.0}\n')
    assert export_py.main([ckpt, str(tmp_path)]) == 2  # a run's out_dir: refused, untouched
    assert "not part of an export" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["ckpt_000020.pt", "hf", "log.jsonl"]


def test_export_refuses_bad_input(tmp_path, capsys):
    small = save_ckpt(random_model(vocab_size=100), tmp_path / "small.pt")
    assert export_py.main([small, str(tmp_path / "a")]) == 2
    assert export_py.main([str(tmp_path / "missing.pt"), str(tmp_path / "b")]) == 2
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    assert export_py.main([str(tmp_path / "junk.pt"), str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") for line in err)
    assert "vocab_size 100" in err[0] and "not found" in err[1] and "not a readable train_gpt2.py checkpoint" in err[2]
    assert sorted(os.listdir(tmp_path)) == ["junk.pt", "small.pt"]


def test_size_table_still_prints(capsys):
    assert model_py.main([]) == 0 and model_py.main(["sizes"]) == 0
    assert capsys.readouterr().out.count("gpt2-xl") == 2
    assert model_py.main(["expor", "a"]) == 2


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_prints_the_usage_and_exits_0(flag, capsys):
    assert export_py.main([flag]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python export.py") and "SRC OUT_DIR" in out


def test_help_from_the_command_line():
    r = subprocess.run([sys.executable, export_py.__file__, "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("usage:") and not r.stderr


def test_model_py_export_help_is_the_exports_help():
    """Issue 39 item 11: `python model.py export --help` exited 2; it is export.py's --help, exit 0."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "model.py"), "export", "--help"], capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0 and r.stdout.startswith("usage:") and "export.py" in r.stdout, r.stdout + r.stderr


def test_model_py_export_still_runs_the_export(tmp_path):
    """`python model.py export ...`, the export's old home, runs export.py with the same arguments, said in one note."""
    ckpt = save_ckpt(random_model(), tmp_path / "ckpt_000010.pt")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "model.py"), "export", ckpt, str(tmp_path / "hf")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr
    assert r.stderr.startswith("note: `python model.py export` is now `python export.py`")
    assert "wrote" in r.stdout and "config.json" in os.listdir(tmp_path / "hf")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "model.py"), "export", str(tmp_path / "missing.pt"),
                        str(tmp_path / "b")], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 2 and r.stderr.splitlines()[1].startswith("error: ") and "not found" in r.stderr
