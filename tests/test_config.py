"""config.py: the defaults, config files and --key=value, the frozen Config and its one-time decisions
(micro_batch_size=auto, resume), did-you-mean, config.json's asked/resolved, and --help."""
import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

from gpt2train import config
from gpt2train.config import Config, asked_and_resolved, oddities, parse_args
from conftest import ROOT
from gpt2train.fileio import UserError
from train_gpt2 import main

# -----------------------------------------------------------------------------
# config: defaults, files, the shipped configs


def test_defaults_are_build_nanogpts_124m_recipe():
    c = Config()
    assert (c.total_batch_size, c.micro_batch_size, c.seq_len, c.max_lr, c.min_lr, c.warmup_steps, c.max_steps,
            c.weight_decay, c.grad_clip, c.vocab_size) == (524288, 64, 1024, 6e-4, 6e-5, 715, 19073, 0.1, 1.0, 50304)


@pytest.mark.parametrize("name", ["gpt2_124m", "gpt2_124m_muon", "gpt2_350m", "gpt2_774m", "gpt2_1558m",
                                  "finetune_gpt2", "quickstart"])
def test_shipped_configs_parse(name):
    cfg, given = parse_args([os.path.join(ROOT, "configs", f"{name}.py")])
    assert cfg.total_batch_size % (cfg.micro_batch_size * cfg.seq_len) == 0
    if cfg.lr_schedule == "wsd":  # the Muon configs: flat, then down to zero (dev/recipe.md)
        assert cfg.min_lr == 0 and cfg.optimizer == "muon" and cfg.zero_init_proj and cfg.muon_split_qkv
    else:  # build-nanogpt's cosine to a tenth
        assert cfg.min_lr == pytest.approx(cfg.max_lr / 10)
    if name != "finetune_gpt2":
        assert "n_layer" in given and cfg.n_embd % cfg.n_head == 0


def test_config_file_then_override(tmp_path):
    path = tmp_path / "c.py"
    path.write_text("import math\nn_layer = 3\nmax_lr = 1\n_private = 5\nseq_len = 2 ** 8\n")
    cfg, given = parse_args([str(path), "--n_layer=5", "--resume=True", "--min_lr=1e-5"])
    assert (cfg.n_layer, cfg.max_lr, cfg.seq_len, cfg.resume, cfg.min_lr) == (5, 1.0, 256, "true", 1e-5)
    assert isinstance(cfg.max_lr, float) and given == {"n_layer": "cli", "max_lr": str(path), "seq_len": str(path),
                                                       "resume": "cli", "min_lr": "cli"}

# -----------------------------------------------------------------------------
# decided once, at parsing: the Config is frozen and each field holds one type


def test_micro_batch_size_is_an_integer_or_auto_decided_at_parsing(tmp_path):
    """micro_batch_size holds an int or the word "auto" (the run then probes for it:
    microbatch.choose_micro_batch), from a flag or a config file, and the last word wins; anything else is one line."""
    cfg, given = parse_args(["--micro_batch_size=auto"])
    assert cfg.micro_batch_size == "auto" and given == {"micro_batch_size": "cli"}
    assert parse_args(["--micro_batch_size=auto", "--micro_batch_size=16"])[0].micro_batch_size == 16
    path = tmp_path / "c.py"
    path.write_text("micro_batch_size = 'auto'\n")
    cfg, given = parse_args([str(path)])
    assert cfg.micro_batch_size == "auto" and given["micro_batch_size"] == str(path)
    assert parse_args([str(path), "--micro_batch_size=8"])[0].micro_batch_size == 8
    assert parse_args([])[0].micro_batch_size == 64
    with pytest.raises(UserError, match='--micro_batch_size=big is not an integer or "auto"'):
        parse_args(["--micro_batch_size=big"])
    path.write_text("micro_batch_size = 'big'\n")
    with pytest.raises(UserError, match='micro_batch_size must be an integer or "auto", got \'big\''):
        parse_args([str(path)])
    with pytest.raises(UserError, match="micro_batch_size must be at least 1, got 0"):
        parse_args(["--micro_batch_size=0"])
    with pytest.raises(UserError, match='--seq_len=auto is not an integer \\(default'):  # auto: micro_batch_size only
        parse_args(["--seq_len=auto"])


@pytest.mark.parametrize("text,resume", [("True", "true"), ("yes", "true"), ("1", "true"), ("no", "false"),
                                         ("0", "false"), ("AUTO", "auto"), ("false", "false")])
