"""Programmatic rewards shipped with rlhfflow, usable as ``score`` stage functions.

A reward function takes the prompts and the responses as lists of str (plus keyword
arguments from ``params.kwargs``) and returns one float per response.
"""

from __future__ import annotations

VOWELS = frozenset("aeiou")


def vowel_ratio(prompts: list[str], responses: list[str], min_length: int = 8) -> list[float]:
    """The demo task: vowels in the response divided by ``max(len(response), min_length)``.

    In [0, 1]; a random character model scores about 0.1, and the best response is at
    least ``min_length`` characters of vowels only. ``min_length`` stops the policy from
    collapsing to one vowel and an EOS.
    """
    return [sum(c in VOWELS for c in r) / max(len(r), min_length) for r in responses]


def length_ratio(prompts: list[str], responses: list[str], target: int = 16) -> list[float]:
    """1 when the response has ``target`` characters, falling linearly to 0 at 0 or 2x."""
    return [max(0.0, 1.0 - abs(len(r) - target) / target) for r in responses]
