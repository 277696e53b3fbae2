"""Serving a model over HTTP: an OpenAI-compatible endpoint (:mod:`rlhfflow.serve.endpoint`)
in front of a :class:`~rlhfflow.engine.service.GenerationService`."""
