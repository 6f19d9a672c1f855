"""Shared fixtures (a small demo corpus and an ingested run folder, made once per session), the SLOW table,
the xdist scheduling, and what a test needs from the machine.

Nothing is skipped quietly: a test marked ``slurm`` or ``chromium`` (``NEEDS``) skips on a developer's machine
that lacks it, and fails naming what is missing under ``CI=true`` (``.ci/run`` sets it); there any other skip
that is not a GPU test's (one marked ``gpu``) fails the run too, a module skipped whole at collection included. Every run ends with a line per reason something was skipped,
GPU-only tests counted apart (they always skip on a CPU).
"""
from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import sys
from collections import Counter
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# `--executor slurm --wait` (in-process and in the Makefile's subprocesses) polls every 0.5 s, never the 5 s a long
# step on a real cluster backs off to: the suite's Slurm steps are seconds long (ovpipe/executors/slurm.py)
os.environ.setdefault("OVPIPE_SLURM_POLL_MAX_S", "0.5")
# pytest keeps each test module, its asserts rewritten, in tests/**/__pycache__ (ignored by git) — unless writing
# bytecode is off, as PYTHONDONTWRITEBYTECODE turns it off on this project's machines and CI: then each worker of
# each run rewrites all ~240 test modules again, about 6 CPU-s a worker. Turned back on for this process (what
# else it imports is compiled already: `make install`, `make bytecode`); its subprocesses keep the variable.
sys.dont_write_bytecode = False


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


# The longest-running modules (CPU seconds, longest first), scheduled right after the Slurm modules so that no
# long module starts late and holds the suite's end (the 2-core CI machine: `make test` is two xdist workers).
LONG_FIRST = ("tests/pretrain/test_parallel_parity.py", "tests/pretrain/test_comm_bytes.py",
              "tests/pretrain/test_kill_drill.py", "tests/pretrain/test_export.py",
              "tests/curation/test_ingest_memory.py", "tests/curation/test_dedup_memory.py",
              "tests/pretrain/test_conversation_training.py",
              "tests/pretrain/test_launch.py", "tests/curation/test_curation_demo.py", "tests/pretrain/test_train.py")


SLURM_DEMO = "tests/ovpipe/test_slurm_demo.py"

