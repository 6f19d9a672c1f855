"""precision fp8: the config, the layer filter on megatron's linears, the swap's numerics on the CPU (torch's
CPU ``_scaled_mm``), and the refusal without float8 tensor cores. Throughput and the 4B's loss curves are
measured on a GPU (bench/gpu/next_call.sh)."""
import pytest
import torch

from pretrain.model.sizes import LLMSize
from pretrain.trainer.config import TrainConfig


def cfg(tmp_path, **kw):
    return TrainConfig(run_dir=tmp_path, stage="1.5", steps=1, **kw)


def test_precision_parses_and_fp8_means_tensorwise(tmp_path):
    assert cfg(tmp_path, precision="fp8").precision == "fp8-tensorwise"
    assert cfg(tmp_path, precision="fp8-rowwise").precision == "fp8-rowwise"
    r = cfg(tmp_path, precision="fp8-rowwise").resolve(cuda=True, capability=(9, 0))
    assert (r.precision, r.bf16) == ("fp8-rowwise", True)
    assert cfg(tmp_path).resolve(cuda=False).precision == "fp32"       # the CPU default, recorded
    assert cfg(tmp_path).resolve(cuda=True).precision == "bf16"
    assert cfg(tmp_path, precision="fp32").resolve(cuda=True).bf16 is False


