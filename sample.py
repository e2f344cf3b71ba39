"""
Text from a GPT-2: one of train_gpt2.py's checkpoints, a save_pretrained directory (model.py export)
or an OpenAI name (gpt2 .. gpt2-xl, from the Hugging Face hub on first use).

    python sample.py --model out/gpt2_124m/ckpt_019073.pt --prompt "Hello, I'm a language model,"
    python sample.py --model out/hf --prompt_file prompt.txt --num_samples 3 --max_new_tokens 200
    python sample.py --model gpt2 --prompt "The meaning of life is" --temperature 0     # greedy

Each sample is printed token by token as it is generated, on stdout (status lines go to stderr). A
sample ends after --max_new_tokens or at <|endoftext|>, as transformers' generate() does. With no
prompt, samples start from <|endoftext|>, i.e. from the start of a document. The same --seed on the
same device and precision gives the same text.
"""
import argparse
import codecs
import dataclasses
import sys

import torch

from model import load_model
from tokenizer import EOT, TokenizerError, get_encoding


class SampleError(Exception):
    """Bad input: main() prints `error: <message>` on one line and exits 2."""

# -----------------------------------------------------------------------------
# LOCAL SHIM, to be replaced at merge by `from precision import resolve_device, make_plan, autocast`
# and model.GPT.load (same names and meaning; this copy only knows what sampling needs).


@dataclasses.dataclass(frozen=True)
class Plan:
    device: str
    dtype: torch.dtype  # autocast dtype; float32 means no autocast

    @property
    def device_type(self):
        return torch.device(self.device).type


def resolve_device(name="auto"):
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    kind = name.partition(":")[0]
    if kind not in ("cpu", "cuda", "mps"):
        raise SampleError(f"--device {name!r} is not one of auto, cpu, cuda, cuda:N, mps")
    if kind == "cuda" and not torch.cuda.is_available():
        raise SampleError(f"--device {name} but this torch ({torch.__version__}) sees no CUDA GPU: use --device cpu")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise SampleError("--device mps but MPS is not available here: use --device cpu")
    return "cuda:0" if name == "cuda" else name


def make_plan(device, precision="auto"):
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    cap = torch.cuda.get_device_capability(device) if torch.device(device).type == "cuda" else None
    if precision == "auto":
        precision = "fp32" if cap is None or cap[0] < 7 else "fp16" if cap[0] == 7 else "bf16"
    if precision == "bf16" and cap is not None and cap[0] < 8:
        raise SampleError(f"--precision bf16 needs an sm80+ GPU; this one is sm{cap[0]}{cap[1]}: use fp16 or fp32")
    return Plan(device, dtypes[precision])


def autocast(plan):
    return torch.autocast(plan.device_type, dtype=plan.dtype, enabled=plan.dtype != torch.float32)

# END OF LOCAL SHIM
# -----------------------------------------------------------------------------
# sampling


def generate_tokens(model, prompt_ids, max_new_tokens, temperature, top_k, generator, plan):
    """Yield the new token ids one at a time, <|endoftext|> included (and last) if the model emits it.
    One GPT.generate step per token with the same generator: the very tokens of one long generate call."""
    idx = torch.tensor([prompt_ids], dtype=torch.long, device=plan.device)  # (1, T)
    for _ in range(max_new_tokens):
        with autocast(plan):
            idx = model.generate(idx, 1, temperature=temperature, top_k=top_k, generator=generator)
        token = idx[0, -1].item()
        yield token
        if token == EOT:
            return


def stream_text(enc, token_ids):
    """Yield the text of token_ids piece by piece. A character split across tokens (emoji, CJK) is held
    back until complete, so the pieces join to exactly enc.decode(token_ids)."""
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
        raise SampleError("give --prompt or --prompt_file, not both")
    text = args.prompt or ""
    if args.prompt_file is not None:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise SampleError(f"--prompt_file {args.prompt_file}: {getattr(e, 'strerror', None) or e}") from None
    return text, enc.encode(text, allowed_special={"<|endoftext|>"}) or [EOT]

# -----------------------------------------------------------------------------
# command line


def main(argv=None):
    p = argparse.ArgumentParser(description="Sample text from a GPT-2 checkpoint, save_pretrained dir or GPT-2 name.")
    p.add_argument("--model", required=True, help="a ckpt_*.pt, a save_pretrained directory, or gpt2 .. gpt2-xl")
    p.add_argument("--prompt", default=None, help="text to continue (default: start a new document)")
    p.add_argument("--prompt_file", default=None, help="read the prompt from this UTF-8 file")
    p.add_argument("--num_samples", type=int, default=3)
    p.add_argument("--max_new_tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (argmax)")
    p.add_argument("--top_k", type=int, default=50, help="sample from the k most likely tokens; 0 = all")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N, mps")
    p.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                   help="autocast dtype; auto = bf16 on sm80+, fp16 on sm7x, else fp32")
    args = p.parse_args(argv)
    say = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731 - status lines stay out of the text
    try:
        for key in ("num_samples", "max_new_tokens"):
            if getattr(args, key) < 1:
                raise SampleError(f"--{key} must be at least 1, got {getattr(args, key)}")
        if args.temperature < 0 or args.top_k < 0:
            raise SampleError(f"--temperature and --top_k must not be negative, got {args.temperature} and {args.top_k}")
        enc = get_encoding()
        text, prompt_ids = read_prompt(args, enc)
        plan = make_plan(resolve_device(args.device), args.precision)
        try:
            model = load_model(args.model, verbose=False)
        except ValueError as e:
            raise SampleError(str(e)) from None
        if model.config.vocab_size < enc.n_vocab:
            raise SampleError(f"{args.model} has vocab_size {model.config.vocab_size}, fewer than GPT-2's {enc.n_vocab} tokens")
    except (SampleError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    model.to(plan.device).eval()
    say(f"{args.model}: {model.num_params(non_embedding=False):,} parameters on {plan.device}, "
        f"{str(plan.dtype).replace('torch.', '')}, {len(prompt_ids)} prompt tokens, seed {args.seed}")
    generator = torch.Generator(device=plan.device).manual_seed(args.seed)
    for i in range(args.num_samples):
        sys.stdout.write(text)
        tokens = generate_tokens(model, prompt_ids, args.max_new_tokens, args.temperature, args.top_k or None,
                                 generator, plan)
        for piece in stream_text(enc, (t for t in tokens if t != EOT)):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n" + ("-" * 40 + "\n" if i < args.num_samples - 1 else ""))
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
