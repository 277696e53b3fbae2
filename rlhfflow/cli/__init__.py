"""The ``rlhfflow`` command line."""

import os

ENVIRONMENT = dict(os.environ)
"""The environment as the command started, before any import changed it (the engine
sets ``DS_ACCELERATOR``): ``--supervise`` gives its attempts the variables read at import
as they were here (``rlhfflow.cli.supervise.attempt_environment``)."""
