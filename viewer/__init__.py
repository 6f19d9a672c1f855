"""``ovpipe view RUN``: a read-only local web page over a run folder (docs/view.md)."""