# `make test-fast` (-m "not slow and not slurm") runs between edits and takes under 90 s on the 2-core
# machine; `make test` runs everything. Besides the tests marked `slow` in their own files, these are slow:
# the end-to-end drills and every test that took more than ~2-4 s there (seconds measured with
# --durations, two xdist workers on a shared machine). A path alone marks the whole file; a node id
# without [params] marks every parametrisation. Listed here rather than as decorators so that marking a
# test slow does not touch a file someone else is editing.
SLOW: dict[str, float] = {
    "tests/curation/test_ingest_shuffle.py::test_merge_past_its_fan_in_gives_the_same_parts": 41.8,
    "tests/curation/test_ingest_shuffle.py::test_id_range_parts_same_bytes_for_any_split": 24.2,
    "tests/curation/test_assign_streaming.py::test_assign_peak_memory_does_not_grow_with_embedding_rows": 27.9,
    "tests/curation/test_recaption_memory.py": 30.0,      # two fresh processes under tracemalloc
    "tests/curation/test_align.py::test_scores_cut_and_bytes_at_1_and_2_tasks": 6.3,
    "tests/curation/test_recaption_select_memory.py": 7.0,
    "tests/curation/test_recaption.py::test_part_is_the_slice_sorted_whatever_the_chunking": 5.9,
    "tests/curation/test_embed_decode.py::test_threads_and_worker_processes_give_the_same_step_output_at_any_task_count": 4.1,
    "tests/curation/test_mid85m_layout.py::test_embed_images_reads_two_ingest_steps": 15.6,
    "tests/ovpipe/test_step_help.py::test_every_field_of_every_step_has_help": 10.0,   # imports every step (megatron)
    "tests/ovpipe/test_slurm_site_flags.py::test_pretrain_takes_the_same_flags": 4.1,
    "tests/ovpipe/test_step_help.py::test_the_writers_table_is_the_steps_outputs": 10.0,   # imports every step
    "tests/ovpipe/test_slurm_executor.py::test_balanced_pack_order_on_slurm_is_the_local_one": 31.9,
    "tests/packing/test_energon.py::test_two_ranks_two_workers_read_every_pack_once": 17.5,
    "tests/packing/test_pack_solve.py::test_bin_layout_is_the_histogram_part_of_pack": 10.1,
    "tests/packing/test_pack_step.py::test_balanced_order_same_packs_any_task_count_and_the_loader_streams_it": 15.0,
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
    "tests/viewer/test_meaning.py": 25.5,
    "tests/packing/test_import_packs_bad.py::test_every_malformed_entry_is_a_status_row": 16.1,
    "tests/viewer/test_guard.py::test_sigterm_stops_the_server_mid_query": 5.5,
    "tests/fuzz/test_fuzz.py::test_official_entries": 18.3,    # most of it the tokenizer's first load
    # the viewer's routes over the run with every step (meaning_run: the index step over planted vectors, 13 s to
    # build at load 6, shared with test_meaning.py on its worker)
    "tests/fuzz/test_fuzz.py::test_viewer_routes": 11.0,
    "tests/fuzz/test_routes.py": 18.7,
    "tests/test_ci_skips.py": 9.2,          # three pytest runs in subprocesses (CPU seconds, loaded machine)
    "tests/pretrain/test_cpu_compat.py::test_setup_distributed_patches_only_without_cuda": 9.3,   # 2 megatron set-ups
    # make test-fast --durations at load 6-9 (over ~4 s there)
    "tests/pretrain/test_host_collectives.py::test_every_staged_collective_means_what_it_says": 12.3,
    "tests/ovpipe/test_demo_and_imports.py::test_demo_data_cli_writes_conversation_sets_deterministically": 6.0,
    "tests/pretrain/test_hf_import.py::test_stage1_starts_from_imported_weights": 5.0,
    # make test-fast --durations on the idle machine, over ~2.2 s there
    "tests/pretrain/test_float8.py::test_float8_gradients_reach_megatrons_buffers_and_train": 3.1,
    "tests/rl_select/test_rewards.py::test_runner_timeouts_and_adversarial_inputs": 2.9,    # a 3-s timeout
    "tests/packing/test_conversation_pack.py::test_mixed_copies_and_two_samples_steps": 2.5,
    "tests/curation/test_recaption.py::test_transformers_backend_bilingual_and_deterministic": 2.5,
    "tests/packing/test_caption_source.py::test_pack_uses_source_copies_and_encodes_the_recaption": 2.3,
    # ROLL's two doc rows through rl-ingest → rollout → score → select → export (the module fixture: 6-9 s idle,
    # 17 s loaded, on whichever of these runs first); the verifier's rule tests beside them stay fast
    "tests/rl_select/test_roll_examples.py::test_both_example_rows_ingest_and_score_without_an_error_row": 9.5,
    "tests/rl_select/test_roll_examples.py::test_a_perfect_detection_answer_gets_the_top_score": 9.5,
    "tests/rl_select/test_roll_examples.py::test_export_round_trips_rolls_schema": 9.5,
    # the RL stage: GRPO runs on a tiny policy (loaded machine)
    "tests/grpo/test_grpo_step.py::test_a_few_steps_move_the_policy_toward_the_rewarded_answer": 20.0,
    "tests/grpo/test_grpo_step.py::test_sigkill_then_rerun_ends_with_the_uninterrupted_runs_metrics": 40.0,
    "tests/grpo/test_grpo_step.py::test_lora_trains_an_adapter_and_saves_it_merged": 10.0,
    "tests/grpo/test_shuffle_r1.py::test_reshaper_selects_pixel_values_per_image_grid": 12.4,   # imports trl
    "tests/grpo/test_behaviour_weights.py": 10.5,   # imports trl, builds a trainer (module fixture: both tests)
    "tests/grpo/test_shuffle_r1_step.py::test_an_ordered_reshaper_is_split_in_its_order": 12.0,   # imports trl
    "tests/grpo/test_shuffle_r1_step.py::test_a_shuffle_r1_run_trains_the_kept_half_and_logs_both_symptoms": 15.0,
    # SortedRL inside `ovpipe grpo`: 4 GRPO steps through the rollout_func, per mode (the first pays TRL's import)
    "tests/grpo/test_sortedrl_grpo.py::test_grpo_steps_run_through_sortedrl": 14.0,
    # controller runs on the CPU engine: three, and a grouped run beside the baseline (~3 s each, loaded machine)
    "tests/grpo/test_engines.py::test_the_same_seed_gives_the_same_schedule_and_tokens": 4.2,
    "tests/grpo/test_engines.py::test_whole_groups_per_batch_and_the_baseline": 3.5,
    # the GPU half's dry run: the 8B config and plan, three toy runs on the CPU engine (bench/bench_sortedrl_gpu.py)
    "tests/grpo/test_sortedrl_gpu_dry.py::test_the_device_script_dry_runs_on_the_cpu": 2.0,
}


def _listed_slow(nodeid: str) -> bool:
    path, _, rest = nodeid.partition("::")
    return path in SLOW or f"{path}::{rest.split('[')[0]}" in SLOW


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _listed_slow(item.nodeid):
            item.add_marker(pytest.mark.slow)
    # Under xdist (`make test`: --dist loadscope) a module's tests keep to one worker, so a module fixture — a Slurm
    # module's loopback cluster, the parity runs' one-process reference, the counted 2- and 4-rank runs — is made
    # once, not on each worker. (loadgroup's xdist_group marks would do it test by test, but pytest-xdist 3.8 names
    # a group in Item._nodeid, which pytest 9.2's Item.nodeid no longer reads: the groups were silently ignored.)
    # Modules are handed out in collection order (the Makefile passes --no-loadscope-reorder): the Makefile-on-Slurm
    # test first (the suite's longest: the demo's curation, packing and RL as ~25 Slurm chains, mostly waiting on
    # Slurm's per-job start-up), the other Slurm modules next, then LONG_FIRST, so no long module starts late.
    def rank(item):
        if item.nodeid.startswith(SLURM_DEMO):
            return 0
        if "slurm" in item.keywords:
            return 1
        path = item.nodeid.split("::")[0]
        return 2 + LONG_FIRST.index(path) if path in LONG_FIRST else len(LONG_FIRST) + 2

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


