"""The exact-match reward of the arithmetic example.

A response is right when the last number in it equals the reference answer: "23 + 58 = 81"
and "The answer is 81." score 1, "81.5", "about 80" and "" score 0. Commas inside a number
("1,081") are ignored, so thousands separators count as the number they write.
"""

from __future__ import annotations

import re

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number(text: str) -> str | None:
    """The last number written in ``text`` (commas removed), or None."""
    found = NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def exact_match(prompts: list[str], responses: list[str], answer: list[str]) -> list[float]:
    """1.0 where the last number of the response is the reference ``answer``, else 0.0."""
    return [float(last_number(r) == a.strip()) for r, a in zip(responses, answer, strict=True)]
