import io
import json
import math
import os
import urllib.error
from dataclasses import asdict

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import hellaswag
from hellaswag import (HellaSwagError, ScoredTokens, batch_losses, collate, collate_packed, evaluate, load_examples,
                       pack_rows, packable, packed_len, rows_of, score_one)
from conftest import make_rows, save_ckpt, write_rows
from gpt2train.fileio import UserError
from model import GPT, GPTConfig
from gpt2train.precision import make_plan
from gpt2train.tokenizer import get_encoding

CPU = make_plan("cpu")

@pytest.fixture(scope="module")
def model(hf_dir):
    return GPT.from_pretrained(hf_dir).eval()


@pytest.fixture(scope="module")
def examples(tmp_path_factory):
    return load_examples(data_file=write_rows(tmp_path_factory.mktemp("rows") / "rows.jsonl", make_rows(9)))


def hf_scores(hf_dir, rows, block_size):
    """Independent reference: GPT2LMHeadModel on each ctx + " " + ending, cut from the left."""
    from transformers import GPT2LMHeadModel  # here, so that spawned workers need not import it
    hf = GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    enc = get_encoding()
    sums, means = [], []
    for r in rows:
        s_row, m_row = [], []
        for end in r["endings"]:
            end_ids = enc.encode_ordinary(" " + end)
            ids = (enc.encode_ordinary(r["ctx"]) + end_ids)[-block_size:]
            scored = [j for j in range(len(ids) - len(end_ids), len(ids)) if j >= 1]
            with torch.no_grad():
                logits = hf(torch.tensor([ids])).logits[0]  # (T, V)
            logp = torch.log_softmax(logits[[j - 1 for j in scored]].float(), dim=-1)  # (n, V)
            losses = -logp[range(len(scored)), [ids[j] for j in scored]]  # (n,)
            s_row.append(losses.sum().item())
            m_row.append(losses.mean().item())
        sums.append(s_row)
        means.append(m_row)
    return torch.tensor(sums), torch.tensor(means)  # (E, 4) each

# -----------------------------------------------------------------------------
# scores: batched == one-example loop == GPT2LMHeadModel


def test_batched_equals_loop_and_hf(hf_dir, model, examples):
    rows = make_rows(9)
    ref_sum, ref_mean = hf_scores(hf_dir, rows, block_size=128)
    # the one-example loop
    loop = [score_one(model, ex) for ex in examples]
    loop_sum = torch.stack([s for s, _ in loop])
    loop_mean = torch.stack([m for _, m in loop])
    assert torch.allclose(loop_sum, ref_sum, atol=1e-3) and torch.allclose(loop_mean, ref_mean, atol=1e-4)
    # batched losses, all 9 examples in one padded batch
    idx, row_id, pos, tgt, counts, cut = collate(examples, block_size=128)
    assert cut == 0 and idx.shape[0] == 36
    with torch.no_grad():
        b_sum, b_mean = batch_losses(model, idx, ScoredTokens(row_id, pos, tgt, counts))
    assert torch.allclose(b_sum.view(9, 4), ref_sum, atol=1e-3)
    assert torch.allclose(b_mean.view(9, 4), ref_mean, atol=1e-4)
    # predictions through evaluate, batches that do not divide 9, sorted by length
    for bs in (1, 5):
        res = evaluate(model, examples, plan=CPU, batch_size=bs)
        assert [r["index"] for r in res["examples"]] == list(range(9))
        assert [r["pred"] for r in res["examples"]] == ref_sum.argmin(dim=1).tolist()
        assert [r["pred_norm"] for r in res["examples"]] == ref_mean.argmin(dim=1).tolist()
        labels = [r["label"] for r in rows]
        assert res["n"] == 9
        assert res["acc"] == sum(p == y for p, y in zip(ref_sum.argmin(dim=1).tolist(), labels)) / 9
        assert res["acc_norm"] == sum(p == y for p, y in zip(ref_mean.argmin(dim=1).tolist(), labels)) / 9



