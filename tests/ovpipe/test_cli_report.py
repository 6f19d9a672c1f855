from ovpipe.cli import main


def test_report_prints_canned_queries_and_step_reports(ingested_run, capsys):
    assert main(["report", str(ingested_run)]) == 0
    out = capsys.readouterr().out
    assert "samples by status" in out
    assert "corrupt_image" in out and "duplicate(s) marked" in out


def test_sql_json_format(ingested_run, capsys):
    assert main(["sql", str(ingested_run), "SELECT count(*) AS n FROM samples WHERE status = 'ok'",
                 "--format", "json"]) == 0
    assert capsys.readouterr().out.strip() == '{"n": 195}'


def test_status_of_finished_run(ingested_run, capsys):
    assert main(["status", str(ingested_run)]) == 0
    out = capsys.readouterr().out
    assert "ingest" in out and "2/2" in out
