"""
HellaSwag, zero-shot and completion style: which of 4 endings does the model find most likely?

    python hellaswag.py --model gpt2                # fetches hellaswag_val.jsonl once (10,042 rows)
    python hellaswag.py --model out/ckpt_019073.pt  # one of train_gpt2.py's checkpoints
    python hellaswag.py --model out/gpt2_124m       # a run's folder: its newest checkpoint
    python hellaswag.py --model out/hf --data rows.jsonl --limit 500 --json result.json
    python hellaswag.py --model gpt2 --compile      # as in training: packed rows at one fixed shape

Each ending is scored as the row context + " " + ending: the model's cross-entropy over the ending
tokens only, summed (acc: the lowest sum wins) and averaged per token (acc_norm: the lowest mean
wins). Many examples go through one forward pass and the lm_head runs only where an ending token is
predicted. Each example is packed into one row ctx + end1 + end2 + end3 + end4 (each ending at the
positions that follow the context, seeing only the context and itself), so the context is computed
once instead of 4 times; examples that do not fit block_size that way use 4 rows ctx + ending_i.
Rows are right-padded, padding never scored; score_one() is the plain one-example reference. A
compiled model (torch.compile) gets packed rows of one fixed shape per evaluation, so it compiles
once, with short examples sharing a row rather than padding it.

The benchmark (batched vs one example at a time): dev/hellaswag_bench.py.

Inside training: load_examples() once at start-up, then evaluate(model, examples, ...) every
hellaswag_interval steps (DDP ranks split the examples and all_reduce the counts).
"""
import bisect
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
import torch
import torch.distributed as dist
from torch.nn import functional as F
from tqdm import tqdm

from gpt2train import precision
from gpt2train.fileio import ArgumentParser, UserError, check_output_file, fail, write_json
from model import GPT, GPT2_VOCAB_SIZE, PRETRAINED
from gpt2train.checkpoint import newest_checkpoint
from gpt2train.distributed import rank0_first
from gpt2train.tokenizer import get_encoding

DEFAULT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "hellaswag")
URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_{split}.jsonl"
SPLITS = ("train", "val", "test")


class HellaSwagError(UserError):
    """A one-line message for the user (missing file, malformed row); the CLI prints it."""

# -----------------------------------------------------------------------------
# data: rowanz/hellaswag jsonl, one {"ctx": str, "endings": [4 str], "label": int, ...} per line


def download_split(split, data_dir=DEFAULT_DIR, file_option="--data"):
    """Fetch hellaswag_{split}.jsonl into data_dir (once); returns its path. file_option: the
    calling command's option for a local file, named in the error."""
    path = os.path.join(data_dir, f"hellaswag_{split}.jsonl")
    if os.path.isfile(path):
        return path
    url = URL.format(split=split)
    print(f"hellaswag: downloading {url} -> {path}")
    tmp = None
    try:
        os.makedirs(data_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=data_dir, prefix=f".hellaswag_{split}.", suffix=".part")
        with os.fdopen(fd, "wb") as f, urllib.request.urlopen(url, timeout=60) as r:
            shutil.copyfileobj(r, f)
        os.replace(tmp, path)  # a partial download never takes the real name
    except OSError as e:  # no network, HTTP error, timeout, unwritable data_dir
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
        reason = str(getattr(e, "reason", None) or e).splitlines()[0]
        raise HellaSwagError(f"could not download {url} ({reason}): save that file as {path} "
                             f"yourself, or pass {file_option}=FILE.jsonl") from None
    return path


