"""
The launcher's environment, read once, and what the ranks of a torchrun launch do together.

    env = DistEnv.from_environ()     # torchrun's RANK, LOCAL_RANK, WORLD_SIZE, ...: once, in main
    startup = init(env, device, timeout)    # the process group, and a gloo group for start-up waits
    data_dir = rank0_first(prepare, env, startup)   # rank 0 builds, then the others read
    n = agree(value, "max", device)      # the same number on every rank
    teardown()

Imports torch and fileio only.
"""
import dataclasses
import datetime
import math
import os
import shlex
import sys
import time
import uuid
from typing import NamedTuple

import torch
import torch.distributed as dist

from gpt2train.fileio import UserError

# the ranks wait this long for rank 0's data prep, not dist_timeout
STARTUP_TIMEOUT = datetime.timedelta(hours=24)


@dataclasses.dataclass(frozen=True)
class DistEnv:
    ddp: bool = False  # launched by torchrun
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    restarts: int = 0  # how often torchrun restarted this node's workers (--max_restarts)
    agent_store: bool = False  # the workers share torchrun's rendezvous store (its default)

    @classmethod
    def from_environ(cls, environ=None):
        e = os.environ if environ is None else environ
        return cls(ddp="RANK" in e, rank=int(e.get("RANK", 0)),
                   local_rank=int(e.get("LOCAL_RANK", 0)),
                   world_size=int(e.get("WORLD_SIZE", 1)),
                   local_world_size=int(e.get("LOCAL_WORLD_SIZE", 1)),
                   restarts=int(e.get("TORCHELASTIC_RESTART_COUNT", 0)),
                   agent_store=e.get("TORCHELASTIC_USE_AGENT_STORE") == "True")

    @property
    def master(self):
        return self.rank == 0

    @property
    def nodes(self):
        return self.world_size // self.local_world_size

    def command(self, script, argv):
        """The command line that continues this run (script with argv, --resume=true), as typed from
        here."""
        args = [a for a in argv if not a.startswith("--resume=")] + ["--resume=true"]
        launcher = [os.path.basename(sys.executable)]
        if self.ddp:
            launcher = ["torchrun", "--standalone" if self.nodes == 1 else f"--nnodes={self.nodes}",
                        f"--nproc_per_node={self.local_world_size}"]
        return shlex.join(launcher + [os.path.relpath(os.path.abspath(script))] + args)

    def shutdown_grace_note(self, took):
        """A note when a stop (the step in progress, then a save: took seconds) outlasts the grace
        torchrun gives its workers between passing on a stop signal and SIGKILL; "" otherwise."""
        grace = float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
                      or os.environ.get("PET_SHUTDOWN_TIMEOUT") or 30)
        if not self.ddp or took <= grace:
            return ""
        return (f"note: a step and a save take {took:.0f} s, more than the {grace:.0f} s torchrun "
                "gives the workers between passing on a stop signal and SIGKILL: set "
                f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={max(60, math.ceil(2 * took / 10) * 10)} for "
                "torchrun (a torch whose torchrun has --shutdown-timeout), or a stop may lose the "
                "steps since the last checkpoint")


class RestartFailed(RuntimeError):
    """A group restarted by torchrun that could not connect at start-up; the message is the line
    to print."""


def init(env, device, timeout_s):
    """Under torchrun: the process group (NCCL on CUDA, gloo on CPU) with timeout_s for collectives,
    and a gloo group for rank0_first's start-up waits (STARTUP_TIMEOUT). Returns that group, or
    None. Both keep their keys under a prefix of this attempt's own (attempt_prefix)."""
    if not env.ddp:
        return None
    device_type = torch.device(device).type
    if device_type == "mps":
        raise UserError("torchrun on MPS is not supported: run one process, or use --device=cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    # NCCL: the watchdog tears a hung collective down after dist_timeout (3: without cleanup, the
    # torch default; 0 would leave it blocking forever); gloo raises in the waiting rank
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store, _, _ = next(dist.rendezvous("env://", env.rank, env.world_size, timeout=timeout))
        prefix = attempt_prefix(store, env, timeout_s)
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo",
                                store=dist.PrefixStore(prefix, store), rank=env.rank,
                                world_size=env.world_size, timeout=timeout)
        return dist.new_group(backend="gloo", timeout=STARTUP_TIMEOUT)
    except RuntimeError as e:
        if env.restarts and env.agent_store:
            raise RestartFailed(restart_failure_line(e, env.rank)) from e
        raise


def attempt_prefix(store, env, timeout_s):
    """A store prefix that this attempt's ranks agree on and no earlier attempt used. torchrun keeps
    one store for all its restarts (torch 2.13), so without one a restarted group reads the dead
    workers' addresses and fails to connect (pytorch/pytorch#135712): rank 0 draws a fresh name,
    and each other rank takes the name it reads only once rank 0 has echoed its own fresh token
    under it (a name left by an earlier attempt gets no echo: rank 0 of that attempt is gone)."""
    if env.master:
        name = uuid.uuid4().hex
        store.set("gpt2train/attempt", name)
        for r in range(1, env.world_size):  # each get waits for rank r, up to the store's timeout
            store.set(f"gpt2train/{name}/pong/{r}", store.get(f"gpt2train/{name}/ping/{r}"))
        return f"gpt2train/{name}/"
    token, deadline = uuid.uuid4().hex.encode(), time.monotonic() + timeout_s
    while True:
        name = store.get("gpt2train/attempt").decode()  # waits for rank 0 on a first start
        store.set(f"gpt2train/{name}/ping/{env.rank}", token)
        pong = f"gpt2train/{name}/pong/{env.rank}"
        if store.check([pong]) and store.get(pong) == token:
            return f"gpt2train/{name}/"
        if time.monotonic() > deadline:
            raise dist.DistStoreError(f"rank 0 did not answer rank {env.rank} at start-up within "
                                      f"{timeout_s} s")
        time.sleep(0.1)  # polled: a store wait that times out logs a warning each time


