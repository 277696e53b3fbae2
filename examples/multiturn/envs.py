"""A number-guessing environment for the ``rollout`` stage (pure Python).

The prompt record carries the secret (``{"prompt": "guess a number from 1 to 9", "secret":
7}``); the model guesses, the environment says ``higher``, ``lower`` or ``correct``, and
reports ``won`` (1 on the winning turn) in its ``info`` for the run's metrics
(``params.info: [won]`` makes it ``info_won_mean``, the win rate).
"""

from __future__ import annotations

import re


class GuessNumber:
    """One episode of guessing ``record["secret"]``. Reward 1 for the right guess (which
    ends the episode), ``-penalty`` for every other turn (``-silent_penalty`` for a turn
    without a number, when given: a denser signal for a model that rambles). ``hint`` words the answer to a
    wrong guess (``{word}``: higher or lower, ``{guess}``: the guess); ``role``: the role
    of the answers (None: the stage's, ``tool`` where the chat template renders it)."""

    def __init__(self, penalty: float = 0.1, hint: str = "{word}",
                 role: str | None = None, silent_penalty: float | None = None) -> None:
        self.penalty = penalty
        self.silent_penalty = penalty if silent_penalty is None else silent_penalty
        self.hint = hint
        self.role = role
        self.secret = 0

    def say(self, text: str) -> list[dict]:
        """One message of the environment, in its role."""
        return [{"content": text} if self.role is None else {"role": self.role, "content": text}]

    def reset(self, record: dict) -> list[dict]:
        """Remember the secret; the prompt says the rest."""
        self.secret = int(record["secret"])
        return []

    def step(self, text: str) -> tuple[str, float, bool, dict]:
        """Judge the first number in the model's turn."""
        found = re.search(r"\d+", text)
        if found is None:
            return self.say("say a number"), -self.silent_penalty, False, {"won": 0}
        guess = int(found.group())
        if guess == self.secret:
            return self.say("correct"), 1.0, True, {"guess": guess, "won": 1}
        word = "higher" if guess < self.secret else "lower"
        return self.say(self.hint.format(word=word, guess=guess)), -self.penalty, False, \
            {"guess": guess, "won": 0}
