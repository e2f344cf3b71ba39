"""Shared fixtures: everything here is local and offline."""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
torch.set_num_threads(min(2, torch.get_num_threads()))


def make_hf_gpt2(path, n_layer=2, n_head=4, n_embd=64, n_positions=128, vocab_size=50257, seed=0):
    """A small random GPT-2 written with transformers' save_pretrained: the offline stand-in for
    OpenAI's weights. Biases and layer norms are randomised too so that no term is trivially zero."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
                     n_head=n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    hf = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(0.02 * torch.randn_like(p))
    hf.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """Toy token shards (test_train.write_shards: a learnable noisy counter), one set per test module."""
    from test_train import write_shards
    return write_shards(str(tmp_path_factory.mktemp("shards")))


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory):
    return make_hf_gpt2(str(tmp_path_factory.mktemp("hf_gpt2")))

# -----------------------------------------------------------------------------
# processes a test starts: bounded in time, killed by process group on every path


def free_port():
    """A free TCP port on 127.0.0.1 (the only address tests may use)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env(**extra):
    """The environment for torchrun on CPU: gloo on the loopback interface only, one thread per rank."""
    return dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", **extra)


class Launched:
    """Commands started in their own process groups (torchrun and its workers together), their output in
    files under log_dir. Use as a context manager: on leaving, every group still alive is SIGKILLed."""

    def __init__(self, cmds, log_dir, env=None, cwd=ROOT):
        self.cmds, self.log_dir, self.env, self.cwd, self.procs = cmds, str(log_dir), env, cwd, []

    def __enter__(self):
        import subprocess
        for i, cmd in enumerate(self.cmds):
            with open(os.path.join(self.log_dir, f"proc{i}.log"), "w") as out:
                self.procs.append(subprocess.Popen(cmd, cwd=self.cwd, env=self.env, stdout=out,
                                                   stderr=subprocess.STDOUT, start_new_session=True))
        return self

    def wait(self, timeout):
        """Exit codes of all, or AssertionError (with the logs' tails) when they outlast timeout seconds."""
        import subprocess
        import time
        deadline = time.monotonic() + timeout
        try:
            return [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in self.procs]
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout} s:\n{self.logs()}") from None

    def logs(self, tail=3000):
        return "\n".join(open(os.path.join(self.log_dir, f"proc{i}.log")).read()[-tail:] for i in range(len(self.procs)))

    def __exit__(self, *exc):
        import signal
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the group: orphaned workers too, even if the launcher is gone
            except (ProcessLookupError, PermissionError):
                pass
            p.wait()
        return False


def torchrun_workers(launcher_pid):
    """{global rank: pid} of the workers a torchrun launcher started (its children whose environment holds RANK)."""
    workers = {}
    for tid in os.listdir(f"/proc/{launcher_pid}/task"):
        with open(f"/proc/{launcher_pid}/task/{tid}/children") as f:
            children = [int(c) for c in f.read().split()]
        for pid in children:
            try:
                with open(f"/proc/{pid}/environ") as f:
                    env = dict(kv.split("=", 1) for kv in f.read().split("\0") if "=" in kv)
            except OSError:  # gone already
                continue
            if "RANK" in env:
                workers[int(env["RANK"])] = pid
    return workers


def wait_for(predicate, timeout, what):
    """Poll predicate() every 20 ms until it is true; AssertionError naming what after timeout seconds."""
    import time
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.02)
