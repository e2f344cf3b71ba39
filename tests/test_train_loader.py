"""TokenLoader: memory-mapped shards read as one stream; rank slicing, shard crossing, resume state."""
import os

import numpy as np
import pytest
import torch

from train_gpt2 import TokenLoader, UserError

SIZES = [37, 50, 23, 64]  # odd sizes: batches straddle every shard boundary


@pytest.fixture
def shards(tmp_path):
    """Train shards holding 0, 1, 2, ... in order (the stream is its own index), and a val shard."""
    stream = np.arange(sum(SIZES), dtype=np.uint16)
    start = 0
    for i, n in enumerate(SIZES):
        np.save(tmp_path / f"edufineweb_train_{i + 1:06d}.npy", stream[start:start + n])
        start += n
    np.save(tmp_path / "edufineweb_val_000000.npy", np.arange(1000, 1100, dtype=np.uint16))
    (tmp_path / "manifest.json").write_text("{}")
    return str(tmp_path), stream.astype(np.int64)


def expected(stream, start, n):
    return torch.from_numpy(np.take(stream, np.arange(start, start + n), mode="wrap"))


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_ranks_read_disjoint_consecutive_slices(shards, world_size):
    data_dir, stream = shards
    B, T = 2, 5
    loaders = [TokenLoader(data_dir, "train", B, T, r, world_size) for r in range(world_size)]
    seen = []
    for k in range(25):  # several laps of the 174-token stream
        for r, loader in enumerate(loaders):
            x, y = loader.next_batch()
            assert x.shape == y.shape == (B, T) and x.dtype == torch.int64
            start = (k * world_size + r) * B * T
            ref = expected(stream, start, B * T + 1)
            assert torch.equal(x.flatten(), ref[:-1]) and torch.equal(y.flatten(), ref[1:])  # targets = next tokens
            seen.append(x.flatten())
    # together, the ranks consumed the stream in order: no token skipped at a shard end, none twice
    consumed = torch.cat(seen)
    assert torch.equal(consumed, expected(stream, 0, len(consumed)))


def test_shards_are_memory_mapped(shards):
    loader = TokenLoader(shards[0], "train", 2, 5)
    assert all(isinstance(s, np.memmap) and s.dtype == np.uint16 for s in loader.shards)
    assert loader.n_tokens == sum(SIZES)


def test_val_split_and_reset(shards):
    loader = TokenLoader(shards[0], "val", 2, 5)
    first = loader.next_batch()
    assert first[0][0, 0] == 1000
    loader.next_batch()
    loader.reset()
    assert torch.equal(loader.next_batch()[0], first[0])


def test_state_dict_resumes_at_the_exact_position(shards):
    data_dir, _ = shards
    a = TokenLoader(data_dir, "train", 3, 7, 1, 2)
    for _ in range(11):
        a.next_batch()
    b = TokenLoader(data_dir, "train", 3, 7, 1, 2)
    b.load_state_dict(a.state_dict())
    for _ in range(5):
        assert torch.equal(a.next_batch()[0], b.next_batch()[0])


def test_state_from_other_data_is_refused(shards, tmp_path):
    data_dir, _ = shards
    state = TokenLoader(data_dir, "train", 2, 5).state_dict()
    os.remove(os.path.join(data_dir, "edufineweb_train_000004.npy"))
    with pytest.raises(UserError, match="differ from the checkpoint"):
        TokenLoader(data_dir, "train", 2, 5).load_state_dict(state)


def test_too_little_data(shards):
    with pytest.raises(UserError, match="fewer than one micro-batch"):
        TokenLoader(shards[0], "val", 10, 10)


def test_tokens_beyond_vocab(shards):
    with pytest.raises(UserError, match="token id .* vocab_size is 64"):
        TokenLoader(shards[0], "train", 2, 50, vocab_size=64).next_batch()