def parse_row(line, where, enc):
    """Parse one jsonl line into {"label", "ctx_tokens", "ending_tokens": [4 lists]}; where names
    the row."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise HellaSwagError(f"{where}: not valid JSON ({e.msg}, column {e.colno})") from None
    except RecursionError:
        raise HellaSwagError(f"{where}: not a HellaSwag row "
                             "(JSON nested too deeply to read)") from None
    if not isinstance(row, dict):
        raise HellaSwagError(f"{where}: expected a JSON object, got {type(row).__name__}")
    ctx, endings, label = row.get("ctx"), row.get("endings"), row.get("label")
    if not isinstance(ctx, str) or not ctx.strip():
        raise HellaSwagError(f"{where}: missing or empty 'ctx' (the context string)")
    four = isinstance(endings, list) and len(endings) == 4
    if not four or not all(isinstance(e, str) for e in endings):
        got = f"{len(endings)} items" if isinstance(endings, list) else type(endings).__name__
        raise HellaSwagError(f"{where}: 'endings' must be a list of 4 strings, got {got}")
    if label is None:
        raise HellaSwagError(f"{where}: no 'label' (HellaSwag's test split is unlabelled: score "
                             "val or train)")
    # the Hugging Face copy stores "0".."3"
    if isinstance(label, str) and label.strip() in ("0", "1", "2", "3"):
        label = int(label)
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label <= 3:
        raise HellaSwagError(f"{where}: 'label' must be 0, 1, 2 or 3, got {label!r}")
    return {"label": label,
            "ctx_tokens": enc.encode_ordinary(ctx),
            "ending_tokens": [enc.encode_ordinary(" " + e) for e in endings]}


def load_examples(split="val", data_file=None, data_dir=DEFAULT_DIR, download=True,
                  file_option="--data"):
    """Tokenized examples of a HellaSwag split (downloaded into data_dir on first use) or of a local
    jsonl file in the same format. Raises HellaSwagError with a one-line message, which names the
    calling command's option for a local file (file_option: hellaswag.py's --data, the trainer's
    --hellaswag_file)."""
    if data_file is not None:
        path = data_file
        if not os.path.isfile(path):
            what = "a folder, not a file" if os.path.isdir(path) else "no such file"
            raise HellaSwagError(f"{path}: {what} (expected HellaSwag jsonl rows)")
    else:
        if split not in SPLITS:
            raise HellaSwagError(f"unknown split {split!r}: use train, val or test")
        if split == "test":
            raise HellaSwagError("HellaSwag's test split has no labels (its answers are held out), "
                                 "so it cannot be scored: use --split val (or train)")
        path = os.path.join(data_dir, f"hellaswag_{split}.jsonl")
        if not os.path.isfile(path):
            if not download:
                raise HellaSwagError(f"{path} is missing: download {URL.format(split=split)} "
                                     f"there, or pass {file_option}=FILE.jsonl")
            path = download_split(split, data_dir, file_option)
    enc = get_encoding()
    examples = []
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    ex = parse_row(line, f"{path} row {lineno}", enc)
                    examples.append({"index": len(examples), **ex})
    except UnicodeDecodeError:
        raise HellaSwagError(f"{path} is not UTF-8 text: is it a HellaSwag jsonl file?") from None
    except OSError as e:
        raise HellaSwagError(f"could not read {path}: {e.strerror or e}") from None
    if not examples:
        raise HellaSwagError(f"{path} has no rows")
    return examples


def training_examples(cfg, env, startup):
    """The trainer's examples (cfg.hellaswag_file or the download, hellaswag_limit of them), loaded
    once at start-up: rank 0 first (it downloads), then the others (they read its cache)."""
    def load():
        try:
            return load_examples("val", data_file=cfg.hellaswag_file or None, data_dir=DEFAULT_DIR,
                                 download=True, file_option="--hellaswag_file")
        except Exception as e:  # offline, a missing or malformed file: the user's to fix
            # a failed download already offers --hellaswag_file: said once
            fix = " (set --hellaswag_file=PATH or --hellaswag_interval=0)"
            if "--hellaswag_file" in str(e):
                fix = ", or --hellaswag_interval=0 to train without it"
            raise UserError(f"cannot load HellaSwag: {e}{fix}") from None
    return rank0_first(load, env, startup)[:cfg.hellaswag_limit or None]

# -----------------------------------------------------------------------------
# scoring


def rows_of(example, block_size):
    """The 4 token rows ctx + ending, cut from the left to block_size. Returns (rows, starts, cut):
    row[start:] are the ending tokens scored (position 0 has nothing before it to predict it from)
    and cut says whether any row lost tokens."""
    ctx = example["ctx_tokens"]
    rows, starts, cut = [], [], False
    for end in example["ending_tokens"]:
        row = ctx + end
        drop = max(0, len(row) - block_size)
        rows.append(row[drop:])
        starts.append(max(len(ctx) - drop, 1))
        cut = cut or drop > 0
    return rows, starts, cut


def token_losses(logits, targets):
    """Cross-entropy per target token, in fp32, over the 50257 real tokens (a padded vocab's extra
    rows are never targets)."""
    logits = logits[..., :GPT2_VOCAB_SIZE].float()
    losses = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                             reduction="none")
    return losses.view(targets.shape)


@torch.no_grad()
def score_one(model, example, plan=None):
    """The reference: one example (4 rows) per forward, full logits, a mask over the ending tokens.
    plan: precision.make_plan(device, ...), fp32 on the CPU by default.
    Returns (summed losses (4,), mean losses (4,))."""
    plan = plan or precision.default_plan("cpu")
    rows, starts, _ = rows_of(example, model.config.block_size)
    T = max(len(r) for r in rows)
    tokens = torch.zeros(4, T, dtype=torch.long)
    mask = torch.zeros(4, T)
    for i, (row, start) in enumerate(zip(rows, starts)):
        tokens[i, :len(row)] = torch.tensor(row)
        mask[i, start:len(row)] = 1.0
    tokens, mask = tokens.to(plan.device), mask.to(plan.device)
    with precision.autocast(plan):
        logits, _ = model(tokens)  # (4, T, V)
    losses = token_losses(logits[:, :-1], tokens[:, 1:])  # (4, T-1): position t predicts token t+1
    mask = mask[:, 1:]
    summed = (losses * mask).sum(dim=1)  # (4,)
    return summed, summed / mask.sum(dim=1)


def collate(batch, block_size, shape=None):
    """Rows of a batch of examples, right-padded to the longest row (or to a fixed (R, T) shape).
    Returns idx (R, T), for every scored token: its row, the position that predicts it and the token
    itself (N,) each; the number of scored tokens per row (R,); and how many examples were cut."""
    rows, starts, n_cut = [], [], 0
    for ex in batch:
        r, s, cut = rows_of(ex, block_size)
        rows += r
        starts += s
        n_cut += cut
    R, T = shape or (len(rows), max(len(r) for r in rows))
    idx = torch.zeros(R, T, dtype=torch.long)
    row_id, pos, tgt = [], [], []
    for i, (row, start) in enumerate(zip(rows, starts)):
        idx[i, :len(row)] = torch.tensor(row)
        row_id += [i] * (len(row) - start)
        pos += range(start - 1, len(row) - 1)
        tgt += row[start:]
    row_id = torch.tensor(row_id)
    counts = torch.bincount(row_id, minlength=R)  # (R,) padding rows score nothing
    return idx, row_id, torch.tensor(pos), torch.tensor(tgt), counts, n_cut


def packed_len(example):
    """Length of the packed row: an ending's last token predicts nothing and no other token attends
    to it, so it is scored but not fed in."""
    return len(example["ctx_tokens"]) + sum(len(e) - 1 for e in example["ending_tokens"])


def packable(example, block_size):
    """Whether the example fits one packed row of block_size, each ctx + ending uncut."""
    ctx, ends = example["ctx_tokens"], example["ending_tokens"]
    return (len(ctx) >= 1 and all(ends) and max(len(ctx) + len(e) for e in ends) <= block_size
            and packed_len(example) <= block_size)


def pack_rows(examples, T):
    """Best-fit decreasing: each example (packed_len tokens) goes into the row of T tokens with the
    least room that still holds it, else a new row. Returns the rows, lists of examples."""
    rows, free = [], []  # free: sorted (tokens left, row number)
    for ex in sorted(examples, key=packed_len, reverse=True):
        n = packed_len(ex)
        i = bisect.bisect_left(free, (n, -1))
        if i == len(free):
            rows.append([ex])
            left, r = T - n, len(rows) - 1
        else:
            left, r = free.pop(i)
            rows[r].append(ex)
            left -= n
        bisect.insort(free, (left, r))
    return rows


def collate_packed(rows, shape=None):
    """Packed rows: each example is ctx + end1 + end2 + end3 + end4 (each ending without its last
    token, see packed_len), and a row holds one or more examples one after the other, right-padded
    to the longest row (or to a fixed (B, T) shape: extra rows are all padding). Each ending's
    position ids restart at len(ctx) and the mask lets it see its own context and itself only, so it
    is scored exactly as the row ctx + ending, but the context goes through the model once, not 4
    times. Returns idx, pos_ids (B, T), attn_mask (B, 1, T, T) and, for every scored token: its row,
    the position that predicts it, the token, its ending (4 * example + i, examples numbered row by
    row) (N,) each; counts (4E,) for the E examples."""
    B, T = shape or (len(rows), max(sum(packed_len(ex) for ex in row) for row in rows))
    idx = torch.zeros(B, T, dtype=torch.long)
    pos_ids = torch.zeros(B, T, dtype=torch.long)
    seg = torch.full((B, T), -1)  # 0 context, 1..4 ending, -1 padding
    ex_id = torch.full((B, T), -1)  # which example of the batch, -1 padding
    seq_id, pos, tgt, row_id = [], [], [], []
    e = 0
    for b, row in enumerate(rows):
        at = 0
        for ex in row:
            ctx = ex["ctx_tokens"]
            C = len(ctx)
            idx[b, at:at + C] = torch.tensor(ctx)
            pos_ids[b, at:at + C], seg[b, at:at + C] = torch.arange(C), 0
            ex_id[b, at:at + packed_len(ex)] = e
            last_ctx = at + C - 1  # the context's last token predicts each ending's first
            at += C
            for i, end in enumerate(ex["ending_tokens"]):
                E = len(end) - 1  # tokens fed in
                idx[b, at:at + E] = torch.tensor(end[:-1], dtype=torch.long)
                pos_ids[b, at:at + E] = torch.arange(C, C + E)
                seg[b, at:at + E] = i + 1
                seq_id += [b] * (E + 1)
                pos += [last_ctx] + list(range(at, at + E))
                tgt += end
                row_id += [4 * e + i] * (E + 1)
                at += E
            e += 1
    q_seg, k_seg = seg[:, :, None], seg[:, None, :]  # (B, T, 1), (B, 1, T)
    # (B, T, T) same example; padding sees only padding
    same = ex_id[:, :, None] == ex_id[:, None, :]
    causal = pos_ids[:, None, :] <= pos_ids[:, :, None]  # (B, T, T) key position <= query position
    attn_mask = same & (((k_seg == 0) & (q_seg >= 0)) | (k_seg == q_seg)) & causal
    row_id = torch.tensor(row_id)
    counts = torch.bincount(row_id, minlength=4 * e)  # (4E,)
    return (idx, pos_ids, attn_mask[:, None], torch.tensor(seq_id), torch.tensor(pos),
            torch.tensor(tgt), row_id, counts)


def is_compiled(model):
    return hasattr(model, "_orig_mod")  # torch.compile's wrapper; only its forward() is compiled


@dataclasses.dataclass(frozen=True)
class ScoredTokens:
    """The ending tokens a batch scores, (N,) each: the row (an ending) each counts for, the
    position that predicts it, the token; and counts (R,), the scored tokens of each row."""
    row_id: torch.Tensor
    pos: torch.Tensor
    tgt: torch.Tensor
    counts: torch.Tensor


def batch_losses(model, idx, scored, packing=None):
    """Summed and mean ending losses per row (R,) for one padded batch idx: the token predicted at
    idx[seq_id, pos] (seq_id is row_id unless packed) counts for row row_id (scored: ScoredTokens).
    Packed batches pass packing=(seq_id, pos_ids, attn_mask) from collate_packed."""
    row_id, pos, tgt, counts = scored.row_id, scored.pos, scored.tgt, scored.counts
    seq_id, pos_ids, attn_mask = packing or (row_id, None, None)
    # the compiled forward's full logits (one fixed shape), then the positions needed
    if is_compiled(model):
        logits = model(idx, pos=pos_ids, attn_mask=attn_mask)[0][seq_id, pos]  # (N, V)
    else:  # eager: run the blocks, then lm_head only at the positions that predict an ending token
        logits = model.lm_head(model.hidden_states(idx, pos_ids, attn_mask)[seq_id, pos])  # (N, V)
    losses = token_losses(logits, tgt)  # (N,)
    summed = torch.zeros(counts.size(0), device=losses.device).index_add_(0, row_id, losses)  # (R,)
    return summed, summed / counts.clamp(min=1)


@torch.no_grad()
def evaluate(model, examples, *, plan, batch_size=16, progress=False, stop=None):
    """Accuracy of model on examples, on plan.device under the plan's autocast (precision.autocast):
    this rank scores examples[rank::world_size] (torch.distributed's, when it is initialized; else
    all of them), batch_size examples per forward (batches_of), and the counts are summed over
    ranks with all_reduce.
    stop: None, or a callable asked before each batch (one process only: ranks hold different
    batches); when it says True the evaluation ends there and returns {"stopped": True}.
    Returns {"n", "acc", "acc_norm", "truncated", "examples": this rank's [{"index", "label",
    "pred", "pred_norm"}]}; the model goes back to the train/eval mode it came in."""
    raw = getattr(model, "_orig_mod", model)
    ranks = dist.is_available() and dist.is_initialized()
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if ranks else (0, 1)
    local = examples[rank::world_size]
    batches, shapes = batches_of(model, local, raw.config.block_size, batch_size)
    was_training = raw.training
    raw.eval()
    results, n_cut, correct, correct_norm = [], 0, 0, 0
    try:
        bar = tqdm(total=len(local), unit="ex", desc="hellaswag", disable=not progress,
                   dynamic_ncols=True)
        for batch, is_packed in batches:
            if stop is not None and stop():
                bar.close()
                return {"stopped": True}
            batch, pred, pred_norm, cut = score_batch(model, batch, is_packed, shapes, plan)
            for ex, p, pn in zip(batch, pred, pred_norm):
                results.append({"index": ex["index"], "label": ex["label"], "pred": p,
                                "pred_norm": pn})
                correct += p == ex["label"]
                correct_norm += pn == ex["label"]
            n_cut += cut
            bar.update(len(batch))
            bar.set_postfix(acc=f"{correct / len(results):.4f}",
                            acc_norm=f"{correct_norm / len(results):.4f}")
        bar.close()
    finally:
        raw.train(was_training)
    counts = torch.tensor([len(results), correct, correct_norm, n_cut], device=plan.device)
    if world_size > 1:
        dist.all_reduce(counts)
    n, correct, correct_norm, truncated = counts.tolist()
    return {"n": n, "acc": correct / n if n else float("nan"),
            "acc_norm": correct_norm / n if n else float("nan"),
            "truncated": truncated, "examples": sorted(results, key=lambda r: r["index"])}


def batches_of(model, examples, block_size, batch_size):
    """The examples in batches, [(batch, packed)], and the shapes they are padded to,
    (packed_shape, rows_shape). Each example is packed (collate_packed) where ctx + 4 endings fit
    block_size, else it is 4 rows (collate); similar lengths together. An eager model gets one
    example per packed row, each batch padded to its own longest row (shapes None). A compiled
    model gets one fixed shape per path, so it compiles once per evaluation set, not once per
    batch: batch_size packed rows of T tokens (T: the longest packed example, rounded up to 16),
    short examples sharing a row (pack_rows) instead of padding, and (4 * batch_size, T') for the
    4-row examples."""
    longest = lambda ex: max(len(r) for r in rows_of(ex, block_size)[0])  # noqa: E731
    packed = sorted([ex for ex in examples if packable(ex, block_size)], key=packed_len,
                    reverse=True)
    rows = sorted([ex for ex in examples if not packable(ex, block_size)], key=longest,
                  reverse=True)
    packed_rows = [[ex] for ex in packed]
    packed_shape = rows_shape = None  # eager: each batch padded only to its own longest row
    # T a multiple of 16: the memory-efficient kernel wants aligned mask rows
    if is_compiled(model) and packed:
        packed_shape = (batch_size, min(-(-packed_len(packed[0]) // 16) * 16, block_size))
        packed_rows = pack_rows(packed, packed_shape[1])
    if is_compiled(model) and rows:
        rows_shape = (4 * batch_size, min(-(-longest(rows[0]) // 8) * 8, block_size))
    batches = ([(packed_rows[i:i + batch_size], True)
                for i in range(0, len(packed_rows), batch_size)]
               + [(rows[i:i + batch_size], False) for i in range(0, len(rows), batch_size)])
    return batches, (packed_shape, rows_shape)


def score_batch(model, batch, is_packed, shapes, plan):
    """One batch of batches_of on plan.device: (its examples, the ending each picks by summed loss,
    by mean loss, the context tokens cut)."""
    packed_shape, rows_shape = shapes
    block_size = getattr(model, "_orig_mod", model).config.block_size
    to = lambda t: None if t is None else t.to(plan.device, non_blocking=True)  # noqa: E731
    if is_packed:
        idx, pos_ids, attn_mask, seq_id, pos, tgt, row_id, counts = \
            collate_packed(batch, packed_shape)
        packing = (to(seq_id), to(pos_ids), to(attn_mask))
        batch, cut = [ex for row in batch for ex in row], 0
    else:
        idx, row_id, pos, tgt, counts, cut = collate(batch, block_size, rows_shape)
        packing = None
    with precision.autocast(plan):
        scored = ScoredTokens(to(row_id), to(pos), to(tgt), to(counts))
        summed, mean = batch_losses(model, to(idx), scored, packing)  # (R,), (R,)
    E = len(batch)
    pred = summed[:4 * E].view(E, 4).argmin(dim=1).tolist()
    pred_norm = mean[:4 * E].view(E, 4).argmin(dim=1).tolist()
    return batch, pred, pred_norm, cut

# -----------------------------------------------------------------------------
# command line


def load_model(name_or_path):
    """A GPT-2 name (Hugging Face hub), a save_pretrained directory, a train_gpt2.py checkpoint, or
    a run's out_dir (its newest checkpoint)."""
    path = newest_checkpoint(name_or_path)
    if name_or_path in PRETRAINED:
        from huggingface_hub.constants import HF_HUB_CACHE
        print(f"model: {name_or_path} from the Hugging Face hub, cached under {HF_HUB_CACHE}")
    else:
        run = ""
        if path != name_or_path:
            run = f" (the newest checkpoint in the run folder {name_or_path})"
        print(f"model: {path}{run}")
    return GPT.load(path)


def main(argv=None):
    p = ArgumentParser(prog="hellaswag.py",
                       description="Zero-shot HellaSwag accuracy (acc, acc_norm) of a GPT-2.")
    p.add_argument("--model", default=None,
                   help="gpt2 (default), gpt2-medium, gpt2-large, gpt2-xl, a save_pretrained dir, "
                        "a ckpt_*.pt, or a run's out_dir (its newest ckpt_*.pt)")
    p.add_argument("--split", default="val", choices=SPLITS)
    p.add_argument("--data", default=None,
                   help="a local jsonl file in the HellaSwag format (works offline)")
    p.add_argument("--data_dir", default=DEFAULT_DIR, help="where the downloaded split is cached")
    p.add_argument("--limit", type=int, default=None, help="only the first N examples")
    p.add_argument("--device", default="auto",
                   help="auto (default: cuda if available), cpu, cuda, cuda:N, mps")
    p.add_argument("--precision", default="auto", choices=precision.PRECISIONS,
                   help="autocast dtype; auto = the GPU's plan (bf16 on sm80+, fp16 on sm7x), fp32 "
                        "on CPU")
    p.add_argument("--batch_size", type=int, default=16,
                   help="examples (4 rows each) per forward pass")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model first (as in training: packed rows at one fixed "
                        "shape)")
    p.add_argument("--json", default=None,
                   help="write n, acc, acc_norm and per-example predictions here")
    try:
        args = p.parse_args(argv)
        plan = precision.make_plan(precision.resolve_device(args.device), args.precision,
                                   compile=args.compile)
        if args.limit is not None and args.limit < 1:
            raise HellaSwagError(f"--limit must be at least 1, got {args.limit}")
        if args.batch_size < 1:
            raise HellaSwagError(f"--batch_size must be at least 1, got {args.batch_size}")
        if args.json:
            check_output_file(args.json, "--json")
        examples = load_examples(args.split, args.data, args.data_dir)[:args.limit]
        model = load_model(args.model or "gpt2")
        model = precision.compile_model(model.to(plan.device), plan)
    except (UserError, OSError) as e:
        return fail(e)
    t0 = time.time()
    res = evaluate(model, examples, plan=plan, batch_size=args.batch_size, progress=True)
    dt = time.time() - t0
    cut = ""
    if res["truncated"]:
        cut = f", {res['truncated']} cut to block_size {model.config.block_size}"
    print(f"hellaswag {'file ' + args.data if args.data else args.split}: {res['n']} examples, "
          f"acc {res['acc']:.4f}, acc_norm {res['acc_norm']:.4f} ({res['n'] / dt:.1f} examples/s"
          f"{cut})")
    if args.json:
        try:
            keys = ("n", "acc", "acc_norm", "truncated", "examples")
            write_json(args.json, {k: res[k] for k in keys}, indent=None)
        except OSError as e:  # the path was checked: a full disk (exit 1)
            return fail(e)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
