"""The typed settings below the stage SDK: the ``algorithm:`` section (``AlgorithmSpec``)
and the field types every spec object is built on (``rlhfflow.spec.fields``).

They sit under ``rlhfflow.sdk`` so that a stage's context and hooks are typed with them;
the whole pipeline file's schema, which names the stages, is ``rlhfflow.config.spec``.
"""
