"""Shared fixtures and helpers (every test module imports them from here; none imports another test
module): toy token shards and tiny runs, tiny models and their checkpoints, HellaSwag rows, text documents,
and the processes a test starts. Everything here is local and offline."""
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

# loss_impl=fused's Triton kernel on CPU runs under Triton's interpreter (tests/test_loss_fused.py); Triton reads
# this when triton.language is imported, which torch does on importing model.py (its custom op): before that
if not torch.cuda.is_available():  # on a GPU the compiled kernels run, the interpreter would take them over
    os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
torch.set_num_threads(min(2, torch.get_num_threads()))

from gpt2train import optim  # noqa: E402 - the repository's modules: after its root is on sys.path
from gpt2train import precision  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

# -----------------------------------------------------------------------------
# toy token shards and tiny training runs


def write_shards(data_dir, n_train=3000, n_val=600, vocab=64, seed=0):
    """A learnable toy stream (a noisy +1 counter) split into a val shard and two train shards."""
    rng = np.random.default_rng(seed)
    n = n_train + n_val
    tokens = (np.arange(n) + (rng.random(n) < 0.1) * rng.integers(0, vocab, n)) % vocab
    tokens = tokens.astype(np.uint16)
    os.makedirs(data_dir, exist_ok=True)
    np.save(os.path.join(data_dir, "toy_val_000000.npy"), tokens[:n_val])
    np.save(os.path.join(data_dir, "toy_train_000001.npy"), tokens[n_val:n_val + n_train // 2])
    np.save(os.path.join(data_dir, "toy_train_000002.npy"), tokens[n_val + n_train // 2:])
    return data_dir


def tiny_args(data_dir, out_dir, **over):
    """train_gpt2.py's arguments for a tiny run on write_shards' data: 8 steps, evals and checkpoints at 4 and 8."""
    args = dict(data_dir=data_dir, out_dir=out_dir, n_layer=1, n_head=2, n_embd=32, block_size=32, vocab_size=64,
                micro_batch_size=2, seq_len=16, total_batch_size=64, max_steps=8, warmup_steps=2, max_lr=1e-2,
                min_lr=1e-3, eval_interval=4, val_steps=2, hellaswag_interval=0, sample_interval=0,
                checkpoint_interval=4, seed=0)
    args.update(over)
    return [f"--{k}={v}" for k, v in args.items() if v is not None]  # None: the key left out


def read_log(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def step_losses(out_dir):
    return {e["step"]: e["loss"] for e in read_log(out_dir) if "loss" in e}


def load_ckpt(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_state(path_a, path_b):
    """Two checkpoints hold the same step, loader position, weights and optimizer state, bit for bit."""
    a, b = load_ckpt(path_a), load_ckpt(path_b)
    assert a["step"] == b["step"] and a["loader"] == b["loader"]
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])

# -----------------------------------------------------------------------------
# tiny models and their checkpoints


def one_line(err):
    """The single `error: ...` line a refused command prints last on stderr (after progress bars, if any, and
    no traceback), or AssertionError showing what it printed."""
    lines = err.strip().splitlines()
    assert lines and lines[-1].startswith("error: ") and sum(x.startswith("error") for x in lines) == 1 \
        and "Traceback" not in err, err
    return lines[-1]


TINY = dict(block_size=32, vocab_size=64, n_layer=1, n_head=2, n_embd=32)  # the model of tiny_args' runs


def tiny_model(seed=0, **shape):
    """The tiny GPT every test builds: tiny_args' model, with shape's GPTConfig fields changed."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY, **shape}))


def adamw(model, lr=1e-3, weight_decay=0.1):
    """model's AdamW as the trainer builds it (optim.build_optimizers)."""
    return optim.build_optimizers(model, "adamw", lr=lr, weight_decay=weight_decay)[0]


def random_model(vocab_size=50304, seed=0):
    """A tiny GPT whose every weight is random (layer norms and biases too), so greedy decoding
    wanders through the vocabulary instead of repeating one token."""
    m = tiny_model(seed, block_size=64, vocab_size=vocab_size, n_layer=2).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.1)
    return m


COMPILED_REGIONS = ("CompiledFunction", "Torch-Compiled Region", "CompiledFxGraph")  # profiler ranges


def aten_outside_compiled(events):
    """The aten ops a profile saw outside compiled code and outside the autograd engine's gradient
    accumulation into .grad (AccumulateGrad: every trainer's, per parameter)."""
    skip = [(e.time_range.start, e.time_range.end) for e in events
            if any(r in e.name for r in COMPILED_REGIONS) or "AccumulateGrad" in e.name]
    return [e for e in events if e.name.startswith("aten::")
            and not any(s <= e.time_range.start and e.time_range.end <= end for s, end in skip)]


def has_input_of(e, numel):
    """Whether a profiled op took a tensor of at least numel elements (record_shapes=True)."""
    return any(shape and torch.Size(shape).numel() >= numel for shape in e.input_shapes
               if isinstance(shape, list))


def cpu_plan(dtype):
    """The CPU precision plan for a torch dtype (autocast to it below fp32)."""
    return precision.make_plan("cpu", precision.dtype_name(dtype))


def save_ckpt(model, path):
    """A checkpoint of model's weights only (what model.py, sample.py and hellaswag.py read)."""
    torch.save({"model": model.state_dict(), "model_args": dataclasses.asdict(model.config)}, path)
    return str(path)

# -----------------------------------------------------------------------------
# HellaSwag rows and text documents


WORDS = ("man woman dog ball kitchen knife water slowly quickly jumps runs paints wall car road tree "
         "rope bike window table chair sings plays guitar piano holds lifts throws catches").split()


def make_rows(n, seed=0, ctx_words=(3, 30), end_words=(1, 12)):
    """n HellaSwag-format rows of random sentences."""
    rng = random.Random(seed)
    sent = lambda k: " ".join(rng.choices(WORDS, k=k)).capitalize() + "."  # noqa: E731
    return [{"ind": i, "ctx": sent(rng.randint(*ctx_words)), "label": rng.randrange(4),
             "endings": [sent(rng.randint(*end_words)) for _ in range(4)], "split": "val"} for i in range(n)]


def write_rows(path, rows):
    with open(path, "w") as f:
        f.writelines((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    return str(path)


DOCS = [
    "Hello, I'm a language model, and this is the first document.\n",
    "  leading spaces, trailing spaces and newlines   \n\n\n",
    "Unicode: café, naïve, 日本語, emoji 🙂 and the dash — done.",
    "A document that spells out <|endoftext|> must keep it as plain text.",
    "\n",  # whitespace only
    "Windows\r\nline\r\nendings\r\n" + "and a longer paragraph that spans many tokens. " * 12,
    "x" * 300 + " " + "1234567890" * 7,
    "The last one ends without a newline",
]


def write_txt(d, docs):
    """Each doc as d/docNN.txt, its bytes as given (no newline translation); their paths."""
    paths = []
    for i, doc in enumerate(docs):
        paths.append(str(d / f"doc{i:02d}.txt"))
        with open(paths[-1], "w", encoding="utf-8", newline="") as f:
            f.write(doc)
    return paths


def snapshot(out):
    """Every file in out_dir with its bytes."""
    return {f: open(os.path.join(out, f), "rb").read() for f in sorted(os.listdir(out))}

# -----------------------------------------------------------------------------
# OpenAI's weights offline, and the fixtures


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


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """Toy token shards (write_shards: a learnable noisy counter), one set for the session: read, never written."""
    return write_shards(str(tmp_path_factory.mktemp("shards")))


def straight_args(data_dir, out_dir, **over):
    """tiny_args at a constant learning rate after its warmup (min_lr == max_lr), so that max_steps changes no
    step: a run stopped at any step, resumed to any max_steps, matches the straight run step for step."""
    kw = dict(min_lr=1e-2, eval_interval=3, val_steps=1, checkpoint_interval=2, keep_last=0)
    return tiny_args(data_dir, out_dir, **{**kw, **over})


@pytest.fixture(scope="session")
def straight(data_dir, tmp_path_factory):
    """straight_args' run, never interrupted: 8 steps, evals at 0, 3, 6 and 8, every 2nd step's checkpoint kept
    (the folder). Tests compare their stopped, resumed or failed runs with it; none writes into it."""
    import train_gpt2
    out = str(tmp_path_factory.mktemp("straight"))
    assert train_gpt2.main(straight_args(data_dir, out)) == 0
    assert sorted(f for f in os.listdir(out) if f.startswith("ckpt_")) == [f"ckpt_00000{s}.pt" for s in (2, 4, 6, 8)]
    return out


# 4 AdamW steps of a 2-layer model: 1 rank x 4 micro-steps of 2 x 16 = 2 ranks x 2 micro-steps (DDP's no_sync
# path, FSDP's sharded state); checkpoints at 2 and 4. val: 4 batches in one process = 2 a rank on 2 ranks.
TWO_RANK_STEPS = dict(n_layer=2, max_steps=4, total_batch_size=128, eval_interval=4, checkpoint_interval=2,
                      max_lr=1e-3, min_lr=1e-4)


@pytest.fixture(scope="session")
def one_process(data_dir, tmp_path_factory):
    """TWO_RANK_STEPS in one process: the reference every 2-rank run of them (DDP on two nodes, FSDP) is compared
    with (assert_same_run), paid for once a session. Read, never written."""
    import train_gpt2
    out = str(tmp_path_factory.mktemp("one_process"))
    assert train_gpt2.main(tiny_args(data_dir, out, **TWO_RANK_STEPS, val_steps=4)) == 0
    return out


def assert_same_run(a_dir, b_dir, steps, final_step=4):
    """b_dir's run logged the given steps with a_dir's losses and ended with its weights and AdamW state (by
    parameter name), each within 1e-5."""
    a, b = step_losses(a_dir), step_losses(b_dir)
    assert sorted(b) == steps
    assert all(abs(a[s] - b[s]) <= 1e-5 for s in steps), (a, b)
    wa = load_ckpt(os.path.join(a_dir, f"ckpt_{final_step:06d}.pt"))
    wb = load_ckpt(os.path.join(b_dir, f"ckpt_{final_step:06d}.pt"))
    assert set(wa["model"]) == set(wb["model"])  # the plain state_dict's keys, whichever run wrote it
    assert max((wa["model"][k] - wb["model"][k]).abs().max().item() for k in wa["model"]) <= 1e-5
    sa, sb = wa["optimizer"]["state"], wb["optimizer"]["state"]
    assert set(sa) == set(sb) and all(isinstance(k, str) for k in sa)  # by parameter name
    assert max((sa[k][n] - sb[k][n]).abs().max().item() for k in sa for n in ("exp_avg", "exp_avg_sq")) <= 1e-5


def val_losses(out_dir):
    return [e["val_loss"] for e in read_log(out_dir) if "val_loss" in e]


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """DOCS as text files (their paths): fineweb.py's input."""
    return write_txt(tmp_path_factory.mktemp("corpus"), DOCS)


def build_shards(corpus, out, *flags):
    """fineweb.py over corpus in 37-token shards, in this process (--num_proc 1); its exit code."""
    import fineweb
    return fineweb.main(["--source", *corpus, "--out_dir", str(out), "--shard_size", "37", "--num_proc", "1", *flags])


@pytest.fixture(scope="session")
def built(corpus, tmp_path_factory):
    """The corpus tokenized once by build_shards (the folder); none writes into it."""
    out = str(tmp_path_factory.mktemp("built") / "out")
    assert build_shards(corpus, out) == 0
    return out


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


def run_ranks(args, out_dir, world_size=2, timeout=150):
    """train_gpt2.py args on world_size local ranks; returns rank 0's stdout. Fails the test on a
    non-zero exit or the deadline; every rank still running by then is killed."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    os.makedirs(out_dir, exist_ok=True)
    procs, logs = [], []
    try:
        for rank in range(world_size):
            log = open(os.path.join(out_dir, f"rank{rank}.txt"), "w+")
            logs.append(log)
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
            procs.append(subprocess.Popen([sys.executable, "train_gpt2.py", *args], cwd=ROOT, stdout=log,
                                          stderr=subprocess.STDOUT, env=rank_env))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break  # one rank failed: the others would wait for it until the deadline
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            p.wait()
        texts = []
        for log in logs:
            log.seek(0)
            texts.append(log.read())
            log.close()
    codes = [p.returncode for p in procs]
    assert codes == [0] * world_size, f"exit codes {codes}\n" + "\n".join(t[-3000:] for t in texts)
    return texts[0]


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
        paths = [os.path.join(self.log_dir, f"proc{i}.log") for i in range(len(self.procs))]
        return "\n".join(open(path).read()[-tail:] for path in paths)

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

# -----------------------------------------------------------------------------
# nothing left running: what a test starts is ended by pid, its whole tree on every path (torchrun's
# workers run in sessions of their own, out of killpg's reach); the session fails if a test leaves one


def process_table():
    """{pid: (parent pid, state letter)} of every process, from /proc (Linux; {} elsewhere)."""
    table = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            except (OSError, ValueError):
                continue  # gone meanwhile
            table[int(entry)] = (int(ppid), state)
    return table


def descendants(pid, table=None):
    """pids of every process below pid (its children, theirs, ...), parents before children."""
    children = {}
    for p, (ppid, _) in (process_table() if table is None else table).items():
        children.setdefault(ppid, []).append(p)
    found, todo = [], [pid]
    while todo:
        kids = sorted(children.get(todo.pop(0), ()))
        found += kids
        todo += kids
    return found


def alive(pid):
    """Whether pid is a process that has not exited (a zombie, exited but not yet reaped, has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def command_line(pid, width=160):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            line = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"
    return line if len(line) <= width else line[:width - 3] + "..."


def has_marker(pid, marker):
    """Whether the environment pid was started with holds marker (VAR=value, inherited by what it starts)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return marker.encode() in f.read().split(b"\0")
    except OSError:
        return False


def end_processes(roots=(), marker=None, timeout=30):
    """Ends roots, every process below them and every one whose environment holds marker (an orphan whose
    parent died first), by pid: all frozen first, top down (SIGSTOP, until no new one appears, so none starts
    another), then SIGKILL and SIGCONT (a stopped process ends too). Waits until they have exited; their pids."""
    def send(pid, sig):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    import signal
    import time
    frozen, me = [], os.getpid()
    while True:
        table = process_table()
        found = [p for p in roots if p in table] + [q for p in roots for q in descendants(p, table)]
        if marker:
            found += [p for p in table if p != me and has_marker(p, marker)]
            found += [q for p in found for q in descendants(p, table)]
        todo = [p for p in dict.fromkeys(found) if p not in frozen and alive(p)]
        if not todo:
            break
        for pid in todo:
            send(pid, signal.SIGSTOP)
        frozen += todo
    for pid in frozen:
        send(pid, signal.SIGKILL)
        send(pid, signal.SIGCONT)
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in frozen):
        if time.monotonic() > deadline:
            raise AssertionError(f"still running {timeout} s after SIGKILL: {[p for p in frozen if alive(p)]}")
        time.sleep(0.02)
    return frozen


class LaunchedTree(Launched):
    """Launched, ended by pid on leaving: each command's whole process tree, torchrun's workers included (killpg
    misses them), and any process started with this launch's marker in its environment (an orphaned worker)."""

    def __init__(self, cmds, log_dir, env=None, cwd=ROOT):
        import uuid
        self.marker = f"TEST_LAUNCH_ID={uuid.uuid4().hex}"
        key, value = self.marker.split("=")
        super().__init__(cmds, log_dir, env=dict(os.environ if env is None else env, **{key: value}), cwd=cwd)

    def __exit__(self, *exc):
        try:
            end_processes([p.pid for p in self.procs if p.poll() is None], marker=self.marker)
        finally:
            for p in self.procs:
                p.wait()
        return False


HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "compile_worker")  # end with pytest


def strays(table=None):
    """pytest's live descendants but its own helpers (and theirs), which exit with it."""
    table = process_table() if table is None else table
    helpers = [p for p in descendants(os.getpid(), table) if any(h in command_line(p) for h in HELPERS)]
    ok = set(helpers) | {q for p in helpers for q in descendants(p, table)}
    return [p for p in descendants(os.getpid(), table) if p not in ok and table[p][1] not in ("Z", "X")]


def _subreaper():
    """Orphans of what the tests start (torchrun's workers when torchrun dies first) become pytest's children
    rather than init's, so that the guard still finds them (Linux's PR_SET_CHILD_SUBREAPER; elsewhere nothing)."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


_subreaper()
_left = {}  # pid: (the test after which it still ran, its command line)
_to_end = set()  # those of them to end at the end of the module


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Notes the processes a test leaves running; ends them after the last test of its module (whose
    module-scoped fixtures are torn down by then); pytest_sessionfinish fails the run naming them."""
    before = set(strays())
    yield
    for pid in strays():
        if pid not in before and pid not in _left:
            _left[pid] = (item.nodeid, command_line(pid))
            _to_end.add(pid)
    if _to_end and (nextitem is None or nextitem.path != item.path):
        end_processes(_to_end & set(strays()))
        _to_end.clear()


def pytest_sessionfinish(session, exitstatus):
    fail_on_unexpected_skips(session)
    left = strays()
    for pid in left:
        _left.setdefault(pid, ("the session", command_line(pid)))
    end_processes(left)
    for pid in [p for p, (ppid, state) in process_table().items() if ppid == os.getpid() and state == "Z"]:
        try:
            os.waitpid(pid, os.WNOHANG)  # orphans that came to pytest (subreaper) and exited: reaped
        except ChildProcessError:
            pass
    if _left:
        lines = [f"error: {len(_left)} process(es) left running by the tests, ended by conftest.py's guard:"]
        lines += [f"  pid {pid} after {test}: {cmd}" for pid, (test, cmd) in _left.items()]
        report_lines(session, lines)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def report_lines(session, lines):
    """Lines in red after pytest's progress line (on stderr without a terminal reporter)."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.line("")  # after the progress line
        for line in lines:
            reporter.write_line(line, red=True)
    else:
        print("\n".join(lines), file=sys.stderr)

# -----------------------------------------------------------------------------
# skips: in CI (CI_NO_SKIPS=1, which .ci/run sets) a test skipped outside the GPU module fails the run: an
# importorskip whose package failed to install would otherwise pass unseen (pytest.ini's -rfEs lists them)

EXPECTED_SKIPS = {os.path.join(os.path.dirname(os.path.abspath(__file__)), "test_cuda.py")}  # no GPU here
_skipped = []  # the node id of every skip


def pytest_collectreport(report):
    if report.skipped:  # a module that skips itself (importorskip or pytest.skip at module level)
        _skipped.append(report.nodeid)


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):  # (an xfail reports as skipped: not one)
        _skipped.append(report.nodeid)


def unexpected_skips(rootpath):
    """The skipped node ids outside EXPECTED_SKIPS' modules, when CI asks for none; else []."""
    if os.environ.get("CI_NO_SKIPS") != "1":
        return []
    return [n for n in _skipped if os.path.abspath(os.path.join(rootpath, n.split("::")[0])) not in EXPECTED_SKIPS]


def fail_on_unexpected_skips(session):
    skips = unexpected_skips(str(session.config.rootpath))
    if skips:
        report_lines(session, [f"error: {len(skips)} skipped outside the GPU module (test_cuda.py), where CI "
                               "expects none: install what they need (pip install -r requirements-dev.txt)"]
                     + [f"  skipped: {n}" for n in skips])
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def assert_export_generates_like_us(data_dir, tmp_path, **keys):
    """Two steps of a GPT-2-vocabulary run with these keys, exported: transformers' text-generation pipeline
    continues a prompt greedily exactly as our GPT.generate does."""
    from transformers import pipeline

    import export as export_py
    from gpt2train.tokenizer import get_encoding
    from train_gpt2 import main
    out = str(tmp_path / "run")
    assert main(tiny_args(data_dir, out, vocab_size=50304, max_steps=2, eval_interval=0, checkpoint_interval=0,
                          **keys)) == 0
    ckpt, hf = os.path.join(out, "ckpt_000002.pt"), str(tmp_path / "hf")
    assert export_py.main([ckpt, hf]) == 0
    prompt, enc = "Hello, I'm a language model,", get_encoding()
    ids = pipeline("text-generation", model=hf, device="cpu")(prompt, max_new_tokens=8, do_sample=False,
                                                             return_tensors=True)[0]["generated_token_ids"]
    ours = GPT.from_checkpoint(ckpt).generate(torch.tensor([enc.encode_ordinary(prompt)]), 8, temperature=0)[0]
    assert list(ids) == ours.tolist()
