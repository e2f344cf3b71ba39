"""sample.py: greedy text equals transformers' generate(do_sample=False) on the same weights; seeds
reproduce; the streamed pieces join to the decoded text; bad input is one line."""
import dataclasses

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from gpt2train import precision
import sample
from model import GPT, GPTConfig
from gpt2train.tokenizer import EOT, get_encoding

PROMPT = "Hello, I'm a language model,"


@pytest.fixture(scope="module")
def hf_random(tmp_path_factory):
    """A tiny GPT-2 saved with save_pretrained whose every weight is random (N(0, 0.1)), so greedy
    decoding walks through the vocabulary rather than repeating one token."""
    path = str(tmp_path_factory.mktemp("hf_random"))
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_positions=64, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                                    embd_pdrop=0.0, attn_pdrop=0.0))
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.1)
    hf.save_pretrained(path)
    return path


def run(capsys, *argv):
    code = sample.main(["--device", "cpu", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_greedy_equals_hf_generate(hf_random, capsys):
    enc = get_encoding()
    prompt = enc.encode_ordinary(PROMPT)
    hf = GPT2LMHeadModel.from_pretrained(hf_random).eval()
    idx = torch.tensor([prompt])
    ref = hf.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=30, do_sample=False,
                      pad_token_id=EOT)[0, len(prompt):].tolist()
    assert len(set(ref)) > 5  # a real continuation, not one token repeated
    code, out, err = run(capsys, "--model", hf_random, "--prompt", PROMPT, "--temperature", "0",
                         "--max_new_tokens", "30", "--num_samples", "2")
    assert code == 0
    assert out == enc.decode(prompt + ref) + "\n"  # greedy: one answer, so one sample, said in one line
    assert "note: --temperature 0 is greedy decoding, the same text every time: printing 1 sample, not 2" in err
    model = GPT.load(hf_random)
    plan = precision.make_plan("cpu", "fp32")
    ours = list(sample.generate_tokens(model, prompt, 30, plan, temperature=0.0))
    assert ours == ref


def test_top_k_1_is_greedy_and_seeds_reproduce(hf_random, tmp_path, capsys):
    model = GPT.from_pretrained(hf_random)  # and through one of our checkpoints this time
    ckpt = str(tmp_path / "ckpt_000001.pt")
    torch.save({"model": model.state_dict(), "model_args": dataclasses.asdict(model.config)}, ckpt)
    capsys.readouterr()  # from_pretrained's "loading GPT-2 weights" line
    common = ["--model", ckpt, "--prompt", PROMPT, "--max_new_tokens", "12", "--num_samples", "2"]
    greedy = run(capsys, *common, "--temperature", "0")[1]
    assert greedy.count(PROMPT) == 1 and "-" * 40 not in greedy  # one sample
    assert run(capsys, *common, "--top_k", "1", "--seed", "5")[1] == greedy
    a = run(capsys, *common, "--seed", "1")[1]
    assert run(capsys, *common, "--seed", "1")[1] == a
    assert run(capsys, *common, "--seed", "2")[1] != a
    first, second = a.split("\n" + "-" * 40 + "\n")
    assert first.startswith(PROMPT) and second.startswith(PROMPT) and first != second + "\n"


def test_eot_ends_a_sample_and_starts_an_empty_prompt():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=50304, n_layer=1, n_head=2, n_embd=16)).eval()
    with torch.no_grad():
        model.lm_head.weight[EOT] = 0.0
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.zero_()  # every logit 0: argmax is token 0 ...
    plan = precision.make_plan("cpu", "fp32")
    assert list(sample.generate_tokens(model, [EOT], 5, plan, temperature=0.0)) == [0] * 5
    with torch.no_grad():
        model.transformer.ln_f.bias.fill_(1.0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[EOT] = 1.0  # ... now <|endoftext|> wins: the sample stops there
    assert list(sample.generate_tokens(model, [EOT], 5, plan, temperature=0.0)) == [EOT]


def test_stream_pieces_join_to_the_decoded_text():
    enc = get_encoding()
    text = "Grüße, 世界 🙂👍 naïve — ok"
    ids = enc.encode_ordinary(text)
    pieces = list(sample.stream_text(enc, ids))
    assert "".join(pieces) == enc.decode(ids) == text and "\ufffd" not in "".join(pieces)
    assert len(pieces) < len(ids)  # some characters spanned several tokens and waited for their bytes
    broken = ids[:-1] + [enc.encode_ordinary("🙂")[0]]  # ends inside a character
    assert "".join(sample.stream_text(enc, broken)) == enc.decode(broken)


def test_bad_input_is_one_line(hf_random, tmp_path, capsys):
    cases = [(["--model", hf_random, "--prompt", "a", "--prompt_file", "p.txt"], "not both"),
             (["--model", hf_random, "--prompt_file", str(tmp_path / "missing.txt")], "missing.txt"),
             (["--model", hf_random, "--temperature", "-1"], "must not be negative"),
             (["--model", hf_random, "--num_samples", "0"], "at least 1"),
             (["--model", str(tmp_path / "nope.pt")], "not found"),
             (["--model", hf_random, "--device", "tpu"], "not one of")]
    for argv, msg in cases:
        code, out, err = run(capsys, *argv)
        assert code == 2 and out == "", (argv, out)
        assert err.startswith("error: ") and msg in err and err.count("\n") == 1, (argv, err)