def test_packed_equals_loop_and_hf(hf_dir, model, examples, monkeypatch):
    """ctx + 4 endings in one row (positions restart, each ending sees the context and itself) scores
    each ending as its own row does; evaluate() takes that path for every example that fits."""
    rows = make_rows(9)
    ref_sum, ref_mean = hf_scores(hf_dir, rows, block_size=128)
    assert all(packable(ex, 128) for ex in examples)
    idx, pos_ids, attn_mask, seq_id, pos, tgt, row_id, counts = collate_packed([[ex] for ex in examples])
    assert idx.shape == (9, max(hellaswag.packed_len(ex) for ex in examples))  # one row per example, padded
    with torch.no_grad():
        p_sum, p_mean = batch_losses(model, idx, ScoredTokens(row_id, pos, tgt, counts), (seq_id, pos_ids, attn_mask))
    assert torch.allclose(p_sum.view(9, 4), ref_sum, atol=1e-3)
    assert torch.allclose(p_mean.view(9, 4), ref_mean, atol=1e-4)
    loop = torch.stack([score_one(model, ex)[0] for ex in examples])  # (9, 4)
    assert torch.allclose(p_sum.view(9, 4), loop, atol=1e-4)
    # the naive attention honours the mask too
    naive = GPT(GPTConfig(**{**asdict(model.config), "attn_impl": "naive"})).eval()
    naive.load_state_dict(model.state_dict())
    with torch.no_grad():
        naive_sum = batch_losses(naive, idx, ScoredTokens(row_id, pos, tgt, counts), (seq_id, pos_ids, attn_mask))[0]
        assert torch.allclose(naive_sum, p_sum, atol=1e-4)
    # evaluate packs: one packed batch of 4 examples per forward (the last one short)
    calls = []
    monkeypatch.setattr(hellaswag, "collate_packed",
                        lambda b, shape=None: calls.append(len(b)) or collate_packed(b, shape))
    res = evaluate(model, examples, plan=CPU, batch_size=4)
    assert calls == [4, 4, 1] and res["truncated"] == 0
    assert [r["pred"] for r in res["examples"]] == ref_sum.argmin(dim=1).tolist()
    assert [r["pred_norm"] for r in res["examples"]] == ref_mean.argmin(dim=1).tolist()


def test_stop_ends_the_evaluation_at_its_next_batch(model, examples, monkeypatch):
    """stop() is asked before each batch: True on the second ends it there (the trainer's Ctrl-C), nothing
    scored after; the model goes back to its mode."""
    calls, asked = [], []
    monkeypatch.setattr(hellaswag, "collate_packed",
                        lambda b, shape=None: calls.append(len(b)) or collate_packed(b, shape))
    model.train()
    res = evaluate(model, examples, plan=CPU, batch_size=4, stop=lambda: asked.append(1) or len(asked) == 2)
    assert res == {"stopped": True} and calls == [4] and len(asked) == 2 and model.training
    model.eval()


def test_examples_sharing_a_row_score_as_alone(model, examples):
    """Several examples one after the other in a row (the compiled path's packing) see only their own
    context: the losses equal one example per row, with SDPA and with the masked softmax."""
    single = collate_packed([[ex] for ex in examples])
    rows = [examples[0:3], examples[3:4], examples[4:9]]
    T = max(sum(packed_len(ex) for ex in row) for row in rows)
    shared = collate_packed(rows, shape=(4, T))  # and a padding row
    assert shared[0].shape == (4, T) and T > model.config.block_size  # a row longer than any one example may be
    sd = model.state_dict()  # the same weights with room for T positions (each example uses only its own < 128)
    sd["transformer.wpe.weight"] = torch.cat([sd["transformer.wpe.weight"], torch.zeros(T - 128, 64)])
    with torch.no_grad():
        ref = batch_losses(model, *reorder(single))
        for attn_impl in ("sdpa", "naive"):
            wide = GPT(GPTConfig(**{**asdict(model.config), "attn_impl": attn_impl, "block_size": T})).eval()
            wide.load_state_dict(sd)
            got = batch_losses(wide, *reorder(shared))
            for a, b in zip(ref, got):
                assert torch.allclose(a, b, atol=1e-4), attn_impl
    loop = torch.stack([score_one(model, ex)[0] for ex in examples])  # (9, 4)
    assert torch.allclose(got[0].view(9, 4), loop, atol=1e-4)


