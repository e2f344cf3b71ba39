import math

import pytest
import torch
from torch.nn import functional as F
from transformers import GPT2LMHeadModel

from conftest import configure_optimizers, make_hf_gpt2
from gpt2train import optim
from gpt2train.fileio import UserError
import model as model_py
from model import GPT, GPTConfig, flops_per_token
from gpt2train.loss import chunked_cross_entropy, loss_chunk_bytes, loss_chunk_rows, loss_head_temp_bytes


def hf_logits(path, idx):
    hf = GPT2LMHeadModel.from_pretrained(path).eval()
    with torch.no_grad():
        return hf(idx).logits


@pytest.mark.parametrize("shape", [dict(n_layer=2, n_head=4, n_embd=64), dict(n_layer=3, n_head=3, n_embd=48)])
def test_logits_match_hf(tmp_path, shape):
    path = make_hf_gpt2(str(tmp_path), n_positions=64, **shape)
    model = GPT.from_pretrained(path, verbose=False).eval()
    assert model.config.n_layer == shape["n_layer"] and model.config.n_embd == shape["n_embd"]
    idx = torch.randint(0, 50257, (3, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, _ = model(idx)
    ref = hf_logits(path, idx)
    assert ours.shape == ref.shape == (3, 64, 50257)
    assert (ours - ref).abs().max().item() < 1e-4


def test_weight_tying_after_from_pretrained(hf_dir):
    model = GPT.from_pretrained(hf_dir, verbose=False)
    assert model.lm_head.weight is model.transformer.wte.weight
    hf = GPT2LMHeadModel.from_pretrained(hf_dir)  # the shared tensor holds the file's embeddings (HF ties them too)
    assert torch.equal(model.lm_head.weight, hf.transformer.wte.weight)


def test_from_pretrained_bad_name():
    with pytest.raises(UserError, match="is not scratch, a GPT-2 name"):
        GPT.from_pretrained("/no/such/dir", verbose=False)


def test_export_round_trip_crops_padded_vocab(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=50304, n_layer=2, n_head=2, n_embd=32)).eval()
    model.save_pretrained(str(tmp_path))
    idx = torch.randint(0, 50257, (2, 32))
    with torch.no_grad():
        ours, _ = model(idx)
    ref = hf_logits(str(tmp_path), idx)
    assert ref.shape[-1] == 50257
    assert (ours[..., :50257] - ref).abs().max().item() < 1e-4
    back = GPT.from_pretrained(str(tmp_path), verbose=False).eval()
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
    model = GPT(GPTConfig(block_size=16, vocab_size=100, n_layer=1, n_head=2, n_embd=16, loss_impl="full"))
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
    opt = configure_optimizers(model, 0.0, 1e-2, "cpu", verbose=False)
    for _ in range(50):
        _, loss = model(x[:, :-1], x[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5


def test_decay_groups_are_exactly_2d(capsys):
    model = GPT(GPTConfig(block_size=16, vocab_size=100, n_layer=2, n_head=2, n_embd=16))
    opt, = optim.build_optimizers(model, "adamw", lr=1e-3, weight_decay=0.1, device_type="cpu")
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0

    def ids(ps):
        return {id(p) for p in ps}
    two_d = {id(p) for p in model.parameters() if p.dim() == 2}
    assert ids(decay["params"]) == two_d
    assert ids(no_decay["params"]) == {id(p) for p in model.parameters() if p.dim() != 2}
    # the tied embedding is one tensor, counted once
    assert len(decay["params"]) == 1 + 1 + 4 * 2  # wte(=lm_head), wpe, 4 matmuls per layer
    assert "decayed" in capsys.readouterr().out


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


def test_from_checkpoint(tmp_path):
    config = GPTConfig(block_size=16, vocab_size=100, n_layer=1, n_head=2, n_embd=16)
    model = GPT(config)
    from dataclasses import asdict
    torch.save({"model": model.state_dict(), "model_args": asdict(config), "step": 3}, tmp_path / "ckpt.pt")
    back = GPT.from_checkpoint(str(tmp_path / "ckpt.pt"))
    assert back.config == config
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), back.state_dict().values()))


# -----------------------------------------------------------------------------
# chunked cross-entropy and activation checkpointing: same numbers as the plain model


def ce_inputs(N=37, C=16, V=101, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, C, generator=g).requires_grad_()
    w = (0.5 * torch.randn(V, C, generator=g)).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    targets[::4] = -1  # masked rows, including the first of several chunks
    return h, w, targets


@pytest.mark.parametrize("chunk_rows", [1, 8, 12, 37, 64, 1000])
def test_chunked_cross_entropy_equals_f_cross_entropy_fp32(chunk_rows):
    h, w, targets = ce_inputs()
    ours = chunked_cross_entropy(h, w, targets, chunk_rows=chunk_rows)
    ref = F.cross_entropy(h @ w.t(), targets, ignore_index=-1)
    torch.testing.assert_close(ours, ref)
    g_ours = torch.autograd.grad(3.0 * ours, (h, w))  # an incoming gradient other than 1 (1/grad_accum, loss scale)
    g_ref = torch.autograd.grad(3.0 * ref, (h, w))
    for a, b in zip(g_ours, g_ref):
        torch.testing.assert_close(a, b)
    assert g_ours[0][::4].abs().max() == 0  # masked rows get no gradient


