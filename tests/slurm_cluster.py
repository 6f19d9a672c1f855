"""The loopback Slurm the tests start: the same cluster `make slurm-up` starts for users
(``ovpipe.executors.slurm_cluster``), here in a temp folder for the life of a test module."""
from ovpipe.executors.slurm_cluster import SlurmCluster, missing_binaries

__all__ = ["SlurmCluster", "missing_binaries"]