@pytest.mark.parametrize("kw, match", [
    ({"precision": "fp16"}, "precision must be one of"),
    ({"precision": "fp8", "bf16": False}, "contradicts bf16=False"),
    ({"precision": "fp8", "tp": 2}, "runs at tp = 1, got tp=2"),
])
def test_wrong_precision_fails_naming_the_field(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        cfg(tmp_path, **kw)


@pytest.mark.parametrize("cuda, capability, have", [(False, None, "a CPU"), (True, (8, 0), "a card of sm80")])
def test_fp8_is_refused_without_float8_tensor_cores(tmp_path, cuda, capability, have):
    with pytest.raises(ValueError) as e:
        cfg(tmp_path, precision="fp8").resolve(cuda=cuda, capability=capability)
    msg = str(e.value)
    assert "\n" not in msg and "precision='fp8-tensorwise' needs a CUDA card of compute capability 8.9" in msg
    assert have in msg


def test_the_cli_refuses_fp8_on_the_cpu_before_any_work(tmp_path, capsys):
    from pretrain.train import main

    with pytest.raises(SystemExit):
        main(["--run-dir", str(tmp_path), "--stage", "1.5", "--precision", "fp8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert "precision='fp8-tensorwise' needs a CUDA card" in err[-1] and "a CPU" in err[-1]
    assert list(tmp_path.iterdir()) == []


def _llm(size):
    from pretrain.model.llm import build_llm

    return build_llm(size, backend="sdpa").to(torch.bfloat16)


# hidden 1024, q 8×128, kv 2×128, ffn 1536, vocab 2048 (untied): per layer (N, K) = qkv (1536, 1024),
# proj (1024, 1024), fc1 (3072, 1024), fc2 (1024, 1536); the output layer (2048, 1024)
WIDE = LLMSize(2, 1024, 1536, 8, 2, 128, 2048)


def test_tensorwise_filter_picks_the_layers_wide_enough_and_never_the_output_layer(megatron_single):
    from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

    from pretrain.model import float8

    llm = _llm(WIDE)
    picked = float8.selected(llm, "fp8-tensorwise")
    # torchao's tensorwise rule leaves N ≤ 1024 with K ≤ 4096 in bf16: proj and fc2
    assert picked == [f"decoder.layers.{i}.{m}" for i in range(2)
                      for m in ("self_attention.linear_qkv", "mlp.linear_fc1")]
    # the output layer is wide enough by shape alone; it stays bf16 by name, as in torchtitan
    out = dict(float8.linears(llm))["output_layer"]
    assert _auto_filter_for_recipe("tensorwise", filter_fqns=[])(float8._shell(out), "output_layer")
    assert "output_layer" not in picked


def test_rowwise_filter_needs_both_dimensions_large(megatron_single):
    from pretrain.model import float8

    # rowwise: qkv (1536, 1024) has N ≤ 2048 and fc1 (3072, 1024) K ≤ 1024: nothing at this width
    assert float8.selected(_llm(WIDE), "fp8-rowwise") == []
    # hidden 1152: fc1 (5120, 1152) passes, qkv (1728, 1152), proj and fc2 (N 1152) do not
    assert float8.selected(_llm(LLMSize(1, 1152, 2560, 8, 2, 144, 512)), "fp8-rowwise") == \
        ["decoder.layers.0.mlp.linear_fc1"]


def test_converted_layer_keeps_its_parameter_and_matches_bf16_within_fp8_error(megatron_single):
    from pretrain.model import float8

    llm = _llm(WIDE)
    keys = list(llm.state_dict())
    fc1 = dict(float8.linears(llm))["decoder.layers.0.mlp.linear_fc1"]
    w = fc1.weight
    torch.manual_seed(0)
    # 32 tokens: torch's CPU _scaled_mm is a reference loop on CPUs without an fp8 oneDNN path (15 s for 256
    # tokens × 1024 × 3072 on a Xeon with AVX-512-FP16, against ~0.1 s elsewhere); the errors are relative norms
    x = torch.randn(32, 1, 1024, dtype=torch.bfloat16)
    g = torch.randn(32, 1, 3072, dtype=torch.bfloat16)

    def run():
        xi = x.clone().requires_grad_()
        y, _ = fc1(xi)
        y.backward(g)
        grads = (xi.grad.float(), w.grad.float().clone())
        w.grad = None
        return y.float(), grads

    ref_y, (ref_dx, ref_dw) = run()
    names = float8.convert(llm, "fp8-tensorwise", compile=False)
    assert float8.converted(llm) == names and "decoder.layers.0.mlp.linear_fc1" in names
    assert fc1.__dict__["_forward_impl"].float8.weight is w         # the same Parameter, not a copy
    assert list(llm.state_dict()) == keys                           # no new names in checkpoints
    y, (dx, dw) = run()
    # e4m3 keeps 3 mantissa bits (relative step 2^-3 at worst, ~3% rms); e5m2 gradients 2 bits
    for a, b, tol in ((y, ref_y, 0.08), (dx, ref_dx, 0.15), (dw, ref_dw, 0.15)):
        assert (a - b).norm() / b.norm() < tol
    assert not torch.equal(y, ref_y)                                # it did run in float8


def test_a_frozen_layer_keeps_megatrons_path(megatron_single):
    from pretrain.model import float8

    llm = _llm(WIDE)
    fc1 = dict(float8.linears(llm))["decoder.layers.0.mlp.linear_fc1"]
    x = torch.randn(64, 1, 1024, dtype=torch.bfloat16)
    fc1.weight.requires_grad_(False)
    ref, _ = fc1(x)
    float8.convert(llm, "fp8-tensorwise", compile=False)
    y, _ = fc1(x)
    assert torch.equal(y, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp8-tensorwise", "fp8-rowwise"])
def test_compiled_float8_layer_matches_bf16_on_the_card(megatron_single, precision):
    """On a float8 card: the compiled ``Float8Linear`` behind a megatron layer of the 4B's MLP width gives the
    bf16 layer's output and gradients within float8's error."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a CUDA card of sm89 or newer")
    from pretrain.model import float8

    llm = _llm(LLMSize(1, 2560, 9728, 32, 8, 128, 512)).cuda()
    fc1 = dict(float8.linears(llm))["decoder.layers.0.mlp.linear_fc1"]
    x = torch.randn(4096, 1, 2560, dtype=torch.bfloat16, device="cuda")

    def run():
        xi = x.clone().requires_grad_()
        y, _ = fc1(xi)
        y.float().square().mean().backward()
        out = (y.float(), xi.grad.float(), fc1.weight.grad.float().clone())
        fc1.weight.grad = None
        return out

    ref = run()
    assert "decoder.layers.0.mlp.linear_fc1" in float8.convert(llm, precision)
    got = run()
    for a, b in zip(got, ref):
        assert (a - b).norm() / b.norm() < 0.15


ONE = LLMSize(1, 1024, 1536, 8, 2, 128, 2048)      # WIDE's widths, one layer


def _megatron_steps(precision, steps=2):
    """``steps`` optimizer steps of a one-layer WIDE LLM through megatron's DDP, optimizer and schedule (fp32 on
    the CPU: megatron's bf16 optimizer wants CUDA tensors); the losses and the first step's ``main_grad``s."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from pretrain.model import float8
    from pretrain.model.attention import rotary_tables
    from pretrain.model.llm import build_llm, packed_seq_params
    from pretrain.recipes import STAGES
    from types import SimpleNamespace

    from pretrain.trainer.optimizer import build_optimizer, ddp_config

    model_parallel_cuda_manual_seed(1)
    torch.manual_seed(1)
    llm = build_llm(ONE, backend="sdpa", calculate_per_token_loss=True)
    if precision != "fp32":
        float8.convert(llm, precision, compile=False)
    ddp, opt = build_optimizer(llm, STAGES["1.5"], 1e-3, False, torch.float32,
                               ddp_config(SimpleNamespace(distributed_optimizer=False)))
    for g in opt.param_groups:
        g["lr"] = 1e-3
    gen = torch.Generator().manual_seed(0)
    # two packed sequences of 8 (16 tokens: the CPU _scaled_mm's cost, test_converted_layer… says why)
    tok = torch.randint(0, ONE.vocab_size, (1, 16), generator=gen)
    pos = torch.arange(8).repeat(2)[None]
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)

    def forward_step(it, model):
        next(it)
        out = model(tok, pos, attention_mask=None, labels=torch.roll(tok, -1, 1),
                    packed_seq_params=packed_seq_params(cu, 8, rotary_tables(pos[0], ONE.kv_channels, 1e6)))
        return out, lambda o: (o.sum(), torch.tensor(o.numel(), dtype=torch.int), {"lm": o.detach().mean()})

    losses, grads = [], None
    for i in range(steps):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        res = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([0]), model=[ddp],
                                          num_microbatches=1, seq_length=16, micro_batch_size=1, forward_only=False)
        if i == 0:
            grads = {n: p.main_grad.clone() for n, p in llm.named_parameters()}
        opt.step()
        losses.append(float(res[0]["lm"]))
    return losses, grads


def test_float8_gradients_reach_megatrons_buffers_and_train(megatron_single):
    """Through megatron's DDP (its backward hooks add ``param.grad`` to ``main_grad``) and optimizer: the
    converted layers' gradients arrive, within float8's error of the unconverted run's, and the second step's
    loss follows."""
    ref_losses, ref = _megatron_steps("fp32")
    losses, got = _megatron_steps("fp8-tensorwise")
    for n in ("decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.self_attention.linear_qkv.weight"):
        assert got[n].norm() > 0 and (got[n] - ref[n]).norm() / ref[n].norm() < 0.25
    assert abs(losses[0] - ref_losses[0]) / ref_losses[0] < 5e-3       # the same model before any update
    assert losses[1] < losses[0] and abs(losses[1] - ref_losses[1]) / ref_losses[1] < 2e-2