def test_resume_is_parsed_once_into_one_of_three_words(text, resume, tmp_path):
    assert parse_args([f"--resume={text}"])[0].resume == resume
    path = tmp_path / "c.py"
    path.write_text(f"resume = {resume.capitalize() if resume != 'auto' else repr('auto')}\n")  # True, False, 'auto'
    assert parse_args([str(path)])[0].resume == resume


def test_config_is_frozen():
    cfg, _ = parse_args(["--n_layer=2"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.n_layer = 3
    assert cfg.n_layer == 2


def test_nanogpt_names_say_what_they_are_here():
    with pytest.raises(UserError, match="unknown config key 'learning_rate': here it is max_lr"):
        parse_args(["--learning_rate=1e-3"])
    with pytest.raises(UserError, match="unknown config key 'max_iters': here it is max_steps$"):
        parse_args(["--max_iters=10"])


def test_a_bad_flag_value_names_the_value_in_force_as_the_flag_spells_it():
    """Issue 44 item 8: `configs/quickstart.py --max_steps=ten` said "(default: 19073)" while the config file sets
    160, and `--shuffle=maybe` said "(default: True)" for a flag written true/false."""
    quickstart = os.path.join(ROOT, "configs", "quickstart.py")
    cases = [([quickstart, "--max_steps=ten"], f"--max_steps=ten is not an integer ({quickstart} sets 160)"),
             (["--max_steps=ten"], "--max_steps=ten is not an integer (default: 19073)"),
             (["--max_steps=5", "--max_steps=ten"], "--max_steps=ten is not an integer (before it: --max_steps=5)"),
             (["--shuffle=maybe"], "--shuffle=maybe is not true or false (default: true)"),
             (["--shuffle=no", "--shuffle=maybe"], "--shuffle=maybe is not true or false (before it: --shuffle=false)")]
    for argv, message in cases:
        with pytest.raises(UserError) as e:
            parse_args(argv)
        assert str(e.value) == message


def test_a_typo_in_a_config_file_names_the_file_and_the_three_nearest_keys(tmp_path, capsys):
    """Issue 44 item 8: a typo in a config file named neither the file nor fewer than every key (a 1,400-character
    line); now the file, the 3 nearest keys and where the full list is, in one short line."""
    path = tmp_path / "mine.py"
    path.write_text("n_layer = 4\nmax_step = 100\n")
    assert main([str(path), f"--out_dir={tmp_path / 'out'}"]) == 2
    line = capsys.readouterr().err.strip()
    assert line == (f"error: config file {str(path)!r}: unknown config key 'max_step' (did you mean 'max_steps', "
                    "'val_steps' or 'max_skipped'?); `python train_gpt2.py --help` lists every key"), line
    assert len(line) < 250 and not (tmp_path / "out").exists()
    with pytest.raises(UserError, match=r"^unknown config key 'n_layers' \(did you mean 'n_layer'\?\); `python"):
        parse_args(["--n_layers=2"])  # on the command line: no file to name


def test_asked_and_resolved_side_by_side():
    """config.json: what the user set as asked, the whole config as resolved, and which values the run chose."""
    cfg, given = parse_args(["--n_layer=2", "--device=auto"])
    resolved = dataclasses.replace(cfg, device="cpu", precision="fp32", micro_batch_size=8)
    out = asked_and_resolved(cfg, given, resolved)
    assert out["asked"] == {"n_layer": 2, "device": "auto"}
    assert out["resolved"]["device"] == "cpu" and out["resolved"]["n_layer"] == 2
    assert out["decided"] == ["device", "micro_batch_size", "precision"]
    assert json.loads(json.dumps(out)) == out  # what config.json holds
    cfg, given = parse_args(["--micro_batch_size=auto"])  # asked as auto, resolved to what the probe found
    out = asked_and_resolved(cfg, given, dataclasses.replace(cfg, micro_batch_size=16))
    assert out["asked"] == {"micro_batch_size": "auto"} and out["resolved"]["micro_batch_size"] == 16
    assert out["decided"] == ["micro_batch_size"]


def test_start_up_block_names_what_differs_from_the_defaults():
    """Issue 44 item 6: the start printed every key as ~60 lines of JSON. Now: the keys set that differ from the
    defaults as asked, then what the run decided as resolved, key=value, a few lines, config.json named."""
    argv = [os.path.join(ROOT, "configs", "gpt2_124m.py"), "--max_steps=12", "--sample_prompt=Once upon a time, a",
            "--micro_batch_size=64", "--data=", "--out_dir=out/try"]
    cfg, given = parse_args(argv)
    resolved = dataclasses.replace(cfg, device="cuda", precision="bf16", compile="true", loss_impl="full",
                                   micro_batch_size=16)
    block = config.changes(asked_and_resolved(cfg, given, resolved), "out/try/config.json")
    lines = block.splitlines()
    assert lines[0] == "config: what differs from the defaults (every key: out/try/config.json)"
    assert 3 <= len(lines) <= 5 and all(len(line) <= 100 for line in lines), block
    said = " ".join(lines[1:])
    set_part, decided_part = said.split("decided:")
    assert set_part.split() == ["set:", "out_dir=out/try", "max_steps=12", "sample_prompt=\"Once", "upon", "a",
                                "time,", "a\"", "resume=auto"]  # in Config's order
    # configs/gpt2_124m.py's other keys (n_layer = 12, max_lr = 6e-4, ...) and --micro_batch_size=64, --data=
    # are the defaults: not said
    assert decided_part.split() == ["micro_batch_size=16", "device=cuda", "precision=bf16", "compile=true",
                                    "loss_impl=full"]
    assert 'sample_prompt="Once upon a time, a"' in block and "max_lr" not in block  # a value is never split
    quickstart = parse_args([os.path.join(ROOT, "configs", "quickstart.py")])
    wide = config.changes(asked_and_resolved(*quickstart, cfg), "c.json", width=60)
    assert len(wide.splitlines()) > 3 and all(len(line) <= 60 for line in wide.splitlines()), wide
    assert config.shown("") == '""' and config.shown(True) == "true" and config.shown(6e-4) == "0.0006"


def test_oddities_warn_of_a_warmup_as_long_as_the_run():
    assert oddities(Config(warmup_steps=9, max_steps=10)) == []
    (line,) = oddities(Config(warmup_steps=10, max_steps=10))
    assert line.startswith("warning: warmup_steps=10 is not below max_steps=10")

# -----------------------------------------------------------------------------
# --help


def test_help_lists_every_key_by_section(capsys):
    source = open(config.__file__).read()
    body = re.search(r"^class Config:\n(.*?)\n\n", source, re.S | re.M).group(1)  # Config's lines
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert main(["-h"]) == 0 and capsys.readouterr().out == out
    flat = " ".join(out.split())  # the meanings may be wrapped
    positions, lines = [], []
    for line in body.splitlines():  # a comment indented under a field's, or under a section's, continues it
        if lines and re.match(r"\s+#", line) and (len(line) - len(line.lstrip()) > 4 or re.match(r"\s+#", lines[-1])):
            lines[-1] += " " + line.strip().lstrip("# ")
        else:
            lines.append(line)
    for line in lines:
        if re.match(r"\s+#", line):  # a section
            positions.append(flat.index(" ".join((line.strip().lstrip("# ") + ":").split())))  # (wrapped too)
            continue
        name, kind, meaning = re.match(r"\s+(\w+): (\w+) = .*?  # (.*)$", line).groups()  # every key has a meaning
        field = config.FIELDS[name]
        assert kind == field.type.__name__
        positions.append(flat.index(f" --{name} "))
        assert " ".join(f"{meaning} (default: {json.dumps(field.default)})".split()) in flat, name
    assert positions == sorted(positions)  # in Config's order, under their sections
    assert {f.name for f in dataclasses.fields(Config)} == set(re.findall(r"^  --(\w+) ", out, re.M))


def test_help_from_the_command_line():
    """`python train_gpt2.py --help`: config's help at the terminal's width (COLUMNS), nothing on stderr, exit 0."""
    res = subprocess.run([sys.executable, "train_gpt2.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, COLUMNS="100"))
    assert res.returncode == 0 and res.stderr == ""
    assert res.stdout == config.help_text(width=100) + "\n"


def test_help_fits_an_80_column_terminal():
    """Each key's meaning wraps at the terminal's width under its name, not in a narrow column beside it."""
    out = config.help_text(width=80)
    meaning_lines = [line for line in out.splitlines() if line.startswith("      ")]
    assert meaning_lines and all(len(line) <= 80 for line in out.splitlines() if line.startswith(" "))
    assert sum(len(line) > 60 for line in meaning_lines) > len(meaning_lines) // 3  # lines use the width
