"""
A trained GPT-2 out to other tools: a Hugging Face directory or one GGUF file.

    python export.py out/ckpt_019073.pt out/hf            # a Hugging Face folder and tokenizer
    python export.py out/gpt2_124m gpt2.gguf --type q8_0  # one GGUF file for llama.cpp / Ollama
    python export.py --help                               # the usage

The export directory loads offline with AutoTokenizer, AutoModelForCausalLM and
pipeline("text-generation"); the source may also be a run's out_dir (its newest checkpoint), a
save_pretrained directory or a GPT-2 name. The .gguf file (gpt2train/gguf_export.py; --type f32, f16
or q8_0) runs in llama.cpp's gpt2 architecture; it needs `pip install gguf`.
"""
import errno
import os
import re
import sys

from gpt2train.checkpoint import newest_checkpoint
from gpt2train.fileio import UserError, fail, replacing_dir
import torch

from model import CONV1D_WEIGHTS, GPT, GPT2_VOCAB_SIZE

# what save_pretrained and write_hf_tokenizer put in a directory: an OUT_DIR holding only these is a
# previous export and may be replaced; anything else (a run's checkpoints, say) is never deleted
EXPORT_FILES = re.compile(r"config\.json|generation_config\.json|"
                          r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?|"
                          r"vocab\.json|merges\.txt|tokenizer(_config)?\.json|"
                          r"special_tokens_map\.json")



def load_for_export(src):
    """The model an export writes: SRC as sample.py's --model takes it (a run's out_dir: its newest
    checkpoint), refused unless GPT-2's tokenizer covers its vocabulary."""
    model = GPT.load(newest_checkpoint(src))
    if model.config.vocab_size < GPT2_VOCAB_SIZE:
        raise UserError(f"{src} has vocab_size {model.config.vocab_size}, fewer than GPT-2's "
                        f"{GPT2_VOCAB_SIZE} tokens: its tokenizer is not GPT-2's, so there is "
                        "nothing to export it with")
    return model


def save_hf(model, out_dir):
    """Write model as a directory that GPT2LMHeadModel.from_pretrained loads with the same logits; a
    padded vocab (50304) is cropped back to the 50257 real tokens."""
    from transformers import GPT2Config, GPT2LMHeadModel
    c = model.config
    vocab = min(c.vocab_size, GPT2_VOCAB_SIZE)
    hf_config = GPT2Config(vocab_size=vocab, n_positions=c.block_size, n_embd=c.n_embd,
                           n_layer=c.n_layer, n_head=c.n_head, activation_function="gelu_new",
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                           layer_norm_epsilon=1e-5, tie_word_embeddings=True)
    hf = GPT2LMHeadModel(hf_config)
    sd_hf = hf.state_dict()
    with torch.no_grad():
        for k, v in model.state_dict().items():
            if k.endswith(CONV1D_WEIGHTS):  # HF's Conv1D stores (in, out)
                v = v.t()
            if k in ("transformer.wte.weight", "lm_head.weight"):
                v = v[:vocab]
            sd_hf[k].copy_(v)
    hf.save_pretrained(out_dir)


def export(src, out_dir):
    """Write out_dir: save_hf's weights plus GPT-2's tokenizer files, built in a new directory
    beside it and swapped in only when complete."""
    from gpt2train.tokenizer import write_hf_tokenizer
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"OUT_DIR {out_dir} is a file: choose a new or empty OUT_DIR")
    if os.path.isdir(out_dir):
        others = [n for n in os.listdir(out_dir) if not EXPORT_FILES.fullmatch(n)]
        if others:
            raise UserError(f"OUT_DIR {out_dir} exists and holds {others[0]!r}, which is not part "
                            "of an export: choose a new or empty OUT_DIR")

    model = load_for_export(src)
    os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
    with replacing_dir(out_dir) as tmp:
        try:
            save_hf(model, tmp)
        # safetensors reports a failed write (a full disk) as its own error type
        except Exception as e:
            if type(e).__name__ != "SafetensorError":
                raise
            raise OSError(errno.EIO, str(e)) from None
        write_hf_tokenizer(tmp, model_max_length=model.config.block_size)
    return model


def export_gguf(src, out, type_name="f16"):
    """Write out, one GGUF file for llama.cpp (gguf_export.py), temp file then rename."""
    # only this command needs it (and gguf)
    from gpt2train.gguf_export import check_type, import_gguf, write_gguf
    import_gguf()  # no gguf package, a wrong --type: said before loading anything
    check_type(type_name)
    if os.path.isdir(out):
        raise UserError(f"OUT {out} is a folder: name the .gguf file to write")
    model = load_for_export(src)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    return write_gguf(model, out, type_name)


def split_type(args):
    """The arguments without their --type T (or --type=T), and T (None when not given)."""
    rest, type_name, it = [], None, iter(args)
    for a in it:
        if a == "--type":
            type_name = next(it, "")
        elif a.startswith("--type="):
            type_name = a[len("--type="):]
        else:
            rest.append(a)
    return rest, type_name


USAGE = "usage: python export.py SRC OUT_DIR | python export.py SRC OUT.gguf [--type f32|f16|q8_0]"
HELP = f"""{USAGE}

  SRC OUT_DIR   a Hugging Face directory (weights and GPT-2's tokenizer) from SRC: a ckpt_*.pt,
                a run's out_dir (its newest checkpoint), a save_pretrained directory or a GPT-2
                name; it loads offline with AutoTokenizer, AutoModelForCausalLM and
                pipeline("text-generation")
  SRC OUT.gguf  one GGUF file (llama.cpp's gpt2 architecture, GPT-2's tokenizer) for llama.cpp,
                Ollama, LM Studio; --type f32, f16 (the default) or q8_0 for its matrices.
                Needs the gguf package: pip install gguf"""


def main(argv):
    if argv and argv[0] in ("-h", "--help"):
        print(HELP)
        return 0
    try:
        args, type_name = split_type(argv)
        if len(args) != 2:
            raise UserError(f"expected `SRC OUT_DIR` or `SRC OUT.gguf`, got {' '.join(argv)!r}; "
                            f"{USAGE}")
        src, out = args
        if out.endswith(".gguf"):
            size = export_gguf(src, out, type_name or "f16")
        elif type_name is not None:
            raise UserError(f"--type is for a .gguf file, and {out} is not one: name it OUT.gguf")
        else:
            export(src, out)
    # OSError: no space or no permission while writing OUT (exit 1)
    except (UserError, OSError) as e:
        return fail(e)
    if out.endswith(".gguf"):
        print(f"wrote {out} ({size / 2**20:.1f} MiB, {type_name or 'f16'}): run it with "
              f"llama-cli -m {out} -p \"Hello\"")
    else:
        print(f"wrote {out}: load it with AutoModelForCausalLM / AutoTokenizer / "
              "pipeline('text-generation')")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
