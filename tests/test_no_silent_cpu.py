"""No silent CPU: where an NVIDIA GPU is present but torch cannot use it, device=auto stops with one line (what
torch has, what the driver reports, the fix) in every script, and --device=cpu still runs. The GPU is faked by
an `nvidia-smi` script on PATH; this machine's torch sees no CUDA."""
import json
import os
import subprocess
import sys

import pytest
import torch

from gpt2train import precision
from conftest import ROOT, one_line, tiny_args, write_shards
from gpt2train.fileio import UserError

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch that cannot use a GPU")

T4 = "Tesla T4, 470.82.01"  # what the fake nvidia-smi answers: a name and an old driver


@pytest.fixture
def fake_smi(tmp_path):
    """A folder with an executable `nvidia-smi` that answers the query like a T4 with driver 470; PATH for it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho '{T4}'\n")
    smi.chmod(0o755)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


def run(args, path, timeout=120, cwd=ROOT):
    env = dict(os.environ, PATH=path, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="2")
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def assert_the_line(res):
    line = one_line(res.stderr)
    assert res.returncode == 2, res.stderr
    for part in ("Tesla T4", "driver 470.82.01", f"torch {torch.__version__}", "--device=cpu", "nvidia-smi"):
        assert part in line, line
    assert ("CPU-only build" in line) == (torch.version.cuda is None), line
    return line


def test_driver_found_by_nvidia_smi_proc_file_or_device(fake_smi, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", fake_smi)
    assert precision.nvidia_driver() == "nvidia-smi: Tesla T4, driver 470.82.01"
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))  # no nvidia-smi: the kernel module's file
    proc = tmp_path / "version"
    proc.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n")
    assert precision.nvidia_driver(str(proc)) == f"{proc}: driver 535.104.05"
    dev = tmp_path / "nvidia0"
    assert precision.nvidia_driver(str(tmp_path / "none"), str(dev)) == ""  # no GPU at all: nothing found
    dev.touch()
    assert precision.nvidia_driver(str(tmp_path / "none"), str(dev)) == f"a device {dev}"


def test_auto_never_picks_the_cpu_beside_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.setattr(precision, "nvidia_driver", lambda *a: "nvidia-smi: Tesla T4, driver 470.82.01")
    monkeypatch.setattr(torch.version, "cuda", "12.8")  # a build newer than the driver runs
    for name in ("auto", "cuda", "cuda:0"):
        with pytest.raises(UserError, match=r"torch .* \(CUDA 12\.8\) cannot use it .*driver 470\.82\.01|"
                                            r"driver 470\.82\.01.* \(CUDA 12\.8\) cannot use it"):
            precision.resolve_device(name)
    assert precision.resolve_device("cpu") == "cpu"  # on purpose: still works
    monkeypatch.setattr(precision, "nvidia_driver", lambda *a: "")  # no GPU here: auto is the CPU, silently
    assert precision.resolve_device("auto") == "cpu"


def test_trainer_says_one_line_and_trains_nothing(fake_smi, tmp_path):
    data = write_shards(str(tmp_path / "data"))
    out = tmp_path / "out"
    res = run(["train_gpt2.py", *tiny_args(data, str(out), max_steps=2, warmup_steps=1)], fake_smi)
    assert_the_line(res)
    assert "step " not in res.stdout and not (out / "log.jsonl").exists()  # stopped before any training step


def test_trainer_on_cpu_on_purpose_still_trains(fake_smi, tmp_path):
    data = write_shards(str(tmp_path / "data"))
    out = tmp_path / "out"
    res = run(["train_gpt2.py", *tiny_args(data, str(out), max_steps=2, warmup_steps=1, eval_interval=0,
                                                 checkpoint_interval=0),
               "--device=cpu"], fake_smi)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "step      1/2" in res.stdout and (out / "ckpt_000002.pt").is_file()


@pytest.mark.parametrize("args", [
    ["sample.py", "--model", "gpt2"],
    ["dev/hellaswag_bench.py"],
    ["bench.py", "--steps", "1"],
], ids=["sample", "hellaswag", "bench"])
def test_every_script_says_the_same_line(fake_smi, args):
    assert_the_line(run(args, fake_smi))


def notebook_install_lines():
    with open(os.path.join(ROOT, "docs", "notebooks.md")) as f:
        return [line[1:].split("   #")[0] for line in f if "requirements" in line and line.startswith("!")
                and "pip install" in line]


def test_notebook_install_keeps_the_preinstalled_torch(tmp_path):
    """The notebook cells (docs/notebooks.md) install every requirement but torch: pip, offline, on this machine
    (where each is installed) would install nothing, and the file it reads names no torch."""
    lines = notebook_install_lines()
    assert len(lines) == 2 and len(set(lines)) == 1, lines  # Colab's and Kaggle's, the same line
    make, install = lines[0].split(" && ")
    subprocess.run(["bash", "-c", make], cwd=ROOT, check=True, timeout=30)
    req = make.split("> ")[-1].strip()
    with open(req) as f:
        kept = [line.split("#")[0].strip() for line in f if line.split("#")[0].strip()]
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        every = [line.split("#")[0].strip() for line in f if line.split("#")[0].strip()]
    assert [r for r in every if r not in kept] == ["torch>=2.9"] and install == f"pip install -q -r {req}"
    report = tmp_path / "report.json"
    res = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--report", str(report),
                          "-q", "-r", req], capture_output=True, text=True, timeout=300)
    if res.returncode:
        pytest.skip(f"a requirement is not installed here (pip --no-index: {res.stderr.strip()[-200:]})")
    assert json.loads(report.read_text())["install"] == []  # a working torch stays as it is
