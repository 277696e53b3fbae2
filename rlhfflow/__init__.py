"""rlhfflow: RLHF pipelines as a graph of stages, run as dataflow on Dask distributed."""

__version__ = "0.1.0"
