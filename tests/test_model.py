"""model.py: the network against Hugging Face's GPT-2, attention kernels, generation, FLOPs, checkpoints it loads,
activation checkpointing and torch.compile, the export command's help.

    python -m pytest -q tests/test_model.py
"""
import dataclasses
import math

import pytest
import torch
from transformers import GPT2LMHeadModel

from conftest import adamw, make_hf_gpt2
from gpt2train.fileio import UserError
from gpt2train.loss import CE_CHUNK_ROWS
import model as model_py
from export import save_hf
from model import GPT, GPTConfig, flops_per_token, llmc_flops_per_token


def hf_logits(path, idx):
    hf = GPT2LMHeadModel.from_pretrained(path).eval()
    with torch.no_grad():
        return hf(idx).logits


@pytest.mark.parametrize("shape", [dict(n_layer=2, n_head=4, n_embd=64), dict(n_layer=3, n_head=3, n_embd=48)])
def test_logits_match_hf(tmp_path, shape):
    path = make_hf_gpt2(str(tmp_path), n_positions=64, **shape)
    model = GPT.from_pretrained(path).eval()
    assert model.config.n_layer == shape["n_layer"] and model.config.n_embd == shape["n_embd"]
    idx = torch.randint(0, 50257, (3, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, _ = model(idx)
    ref = hf_logits(path, idx)
    assert ours.shape == ref.shape == (3, 64, 50257)
    assert (ours - ref).abs().max().item() < 1e-4


def test_weight_tying_after_from_pretrained(hf_dir):
    model = GPT.from_pretrained(hf_dir)
    assert model.lm_head.weight is model.transformer.wte.weight
    hf = GPT2LMHeadModel.from_pretrained(hf_dir)  # the shared tensor holds the file's embeddings (HF ties them too)
    assert torch.equal(model.lm_head.weight, hf.transformer.wte.weight)


def test_from_pretrained_bad_name():
    with pytest.raises(UserError, match="is not scratch, a GPT-2 name"):
        GPT.from_pretrained("/no/such/dir")


def test_export_round_trip_crops_padded_vocab(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=50304, n_layer=2, n_head=2, n_embd=32)).eval()
    save_hf(model, str(tmp_path))
    idx = torch.randint(0, 50257, (2, 32))
    with torch.no_grad():
        ours, _ = model(idx)
    ref = hf_logits(str(tmp_path), idx)
    assert ref.shape[-1] == 50257
    assert (ours[..., :50257] - ref).abs().max().item() < 1e-4
    back = GPT.from_pretrained(str(tmp_path)).eval()
    with torch.no_grad():
        again, _ = back(idx)
    assert (again - ours[..., :50257]).abs().max().item() < 1e-5


def test_init_loss_is_ln_vocab():
    torch.manual_seed(0)
    config = GPTConfig(block_size=64, vocab_size=50304, n_layer=2, n_head=2, n_embd=64)
    model = GPT(config)
    idx = torch.randint(0, 50257, (4, 65))
    _, loss = model(idx[:, :-1], idx[:, 1:])  # next tokens are random: nothing to know at init
    assert abs(loss.item() - math.log(config.vocab_size)) < 0.1


def test_masked_targets_are_ignored():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=100, n_layer=1, n_head=2, n_embd=16), loss_impl="full")
    idx = torch.randint(0, 100, (2, 16))
    targets = idx.clone()
    targets[:, :8] = -1
    logits, loss = model(idx, targets)
    ref = torch.nn.functional.cross_entropy(logits[:, 8:].reshape(-1, 100), idx[:, 8:].reshape(-1))
    assert torch.allclose(loss, ref)


def test_naive_attention_matches_sdpa():
    torch.manual_seed(0)
    a = GPT(GPTConfig(block_size=32, vocab_size=100, n_layer=2, n_head=4, n_embd=32)).eval()
    b = GPT(GPTConfig(block_size=32, vocab_size=100, n_layer=2, n_head=4, n_embd=32, attn_impl="naive")).eval()
    b.load_state_dict(a.state_dict())
    idx = torch.randint(0, 100, (2, 32))
    with torch.no_grad():
        assert torch.allclose(a(idx)[0], b(idx)[0], atol=1e-5)



