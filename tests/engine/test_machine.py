"""Figures of the machine at hand: a process's peak resident set (``engine.machine``)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from rlhfflow.engine.machine import peak_rss

MiB = 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")
def test_the_peak_resident_set_counts_what_was_touched_and_starts_again_when_reset():
    peak_rss(reset=True)
    before = peak_rss()
    block = np.ones(256 * MiB // 8)  # 256 MiB written, so resident
    assert peak_rss() >= before + 250 * MiB
    del block
    high = peak_rss(reset=True)  # the mark from here on is today's resident set
    assert high >= before + 250 * MiB
    assert peak_rss() < high - 200 * MiB
