#!/bin/bash
# Issue 41 item 1 on one card (carry [".whl", ".whl-cur"]; kind nvidia-h100-x1 or nvidia-h200, timeout_s 420):
# tests/pretrain/test_host_collectives.py and every layout of tests/pretrain/test_parallel_parity.py — TP=2, PP=2,
# CP=2, TP=2+SP, DP=2, the 4-rank TP=2×CP=2+SP, the resume at another layout, and the bf16 runs with the distributed
# optimizer — all ranks on the one GPU through the host-staged gloo collectives, each against the one-rank GPU run;
# the table of bench/gpu/layouts_table.py goes into the log. Usage: LIMIT=400 bash bench/gpu/layouts_h100.sh
LIMIT=${LIMIT:-400}
source bench/gpu/lib.sh
layouts
finish
