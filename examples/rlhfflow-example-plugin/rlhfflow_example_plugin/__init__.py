"""An example rlhfflow plugin: the ``length_penalty`` stage type and a reward function.

Install it (``pip install examples/rlhfflow-example-plugin``) where the pipeline is
validated and on every Dask worker; pipelines then name the stage type
``length_penalty`` (entry point) or ``rlhfflow_example_plugin.stages:LengthPenalty``
(import path), and the reward function ``rlhfflow_example_plugin.rewards:says_yes``.
"""
