"""A reward function, named in a ``score`` stage as ``rlhfflow_example_plugin.rewards:says_yes``."""

from __future__ import annotations


def says_yes(prompts: list[str], responses: list[str]) -> list[float]:
    """1.0 for a response that contains "yes" (any case), else 0.0."""
    return [float("yes" in r.lower()) for r in responses]