def restart_failure_line(e, rank):
    """The error line for a group that torchrun restarted and that failed at start-up."""
    why = (str(e).strip().splitlines() or [type(e).__name__])[-1][:200]
    return (f"error: rank {rank}: the workers torchrun restarted could not start together ({why}): "
            "start torchrun again with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 set (a fresh "
            "rendezvous store for each restart, pytorch/pytorch#135712); --resume=auto continues "
            "from the newest checkpoint")


def agreed_signal(signals, device):
    """The stop signal caught by any rank (the largest number over the ranks; 0: none), from this
    rank's caught signals. Under torchrun a signal may reach one rank only: the others learn of it
    here, in an evaluation, as they do from the step's all_reduce after a step (guard.Asks)."""
    mine = signals[0] if signals else 0
    return int(agree(float(mine), "max", device))


def teardown():
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def rank():
    """This process's rank in the default process group: 0 without one (no torchrun)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def agree(value, op, device, group=None):
    """The same number on every DDP rank: all_reduce with op ('max' or 'min') over group (None: all
    ranks, the default process group; a gloo group takes device "cpu"); unchanged without DDP."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN, group=group)
    return t.item()  # sync


def rank0_first(work, env, startup):
    """work() on rank 0 first, then on the other ranks, which use what it made (a tokenized corpus,
    a download in the cache). The ranks wait for each other in the start-up group (gloo,
    STARTUP_TIMEOUT: tokenizing a large --data can outlast dist_timeout). Each turn ends with the
    ranks agreeing on the worst outcome, so a failure on any rank stops them all at once, with its
    exit code (2 bad input, 1 otherwise), instead of leaving the others waiting for a peer that is
    gone and then blaming the network. startup None (no torchrun): work() alone."""
    if startup is None:
        return work()
    result = None
    for turn in ("rank 0", "another rank"):
        failure = None
        if env.master == (turn == "rank 0"):
            try:
                result = work()
            except Exception as e:  # noqa: BLE001 - said below, then raised again
                failure = e
        code = 0
        if failure is not None:
            code = 2 if isinstance(failure, UserError) else 1
        worst = int(agree(code, "max", "cpu", group=startup))
        if failure is not None:
            # main() says rank 0's errors only
            if not env.master and isinstance(failure, (UserError, OSError)):
                print(f"error: rank {env.rank}: {failure}", file=sys.stderr)
            raise failure
        if worst:
            why = f"stopped: {turn} failed at start-up; its error is in its output"
            # one line on each other node (rank 0 says its own)
            if not env.master and env.local_rank == 0:
                print(f"error: rank {env.rank}: {why}", file=sys.stderr)
            raise (UserError if worst == 2 else OSError)(why)
    return result


class OverRanks(NamedTuple):
    loss: object  # 0-d tensor: the loss averaged over the ranks
    counts: object  # 1-D tensor on the device: how many ranks ask for each ask, or None alone


def over_ranks(loss, asks, env):
    """The loss averaged over the ranks and how many ranks ask for each of asks (numbers), in one
    all_reduce (SUM) under torchrun, so that every rank decides alike; the counts stay on the device
    for optim.optimizer_step to read with the loss and the norm, in one transfer. Alone: (loss,
    None)."""
    if not env.ddp:
        return OverRanks(loss, None)
    # no host-to-device copy
    stats = torch.stack([loss] + [torch.full_like(loss, ask) for ask in asks])
    dist.all_reduce(stats)
    return OverRanks(stats[0] / env.world_size, stats[1:])


def peer_failure_line(e, rank, newest=None):
    """The error line for a peer that stopped answering (dist_timeout) or went away
    (peer_failure(e)): nothing more is saved (a save needs every rank), so it names newest, the
    checkpoint to continue from ("": out_dir holds none; None: out_dir not decided yet)."""
    why = (str(e).strip().splitlines() or [type(e).__name__])[-1][:200]
    saved = "the checkpoints written so far are intact, continue with --resume=auto"
    if newest is not None:
        saved = (f"nothing was saved since {newest}, the newest checkpoint: --resume=auto "
                 "continues from it" if newest else
                 "no checkpoint was written (out_dir holds none): the same command starts over")
    return (f"error: rank {rank}: a peer did not answer within dist_timeout or went away ({why}): "
            "check that every node is up and reachable (NCCL_DEBUG=INFO shows where it waits); "
            f"{saved}")


def peer_failure(e):
    """Whether a RuntimeError is a collective that failed for want of a peer: torch.distributed's
    own errors, and the backends' timeouts and closed connections that DDP's reducer raises as plain
    RuntimeErrors."""
    return isinstance(e, dist.DistError) or any(s in str(e) for s in (
        "Timed out waiting", "Connection closed by peer", "Connection reset by peer",
        "NCCL communicator was aborted", "Watchdog caught collective operation timeout"))
