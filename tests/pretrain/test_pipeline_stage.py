"""The pipeline stage module at PP=1 on the CPU (PP=2 through megatron's schedule is a GPU test: even
its no-pipelining schedule allocates with ``device="cuda"``): padded micro-batches give the VLM losses."""
import torch


def test_stage_through_schedule_matches_vlm(megatron_single, packed_demo):
    from pretrain.data import iter_batches
    from pretrain.pipeline import VLMStage, pad_to
    from pretrain.recipes import RECIPES
    from pretrain.train import image_pad_id
    from pretrain.vlm import VLM

    pad = image_pad_id(packed_demo, None)
    torch.manual_seed(0)
    vlm = VLM(RECIPES["tiny"], pad, backend="sdpa").eval()
    stage = VLMStage(RECIPES["tiny"], pad, backend="sdpa").eval()
    stage.load_state_dict(vlm.state_dict())
    it = iter_batches(packed_demo, "pack", 1)
    batches = [next(it) for _ in range(2)]
    T = max(b.tokens.shape[1] for b in batches) + 3            # force padding on both
    with torch.no_grad():
        ref = [float((vlm(b) * b.loss_mask).sum() / b.loss_mask.sum()) for b in batches]
        padded = [pad_to(b, T) for b in batches]
        assert all(p.tokens.shape[1] == T and int(p.cu_seqlens[-1]) == T for p in padded)
        got = [float((stage(p) * p.loss_mask).sum() / p.loss_mask.sum()) for p in padded]
    assert max(abs(a - b) for a, b in zip(ref, got)) <= 1e-5
