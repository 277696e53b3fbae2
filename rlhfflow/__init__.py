"""rlhfflow: RLHF pipelines as a graph of stages, run as dataflow on Dask distributed.

Progress and warnings are logged under the ``rlhfflow`` logger (``rlhfflow.runtime...``);
the ``rlhfflow`` command installs the handler that prints them. A program that runs
pipelines itself configures logging as it likes (``logging.basicConfig(level="INFO")``
shows the progress lines).
"""

import logging

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())