@pytest.fixture(scope="session")
def view_run(ingested_run, tmp_path_factory) -> dict:
    """The viewer's run: ingest and every later step's manifests (``tests/viewer/run_builder.write_view_run``)."""
    from tests.viewer.run_builder import write_view_run

    return write_view_run(ingested_run, tmp_path_factory.mktemp("view") / "run")


@pytest.fixture(scope="session")
def meaning_run(view_run, tmp_path_factory) -> dict:
    """The viewer's run with image vectors, a dedup and the real ``index`` step: every page has its step (the
    viewer's tests and the fuzzer's routes read it)."""
    from tests.viewer.run_builder import write_meaning_run

    return write_meaning_run(view_run, tmp_path_factory.mktemp("meaning") / "run")


# ---- what a test needs from the machine, and the skips summary -----------------------------------------------
IN_CI = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
REPO = Path(__file__).resolve().parents[1]


@functools.cache
def _missing_slurm() -> str | None:
    from ovpipe.executors.slurm_cluster import missing_binaries

    gone = missing_binaries()
    return f"Slurm ({', '.join(gone)} not on PATH; bash scripts/install_slurm.sh installs it)" if gone else None


@functools.cache
def _missing_chromium() -> str | None:
    gone = [what for what, there in (
        ("chromium on PATH: bash scripts/install_system_deps.sh installs Debian's",
         shutil.which("chromium") or shutil.which("chromium-browser")),
        ("the playwright package: make install", importlib.util.find_spec("playwright"))) if not there]
    return f"Chromium ({'; '.join(gone)})" if gone else None


@functools.cache
def _missing_checkout_venv() -> str | None:
    venv = REPO / ".venv"
    if Path(sys.prefix).resolve() == venv.resolve() and (venv / ".installed").exists():
        return None
    return f"the checkout's .venv (the test runs the Makefile, which uses {venv}: make install, then its python)"


# marker: what is missing (None when it is there). A test with the marker skips without it; under CI=true it fails.
NEEDS = {"slurm": _missing_slurm, "chromium": _missing_chromium, "checkout_venv": _missing_checkout_venv}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    for marker in NEEDS:
        if marker in item.keywords and (missing := NEEDS[marker]()):
            if IN_CI:
                pytest.fail(f"CI=true, and this test needs {missing}", pytrace=False)
            pytest.skip(f"needs {missing}")


_skipped: list[tuple[str, bool, str]] = []        # (node id, GPU-only, reason), on the controller


def _skip_reason(report) -> str:
    r = report.longrepr
    text = str(r[2]) if isinstance(r, (tuple, list)) and len(r) == 3 else str(r)
    return text.removeprefix("Skipped: ")


def pytest_runtest_logreport(report):
    # GPU-only is the test's ``gpu`` marker, never the skip's text (a pip error can mention CUDA)
    if report.skipped and not hasattr(report, "wasxfail"):
        _skipped.append((report.nodeid, "gpu" in report.keywords, _skip_reason(report)))


def pytest_collectreport(report):
    """A module skipped whole (a module-level ``importorskip`` or ``skip(allow_module_level=True)``) is a collect
    report, never a test's: counted here, and never GPU-only — a GPU module marks its tests ``gpu`` instead."""
    if report.skipped:
        _skipped.append((report.nodeid, False, _skip_reason(report)))


def _unexpected_in_ci() -> list[tuple[str, bool, str]]:
    return [s for s in _skipped if not s[1]] if IN_CI else []


def pytest_sessionfinish(session, exitstatus):
    if _unexpected_in_ci() and exitstatus == 0 and not hasattr(session.config, "workerinput"):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter):
    """After pytest's own summary (this wrapper is the outermost): what was skipped and why, in counts — the
    run's last lines but pytest's one-line tally."""
    result = yield
    if _skipped:
        tr = terminalreporter
        gpu = sum(1 for _, is_gpu, _ in _skipped if is_gpu)
        other = Counter(reason for _, is_gpu, reason in _skipped if not is_gpu)
        tr.write_sep("-", f"skipped: {len(_skipped)}")
        if gpu:
            tr.write_line(f"{gpu} GPU-only (they skip on a machine without CUDA)")
        for reason, n in other.most_common():
            tr.write_line(f"{n} × {reason}")
        if _unexpected_in_ci():
            tr.write_line(f"CI=true: the run fails — {sum(other.values())} test(s) skipped for what this machine "
                          f"lacks: {', '.join(sorted({n for n, g, _ in _skipped if not g}))}", red=True, bold=True)
    return result
