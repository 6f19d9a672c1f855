"""A step's report.md is a page of the viewer (headings, tables, lists), escaped; ``?raw=1`` is the text."""
from viewer.markdown import render


def test_render_makes_tables_and_escapes_the_data():
    md = ("# Ingest\n\n200 samples; **1** duplicate.\n\n| status | samples |\n| --- | ---: |\n| ok | 195 |\n"
          "| <script>x</script> \\| y | 1 |\n\n- one `code`\n- two\n\n![plot](hist.png) [out](https://evil/x)")
    out = render(md, "ingest")
    assert "<h2>Ingest</h2>" in out and "<strong>1</strong>" in out
    assert "<tr><th>status</th><th>samples</th></tr><tr><td>ok</td><td>195</td></tr>" in out
    assert "<script>" not in out and "&lt;script&gt;x&lt;/script&gt; | y" in out
    assert "<ul><li>one <code>code</code></li><li>two</li></ul>" in out
    assert '<img src="/files/ingest/hist.png" alt="plot">' in out
    assert "href=\"https" not in out                                   # a link out of the run stays text


def test_the_report_route_is_a_page_and_raw_is_text(view_client):
    r = view_client.get("/files/ingest/report.md")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "<table>" in r.text and "as text" in r.text
    raw = view_client.get("/files/ingest/report.md?raw=1")
    assert raw.headers["content-type"].startswith("text/plain") and raw.text.lstrip()[:1] != "<"
