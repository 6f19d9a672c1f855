"""The CP/SP split of a packed micro-batch (pretrain.model.parallel) and the CP attention on one process."""
import numpy as np
import torch


def _batch(lens):
    from pretrain.data import PackedBatch

    T = sum(lens)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    tok = torch.arange(1, T + 1)[None]
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    return PackedBatch(tok, tok + 1000, torch.ones(1, T), pos, cu, max(lens), 0, [])


def test_cp_split_is_load_balanced_and_complete():
    from pretrain.model.parallel import cp_local_index, pad_samples, shard_batch

    b = _batch([5, 8, 3])
    cp = 2
    parts = [shard_batch(b, cp=cp, cp_rank=r) for r in range(cp)]
    cu = parts[0].cu_seqlens.tolist()
    assert cu == [0, 8, 16, 20]                                   # each sample padded to a multiple of 2·cp
    assert all(int(p.tokens.shape[1]) == 20 for p in parts)       # tokens stay whole for the embedding
    idx = [cp_local_index(parts[0].cu_seqlens, cp, r) for r in range(cp)]
    assert sorted(torch.cat(idx).tolist()) == list(range(20))     # every position on exactly one rank
    assert idx[0][:4].tolist() == [0, 1, 6, 7] and idx[1][:4].tolist() == [2, 3, 4, 5]   # chunks r and 2cp-1-r
    # padding carries no loss; real targets survive the split unchanged
    full = shard_batch(b, cp=1)
    assert sum(float(p.loss_mask.sum()) for p in parts) == float(b.loss_mask.sum()) == float(full.loss_mask.sum())
    padded = pad_samples(b, 2 * cp)
    for p, i in zip(parts, idx):
        assert torch.equal(p.labels[0], padded.labels[0][i]) and torch.equal(p.loss_mask[0], padded.loss_mask[0][i])
        assert len(i) == 10


def test_sequence_parallel_pads_to_a_multiple_of_tp():
    from pretrain.model.parallel import shard_batch

    b = _batch([5, 6])
    s = shard_batch(b, tp=4, sequence_parallel=True)
    assert s.tokens.shape[1] == 12 and s.cu_seqlens.tolist() == [0, 5, 11, 12] and float(s.loss_mask[0, 11]) == 0
    s = shard_batch(b, tp=2, cp=2, sequence_parallel=True)
    assert s.cu_seqlens[-1] % 8 == 0 and s.labels.shape[1] % 2 == 0


def test_cp_mask_rebuilds_the_block_causal_mask():
    """Local queries × gathered keys under the CP mask = the rows of the full block-causal mask."""
    from pretrain.model.attention import block_causal_mask
    from pretrain.model.parallel import cp_local_index, cp_mask, shard_batch

    b = shard_batch(_batch([6, 10, 4]), cp=2, cp_rank=0)
    cu, cp = b.cu_seqlens, 2
    full = block_causal_mask(cu, int(cu[-1]))
    k_pos = torch.cat([cp_local_index(cu, cp, r) for r in range(cp)])
    for r in range(cp):
        q = cp_local_index(cu, cp, r)
        assert torch.equal(cp_mask(cu, cp, r), full[q][:, k_pos])
