"""
A GGUF file of one of our GPT-2s, for llama.cpp and what is built on it (Ollama, LM Studio,
llama-cpp-python): llama.cpp's `gpt2` architecture, its tensor names and metadata, GPT-2's BPE
tokenizer. Written and quantized by the `gguf` package, llama.cpp's own Python library (optional:
`pip install gguf`, in requirements-dev.txt). From the command line, through export.py:

    python export.py out/quickstart out/quickstart.gguf  # a run's newest checkpoint, f16
    python export.py out/quickstart/ckpt_000160.pt q8.gguf --type q8_0  # f32, f16 or q8_0

    from gpt2train.gguf_export import write_gguf
    write_gguf(model, "out.gguf", "q8_0")

The weights go in as they are: llama.cpp's gpt2 matrices are (out, in) like our nn.Linear (its
converter transposes Hugging Face's Conv1D into that layout). The padded 50304 vocabulary is cropped
to GPT-2's 50257 tokens; the output layer is left out, as llama.cpp ties it to token_embd when
absent. Nothing imports this file but model.py's command line, inside the command.
"""
import os

import torch

from gpt2train.fileio import UserError, replacing
from gpt2train.tokenizer import EOT, gpt2_bpe

TYPES = ("f32", "f16", "q8_0")


def import_gguf():
    try:
        import gguf
    except ImportError:
        raise UserError("writing a .gguf file needs the gguf package (llama.cpp's own Python "
                        "library): run `pip install gguf`") from None
    return gguf


def check_type(type_name):
    if type_name not in TYPES:
        raise UserError(f"--type {type_name!r} is not one of {', '.join(TYPES)}")


def tensor_type(gguf, name, array, qtype):
    """The ggml type one tensor is stored in, as llama.cpp's converter picks it: vectors (norms,
    biases) and the position embedding in f32; the other matrices in qtype, f16 where a row does not
    split into q8_0's 32-value blocks."""
    T = gguf.GGMLQuantizationType
    if array.ndim == 1 or name == "position_embd.weight":
        return T.F32
    if qtype == T.Q8_0 and array.shape[-1] % gguf.GGML_QUANT_SIZES[T.Q8_0][0]:
        return T.F16
    return qtype


def gguf_tensors(gguf, model, n_vocab):
    """[(llama.cpp name, fp32 array)] of model's weights, the vocabulary cropped to n_vocab
    tokens."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT2, model.config.n_layer)
    out = []
    for key, t in model.state_dict().items():
        if key == "lm_head.weight":
            continue  # tied to wte: llama.cpp reuses token_embd when output.weight is absent
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise UserError(f"the model holds {key!r}, which llama.cpp's gpt2 has no tensor for")
        if key == "transformer.wte.weight":
            t = t[:n_vocab]  # (50257, C): the padded rows (50304) are never targets
        out.append((name, t.detach().to("cpu", torch.float32).contiguous().numpy()))
    return out


def add_metadata(writer, gguf, model, tokens, merges):
    """llama.cpp's gpt2 hyperparameters and GPT-2's tokenizer (tokens, merges, types, BOS/EOS
    ids)."""
    c = model.config
    writer.add_context_length(c.block_size)
    writer.add_embedding_length(c.n_embd)
    writer.add_block_count(c.n_layer)
    writer.add_feed_forward_length(model.transformer.h[0].mlp.c_fc.out_features)  # 4 * n_embd
    writer.add_head_count(c.n_head)
    # every LayerNorm of ours has the same eps
    writer.add_layer_norm_eps(model.transformer.ln_f.eps)
    types = [gguf.TokenType.NORMAL] * len(tokens)
    types[EOT] = gguf.TokenType.CONTROL  # <|endoftext|>: a special token, not text
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")  # llama.cpp's name for GPT-2's pre-tokenizer regex
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(EOT)
    writer.add_eos_token_id(EOT)


def write_gguf(model, path, type_name="f16", name=None):
    """Write model, a GPT-2-shaped GPT (export.py checks), as one GGUF file at path (temp file, then
    renamed; the umask's mode). type_name: f32, f16 or q8_0 for the matrices. Returns its size in
    bytes."""
    gguf = import_gguf()
    tokens, merges = gpt2_bpe()
    if model.config.vocab_size < len(tokens):
        raise ValueError(f"vocab_size {model.config.vocab_size} < GPT-2's {len(tokens)} tokens")
    check_type(type_name)
    T = gguf.GGMLQuantizationType
    qtype = {"f32": T.F32, "f16": T.F16, "q8_0": T.Q8_0}[type_name]
    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
             "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[type_name]
    # general.name: the file's, by default
    name = name or os.path.splitext(os.path.basename(path))[0]
    with replacing(path) as tmp:
        writer = gguf.GGUFWriter(tmp, "gpt2")
        try:
            writer.add_name(name)
            writer.add_file_type(ftype)
            add_metadata(writer, gguf, model, tokens, merges)
            for tname, array in gguf_tensors(gguf, model, len(tokens)):
                ttype = tensor_type(gguf, tname, array, qtype)
                # q8_0: uint8 (rows, 34 bytes per 32 values)
                data = gguf.quants.quantize(array, ttype)
                writer.add_tensor(tname, data, raw_dtype=ttype if ttype == T.Q8_0 else None)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()
    return os.path.getsize(path)
