"""The chunked cross-entropy and its sizing (chunk_rows for a memory budget, the temporaries' estimate): the same
loss and gradients as F.cross_entropy of the whole logits, fp32 tight, under bf16/fp16 autocast to their rounding.

    python -m pytest -q tests/test_loss.py
"""
import pytest
import torch
from torch.nn import functional as F

from model import GPT, GPTConfig
from gpt2train import loss
from gpt2train.loss import chunked_cross_entropy, loss_chunk_bytes, loss_chunk_rows, loss_head_temp_bytes


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
    chunked, full = GPT(config), GPT(config, loss_impl="full")
    assert chunked.loss_impl == "chunked"
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
    """The most bytes of new storages alive at once among those the ops under it create (as memory_report.py's
    LiveTensors)."""

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


# -----------------------------------------------------------------------------
# fp16 chunks past 1024 rows where the device sums the weight gradient in fp32 (loss.addmm_fp32, CUDA only)


@pytest.fixture
def probe():
    """loss.fp32_out_matmul probed afresh in the test (its cache cleared before and after)."""
    loss.fp32_out_matmul.cache_clear()
    yield loss.fp32_out_matmul
    loss.fp32_out_matmul.cache_clear()


def emulated_addmm_fp32(acc, a, b):
    """addmm_fp32 as CUDA computes it: fp16/bf16 products are exact in fp32, summed in fp32, added into acc."""
    return acc.add_(a.float() @ b.float())


def overflowing_fp16_inputs(N=4096, C=8, V=64):
    """N rows all aiming at token 0 with one hidden column at 20: the weight gradient's (0, 0) entry sums
    N x 20 = 81920 > fp16's 65504 (an fp16 product of more than 3276 rows overflows); inputs and targets."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, C, generator=g)
    h[:, 0] = 20.0
    w = (0.1 * torch.randn(V, C, generator=g)).requires_grad_()
    return h.requires_grad_(), w, torch.zeros(N, dtype=torch.long)


def chunk_sizes(monkeypatch):
    """The rows of each chunk ChunkedCrossEntropy.forward computes (a list filled as it runs)."""
    rows, eager = [], loss.chunk_loss
    monkeypatch.setattr(loss, "chunk_loss", lambda hc, *a, **k: rows.append(hc.size(0)) or eager(hc, *a, **k))
    return rows


def fp16_against_fp32(h, w, targets, chunk_rows):
    """Max relative difference of (dL/dh, dL/dW) under fp16 autocast against the fp32 F.cross_entropy, and both
    losses."""
    with torch.autocast("cpu", dtype=torch.float16):
        ours = chunked_cross_entropy(h, w, targets, chunk_rows=chunk_rows)
    ref = F.cross_entropy(h @ w.t(), targets, ignore_index=-1)
    diffs = [((a - b).abs().max() / b.abs().max()).item()
             for a, b in zip(torch.autograd.grad(ours, (h, w)), torch.autograd.grad(ref, (h, w)))]
    return diffs, ours, ref


def test_the_fp32_out_matmul_probe_says_no_on_cpu_and_fp16_chunks_stay_capped(probe, monkeypatch):
    """The CPU build has no addmm with out_dtype (NotImplementedError): the probe says False, and fp16 chunks
    stay at 1024 rows (the sizing, the forward) with the fp16 product in the estimate."""
    assert not probe(torch.device("cpu"), torch.float16) and not probe(torch.device("cpu"), torch.bfloat16)
    assert not probe(torch.device("meta"), torch.float16)  # runs there, but no values to check
    assert loss_chunk_rows(16384, 50304, 10**12, torch.float16, "cpu") == 1024
    assert loss_head_temp_bytes(16384, 50304, 768, 1024, torch.float16, "cpu") == \
        loss_head_temp_bytes(16384, 50304, 768, 1024, torch.float16)  # the (V, C) fp16 product counted
    rows = chunk_sizes(monkeypatch)
    diffs, ours, ref = fp16_against_fp32(*overflowing_fp16_inputs(), chunk_rows=4096)
    assert rows == [1024] * 4  # capped: 1024 x 20 stays below 65504
    assert max(diffs) < 5e-3 and abs(ours.item() - ref.item()) < 1e-3


def test_fp16_chunks_grow_past_1024_rows_with_the_fp32_out_matmul(probe, monkeypatch):
    """With the fp32-out matmul (emulated on the CPU: what CUDA's kernel computes) the probe passes, fp16 chunks
    take the budget's rows, and one 4096-row chunk, whose fp16 weight-gradient product would overflow, gives
    F.cross_entropy's loss and gradients; the estimate drops the fp16 (V, C) product."""
    monkeypatch.setattr(loss, "addmm_fp32", emulated_addmm_fp32)
    assert probe(torch.device("cpu"), torch.float16) and probe(torch.device("cpu"), torch.bfloat16)
    assert loss_chunk_rows(16384, 50304, 10**12, torch.float16, "cpu") == 16384  # one chunk, as bf16
    assert loss_chunk_rows(16384, 50304, 715 * 2**20, torch.float16, "cpu") == 2368  # a T4's share: 7 chunks
    V, C = 50304, 768
    assert loss_head_temp_bytes(16384, V, C, 2368, torch.float16) - \
        loss_head_temp_bytes(16384, V, C, 2368, torch.float16, "cpu") == 2 * V * C
    h, w, targets = overflowing_fp16_inputs()
    assert (20.0 * torch.ones(1, 4096, dtype=torch.float16) @ torch.ones(4096, 1, dtype=torch.float16)).isinf()
    rows = chunk_sizes(monkeypatch)
    diffs, ours, ref = fp16_against_fp32(h, w, targets, chunk_rows=4096)
    assert rows == [4096]
    assert max(diffs) < 5e-3 and abs(ours.item() - ref.item()) < 1e-3
    diffs, _, _ = fp16_against_fp32(*ce_inputs(N=3000, C=16, V=301), chunk_rows=2048)  # a short last chunk, masks
    assert max(diffs) < 5e-3


@pytest.mark.parametrize("broken", ["raises", "wrong sum"])
def test_a_failing_fp32_out_matmul_falls_back_to_the_capped_path(broken, probe, monkeypatch):
    """An older torch or a GPU without the kernel (an exception), or a kernel whose sum is not fp32's: the probe
    says False, and the loss runs the capped fp16 path as before, never stopping the trainer."""
    def addmm_fp32(acc, a, b):
        if broken == "raises":
            raise RuntimeError("self and mat2 must have the same dtype")  # torch 2.8's addmm.dtype with a fp32 acc
        return acc.add_((a @ b).float())  # the fp16 product: inf
    monkeypatch.setattr(loss, "addmm_fp32", addmm_fp32)
    assert not probe(torch.device("cpu"), torch.float16)
    assert loss_chunk_rows(16384, 50304, 10**12, torch.float16, "cpu") == 1024
    rows = chunk_sizes(monkeypatch)
    diffs, ours, ref = fp16_against_fp32(*overflowing_fp16_inputs(), chunk_rows=4096)
    assert rows == [1024] * 4 and max(diffs) < 5e-3 and abs(ours.item() - ref.item()) < 1e-3
