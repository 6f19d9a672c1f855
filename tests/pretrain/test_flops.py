"""MFU's FLOP counts (``pretrain.trainer.flops``) against the tiny recipe itself: the loader's counts of
a real packed micro-batch (attention per sample, not per pack; 4 patches per merged image token), the
matmul weights of the built model, and the matmul FLOPs torch's ``FlopCounterMode`` sees in one
forward + backward of it — exactly, for stage 1.5 (everything trains) and stage 1 (the projector
alone: frozen tower forward only, frozen LLM forward + input gradient)."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

PAD = 7
LENS, IMAGES = [20, 40], [(28, 56), (56, 56)]     # one image per sample: 8 and 16 patches → 2 and 4 merged tokens


@pytest.fixture(scope="module")
def tiny(megatron_single):
    from pretrain.data import BatchPrep, PackedBatch
    from pretrain.recipes import RECIPES
    from pretrain.model.vlm import VLM

    r = RECIPES["tiny"]
    g = torch.Generator().manual_seed(0)
    seqs = []
    for n, (h, w) in zip(LENS, IMAGES):
        ids = torch.randint(10, 500, (n,), generator=g)
        ids[2:2 + h * w // 28 ** 2] = PAD
        seqs.append(ids)
    tokens = torch.cat(seqs)[None]
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
    mask = torch.ones(1, tokens.shape[1])
    mask[0, cu[1:].long() - 1] = 0
    b = PackedBatch(tokens, torch.roll(tokens, -1, 1), mask, torch.cat([torch.arange(n) for n in LENS])[None], cu,
                    max(LENS), len(IMAGES), [torch.randn(3, h, w, generator=g) for h, w in IMAGES], n_packs=1,
                    n_samples=len(LENS), pack_ids=[0])
    b = BatchPrep(r.vit, r.llm.kv_channels, r.llm.rope_theta, PAD)(b)
    torch.manual_seed(0)
    return r, VLM(r, PAD, backend="sdpa"), b


def _matmul_flops(model, b) -> int:
    model.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as fc:
        ((model(b).float() * b.loss_mask).sum()).backward()
    return sum(fc.get_flop_counts()["Global"].values())


def test_the_loaders_counts_are_per_sample_and_per_patch(tiny):
    r, _, b = tiny
    patches = [h * w // 14 ** 2 for h, w in IMAGES]
    assert b.stats == {"tokens": sum(LENS), "attn_sq": sum(n * n for n in LENS),       # 2,000, not 60² = 3,600
                       "vit_tokens": sum(p + 1 for p in patches),                         # + one class token each
                       "vit_sq": sum((p + 1) ** 2 for p in patches), "merged": sum(patches) // 4}


def test_parameter_counts_are_the_models_matmul_weights(tiny):
    from pretrain.trainer.flops import matmul_params

    r, model, _ = tiny
    sd = {k: v.numel() for k, v in model.named_parameters()}
    n = matmul_params(r)
    pick = (lambda part, *keys: sum(v for k, v in sd.items() if k.startswith(part) and k.endswith(".weight")
                                    and any(s in k for s in keys)))
    assert n["llm_layers"] == pick("llm.", "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    assert n["llm_output"] == sd["llm.embedding.word_embeddings.weight"]       # tied: the output layer, counted once
    assert n["vit_layers"] == pick("vision.", "q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")
    assert n["patch_embed"] == sd["vision.embeddings.patch_embedding.weight"]
    assert n["projector"] == pick("projector.", "mlp")


@pytest.mark.parametrize("trainable", ["all", "projector"])
def test_model_flops_match_the_counted_matmuls(tiny, trainable):
    """Matmul FLOPs of forward + backward = model FLOPs without attention (torch's counter does not see
    the CPU attention kernel; its per-sample count is checked above). With everything trained, autograd
    skips one product MFU's 6·N convention counts: the gradient of the input patches (data)."""
    from pretrain.trainer.flops import forward_flops, model_flops

    r, model, b = tiny
    model.set_trainable(trainable)
    f = forward_flops(r, b.stats)
    mf, hf = model_flops(r, trainable, b.stats, "none")
    attn = (3 if trainable == "all" else 2) * f["llm_attn"] + (3 if trainable == "all" else 1) * f["vit_attn"]
    skipped = f["patch_embed"] if trainable == "all" else 0
    assert mf == hf and _matmul_flops(model, b) == mf - attn - skipped
    frozen_llm = 2 * (f["llm_layers"] + f["llm_output"])
    if trainable == "projector":                         # the rule for stage 1, by part
        assert mf - attn == (f["vit_layers"] + f["patch_embed"]) + 3 * f["projector"] + frozen_llm


@pytest.mark.parametrize("trainable", ["all", "projector"])
def test_hfu_adds_the_recomputed_tower_forward_only_where_it_trains(tiny, trainable):
    """The tower's recompute runs on the CPU too (torch's non-reentrant checkpoint, which stops once the
    backward has what it needs): ``full`` repeats every tower layer's forward but the MLP's down
    projection, ``selective`` the MLP's up projection, and a frozen tower (stage 1) has no backward to
    recompute for. The LLM's recompute goes through megatron's CUDA RNG tracker (GPU only); its share is
    the formula's: every LLM layer's forward (full), each MLP + core attention (selective)."""
    from pretrain.trainer.flops import forward_flops, model_flops

    r, model, b = tiny
    model.set_trainable(trainable)
    f = forward_flops(r, b.stats)
    base = _matmul_flops(model, b)
    try:
        for mode, tower in (("full", f["vit_layers"] - f["vit_fc"]), ("selective", f["vit_fc"])):
            model.vision.recompute = mode
            got = _matmul_flops(model, b) - base
            assert got == (tower if trainable == "all" else 0), mode
            mf, hf = model_flops(r, trainable, b.stats, mode)
            llm = f["llm_layers"] + f["llm_attn"] if mode == "full" else f["llm_mlp"] + f["llm_attn"]
            tower_attn = f["vit_attn"] if mode == "full" and trainable == "all" else 0
            assert hf - mf == llm + got + tower_attn
    finally:
        model.vision.recompute = "none"
