"""The environment of ``benchmarks/longtail.py``: long-tailed multi-turn episodes.

Each record says how many turns its episode lasts (``turns``, 1 to 8) and seeds the time
each step takes: lognormal around ``median_s`` (a tool call or a remote environment that
is usually quick and sometimes slow). The reward teaches something a tiny model can
learn: the share of vowels in what the model says, averaged over its turns, paid when the
episode ends.
"""

from __future__ import annotations

import math
import random
import time

VOWELS = set("aeiou")


class LongTail:
    """One episode of ``record["turns"]`` model turns; every step sleeps a lognormal
    time (``median_s``, ``sigma``) drawn from the record's ``id`` and the turn."""

    def __init__(self, median_s: float = 0.05, sigma: float = 0.8) -> None:
        self.median_s, self.sigma = median_s, sigma
        self.turns, self.said, self.seed = 1, [], 0

    def reset(self, record: dict) -> list:
        self.turns, self.said, self.seed = int(record["turns"]), [], int(record["id"])
        return []

    def step(self, text: str) -> tuple[str, float, bool, dict]:
        turn = len(self.said)
        draw = random.Random(self.seed * 64 + turn).gauss(0.0, self.sigma)
        time.sleep(self.median_s * math.exp(draw))
        letters = [c for c in text.lower() if c.isalpha()]
        self.said.append(sum(c in VOWELS for c in letters) / max(len(letters), 1))
        if len(self.said) >= self.turns:
            return "", sum(self.said) / len(self.said), True, {}
        return "ok", 0.0, False, {}