def test_pack_rows_fills_rows_best_fit():
    lengths = [6, 5, 4, 3, 2, 9, 1, 1]
    exs = [{"index": i, "ctx_tokens": [0] * n, "ending_tokens": [[0]] * 4} for i, n in enumerate(lengths)]
    assert [packed_len(ex) for ex in exs] == lengths  # endings of 1 token feed nothing in
    rows = pack_rows(exs, 10)
    assert sorted(ex["index"] for row in rows for ex in row) == list(range(8))  # each example once
    assert all(sum(packed_len(ex) for ex in row) <= 10 for row in rows)
    assert [[packed_len(ex) for ex in row] for row in rows] == [[9, 1], [6, 4], [5, 3, 2], [1]]
    assert pack_rows(exs[:1], 6) == [[exs[0]]]


def test_too_long_to_pack_falls_back_to_rows(model, tmp_path, monkeypatch):
    # ctx + 4 endings is longer than block_size 128, each ctx + ending is not: 4 rows, nothing cut
    rows = make_rows(3, seed=7, ctx_words=(50, 60), end_words=(18, 22)) + make_rows(2, seed=8)
    examples = load_examples(data_file=write_rows(tmp_path / "mixed.jsonl", rows))
    assert [packable(ex, 128) for ex in examples] == [False] * 3 + [True] * 2
    assert not any(rows_of(ex, 128)[2] for ex in examples)
    calls = []
    monkeypatch.setattr(hellaswag, "collate_packed",
                        lambda b, shape=None: calls.append(len(b)) or collate_packed(b, shape))
    res = evaluate(model, examples, plan=CPU, batch_size=4)
    assert calls == [2] and res["truncated"] == 0 and res["n"] == 5
    loop = [score_one(model, ex) for ex in examples]
    assert [r["pred"] for r in res["examples"]] == [s.argmin().item() for s, _ in loop]
    assert [r["pred_norm"] for r in res["examples"]] == [m.argmin().item() for _, m in loop]

def test_padding_does_not_change_scores(model, examples):
    batch = examples[:5]
    with torch.no_grad():
        idx, *rest, _ = collate(batch, 128)
        tight = batch_losses(model, idx, ScoredTokens(*rest))
        idx, *rest, _ = collate(batch, 128, shape=(32, 120))  # extra rows and columns of padding
        assert idx.shape == (32, 120)
        padded = batch_losses(model, idx, ScoredTokens(*rest))
    for a, b in zip(tight, padded):
        assert torch.allclose(a, b[:20], atol=1e-4)
        assert (a.view(5, 4).argmin(1) == b[:20].view(5, 4).argmin(1)).all()
    assert (padded[0][20:] == 0).all()  # padding rows score nothing


def test_long_rows_are_cut_from_the_left(hf_dir, model, tmp_path):
    rows = make_rows(2, seed=5, ctx_words=(150, 200)) + make_rows(1, seed=6)  # 2 exceed block_size 128
    examples = load_examples(data_file=write_rows(tmp_path / "long.jsonl", rows))
    ref_sum, ref_mean = hf_scores(hf_dir, rows, block_size=128)
    res = evaluate(model, examples, plan=CPU, batch_size=2)
    assert res["truncated"] == 2
    assert [r["pred"] for r in res["examples"]] == ref_sum.argmin(dim=1).tolist()
    assert [r["pred_norm"] for r in res["examples"]] == ref_mean.argmin(dim=1).tolist()
    s, m = score_one(model, examples[0])
    assert torch.allclose(s, ref_sum[0], atol=1e-3) and torch.allclose(m, ref_mean[0], atol=1e-4)

# -----------------------------------------------------------------------------
# acc (summed loss) vs acc_norm (per-token loss): a model whose loss depends only on the target


