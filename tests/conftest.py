"""Shared fixtures: a small demo corpus and an ingested run folder, made once per session."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


# The longest-running modules, scheduled right after the Slurm group so that no long test starts late and
# holds the suite's end (the 2-core CI machine: `make test` is two xdist workers).
LONG_FIRST = ("tests/pretrain/test_parallel_parity.py", "tests/pretrain/test_kill_drill.py",
              "tests/pretrain/test_export.py", "tests/pretrain/test_tensor_parallel.py",
              "tests/pretrain/test_conversation_training.py", "tests/curation/test_curation_demo.py")


# `make test-fast` (-m "not slow and not slurm") runs between edits and takes under 3 minutes on the 2-core
# machine; `make test` runs everything. Besides the tests marked `slow` in their own files, these are slow:
# the end-to-end drills and every test that took more than ~4 s there (seconds measured with
# --durations, two xdist workers on a shared machine). A path alone marks the whole file; a node id
# without [params] marks every parametrisation. Listed here rather than as decorators so that marking a
# test slow does not touch a file someone else is editing.
SLOW: dict[str, float] = {
    "tests/curation/test_ingest_shuffle.py::test_merge_past_its_fan_in_gives_the_same_parts": 41.8,
    "tests/curation/test_ingest_shuffle.py::test_id_range_parts_same_bytes_for_any_split": 24.2,
    "tests/curation/test_assign_streaming.py::test_assign_peak_memory_does_not_grow_with_embedding_rows": 27.9,
    "tests/curation/test_recaption_memory.py": 12.5,
    "tests/curation/test_align.py::test_scores_cut_and_bytes_at_1_and_2_tasks": 6.3,
    "tests/curation/test_recaption_select_memory.py": 7.0,
    "tests/curation/test_recaption.py::test_part_is_the_slice_sorted_whatever_the_chunking": 5.9,
    "tests/curation/test_embed_decode.py::test_threads_and_worker_processes_give_the_same_step_output_at_any_task_count": 4.1,
    "tests/ovpipe/test_run_safety.py::test_second_identical_command_refuses_naming_the_holder": 20.4,
    "tests/packing/test_energon.py::test_two_ranks_two_workers_read_every_pack_once": 17.5,
    "tests/packing/test_pack_solve.py::test_bin_layout_is_the_histogram_part_of_pack": 10.1,
    "tests/pretrain/test_train.py::test_loss_falls_and_resume_is_exact": 19.0,
    "tests/pretrain/test_data_position.py::test_resume_continues_at_the_exact_pack": 10.8,
    "tests/pretrain/test_export.py": 12.6,
    "tests/pretrain/test_comm_bytes.py": 102.0,          # a 2-rank and a 4-rank run, counted (fixture included)
    "tests/pretrain/test_official_layout.py": 5.8,
    "tests/pretrain/test_instruction_stage.py::test_stage2_loss_falls_on_the_instruction_packs": 7.7,
    "tests/pretrain/test_stage_rules.py::test_second_command_lock_config_change_status_and_export": 5.1,
    "tests/pretrain/test_conversation_training.py::test_text_only_steps_under_overlapped_grad_reduce": 4.7,
    "tests/pretrain/test_conversation_training.py::test_epochs_derive_steps_and_metrics_count_packs": 8.7,
    "tests/pretrain/test_conversation_training.py::test_a_global_batch_sets_the_accumulation_and_trains_as_it_would": 7.0,
    "tests/pretrain/test_fake_trace.py": 11.3,          # one fake-tensor trace in a child (6 min wall at load 40)
    "tests/rl_select/test_trainer_adapters.py::test_areal_reward_fn_matches_its_workflow_call": 30.9,  # installs the trainers
    "tests/rl_select/test_select_scale.py::test_apply_rank_memory_follows_its_slice_not_the_corpus": 18.4,
    "tests/rl_select/test_select_scale.py::test_selection_is_byte_identical_to_the_whole_corpus_computation_for_1_3_8_tasks": 14.2,
    "tests/rl_select/test_rl_pipeline.py::test_score_task_memory_follows_its_slice_not_the_corpus": 10.9,
    "tests/rl_select/test_rl_pipeline.py::test_rollout_task_memory_follows_its_chunk_not_its_slice": 9.1,
    "tests/rl_select/test_rl_ingest.py::test_rl_ingest_merge_memory_follows_its_fan_in_not_its_runs": 5.2,
    "tests/rl_select/test_rewards_adversarial.py::test_math_pathologies_are_bounded_by_the_runner": 4.4,
    "tests/viewer/test_browser.py": 14.2,
}


def _listed_slow(nodeid: str) -> bool:
    path, _, rest = nodeid.partition("::")
    return path in SLOW or f"{path}::{rest.split('[')[0]}" in SLOW


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _listed_slow(item.nodeid):
            item.add_marker(pytest.mark.slow)
    # Under xdist the Slurm tests share one worker: each module starts its own loopback cluster, and two
    # clusters at once would compete for the same two cores and node name. The parallel-parity tests share
    # another, so their one-process reference run (a module fixture) is computed once, not on each worker.
    # Both groups go first (xdist's loadgroup hands out work in collection order), then LONG_FIRST.
    def rank(item):
        if "slurm" in item.keywords:
            return 0
        path = item.nodeid.split("::")[0]
        return 1 + LONG_FIRST.index(path) if path in LONG_FIRST else len(LONG_FIRST) + 1

    for item in items:
        if "slurm" in item.keywords:
            item.add_marker(pytest.mark.xdist_group("slurm"))
        elif item.nodeid.startswith("tests/pretrain/test_parallel_parity.py"):
            item.add_marker(pytest.mark.xdist_group("parity"))
    items.sort(key=rank)          # stable: collection order within each rank
    if any("gpu" in item.keywords for item in items) and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def demo_corpus(tmp_path_factory) -> Path:
    """200 demo samples in 4 shards (with the deliberately broken ones)."""
    from demo.corpus import write_demo_corpus

    out = tmp_path_factory.mktemp("demo-data")
    write_demo_corpus(out, n_samples=200, seed=0, shards=4)
    return out


@pytest.fixture(scope="session")
def ingested_run(demo_corpus, tmp_path_factory) -> Path:
    """A run folder where `ingest` ran over the demo corpus (2 tasks)."""
    from ovpipe.cli import main

    run = tmp_path_factory.mktemp("run")
    rc = main(["ingest", "--set", f'inputs=["{demo_corpus}/shards/*.tar"]', "--set", "source=demo",
               "--run-dir", str(run), "--tasks", "2", "--quiet"])
    assert rc == 0
    return run
