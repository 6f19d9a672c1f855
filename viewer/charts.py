"""The viewer's charts: plotly figures built here from small aggregates, drawn in the page by plotly.min.js,
which the plotly package ships (``plotly.offline.get_plotlyjs``) and the server hands out itself.

Every chart gets at most a few thousand points: a curve over 500K concepts is cut to log-spaced ranks and a
distribution over 1M rows is binned by DuckDB before it leaves the server.
"""
from __future__ import annotations

LAYOUT = dict(margin=dict(l=50, r=20, t=40, b=40), height=320, template="plotly_white",
              legend=dict(orientation="h", y=-0.2))


def _json(fig) -> str:
    import plotly.io as pio

    return pio.to_json(fig, validate=False)


def head_tail(before: list[tuple[int, int]], after: list[tuple[int, int]]) -> str:
    """Concept frequency by rank (log-log), before and after balancing: MetaCLIP's head-versus-tail picture."""
    import plotly.graph_objects as go

    fig = go.Figure()
    fig.add_scatter(x=[r for r, _ in before], y=[c for _, c in before], mode="lines", name="before balance")
    fig.add_scatter(x=[r for r, _ in after], y=[c for _, c in after], mode="lines", name="after balance")
    fig.update_layout(title="Concept frequency by rank", xaxis=dict(type="log", title="concept rank"),
                      yaxis=dict(type="log", title="images"), **LAYOUT)
    return _json(fig)


def bars(title: str, series: dict[str, list[tuple[float, int]]], xtitle: str, ytitle: str = "count") -> str:
    """Binned counts, one bar trace per series (``[(bin start, count)]``)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for name, pts in series.items():
        fig.add_bar(x=[x for x, _ in pts], y=[n for _, n in pts], name=name)
    fig.update_layout(title=title, barmode="stack", xaxis=dict(title=xtitle), yaxis=dict(title=ytitle), **LAYOUT)
    return _json(fig)


def lines(title: str, series: dict[str, tuple[list, list]], xtitle: str, ytitle: str, log_y: bool = False) -> str:
    """One line per series (``{name: (x, y)}``); a None y is a gap, not a zero."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for name, (x, y) in series.items():
        fig.add_scatter(x=x, y=y, mode="lines+markers", name=name, connectgaps=False)
    fig.update_layout(title=title, xaxis=dict(title=xtitle), yaxis=dict(title=ytitle, type="log" if log_y else "linear"),
                      **LAYOUT)
    return _json(fig)


def plotly_js() -> str:
    from plotly.offline import get_plotlyjs

    return get_plotlyjs()