def constant_model():
    """ln_f's weight is zero, so every position's hidden state is its bias e_0 and the logits are
    column 0 of the tied embedding: 12 for " the", 0 elsewhere. Loss(" the") = log(e^12 + 50256) - 12
    ~ 0.27 nats, any other token log(e^12 + 50256) ~ 12.27."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, n_layer=1, n_head=1, n_embd=8))
    with torch.no_grad():
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.zero_()
        model.transformer.ln_f.bias[0] = 1.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[get_encoding().encode_ordinary(" the")[0], 0] = 12.0
    return model


def test_acc_and_acc_norm_differ_when_length_matters(tmp_path, capsys):
    hi = math.log(math.exp(12) + 50256)
    lo = hi - 12.0
    # ending 0: one costly token (lowest sum); ending 1: one costly token + five cheap ones (lowest mean)
    endings = ["dog", "dog the the the the the", "dog cat", "cat dog ball"]
    rows = [{"ctx": "A man walks his dog to the park and", "endings": endings, "label": 0},
            {"ctx": "Then the dog sits and", "endings": endings, "label": 1}]
    path = write_rows(tmp_path / "crafted.jsonl", rows)
    model = constant_model()
    s, m = score_one(model, load_examples(data_file=path)[0])
    # fp32's bound for a token's loss: log-sum-exp adds V positive terms, each addition off by at most
    # 2^-24 of the running sum (recursive summation: relative error <= (V-1) * 2^-24), and log turns that
    # relative error into the same absolute one in nats; an ending of n tokens sums n of them. torch's CPU
    # kernels differ by version (2.13: ~2.6e-4 per token here), the bound covers any order of summation.
    per_token = (50257 - 1) * 2.0 ** -24  # ~3.0e-3 nats
    n_tokens = torch.tensor([1, 6, 2, 3])
    assert (s - torch.tensor([hi, hi + 5 * lo, 2 * hi, 3 * hi])).abs().le(n_tokens * per_token).all()
    assert (m - torch.tensor([hi, (hi + 5 * lo) / 6, hi, hi])).abs().le(per_token).all()
    # through the CLI, from one of our checkpoints
    ckpt = save_ckpt(model, tmp_path / "ckpt_000010.pt")
    out = tmp_path / "res.json"
    assert hellaswag.main(["--model", ckpt, "--data", path, "--json", str(out), "--device", "cpu"]) == 0
    res = json.loads(out.read_text())
    assert res["n"] == 2 and res["acc"] == 0.5 and res["acc_norm"] == 0.5
    got = [(e["index"], e["label"], e["pred"], e["pred_norm"]) for e in res["examples"]]
    assert got == [(0, 0, 0, 1), (1, 1, 0, 1)]  # (index, label, pred by sum, pred by mean)
    assert "acc 0.5000, acc_norm 0.5000" in capsys.readouterr().out

# -----------------------------------------------------------------------------
# model paths, compile, train/eval mode


def test_cli_hf_dir_matches_checkpoint(hf_dir, model, examples, tmp_path):
    data = write_rows(tmp_path / "rows.jsonl", make_rows(9))
    ckpt = save_ckpt(model, tmp_path / "ckpt_000001.pt")
    outs = []
    for name in (hf_dir, ckpt):
        out = tmp_path / f"{len(outs)}.json"
        assert hellaswag.main(["--model", name, "--data", data, "--limit", "7", "--batch_size", "4",
                               "--json", str(out)]) == 0
        outs.append(json.loads(out.read_text()))
    assert outs[0] == outs[1] and outs[0]["n"] == 7
    loop = [score_one(model, ex) for ex in examples[:7]]
    assert [e["pred"] for e in outs[0]["examples"]] == [s.argmin().item() for s, _ in loop]
    assert [e["pred_norm"] for e in outs[0]["examples"]] == [m.argmin().item() for _, m in loop]


def counting_compile(model, graphs, backend="eager"):
    """torch.compile(model) with static shapes whose backend records the input shapes of every graph
    it is handed (one entry per compilation), then runs it with `backend` ("eager", "aot_eager", "inductor")."""
    from torch._dynamo.backends.registry import lookup_backend
    inner = lookup_backend(backend)

    def counting_backend(gm, example_inputs):
        graphs.append([tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)])
        return inner(gm, example_inputs)

    torch._dynamo.reset()
    return torch.compile(model, backend=counting_backend, dynamic=False)


def test_compiled_model_packs_compiles_once_and_mode_is_restored(model, examples, monkeypatch):
    graphs, calls = [], []
    compiled = counting_compile(model, graphs)
    model.train()
    compiled(torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 16, dtype=torch.long))  # a "training" step
    n_train = len(graphs)
    ref = evaluate(model, examples, plan=CPU, batch_size=4)  # eager, packed
    loop = [score_one(model, ex) for ex in examples]  # the one-example reference
    model.train()
    monkeypatch.setattr(hellaswag, "collate_packed",
                        lambda b, shape=None: calls.append(shape) or collate_packed(b, shape))
    first = evaluate(compiled, examples, plan=CPU, batch_size=4)  # 3 batches, the last one short
    assert model.training
    n_eval = len(graphs) - n_train
    again = evaluate(compiled, examples, plan=CPU, batch_size=4)
    model.eval()
    # packed rows at one fixed shape (4 rows, T a multiple of 16) for every batch, short or not, and call
    T = -(-max(packed_len(ex) for ex in examples) // 16) * 16
    n_rows = len(pack_rows(examples, T))
    assert n_rows < 9  # short examples share rows
    assert calls == [(4, T)] * (2 * -(-n_rows // 4))
    assert n_eval == 1 and len(graphs) == n_train + 1
    assert (4, T) in graphs[-1] and (4, T) in graphs[-1] and (4, 1, T, T) in graphs[-1]  # idx, pos ids, mask
    assert first["examples"] == again["examples"] == ref["examples"]
    assert [r["pred"] for r in first["examples"]] == [s.argmin().item() for s, _ in loop]
    assert [r["pred_norm"] for r in first["examples"]] == [m.argmin().item() for _, m in loop]
    torch._dynamo.reset()


def test_compiled_packed_scores_equal_eager(model, examples):
    """The compiled forward with pos and mask at a padded fixed shape (aot_eager: the graph autograd's
    tracer produces, as inductor gets it) gives the eager packed losses; extra rows score nothing."""
    graphs = []
    compiled = counting_compile(model, graphs, backend="aot_eager")
    batch = examples[:5]
    with torch.no_grad():
        tight = batch_losses(model, *reorder(collate_packed([[ex] for ex in batch])))
        padded = collate_packed([[ex] for ex in batch], shape=(8, 128))
        assert padded[0].shape == (8, 128) and padded[2].shape == (8, 1, 128, 128)
        got = batch_losses(compiled, *reorder(padded))
    assert len(graphs) == 1
    for a, b in zip(tight, got):
        assert torch.allclose(a, b[:20], atol=1e-4)
    assert (got[0][20:] == 0).all()
    torch._dynamo.reset()


def reorder(packed):
    """collate_packed's outputs in batch_losses' argument order."""
    idx, pos_ids, attn_mask, seq_id, pos, tgt, row_id, counts = packed
    return idx, ScoredTokens(row_id, pos, tgt, counts), (seq_id, pos_ids, attn_mask)


def test_compiled_mixed_rows_compile_once_per_path(model, tmp_path):
    # 3 examples too long to pack (4 rows each) and 4 that pack: two fixed shapes, two graphs, same answers
    rows = make_rows(3, seed=7, ctx_words=(50, 60), end_words=(18, 22)) + make_rows(4, seed=8)
    examples = load_examples(data_file=write_rows(tmp_path / "mixed.jsonl", rows))
    graphs = []
    compiled = counting_compile(model, graphs)
    res = evaluate(compiled, examples, plan=CPU, batch_size=2)
    assert len(graphs) == 2
    evaluate(compiled, examples, plan=CPU, batch_size=2)
    assert len(graphs) == 2  # the next evaluation reuses both
    loop = [score_one(model, ex) for ex in examples]
    assert [r["pred"] for r in res["examples"]] == [s.argmin().item() for s, _ in loop]
    assert [r["pred_norm"] for r in res["examples"]] == [m.argmin().item() for _, m in loop]
    torch._dynamo.reset()


def test_inductor_compiled_packed_equals_eager(model, examples):
    """The real compiler (C++ codegen on a CPU): the in-training path end to end."""
    graphs = []
    compiled = counting_compile(model, graphs, backend="inductor")
    ref = evaluate(model, examples, plan=CPU, batch_size=8)
    res = evaluate(compiled, examples, plan=CPU, batch_size=8)
    assert len(graphs) == 1 and res["examples"] == ref["examples"]
    torch._dynamo.reset()


def linear_output_dtypes(model, run):
    """The dtypes every nn.Linear of model (each block's four and lm_head) output while run() ran, and its result."""
    dtypes = set()
    hooks = [m.register_forward_hook(lambda m, args, out: dtypes.add(out.dtype))
             for m in model.modules() if isinstance(m, torch.nn.Linear)]
    try:
        return dtypes, run()
    finally:
        for h in hooks:
            h.remove()


def test_bf16_autocast_runs_and_mostly_agrees(model, examples):
    """The bf16 plan runs every matmul in bf16 (its linear layers output bf16, fp32's fp32), and bf16's rounding
    changes few predictions."""
    fp32, ref = linear_output_dtypes(model, lambda: evaluate(model, examples, plan=CPU))
    bf16, res = linear_output_dtypes(model, lambda: evaluate(model, examples, plan=make_plan("cpu", "bf16")))
    assert fp32 == {torch.float32} and bf16 == {torch.bfloat16}, (fp32, bf16)
    assert res["n"] == 9
    same = sum(a["pred"] == b["pred"] for a, b in zip(ref["examples"], res["examples"]))
    assert same >= 7  # bf16 rounding may flip near-ties of a random model, not most predictions

# -----------------------------------------------------------------------------
# two processes over gloo give the single-process counts


def _worker(rank, world_size, ckpt, examples, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        model = GPT.from_checkpoint(ckpt)
        res = evaluate(model, examples, plan=CPU, batch_size=2)  # rank, world_size: the group's
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(res, f)
    finally:
        dist.destroy_process_group()


def test_two_process_gloo_equals_one_process(model, examples, tmp_path):
    ckpt = save_ckpt(model, tmp_path / "ckpt.pt")
    mp.spawn(_worker, args=(2, ckpt, examples, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    single = evaluate(model, examples, plan=CPU, batch_size=2)
    for r in ranks:
        assert (r["n"], r["acc"], r["acc_norm"]) == (single["n"], single["acc"], single["acc_norm"])
    assert sorted(ranks[0]["examples"] + ranks[1]["examples"], key=lambda e: e["index"]) == single["examples"]
    assert [len(r["examples"]) for r in ranks] == [5, 4]

# -----------------------------------------------------------------------------
# bad input


GOOD = {"ctx": "A man plays", "endings": ["a", "b", "c", "d"], "label": 2}


@pytest.mark.parametrize("bad, message", [
    ({**GOOD, "endings": ["a", "b", "c"]}, "'endings' must be a list of 4 strings, got 3 items"),
    ({**GOOD, "label": 4}, "'label' must be 0, 1, 2 or 3, got 4"),
    ({k: v for k, v in GOOD.items() if k != "ctx"}, "missing or empty 'ctx'"),
    ({k: v for k, v in GOOD.items() if k != "label"}, "no 'label'"),
    ('{"ctx": "A man", "endings": [', "not valid JSON"),
])
def test_malformed_row_names_the_row(tmp_path, bad, message):
    path = write_rows(tmp_path / "bad.jsonl", [GOOD, GOOD, bad, GOOD])
    with pytest.raises(HellaSwagError) as e:
        load_examples(data_file=path)
    assert f"{path} row 3: {message}" in str(e.value) and "\n" not in str(e.value)


def test_cli_errors_are_one_line(tmp_path, hf_dir, capsys):
    bad = write_rows(tmp_path / "bad.jsonl", [GOOD, {**GOOD, "label": -1}])
    cases = [["--data", bad, "--model", hf_dir],
             ["--data", str(tmp_path / "nope.jsonl")],
             ["--split", "test"],
             ["--data", write_rows(tmp_path / "ok.jsonl", [GOOD]), "--model", str(tmp_path / "ckpt_missing.pt")],
             ["--data", bad, "--model", hf_dir, "--limit", "0"],
             ["--data", bad, "--model", hf_dir, "--json", str(tmp_path / "no_dir" / "out.json")]]
    if not torch.cuda.is_available():
        cases.append(["--data", write_rows(tmp_path / "ok.jsonl", [GOOD]), "--model", hf_dir, "--device", "cuda"])
    for argv in cases:
        code = hellaswag.main(argv)
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]  # transformers may draw its loading bar before it
        assert code == 2 and last.startswith("error: ") and err.count("error: ") == 1, (argv, err)
        assert "Traceback" not in err
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\x80\x81 not text\n")
    with pytest.raises(HellaSwagError, match="is not UTF-8 text"):
        load_examples(data_file=str(binary))
    not_ckpt = tmp_path / "ckpt_bad.pt"
    not_ckpt.write_text("not a checkpoint")
    with pytest.raises(UserError, match="ckpt_bad.pt is not a readable train_gpt2.py checkpoint"):
        hellaswag.load_model(str(not_ckpt))


def test_missing_file_offline_says_where_to_put_it(tmp_path, monkeypatch):
    path = tmp_path / "hellaswag_val.jsonl"
    with pytest.raises(HellaSwagError) as e:
        load_examples("val", data_dir=str(tmp_path), download=False)
    assert str(path) in str(e.value) and hellaswag.URL.format(split="val") in str(e.value)

    def offline(url, timeout):
        raise urllib.error.URLError("Name or service not known")
    monkeypatch.setattr(hellaswag.urllib.request, "urlopen", offline)
    with pytest.raises(HellaSwagError, match=r"could not download .*\(Name or service not known\): save that file as"):
        load_examples("val", data_dir=str(tmp_path))
    assert os.listdir(tmp_path) == []  # no partial file left behind


def test_the_trainers_offline_hellaswag_error_gives_each_advice_once(data_dir, tmp_path, monkeypatch, capsys):
    """Issue 44 item 8: the trainer with HellaSwag on and no network said "... or pass --hellaswag_file=FILE.jsonl
    (set --hellaswag_file=PATH or --hellaswag_interval=0)": the same advice twice. Now each way once."""
    import train_gpt2
    from conftest import one_line, tiny_args

    def offline(url, timeout):
        raise urllib.error.URLError("Name or service not known")
    monkeypatch.setattr(hellaswag.urllib.request, "urlopen", offline)
    monkeypatch.setattr(hellaswag, "DEFAULT_DIR", str(tmp_path / "hellaswag"))  # no file there: a download
    out = tmp_path / "out"
    assert train_gpt2.main(tiny_args(data_dir, str(out), vocab_size=50304, hellaswag_interval=4)) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith("error: cannot load HellaSwag: could not download ") and "(Name or service not known)" \
        in line, line
    assert line.count("--hellaswag_file") == 1 and line.count("--hellaswag_interval=0") == 1, line
    assert line.endswith(f"save that file as {tmp_path / 'hellaswag' / 'hellaswag_val.jsonl'} yourself, or pass "
                         "--hellaswag_file=FILE.jsonl, or --hellaswag_interval=0 to train without it"), line
    assert not out.exists()


def test_download_is_cached(tmp_path, monkeypatch):
    body = "".join(json.dumps(r) + "\n" for r in make_rows(3)).encode()
    urls = []

    def fake(url, timeout):
        urls.append(url)
        return io.BytesIO(body)
    monkeypatch.setattr(hellaswag.urllib.request, "urlopen", fake)
    first = load_examples("train", data_dir=str(tmp_path))
    again = load_examples("train", data_dir=str(tmp_path))
    assert urls == ["https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_train.jsonl"]
    assert first == again and len(first) == 3 and os.listdir(tmp_path) == ["hellaswag_train.jsonl"]

# -----------------------------------------------------------------------------
# dev/hellaswag_bench.py: the agreement it reports and the tolerance it exits on


def test_hellaswag_bench_reports_agreement_and_fails_only_below_its_tolerance(capsys, monkeypatch):
    """fp32 on CPU: every prediction agrees (exit 0); a tolerance no run can meet exits 1 with one line saying
    the share; a flipped prediction (the batched run's acc changed for one example) is counted with its margin."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("hellaswag_bench", os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dev", "hellaswag_bench.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--limit", "3", "--device", "cpu"]) == 0
    assert "predictions (acc and acc_norm) agreeing: 100.00% (0 of 6 differ)" in capsys.readouterr().out
    assert bench.main(["--limit", "3", "--device", "cpu", "--min_agree", "1.01"]) == 1
    assert "error: 100.00% of the predictions agree, below --min_agree=1.01" in capsys.readouterr().err
    real = bench.evaluate

    def one_flipped(*args, **kwargs):
        res = real(*args, **kwargs)
        res["examples"][0]["pred"] = (res["examples"][0]["pred"] + 1) % 4
        return res
    monkeypatch.setattr(bench, "evaluate", one_flipped)
    assert bench.main(["--limit", "3", "--device", "cpu", "--min_agree", "0.8"]) == 0  # 5 of 6 = 83%
    out = capsys.readouterr().out
    assert "agreeing: 83.33% (1 of 6 differ; their one-at-a-time margins: at most " in out
    assert bench.main(["--limit", "3", "--device", "cpu"]) == 1  # fp32's default: all must agree
