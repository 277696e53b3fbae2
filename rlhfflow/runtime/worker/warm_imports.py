"""Imported by the embedded cluster's fork server as it starts (``start_fork_server``):
every worker process is then a fork of a process that already imported torch,
transformers' model classes, zarr and the stages (~6 s of imports on a 2-core machine,
paid once, beside the coordinator's own imports, instead of once per worker after them)."""

from rlhfflow.runtime.worker.preload import warm

warm()