@pytest.mark.parametrize("attn_impl", ["sdpa", "naive"])
def test_explicit_causal_mask_equals_default(attn_impl):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=100, n_layer=2, n_head=4, n_embd=32, attn_impl=attn_impl)).eval()
    idx = torch.randint(0, 100, (2, 20))
    causal = torch.ones(20, 20, dtype=torch.bool).tril()
    with torch.no_grad():
        ref = model.hidden_states(idx)
        assert torch.allclose(model.hidden_states(idx, attn_mask=causal), ref, atol=1e-5)
        positions = torch.arange(20).expand(2, 20)
        assert torch.allclose(model.hidden_states(idx, positions, causal[None, None]), ref, atol=1e-5)


@pytest.mark.parametrize("attn_impl", ["sdpa", "naive"])
def test_packed_continuations_equal_separate_rows(attn_impl):
    """One row prefix + cont_1 + cont_2 + cont_3 (+ padding), each continuation at positions from
    len(prefix) and seeing only the prefix and itself, gives the hidden states of the 3 separate rows
    prefix + cont_i."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=100, n_layer=2, n_head=4, n_embd=32, attn_impl=attn_impl)).eval()
    prefix, conts = torch.randint(0, 100, (7,)), [torch.randint(0, 100, (n,)) for n in (3, 1, 5)]
    T = 7 + 9 + 4  # 4 padding tokens
    idx = torch.zeros(1, T, dtype=torch.long)
    pos = torch.zeros(1, T, dtype=torch.long)
    seg = [0] * 7 + [1] * 3 + [2] * 1 + [3] * 5 + [-1] * 4  # which part each token belongs to
    idx[0, :16] = torch.cat([prefix] + conts)
    pos[0, :16] = torch.cat([torch.arange(7), torch.arange(7, 10), torch.arange(7, 8), torch.arange(7, 12)])
    mask = torch.zeros(T, T, dtype=torch.bool)
    for q in range(T):
        for k in range(T):
            if seg[q] == -1:
                mask[q, k] = k == q  # padding sees itself only
            else:
                mask[q, k] = (seg[k] == 0 or seg[k] == seg[q]) and seg[k] != -1 and pos[0, k] <= pos[0, q]
    with torch.no_grad():
        packed = model.hidden_states(idx, pos, mask[None, None])[0]  # (T, C)
        assert torch.isfinite(packed).all()
        at = 7
        for cont in conts:
            row = model.hidden_states(torch.cat([prefix, cont])[None])[0]  # (7 + n, C)
            assert torch.allclose(packed[:7], row[:7], atol=1e-5)
            assert torch.allclose(packed[at:at + len(cont)], row[7:], atol=1e-5)
            at += len(cont)

def test_single_batch_overfits():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=256, n_layer=2, n_head=2, n_embd=64))
    x = torch.randint(0, 256, (4, 33))
    opt = adamw(model, lr=1e-2, weight_decay=0.0)
    for _ in range(50):
        _, loss = model(x[:, :-1], x[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5


def test_topk_never_leaves_top_k():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, vocab_size=64, n_layer=1, n_head=2, n_embd=16)).eval()
    k = 3
    for seed in range(30):
        idx = torch.randint(0, 64, (4, 5), generator=torch.Generator().manual_seed(seed))
        out = model.generate(idx, 1, temperature=1.5, top_k=k, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            top = model(idx)[0][:, -1].topk(k).indices
        assert all(out[b, -1] in top[b] for b in range(4))


def test_generate_reproducible_and_crops_context():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, vocab_size=64, n_layer=1, n_head=2, n_embd=16)).eval()
    idx = torch.randint(0, 64, (2, 6))
    a = model.generate(idx, 20, top_k=10, generator=torch.Generator().manual_seed(7))  # passes block_size
    b = model.generate(idx, 20, top_k=10, generator=torch.Generator().manual_seed(7))
    assert a.shape == (2, 26) and torch.equal(a, b)
    assert torch.equal(a[:, :6], idx)


def test_generate_never_samples_padding_rows():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, vocab_size=50304, n_layer=1, n_head=2, n_embd=16)).eval()
    with torch.no_grad():
        model.lm_head.weight[50257:] = 100.0 * model.lm_head.weight[0]  # make padding rows dominate
    out = model.generate(torch.zeros(2, 1, dtype=torch.long), 5, generator=torch.Generator().manual_seed(0))
    assert out.max().item() < 50257


def test_flops_per_token_124m():
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=50304))
    # 6N + 12 L H Q T: N = 124,475,904 parameters (vocab 50304) less the 1024 x 768 position table
    assert sum(p.numel() for p in model.parameters()) == 124_475_904
    assert model.num_params() == 123_689_472
    assert flops_per_token(model, 1024) == 855_383_040  # 6 x 123,689,472 + 12 x 12 x 12 x 64 x 1024


def test_mfu_as_llmc_counts_it_on_the_h200():
    """llm.c's count (train_gpt2.cu: 6N + 6 L C T, N = every parameter, 124,475,904 at vocab 50304) against the same
    dense bf16 peak (989.4 TFLOP/s: llm.c's mfu.h has the H100 SXM's, patched in for the H200): by hand,
    6 x 124,475,904 + 6 x 12 x 768 x 1024 = 803,478,528. On the H200 of 2026-11-28 ours printed 46.3% at 535,450
    tok/s, which llm.c's count makes 43.5%; llm.c printed 46.8% at 575,748 tok/s, which this reproduces."""
    from gpt2train.logger import fmt_mfu
    from gpt2train.precision import estimate_mfu
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=50304))
    assert llmc_flops_per_token(model, 1024) == 803_478_528
    ours, theirs = (estimate_mfu(f, 535_450, "NVIDIA H200", torch.bfloat16) for f in
                    (flops_per_token(model, 1024), llmc_flops_per_token(model, 1024)))
    assert round(ours * 100, 1) == 46.3 and round(theirs * 100, 1) == 43.5
    assert round(estimate_mfu(803_478_528, 575_748, "NVIDIA H200", torch.bfloat16) * 100, 1) == 46.8
    assert fmt_mfu(ours, theirs) == "46.3% (llm.c's count 43.5%)" and fmt_mfu(None, None) == "n/a"


