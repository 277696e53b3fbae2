"""A number-guessing environment for the ``rollout`` stage (pure Python).

The prompt record carries the secret (``{"prompt": "guess a number from 1 to 9", "secret":
7}``); the model guesses, the environment says ``higher``, ``lower`` or ``correct``.
"""

from __future__ import annotations

import re


class GuessNumber:
    """One episode of guessing ``record["secret"]``. Reward 1 for the right guess (which
    ends the episode), ``-penalty`` for every other turn."""

    def __init__(self, penalty: float = 0.1) -> None:
        self.penalty = penalty
        self.secret = 0

    def reset(self, record: dict) -> list[dict]:
        """Remember the secret; the prompt says the rest."""
        self.secret = int(record["secret"])
        return []

    def step(self, text: str) -> tuple[str, float, bool, dict]:
        """Judge the first number in the model's turn."""
        found = re.search(r"\d+", text)
        if found is None:
            return "say a number", -self.penalty, False, {}
        guess = int(found.group())
        if guess == self.secret:
            return "correct", 1.0, True, {"guess": guess}
        return ("higher" if guess < self.secret else "lower"), -self.penalty, False, \
            {"guess": guess}
