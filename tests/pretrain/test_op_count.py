"""The step has no per-sample or per-image work: one forward + backward of the tiny recipe
dispatches the same number of aten operators (±2%) for a micro-batch of 2 samples with 2 images as
for one of 64 samples with 64 images (the loader's ``BatchPrep`` did the per-sample and per-image
work on the CPU beforehand)."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

PAD = 7


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _batch(n_samples: int, prep):
    """``n_samples`` samples of 9 tokens, each with one 28×28 image (one merged token)."""
    from pretrain.data import PackedBatch

    g = torch.Generator().manual_seed(n_samples)
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


def _ops(model, b) -> int:
    model.zero_grad(set_to_none=True)
    with _Count() as c:
        per_tok = model(b)
        ((per_tok.float() * b.loss_mask).sum() / b.loss_mask.sum()).backward()
    return c.n


def test_op_count_does_not_grow_with_samples_and_images(megatron_single):
    from pretrain.data import BatchPrep
    from pretrain.recipes import RECIPES
    from pretrain.vlm import VLM

    torch.manual_seed(0)
    r = RECIPES["tiny"]
    model = VLM(r, PAD, backend="sdpa")
    model.set_trainable("all")
    prep = BatchPrep(r.vit, r.llm.kv_channels, r.llm.rope_theta, PAD)
    small, large = _batch(2, prep), _batch(64, prep)
    assert large.vision.n_images == 64 and len(large.cu_seqlens) == 65
    _ops(model, small)                                   # first call: lazy set-up outside the count
    a, b = _ops(model, small), _ops(model, large)
    assert abs(a - b) <= 0.02 * a, (a, b)