def test_from_checkpoint(tmp_path):
    config = GPTConfig(block_size=16, vocab_size=100, n_layer=1, n_head=2, n_embd=16)
    model = GPT(config)
    from dataclasses import asdict
    torch.save({"model": model.state_dict(), "model_args": asdict(config), "step": 3}, tmp_path / "ckpt.pt")
    back = GPT.from_checkpoint(str(tmp_path / "ckpt.pt"))
    assert back.config == config
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), back.state_dict().values()))


def test_run_time_settings_stay_out_of_the_config_and_older_checkpoints_load(tmp_path):
    """activation_checkpointing, ce_chunk_rows and loss_impl are how a run executes the model, set apart from its
    GPTConfig (what a checkpoint saves); a checkpoint from before, whose model_args carry them, loads with them
    left out."""
    config = GPTConfig(block_size=16, vocab_size=100, n_layer=1, n_head=2, n_embd=16)
    model = GPT(config, activation_checkpointing="blocks", ce_chunk_rows=7)
    assert (model.activation_checkpointing, model.ce_chunk_rows) == ("blocks", 7) and model.config == config
    assert model.set_runtime(ce_chunk_rows=9) is model and (model.activation_checkpointing, model.ce_chunk_rows) == \
        ("blocks", 9)  # None keeps a setting as it is
    assert model.loss_impl == "chunked" and model.set_runtime(loss_impl="full").loss_impl == "full"
    for bad in (dict(activation_checkpointing="all"), dict(ce_chunk_rows=0), dict(ce_chunk_rows=2.0),
                dict(loss_impl="auto")):
        with pytest.raises(ValueError):
            model.set_runtime(**bad)
    old = dict(dataclasses.asdict(config), activation_checkpointing="every_other", ce_chunk_rows=21888,
               loss_impl="full")
    torch.save({"model": model.state_dict(), "model_args": old, "step": 3}, tmp_path / "old.pt")
    back = GPT.from_checkpoint(str(tmp_path / "old.pt"))
    assert back.config == config and (back.activation_checkpointing, back.ce_chunk_rows, back.loss_impl) == \
        ("none", CE_CHUNK_ROWS, "chunked")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), back.state_dict().values()))