def test_chunked_cross_entropy_under_bf16_autocast():
    h, w, targets = ce_inputs(N=64, C=32, V=300)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = chunked_cross_entropy(h, w, targets, chunk_rows=16)
        ref = F.cross_entropy(F.linear(h, w), targets, ignore_index=-1)  # bf16 logits, fp32 softmax inside
    assert ours.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(ours, ref, rtol=1e-3, atol=1e-3)
    g_ours, g_ref = torch.autograd.grad(ours, (h, w)), torch.autograd.grad(ref, (h, w))
    for a, b in zip(g_ours, g_ref):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3 * b.abs().max().item())  # bf16: 8 mantissa bits


def test_compiled_chunk_body_equals_f_cross_entropy_in_one_graph():
    """GPT.compile_loss_head's body (inductor): the same loss and gradients as F.cross_entropy, fp32 and under
    bf16 autocast, with a short last chunk padded into the same graph: one compile per dtype, no recompile."""
    torch._dynamo.reset()
    model = GPT(GPTConfig(block_size=8, vocab_size=300, n_layer=1, n_head=2, n_embd=32))
    model.compile_loss_head()
    h, w, targets = ce_inputs(N=100, C=32, V=300)  # 64-row chunks: 64 + 36 (padded to 64)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for dtype, loose in ((torch.float32, False), (torch.bfloat16, True)):  # bf16: 8 mantissa bits
        for _ in range(2):  # the second call compiles nothing
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                ours = chunked_cross_entropy(h, w, targets, 64, model.loss_body)
                ref = F.cross_entropy(F.linear(h, w), targets, ignore_index=-1)
            torch.testing.assert_close(ours, ref, **(dict(rtol=1e-3, atol=1e-3) if loose else {}))
            for a, b in zip(torch.autograd.grad(3.0 * ours, (h, w)), torch.autograd.grad(3.0 * ref, (h, w))):
                tol = dict(rtol=2e-2, atol=2e-3 * b.abs().max().item()) if loose else {}
                torch.testing.assert_close(a, b, **tol)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 2  # fp32 and bf16, nothing else
    model.compile_loss_head(None)
    assert model.loss_body is None
    torch._dynamo.reset()


