"""Side-by-side benchmarks against the peers each issue names; `make bench` runs them all."""
