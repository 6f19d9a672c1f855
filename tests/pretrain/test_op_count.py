"""The step has no per-sample or per-image work: one forward + backward of the tiny recipe
dispatches the same number of aten operators (±2%) for a micro-batch of 2 samples with 2 images as
for one of 64 samples with 64 images (the loader's ``BatchPrep`` did the per-sample and per-image
work on the CPU beforehand)."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tiny_batches import PAD, tiny_batch  # (tests/pretrain is on sys.path)


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _ops(model, b) -> int:
    model.zero_grad(set_to_none=True)
    with _Count() as c:
        per_tok = model(b)
        ((per_tok.float() * b.loss_mask).sum() / b.loss_mask.sum()).backward()
    return c.n


def test_op_count_does_not_grow_with_samples_and_images(megatron_single):
    from pretrain.data import BatchPrep
    from pretrain.recipes import RECIPES
    from pretrain.model.vlm import VLM

    torch.manual_seed(0)
    r = RECIPES["tiny"]
    model = VLM(r, PAD, backend="sdpa")
    model.set_trainable("all")
    prep = BatchPrep(r.vit, r.llm.kv_channels, r.llm.rope_theta, PAD)
    small, large = tiny_batch(2, prep), tiny_batch(64, prep)
    assert large.vision.n_images == 64 and len(large.cu_seqlens) == 65
    _ops(model, small)                                   # first call: lazy set-up outside the count
    a, b = _ops(model, small), _ops(model, large)
    assert abs(a - b) <= 0.02 * a, (a, b)
