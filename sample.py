"""
Text from a GPT-2: one of train_gpt2.py's checkpoints, a save_pretrained directory (export.py)
or an OpenAI name (gpt2 .. gpt2-xl, from the Hugging Face hub on first use).

    python sample.py --model out/gpt2_124m/ckpt_019073.pt --prompt "Hello, I'm a language model,"
    python sample.py --model out/quickstart --prompt "def"  # a run's folder: its newest checkpoint
    python sample.py --model out/hf --prompt_file prompt.txt --num_samples 3 --max_new_tokens 200
    python sample.py --model gpt2 --prompt "The meaning of life is" --temperature 0  # greedy

Each sample is printed token by token as it is generated, on stdout (status lines go to stderr). A
sample ends after --max_new_tokens or at <|endoftext|>, as transformers' generate() does. With no
prompt, samples start from <|endoftext|>, i.e. from the start of a document. The same --seed on the
same device and precision gives the same text. Greedy decoding (--temperature 0, or --top_k 1) has
one answer, so it prints one sample whatever --num_samples says.
"""
import codecs
import sys

import torch

from gpt2train import precision
from gpt2train.fileio import ArgumentParser, UserError, fail
from model import GPT
from gpt2train.checkpoint import newest_checkpoint
from gpt2train.logger import redirect0
from gpt2train.tokenizer import EOT, get_encoding

# -----------------------------------------------------------------------------
# sampling


def generate_tokens(model, prompt_ids, max_new_tokens, plan, **sampling):
    """Yield the new token ids one at a time, <|endoftext|> included (and last) if the model emits
    it. sampling: GPT.generate's temperature, top_k and generator. One GPT.generate step per token
    with the same generator: the very tokens of one long generate call."""
    idx = torch.tensor([prompt_ids], dtype=torch.long, device=plan.device)  # (1, T)
    for _ in range(max_new_tokens):
        with precision.autocast(plan):
            idx = model.generate(idx, 1, **sampling)
        token = idx[0, -1].item()
        yield token
        if token == EOT:
            return


def sample_batch(model, plan, prompt, num_samples, max_new_tokens, seed):
    """num_samples top-k (50) continuations of prompt at once (an empty one: a new document, after
    <|endoftext|>), the trainer's periodic samples: a generator of their own, seeded afresh each
    time, so that sampling never moves the training RNG (resumed runs stay bit-exact)."""
    enc = get_encoding()
    ids = enc.encode_ordinary(prompt) or [EOT]
    idx = torch.tensor(ids, dtype=torch.long, device=plan.device)
    idx = idx.unsqueeze(0).repeat(num_samples, 1)  # (num_samples, T0)
    gen = torch.Generator(device=plan.device).manual_seed(seed)
    model.eval()
    with precision.autocast(plan):
        out = model.generate(idx, max_new_tokens, temperature=1.0, top_k=50, generator=gen)
    model.train()
    return [enc.decode(row.tolist()) for row in out]