def test_chunked_cross_entropy_keeps_small_fp16_gradients():
    """fp16 (the sm7x path): softmax / n_valid for 8192 rows of a 2048 vocab is ~6e-8, below fp16's
    normal range; the 1/n_valid must come after the fp16 matmuls, or the gradients lose 3-5%."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(8192, 16, generator=g).requires_grad_()
    w = (0.1 * torch.randn(2048, 16, generator=g)).requires_grad_()
    targets = torch.randint(0, 2048, (8192,), generator=g)
    with torch.autocast("cpu", dtype=torch.float16):
        ours = chunked_cross_entropy(h, w, targets, chunk_rows=1024)
    ref = F.cross_entropy(F.linear(h, w), targets)  # fp32 reference
    for a, b in zip(torch.autograd.grad(ours, (h, w)), torch.autograd.grad(ref, (h, w))):
        assert ((a - b).abs().max() / b.abs().max()).item() < 5e-3


def test_chunked_loss_is_the_default_and_equals_the_full_one():
    torch.manual_seed(0)
    config = GPTConfig(block_size=16, vocab_size=100, n_layer=2, n_head=2, n_embd=16)
    assert config.loss_impl == "chunked"
    chunked, full = GPT(config), GPT(GPTConfig(**{**config.__dict__, "loss_impl": "full"}))
    full.load_state_dict(chunked.state_dict())
    idx, targets = torch.randint(0, 100, (3, 16)), torch.randint(0, 100, (3, 16))
    targets[:, :5] = -1
    logits, loss = chunked(idx, targets)
    assert logits is None  # training never builds the (B, T, V) logits
    logits_full, loss_full = full(idx, targets)
    assert logits_full.shape == (3, 16, 100)
    torch.testing.assert_close(loss, loss_full)
    loss.backward()
    loss_full.backward()
    for (name, a), b in zip(chunked.named_parameters(), full.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)
    with torch.no_grad():  # evaluation: the same loss, no gradient work
        torch.testing.assert_close(chunked(idx, targets)[1], loss_full)
    assert torch.equal(chunked(idx)[0], full(idx)[0])  # without targets: logits from both


@pytest.mark.parametrize("mode", ["blocks", "every_other"])
def test_activation_checkpointing_gives_the_same_gradients(mode):
    torch.manual_seed(0)
    config = GPTConfig(block_size=16, vocab_size=100, n_layer=3, n_head=2, n_embd=16)
    plain, ckpt = GPT(config), GPT(GPTConfig(**{**config.__dict__, "activation_checkpointing": mode}))
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_cross_entropy_is_exact_at_the_chunk_sizes_loss_chunk_rows_picks(dtype):
    """Every chunk size the budget can give (one chunk, equal chunks, a ragged last one): the same loss and
    gradients as F.cross_entropy of the whole logits, fp32 tight, bf16 autocast to bf16 rounding."""
    h, w, targets = ce_inputs(N=200, C=16, V=301)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype == torch.bfloat16):
        ref = F.cross_entropy(F.linear(h, w), targets, ignore_index=-1)
    g_ref = torch.autograd.grad(ref, (h, w))
    for budget in (None, 1, loss_chunk_bytes(70, 301, dtype), loss_chunk_bytes(200, 301, dtype), 10**12):
        rows = loss_chunk_rows(200, 301, budget, dtype)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype == torch.bfloat16):
            ours = chunked_cross_entropy(h, w, targets, chunk_rows=rows)
        g_ours = torch.autograd.grad(ours, (h, w))
        tight = dtype == torch.float32
        torch.testing.assert_close(ours, ref, **({} if tight else dict(rtol=1e-3, atol=1e-3)))
        for a, b in zip(g_ours, g_ref):
            assert a.dtype == torch.float32
            torch.testing.assert_close(a, b, **({} if tight else dict(rtol=2e-2, atol=2e-3 * b.abs().max().item())))


def test_loss_chunk_rows_fits_the_budget_in_few_equal_chunks():
    V, N = 50304, 64 * 1024
    assert loss_chunk_rows(N, V) == 1024  # no budget: 64 chunks of 1024 rows, as before
    assert loss_chunk_bytes(1024, V) == 1024 * V * 4 and loss_chunk_bytes(1024, V, torch.bfloat16) == 1024 * V * 6
    assert loss_chunk_rows(N, V, 10**12, torch.bfloat16) == N  # a big GPU: one chunk
    assert loss_chunk_rows(100, V) == 100 and loss_chunk_rows(100, V, 1) == 1  # never more rows than exist, at least 1
    for budget in (2**30, 4 * 2**30, 3 * 10**9, 123456789):
        for dtype in (torch.float32, torch.bfloat16):
            rows = loss_chunk_rows(N, V, budget, dtype)
            chunks = -(-N // rows)
            assert loss_chunk_bytes(rows, V, dtype) <= budget  # fits
            fewer = -(-N // (chunks - 1) // 64) * 64  # equal aligned rows for one chunk fewer: would not fit
            assert loss_chunk_bytes(fewer, V, dtype) > budget or chunks == 1
            assert rows % 64 == 0 and N - (chunks - 1) * rows > 0  # aligned, and no empty chunk
    assert loss_chunk_rows(N, V, 2**30) == 5056  # 1 GiB of fp32 logits: 13 chunks
    assert loss_chunk_rows(N, V, 2**30, torch.bfloat16) == 3456  # fp32 + bf16 per element: 19 chunks
    assert loss_chunk_rows(N, V, 10**12, torch.float16) == 1024  # fp16: capped, the weight product must not overflow


class PeakTensors(torch.utils._python_dispatch.TorchDispatchMode):
    """The most bytes of new storages alive at once among those the ops under it create (as bench.LiveTensors)."""

    def __init__(self):
        super().__init__()
        self.refs, self.peak = {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        self.refs = {k: v for k, v in self.refs.items() if not v[0].expired()}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs | set(self.refs):
                s = t.untyped_storage()
                self.refs[s.data_ptr()] = (torch.multiprocessing.reductions.StorageWeakRef(s), s.nbytes())
        self.peak = max(self.peak, sum(n for _, n in self.refs.values()))
        return out


def test_loss_head_temporaries_stay_within_their_estimate():
    """What the chunked loss allocates beyond what it keeps for backward (dL/dh, dL/dW fp32) is at most
    loss_head_temp_bytes, counted op by op, in fp32 and bf16: one chunk of logits at a time."""
    N, C, V = 256, 32, 3000
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (64, 100, 256):
            h, w, targets = ce_inputs(N=N, C=C, V=V)
            with PeakTensors() as counter:
                with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                    loss = chunked_cross_entropy(h, w, targets, chunk_rows=rows)
            kept = N * C * 4 + V * C * 4
            assert kept + loss_chunk_bytes(rows, V, dtype) <= counter.peak
            assert counter.peak <= kept + loss_head_temp_bytes(N, V, C, rows, dtype)
            del loss


def test_compiled_model_is_one_graph_per_shape_and_equals_eager():
    """The loss runs eager (torch.compiler.disable): the compiled graph holds the transformer only, whatever
    the chunk count (3 chunks of 7 rows, or 2), and a second shape is one more graph, never more."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=100, n_layer=2, n_head=2, n_embd=16, ce_chunk_rows=7))
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
    assert all("lm_head" not in str(g.graph) or "logits" not in str(g.graph) for g in graphs)
    torch._dynamo.reset()


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_prints_the_usage_and_exits_0(flag, capsys):
    assert model_py.main([flag]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python model.py") and "export SRC OUT_DIR" in out


def test_help_from_the_command_line():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, model_py.__file__, "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("usage:") and not r.stderr
