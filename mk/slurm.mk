# slurm-up / slurm-down / slurm-demo: a Slurm on 127.0.0.1 (private munge, slurmctld, one slurmd per node, SLURM_NODES;
# ovpipe/executors/slurm_cluster.py, the cluster the Slurm tests start) to try the cluster path on one
# machine (docs/slurm.md). Install Slurm first: bash scripts/install_slurm.sh (root).
#   make slurm-up && make slurm-demo && make slurm-down
SLURM_DIR  ?= /tmp/ovpipe-slurm-$(notdir $(CURDIR))
SLURM_CPUS ?= 4
SLURM_NODES ?= 1
LOOPBACK   = $(BIN)/python -m ovpipe.executors.slurm_cluster

.PHONY: slurm-up slurm-down slurm-status slurm-demo
slurm-up: install
	@$(LOOPBACK) up --dir $(SLURM_DIR) --cpus $(SLURM_CPUS) --nodes $(SLURM_NODES)

slurm-down:
	@$(LOOPBACK) down --dir $(SLURM_DIR)

slurm-status:
	@$(LOOPBACK) status --dir $(SLURM_DIR)

# the whole demo, every step a Slurm job chain on the loopback cluster (SLURM_CONF from slurm-up)
slurm-demo: install
	@$(LOOPBACK) status --dir $(SLURM_DIR) >/dev/null || { echo "no loopback cluster in $(SLURM_DIR): make slurm-up first" >&2; exit 1; }
	SLURM_CONF=$(SLURM_DIR)/slurm.conf $(MAKE) --no-print-directory demo EXECUTOR=slurm
