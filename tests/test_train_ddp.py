"""torchrun with 2 CPU processes (gloo): one read of the device per step on every rank, a data prep longer than
dist_timeout waited for, and the micro-batch that keeps the tokens per step (the losses then equal 1 process's).
That 2 ranks accumulating 2 micro-steps each (DDP's no_sync path) train exactly what 1 process trains, with the
same val losses, weights and optimizer state, is checked once, on the two-node run of tests/test_multinode.py."""
import json
import sys

from conftest import Launched, step_losses, tiny_args, torchrun_env, write_shards
from train_gpt2 import main


READS = '''
import json, os, sys
import torch
sys.path.insert(0, {root!r})
from gpt2train import optim
import train_gpt2

reads, marks = [0], []
for name in ("item", "tolist"):  # every read of a tensor's values into Python by the project's code
    def counted(self, *a, _orig=getattr(torch.Tensor, name), **k):  # (not torch's: CPU AdamW reads its step counts)
        reads[0] += os.path.dirname(sys._getframe(1).f_code.co_filename) in ({root!r}, {root!r} + '/gpt2train')
        return _orig(self, *a, **k)
    setattr(torch.Tensor, name, counted)
accumulate = optim.accumulate_gradients
def marked(*a, **k):  # called once per optimizer step, at its start
    marks.append(reads[0])
    return accumulate(*a, **k)
optim.accumulate_gradients = marked
code = train_gpt2.main(sys.argv[1:])
with open(os.path.join({out!r}, "reads_" + os.environ["RANK"] + ".json"), "w") as f:
    json.dump([b - a for a, b in zip(marks, marks[1:])], f)
sys.exit(code)
'''


def test_two_ranks_read_the_device_once_per_step(tmp_path):
    """Under DDP the stop requests ride the loss all_reduce and are read with loss and norm: one read of
    tensor values (one host sync on a GPU) per optimizer step, on every rank."""
    from conftest import ROOT
    data = write_shards(str(tmp_path / "data"))
    script = tmp_path / "count_reads.py"
    script.write_text(READS.format(root=ROOT, out=str(tmp_path)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
           *tiny_args(data, str(tmp_path / "out"), max_steps=5, eval_interval=0, checkpoint_interval=0,
                      checkpoint_minutes=0)]
    with Launched([cmd], tmp_path, env=torchrun_env()) as run:
        assert run.wait(timeout=180) == [0], run.logs()
        assert "note: a step and a save take" not in run.logs(tail=100000)  # well within torchrun's default 30 s
    per_step = [json.loads((tmp_path / f"reads_{rank}.json").read_text()) for rank in (0, 1)]
    assert per_step == [[1, 1, 1, 1]] * 2  # steps 0-3, each counted from its start to the next one's


SLOW_PREP = '''
import os, sys, time
sys.path.insert(0, {root!r})
import train_gpt2

prepare = train_gpt2.data.prepare
def slow(*args, build=True, **kwargs):  # rank 0 tokenizing a large --data: longer than dist_timeout
    if build:
        time.sleep(8)
    return prepare(*args, build=build, **kwargs)
train_gpt2.data.prepare = slow
sys.exit(train_gpt2.main(sys.argv[1:]))
'''


def test_data_prep_longer_than_dist_timeout_is_waited_for(tmp_path):
    """The other ranks wait for rank 0's data prep in the start-up group, whose timeout is not dist_timeout
    (which bounds a hung step, 3 s here): an 8 s prep does not end them."""
    from conftest import ROOT
    data = write_shards(str(tmp_path / "data"))
    script = tmp_path / "slow_prep.py"
    script.write_text(SLOW_PREP.format(root=ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
           *tiny_args(data, str(tmp_path / "out"), max_steps=2, eval_interval=0, checkpoint_interval=0, dist_timeout=3)]
    with Launched([cmd], tmp_path, env=torchrun_env()) as run:
        assert run.wait(timeout=120) == [0], run.logs()
    assert sorted(step_losses(str(tmp_path / "out"))) == [0, 1]


def test_two_ranks_take_the_micro_batch_that_keeps_the_tokens_per_step(tmp_path):
    """Issue 31: torchrun on the quickstart was refused with "e.g. --total_batch_size=2048" (double the tokens
    per step) under torchrun's traceback. Left at its default, the micro-batch is now the largest that keeps
    total_batch_size (2 ranks: 2 rows each where 1 process takes 4), and the losses equal one process's; set
    too large for 2 ranks, the refusal names the micro-batch that keeps the step, and torchrun's failure
    summary, printed last, shows that line."""
    data = write_shards(str(tmp_path / "data"))
    common = dict(micro_batch_size=None, max_steps=3, eval_interval=0, checkpoint_interval=0)
    one = str(tmp_path / "one")
    assert main(tiny_args(data, one, **common)) == 0
    two = str(tmp_path / "two")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train_gpt2.py"]
    with Launched([cmd + tiny_args(data, two, **common)], tmp_path, env=torchrun_env()) as run:
        assert run.wait(timeout=180) == [0], run.logs()
        assert "micro_batch_size=2: the largest up to 64 whose 2 x 16 x 2 rank(s) divides total_batch_size=64" \
            in run.logs(tail=100_000)  # the whole log: the resolved config and the end-of-run summary follow
    a, b = step_losses(one), step_losses(two)
    assert sorted(a) == sorted(b) == [0, 1, 2] and all(abs(a[s] - b[s]) <= 1e-5 for s in a), (a, b)

    refused = cmd + tiny_args(data, str(tmp_path / "refused"), micro_batch_size=4)
    with Launched([refused], tmp_path, env=torchrun_env()) as run:
        assert run.wait(timeout=180) != [0]
        line = ("error: total_batch_size=64 is not a multiple of micro_batch_size x seq_len x world_size = 4 x 16 x 2 "
                "= 128: --micro_batch_size=2 keeps 64 tokens per step (or --total_batch_size=128 makes it 128)")
        tail = run.logs().strip().splitlines()[-12:]  # torchrun's summary box, last
        assert any(line in t for t in tail), run.logs()


def test_a_config_files_micro_batch_adapts_to_the_ranks(tmp_path):
    """Issue 39: the quickstart's config file pins micro_batch_size = 8 and torchrun refused it; a micro-batch
    from a config file (not the command line) now becomes the largest that keeps total_batch_size over the
    ranks, said once, and the 2-rank run trains."""
    data = write_shards(str(tmp_path / "data"))
    config = tmp_path / "pinned.py"
    config.write_text("micro_batch_size = 4\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train_gpt2.py",
           str(config)] + tiny_args(data, str(tmp_path / "two"), micro_batch_size=None, max_steps=2, eval_interval=0,
                                    checkpoint_interval=0)
    with Launched([cmd], tmp_path, env=torchrun_env()) as run:
        assert run.wait(timeout=180) == [0], run.logs()
        assert "micro_batch_size=2: the largest up to 4 whose 2 x 16 x 2 rank(s) divides total_batch_size=64" \
            in run.logs(tail=100_000)  # the whole log: the resolved config and the end-of-run summary follow
    assert sorted(step_losses(str(tmp_path / "two"))) == [0, 1]
