import pytest

from pretrain.recipes import RECIPES, Parallelism, pipeline_layers, pipeline_overrides, pipeline_sizes, validate


def test_published_sizes():
    r = RECIPES["llava-ov-1.5-8b"]
    assert (r.llm.num_layers, r.llm.hidden_size, r.llm.num_attention_heads, r.llm.num_query_groups) == (36, 4096, 32, 8)
    assert (r.vit.num_layers, r.vit.hidden_size, r.vit.num_heads, r.vit.patch_size) == (24, 1024, 16, 14)
    assert RECIPES["llava-ov-1.5-4b"].llm.hidden_size == 2560


@pytest.mark.parametrize("par, needles", [
    (Parallelism(tp=3, world_size=3), ["tp=3", "num_attention_heads=32"]),
    (Parallelism(tp=16, world_size=16), ["tp=16", "num_query_groups=8"]),
    (Parallelism(pp=40, world_size=40), ["pp=40", "num_layers=36"]),
    (Parallelism(sequence_parallel=True), ["sequence_parallel=True", "tp > 1"]),
    (Parallelism(cp=3, seq_len=8192, world_size=3), ["cp=3", "seq_len=8192"]),
    (Parallelism(tp=2, pp=2, world_size=6), ["world_size=6", "tp·pp·cp=4"]),
    (Parallelism(tp=2, sequence_parallel=True, seq_len=8191, world_size=2), ["seq_len=8191", "tp=2"]),
])
def test_validation_names_conflicting_settings(par, needles):
    with pytest.raises(ValueError) as e:
        validate(RECIPES["llava-ov-1.5-8b"], par)
    for n in needles:
        assert n in str(e.value)


def test_valid_combination_passes():
    validate(RECIPES["llava-ov-1.5-8b"], Parallelism(tp=8, pp=4, cp=2, sequence_parallel=True, world_size=128))


def test_pipeline_partition():
    parts = pipeline_layers(36, 5)
    assert [len(p) for p in parts] == [6, 8, 8, 8, 6]    # max 8 either way; stage 0 also hosts the ViT
    assert sum(parts, []) == list(range(36))
    assert pipeline_sizes(28, 8) == [2, 4, 4, 4, 4, 4, 4, 2]         # not [5, 3, …, 3, 5]: max 4, not 5
    assert pipeline_overrides(36, 5) == {"num_layers_in_first_pipeline_stage": 6,
                                         "num_layers_in_last_pipeline_stage": 6}
    assert pipeline_overrides(36, 4) == {}
    assert pipeline_layers(4, 1) == [[0, 1, 2, 3]]
