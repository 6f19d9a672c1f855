"""The trainer's kernel switches (``pretrain.model.fused``): the loss through megatron's ``output_processor``
hook gives megatron's own per-token losses and gradients; on CUDA the compiled rotary / RMSNorm and
liger's fused linear cross-entropy match the eager expressions within bf16 tolerance."""
import pytest
import torch

from pretrain.model import fused
from tiny_batches import PAD, tiny_batch  # (tests/pretrain is on sys.path)


def _loss_and_grads(model, b):
    model.zero_grad(set_to_none=True)
    per_tok = model(b)
    (per_tok.float() * b.loss_mask).sum().backward()
    return per_tok.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_output_processor_hook_gives_megatrons_loss_and_gradients(megatron_single):
    from pretrain.data import BatchPrep
    from pretrain.recipes import RECIPES
    from pretrain.model.vlm import VLM

    torch.manual_seed(0)
    r = RECIPES["tiny"]
    model = VLM(r, PAD, backend="sdpa")
    model.set_trainable("all")
    b = tiny_batch(3, BatchPrep(r.vit, r.llm.kv_channels, r.llm.rope_theta, PAD), seed=0)
    ref, ref_g = _loss_and_grads(model, b)
    model.set_loss_kernel("torch")
    got, got_g = _loss_and_grads(model, b)
    assert model._loss_fn is not None and got.shape == ref.shape == b.tokens.shape
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    assert got_g.keys() == ref_g.keys() and "llm.embedding.word_embeddings.weight" in got_g   # tied output weight
    for n in ref_g:
        torch.testing.assert_close(got_g[n], ref_g[n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("bad, match", [
    ({"kernels": "triton"}, "kernels must be one of"),
    ({"loss_kernel": "fast"}, "loss_kernel must be one of"),
    ({"loss_kernel": "liger", "tp": 2}, "loss_kernel='liger' needs the whole vocabulary on a rank"),
])
def test_kernel_settings_are_checked_before_any_work(bad, match, tmp_path):
    from pretrain.trainer.config import TrainConfig

    with pytest.raises(ValueError, match=match):
        TrainConfig(run_dir=tmp_path, stage="1.5", steps=1, **bad)


def test_kernel_defaults_per_device(tmp_path):
    from pretrain.trainer.config import TrainConfig

    cfg = TrainConfig(run_dir=tmp_path, stage="1.5", steps=1)
    cpu = cfg.resolve(cuda=False)
    assert (cpu.kernels, cpu.loss_kernel) == ("eager", "megatron")
    gpu = cfg.resolve(cuda=True)
    assert (gpu.kernels, gpu.loss_kernel) == ("fused", None)     # recompute auto weighs it with the recompute
    named = TrainConfig(run_dir=tmp_path, stage="1.5", steps=1, recompute="selective").resolve(cuda=True)
    assert named.loss_kernel == "megatron"                          # liger measured slower at equal recompute
    liger = TrainConfig(run_dir=tmp_path, stage="1.5", steps=1, loss_kernel="liger")
    assert liger.resolve(cuda=True).loss_kernel == "liger"


def test_eager_switch_keeps_the_cpu_expressions():
    """On the CPU (and with kernels = eager) the functions are the plain expressions, bit for bit."""
    from pretrain.model.fused import rotate_half

    fused.set_kernels("fused")           # fused is a CUDA-only switch: CPU tensors still run eagerly
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(5, 4, 8, generator=g, dtype=torch.bfloat16)
        cos, sin = torch.randn(5, 8, generator=g), torch.randn(5, 8, generator=g)
        c, s = cos[:, None].bfloat16(), sin[:, None].bfloat16()
        assert torch.equal(fused.rotary(x, cos, sin), x * c + rotate_half(x) * s)
        c32, s32 = cos[:, None], sin[:, None]
        assert torch.equal(fused.rotary_acc(x, c32, s32), (x.float() * c32 + rotate_half(x.float()) * s32).bfloat16())
        norm = torch.nn.RMSNorm(8, eps=1e-6, dtype=torch.bfloat16)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(8, generator=g))
            assert torch.equal(fused.rms_norm(x, norm.weight, 1e-6), norm(x))
    finally:
        fused.set_kernels("eager")


# ------------------------------------------------------------------------------------- CUDA only

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _fwd_bwd(fn, *xs):
    xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in xs]
    out = fn(*xs)
    out.float().square().sum().backward()
    return out.detach(), [x.grad for x in xs if x.grad is not None]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("t", [77, 4099])
def test_compiled_kernels_match_eager_on_cuda(t):
    g = torch.Generator(device="cuda").manual_seed(t)
    x = torch.randn(t, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    ang = torch.randn(t, 128, device="cuda", generator=g) * 5          # rotary tables are cos/sin of angles
    cos, sin = ang.cos(), ang.sin()
    w = torch.randn(128, device="cuda", dtype=torch.bfloat16, generator=g)
    cases = [(fused.rotary, fused.rotary_eager, (x, cos, sin)),
             (fused.rotary_acc, fused.rotary_acc_eager, (x, cos[:, None], sin[:, None])),
             (fused.rms_norm, fused.rms_norm_eager, (x, w, 1e-6))]
    fused.set_kernels("fused")
    try:
        for f, ref, args in cases:
            targs = [a for a in args if torch.is_tensor(a)]
            rest = [a for a in args if not torch.is_tensor(a)]
            got, got_g = _fwd_bwd(lambda *z: f(*z, *rest), *targs)
            eager, eager_g = _fwd_bwd(lambda *z: ref(*z, *rest), *targs)
            exact, exact_g = _fwd_bwd(lambda *z: ref(*(a.float() for a in z), *rest), *targs)   # fp32 reference
            # the fused kernel rounds once where eager bf16 rounds every intermediate: at least as accurate
            for a, e, x in zip([got, *got_g], [eager, *eager_g], [exact, *exact_g]):
                err, eager_err = (a.float() - x.float()).abs().max(), (e.float() - x.float()).abs().max()
                assert err <= 1.5 * eager_err + 1e-3, (ref.__name__, float(err), float(eager_err))
    finally:
        fused.set_kernels("eager")


@pytest.mark.gpu
@cuda
def test_liger_loss_matches_the_plain_loss_on_cuda():
    if not fused.liger_available():       # asked here, not in a skipif: importing liger costs every collection 2 s
        pytest.skip("needs liger-kernel")
    g = torch.Generator(device="cuda").manual_seed(0)
    s, h, v = 1000, 256, 5000
    hidden = torch.randn(s, 1, h, device="cuda", dtype=torch.bfloat16, generator=g)
    weight = (torch.randn(v, h, device="cuda", generator=g) * 0.05).bfloat16()
    labels = torch.randint(0, v, (1, s), device="cuda", generator=g)
    out = {}
    for kind in ("torch", "liger"):
        proc = fused.output_processor(kind)
        x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = proc(hidden_states=x, output_layer=None, output_weight=w, labels=labels)
        (loss.float() * torch.linspace(0, 1, s, device="cuda")).sum().backward()
        out[kind] = (loss.detach().float(), x.grad.float(), w.grad.float())
    for a, b in zip(out["liger"], out["torch"]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
