"""Types shared by every layer, free of torch so the stage SDK can name them."""

from __future__ import annotations

from typing import Any

Batch = dict[str, Any]
"""Columns of a (micro-)batch: tensors with the row dimension first, or lists of str."""
