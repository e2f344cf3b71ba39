"""The end of a run (train_gpt2.py, tiny CPU runs in this process): the final checkpoint is written before
anything optional (the last evals, samples, plot), an optional part that fails costs one warning and neither
the checkpoint nor the exit code, an empty sample_prompt samples new documents, and rank 0 ends on a summary
whose numbers are log.jsonl's."""
import os

import sample
from conftest import read_log, tiny_args
from train_gpt2 import main


def sampling_args(data_dir, out, **over):
    """tiny_args with GPT-2's vocabulary (sampling needs it), samples at the end only."""
    return tiny_args(data_dir, out, vocab_size=50304, sample_interval=8, sample_tokens=3, num_samples=1, **over)


def test_empty_sample_prompt_samples_new_documents(data_dir, tmp_path, capsys):
    out = str(tmp_path / "run")
    assert main(sampling_args(data_dir, out, sample_prompt="")) == 0
    printed = capsys.readouterr().out
    assert os.path.isfile(os.path.join(out, "ckpt_000008.pt"))
    assert printed.count("sample: '<|endoftext|>") == 1, printed[-2000:]  # after <|endoftext|>, as sample.py


def test_final_checkpoint_first_and_a_failing_extra_is_one_warning(data_dir, tmp_path, capsys, monkeypatch):
    def broken(*args):
        raise RuntimeError("the sampler broke")
    monkeypatch.setattr(sample, "sample_batch", broken)  # the trainer's periodic samples
    out = str(tmp_path / "run")
    assert main(sampling_args(data_dir, out)) == 0
    printed = capsys.readouterr().out
    assert os.path.isfile(os.path.join(out, "ckpt_000008.pt"))
    warnings = [line for line in printed.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "the sampler broke" in warnings[0] and "ckpt_000008.pt" in warnings[0], warnings
    assert printed.index("saved " + os.path.join(out, "ckpt_000008.pt")) < printed.index("step      8 | val loss")


def test_end_of_run_summary(data_dir, tmp_path, capsys):
    out = str(tmp_path / "run")
    assert main(tiny_args(data_dir, out, max_steps=8, eval_interval=2)) == 0
    lines = capsys.readouterr().out.splitlines()
    done = next(i for i, line in enumerate(lines) if line.startswith("done: "))
    vals = [(r["val_loss"], r["step"]) for r in read_log(out) if "val_loss" in r]
    assert [s for _, s in vals] == [0, 2, 4, 6, 8]
    best = min(vals)
    ckpt = os.path.join(out, "ckpt_000008.pt")
    assert (f"val loss {vals[-1][0]:.4f} (best {best[0]:.4f} at step {best[1]})" in lines[done]
            and "8 steps, 512 tokens in " in lines[done] and " tok/s | checkpoint " + ckpt in lines[done]), lines[done]
    assert lines[done + 1] == f"next: python sample.py --model {out}          # text from the newest checkpoint"
    assert f"python export.py {ckpt} {os.path.join(out, 'hf')}" in lines[done + 2]
    assert f"python plot.py {out} " in lines[done + 3] and done + 4 == len(lines)
    # issue 44 item 8: plot.py needs matplotlib, which the install leaves out: said, with how to get it
    assert lines[done + 3].endswith(f"{os.path.join(out, 'curves.png')} (needs matplotlib, optional: pip install "
                                    "matplotlib)"), lines[done + 3]
