"""Hand-made micro-batches for the tiny recipe's model-level tests: ``n_samples`` samples of 9 tokens,
each with one 28×28 image (one merged token in the ``<|image_pad|>`` position 3)."""
import torch

PAD = 7


def tiny_batch(n_samples: int, prep, seed: int | None = None):
    """The packed micro-batch through the loader's ``BatchPrep`` ``prep``; ``seed`` (default: ``n_samples``)
    draws the token ids and the images."""
    from pretrain.data import PackedBatch

    g = torch.Generator().manual_seed(n_samples if seed is None else seed)
    seqs = []
    for _ in range(n_samples):
        ids = torch.randint(10, 500, (9,), generator=g)
        ids[3] = PAD
        seqs.append(ids)
    tokens = torch.cat(seqs)[None]
    T = tokens.shape[1]
    labels = torch.roll(tokens, -1, 1)
    cu = torch.arange(0, T + 1, 9, dtype=torch.int32)
    pos = torch.arange(9).repeat(n_samples)[None]
    mask = torch.ones(1, T)
    mask[0, cu[1:].long() - 1] = 0
    images = [torch.randn(3, 28, 28, generator=g) for _ in range(n_samples)]
    b = PackedBatch(tokens, labels, mask, pos, cu, 9, n_samples, images, n_packs=1, n_samples=n_samples,
                    pack_ids=[0])
    return prep(b)
