"""The training page plots the RL stage: one row and one line per grpo step folder and stage (`grpo_metrics`),
whether or not the run also holds pretraining metrics."""
import pyarrow as pa
import pyarrow.parquet as pq


def _grpo_metrics(run, folder, rewards):
    from manifests.schemas import schema_for

    schema = schema_for("grpo_metrics")
    rows = [{**{n: None for n in schema.names}, "stage": "answer_only", "step": i + 1, "reward_mean": r,
             "zero_std_group_share": 0.5, "token_utilization": 0.25, "completion_len_mean": 9.0, "step_time_s": 2.0,
             "extras": "{}"} for i, r in enumerate(rewards)]
    out = run / folder / "grpo_metrics"
    out.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), out / "part-00000.parquet")


def test_the_training_page_shows_each_grpo_run(tmp_path):
    from starlette.testclient import TestClient

    from viewer.app import create_app

    _grpo_metrics(tmp_path, "grpo", [-5.0, -2.5])
    _grpo_metrics(tmp_path, "grpo-s1", [-4.0, 0.0])
    page = TestClient(create_app(tmp_path), base_url="http://127.0.0.1").get("/training")
    assert page.status_code == 200
    t = page.text
    assert 'id="grpo"' in t and "grpo-s1" in t and "-5" in t and "-2.5" in t
    assert t.count('class="chart"') == 5          # reward, zero-spread groups, utilization, length, step time