# -----------------------------------------------------------------------------
# activation checkpointing and torch.compile: same numbers as the plain model (the chunked loss: tests/test_loss.py)


@pytest.mark.parametrize("mode", ["blocks", "every_other"])
def test_activation_checkpointing_gives_the_same_gradients(mode):
    torch.manual_seed(0)
    config = GPTConfig(block_size=16, vocab_size=100, n_layer=3, n_head=2, n_embd=16)
    plain, ckpt = GPT(config), GPT(config, activation_checkpointing=mode)
    ckpt.load_state_dict(plain.state_dict())
    assert [ckpt.checkpointed(i) for i in range(3)] == ([True] * 3 if mode == "blocks" else [True, False, True])
    idx, targets = torch.randint(0, 100, (2, 16)), torch.randint(0, 100, (2, 16))
    losses = []
    for model in (plain, ckpt):
        _, loss = model(idx, targets)
        loss.backward()
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-7, msg=name)
    with torch.no_grad():
        assert not any(ckpt.checkpointed(i) for i in range(3))  # nothing to recompute without gradients


def test_compiled_model_is_one_graph_per_shape_and_equals_eager():
    """The loss runs eager (torch.compiler.disable): the compiled graph holds the transformer only, whatever
    the chunk count (3 chunks of 7 rows, or 2), and a second shape is one more graph, never more. No node of
    a graph outputs a vocab-wide tensor (logits or a chunk of them: last dim vocab_size = 100, a size nothing
    else here has; wte's weight is (100, 16))."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=100, n_layer=2, n_head=2, n_embd=16), ce_chunk_rows=7)
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    compiled = torch.compile(model, backend=counting_backend, dynamic=False)
    for B in (3, 3, 2, 3):
        idx, targets = torch.randint(0, 100, (B, 16)), torch.randint(0, 100, (B, 16))
        targets[0, :4] = -1
        results = []
        for m in (compiled, model):
            model.zero_grad(set_to_none=True)
            _, loss = m(idx, targets)
            loss.backward()
            results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        (loss_c, grads_c), (loss_e, grads_e) = results
        torch.testing.assert_close(loss_c, loss_e)
        for a, b in zip(grads_c, grads_e):
            torch.testing.assert_close(a, b)
    assert len(graphs) == 2  # (3, 16) and (2, 16)
    values = lambda n: n.meta.get("example_value", ())  # noqa: E731 - a node's output (Dynamo's fake tensor(s))
    shapes = [[tuple(v.shape) for n in g.graph.nodes for v in (values(n) if isinstance(values(n), (tuple, list))
                                                            else [values(n)]) if isinstance(v, torch.Tensor)]
              for g in graphs]
    assert all(len(s) > 20 and (B, 16, 16) in s for s, B in zip(shapes, (3, 2))), shapes  # the blocks' outputs
    assert not [s for s in sum(shapes, []) if s[-1:] == (100,)], shapes
    torch._dynamo.reset()


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_prints_the_usage_and_exits_0(flag, capsys):
    assert model_py.main([flag]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python model.py") and "python export.py" in out  # the export: its own command


def test_help_from_the_command_line():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, model_py.__file__, "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("usage:") and not r.stderr
