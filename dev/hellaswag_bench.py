"""
hellaswag.py's batched, packed scoring against the one-example-at-a-time loop (score_one), examples/s.

    python dev/hellaswag_bench.py                     # a tiny random GPT-2 on 200 synthetic rows
    python dev/hellaswag_bench.py --model scratch --data data/hellaswag/hellaswag_val.jsonl --compile
    python dev/hellaswag_bench.py --model scratch --limit 10042 --compile   # synthetic rows

Reports how often the two agree on the predictions (acc and acc_norm). In fp32 they must agree on every one;
in bf16/fp16 the batched rows round differently from one example's, so an example whose two best endings score
within the dtype's rounding can flip: --min_agree (default 0.995 there) is the share below which it exits 1,
and the flipped examples' margins (the one-at-a-time gap between their two best endings) are printed.
Results: dev/README.md.
"""
import json
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from gpt2train import precision  # noqa: E402
from gpt2train.fileio import ArgumentParser, UserError, fail  # noqa: E402
from gpt2train.tokenizer import get_encoding  # noqa: E402
from hellaswag import HellaSwagError, evaluate, is_compiled, load_examples, load_model, score_one  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402


def synthetic_rows(n, seed=0):
    """n HellaSwag-format rows of random English words (from the GPT-2 vocabulary) with
    HellaSwag-like lengths, for the benchmark."""
    enc = get_encoding()
    words = [w for w in (enc.decode([i]) for i in range(enc.n_vocab - 1))
             if w.startswith(" ") and w[1:].isalpha() and w[1:].islower() and len(w) > 3]
    rng = random.Random(seed)
    sentence = lambda k: " ".join(w.strip() for w in rng.choices(words, k=k)).capitalize() + "."  # noqa: E731
    return [{"ind": i, "ctx": sentence(rng.randint(15, 70)), "label": rng.randrange(4),
             "endings": [sentence(rng.randint(5, 35)) for _ in range(4)]} for i in range(n)]


def bench(model, examples, plan, batch_size):
    """examples/s of evaluate() against the score_one() loop on the same model and rows. The two
    alternate chunk by chunk, so that a machine busy with other work slows both alike. A compiled
    model is warmed up and timed on all the rows at once: its fixed shape comes from the rows it is
    given, so each new chunk would compile again (score_one runs its eager module)."""
    raw = getattr(model, "_orig_mod", model)
    raw.eval()
    for ex in examples[:2]:  # warm-up
        score_one(raw, ex, plan)
    chunk_size = len(examples) if is_compiled(model) else 4 * batch_size
    warm = examples[:chunk_size] if is_compiled(model) else examples[:batch_size]
    evaluate(model, warm, plan=plan, batch_size=batch_size)
    t_loop = t_batch = 0.0
    flipped = []  # the one-at-a-time margin (nats) of each prediction the batched run gave differently
    for i in range(0, len(examples), chunk_size):
        chunk = examples[i:i + chunk_size]
        t0 = time.perf_counter()
        loop = [score_one(raw, ex, plan) for ex in chunk]
        t1 = time.perf_counter()
        res = evaluate(model, chunk, plan=plan, batch_size=batch_size)
        t2 = time.perf_counter()
        t_loop, t_batch = t_loop + t1 - t0, t_batch + t2 - t1
        for r, scores in zip(res["examples"], loop):
            for key, score in zip(("pred", "pred_norm"), scores):
                if r[key] != score.argmin().item():
                    two = score.float().sort().values[:2]
                    flipped.append((two[1] - two[0]).item())
    agree = 1 - len(flipped) / (2 * len(examples))
    print(f"one example per forward: {len(examples) / t_loop:8.1f} examples/s")
    print(f"batched ({batch_size:3d} examples{', compiled' if is_compiled(model) else ''}): "
          f"{len(examples) / t_batch:8.1f} examples/s ({t_loop / t_batch:.1f}x)")
    margins = f"; their one-at-a-time margins: at most {max(flipped):.2e} nats" if flipped else ""
    print(f"predictions (acc and acc_norm) agreeing: {agree:.2%} ({len(flipped)} of {2 * len(examples)} "
          f"differ{margins})")
    return agree


def main(argv=None):
    p = ArgumentParser(prog="dev/hellaswag_bench.py", description="HellaSwag scoring: batched vs one example")
    p.add_argument("--model", default=None, help="as hellaswag.py's --model; default: a tiny random GPT-2")
    p.add_argument("--data", default=None, help="a local jsonl file in the HellaSwag format; default: synthetic rows")
    p.add_argument("--limit", type=int, default=None, help="the first N examples (synthetic: N rows, default 200)")
    p.add_argument("--device", default="auto", help="auto (default: cuda if available), cpu, cuda, cuda:N, mps")
    p.add_argument("--precision", default="auto", choices=precision.PRECISIONS, help="as hellaswag.py's")
    p.add_argument("--batch_size", type=int, default=16, help="examples (4 rows each) per forward pass")
    p.add_argument("--compile", action="store_true", help="torch.compile the model first (as in training)")
    p.add_argument("--min_agree", type=float, default=None,
                   help="the share of predictions that must agree, else exit 1 (default: 1 in fp32, 0.995 in 16-bit)")
    try:
        args = p.parse_args(argv)
        plan = precision.make_plan(precision.resolve_device(args.device), args.precision, compile=args.compile)
        if args.limit is not None and args.limit < 1:
            raise HellaSwagError(f"--limit must be at least 1, got {args.limit}")
        if args.data is None:
            with tempfile.TemporaryDirectory() as d:
                rows = synthetic_rows(args.limit or 200)
                with open(os.path.join(d, "rows.jsonl"), "w") as f:
                    f.writelines(json.dumps(r) + "\n" for r in rows)
                examples = load_examples(data_file=os.path.join(d, "rows.jsonl"))
        else:
            examples = load_examples("val", args.data)[:args.limit]
        if args.model is None:
            torch.manual_seed(0)
            model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64))
            print("model: a tiny random GPT-2 (2 layers, n_embd 64, the tests' size)")
        else:
            model = load_model(args.model)
        model = precision.compile_model(model.to(plan.device), plan)
    except (UserError, OSError) as e:
        return fail(e)
    print(f"benchmark: {len(examples)} examples on {plan.device}, {torch.get_num_threads()} threads, "
          f"{plan.describe()}")
    need = args.min_agree if args.min_agree is not None else 1.0 if plan.dtype == torch.float32 else 0.995
    agree = bench(model, examples, plan, args.batch_size)
    if agree < need:
        print(f"error: {agree:.2%} of the predictions agree, below --min_agree={need}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
