# the third call's command (carry [".whl", ".gpu"], timeout_s 170), written to /tmp/c.sh on the device and run
LIMIT=150
source bench/gpu/lib.sh
mfu none_vsel_liger 55 --recompute none --vision-recompute selective --kernels fused --loss-kernel liger
mfu none_vsel_liger_ga4_rerun 65 --recompute none --vision-recompute selective --kernels fused --loss-kernel liger --grad-accum 4 --steps 6
finish