def stream_text(enc, token_ids):
    """Yield the text of token_ids piece by piece. A character split across tokens (emoji, CJK) is
    held back until complete, so the pieces join to exactly enc.decode(token_ids)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for t in token_ids:
        piece = decoder.decode(enc.decode_single_token_bytes(t))
        if piece:
            yield piece
    tail = decoder.decode(b"", final=True)
    if tail:
        yield tail


def read_prompt(args, enc):
    if args.prompt is not None and args.prompt_file is not None:
        raise UserError("give --prompt or --prompt_file, not both")
    text = args.prompt or ""
    if args.prompt_file is not None:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            reason = getattr(e, 'strerror', None) or e
            raise UserError(f"--prompt_file {args.prompt_file}: {reason}") from None
    return text, enc.encode(text, allowed_special={"<|endoftext|>"}) or [EOT]

# -----------------------------------------------------------------------------
# command line


def main(argv=None):
    try:
        args = parse_args(argv)
        # first: a GPU torch cannot use is one line, not a CPU run
        device = precision.resolve_device(args.device)
        enc = get_encoding()
        text, prompt_ids = read_prompt(args, enc)
        plan = precision.make_plan(device, args.precision, compile=False)
        model = load_model(args, enc)
    except (UserError, OSError) as e:
        return fail(e)
    model.to(plan.device).eval()
    say(f"{args.model}: {model.num_params(non_embedding=False):,} parameters on {plan.device}, "
        f"{plan.describe()}, {len(prompt_ids)} prompt tokens, seed {args.seed}")
    generator = torch.Generator(device=plan.device).manual_seed(args.seed)
    num_samples = samples_to_print(args)
    for i in range(num_samples):
        sys.stdout.write(text)
        tokens = generate_tokens(model, prompt_ids, args.max_new_tokens, plan,
                                 temperature=args.temperature, top_k=args.top_k or None,
                                 generator=generator)
        for piece in stream_text(enc, (t for t in tokens if t != EOT)):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n" + ("-" * 40 + "\n" if i < num_samples - 1 else ""))
        sys.stdout.flush()
    return 0


def parse_args(argv):
    p = ArgumentParser(prog="sample.py",
                       description="Sample text from a GPT-2 checkpoint, save_pretrained dir or "
                                   "GPT-2 name.")
    p.add_argument("--model", required=True,
                   help="a ckpt_*.pt, a run's out_dir (its newest ckpt), a save_pretrained dir, or "
                        "gpt2 .. gpt2-xl")
    p.add_argument("--prompt", default=None,
                   help="text to continue (default: start a new document)")
    p.add_argument("--prompt_file", default=None, help="read the prompt from this UTF-8 file")
    p.add_argument("--num_samples", type=int, default=3)
    p.add_argument("--max_new_tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (argmax): one sample")
    p.add_argument("--top_k", type=int, default=50,
                   help="sample from the k most likely tokens; 0 = all")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N, mps")
    p.add_argument("--precision", default="auto", choices=precision.PRECISIONS,
                   help="autocast dtype; auto = bf16 on sm80+, fp16 on sm7x, else fp32")
    args = p.parse_args(argv)
    for key in ("num_samples", "max_new_tokens"):
        if getattr(args, key) < 1:
            raise UserError(f"--{key} must be at least 1, got {getattr(args, key)}")
    if not args.temperature >= 0 or args.top_k < 0:  # (NaN fails >= 0 too)
        raise UserError("--temperature and --top_k must not be negative, got "
                        f"{args.temperature} and {args.top_k}")
    return args


def load_model(args, enc):
    """The GPT that --model names (a run's folder: its newest checkpoint), checked against the
    tokenizer's vocabulary."""
    with redirect0(sys.stderr):  # a run's out_dir: its newest readable ckpt_*.pt (skips said)
        path = newest_checkpoint(args.model)
    if path != args.model:
        say(f"{args.model} is a training run's folder: sampling from its newest checkpoint, "
            f"{path}")
    with redirect0(None):  # the text alone on stdout
        model = GPT.load(path)
    if model.config.vocab_size < enc.n_vocab:
        raise UserError(f"{args.model} has vocab_size {model.config.vocab_size}, fewer than "
                        f"GPT-2's {enc.n_vocab} tokens")
    return model


def samples_to_print(args):
    """--num_samples, or 1 where decoding is greedy: every sample would be the same text."""
    if (args.temperature == 0 or args.top_k == 1) and args.num_samples > 1:
        what = "--temperature 0" if args.temperature == 0 else "--top_k 1"
        say(f"note: {what} is greedy decoding, the same text every time: printing 1 sample, not "
            f"{args.num_samples}")
        return 1
    return args.num_samples


def say(*a):
    print(*a, file=sys.stderr, flush=True)  # status lines stay out of the text

if __name__ == "__main__":
    sys.exit(main())
