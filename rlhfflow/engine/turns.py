"""KV-cached decoding in turns: rows leave the decode batch at the end of a turn with their
cache, and rejoin later with new tokens fed on top of it (continuous batching at turn
granularity, for the multi-turn ``rollout`` stage).

The rows decoding now share one :class:`~rlhfflow.engine.decoding.KVState`. A row whose
turn ended is *parked*: its cache columns (holes dropped) are cut out of the state into a
:class:`RowCache`, and the state keeps decoding the others (as ``generate``'s compaction
does for rows at EOS). A parked row *joins* again with a block of new tokens: the last
token it sampled (never fed yet) and what came after it (an environment's answer). The
joining rows run one forward of their own on their caches, which gives the logits of
their next token, and their state is merged into the decoding one. Positions are explicit
and holes masked, so where a row's columns sit in the batch never changes its values
beyond float rounding; a row with no cache (``kv_cache`` off) is prefilled afresh.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhfflow.engine.decoding import KVState


@dataclass
class RowCache:
    """One parked row's KV cache with no holes: per layer ``keys``/``values`` ``[H, n, D]``
    for its ``n`` tokens so far, at positions ``0 .. n-1``."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def length(self) -> int:
        """Tokens in the cache."""
        return self.keys[0].shape[-2] if self.keys else 0


class TurnBatch:
    """The rows decoding now (``rows``: the caller's ids, in state order) on one KV state."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.state: KVState | None = None
        self.rows: list[int] = []

    def start(self, rows: list[int], ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Prefill left-padded ``ids`` for ``rows`` (nothing decoding yet): the float logits
        of each row's next token ``[N, V]`` (``generate``'s prefill, the same values)."""
        self.state = KVState(self.module, ids, mask)
        self.rows = list(rows)
        return self.state.prefill_logits

    def step(self, last: torch.Tensor) -> torch.Tensor:
        """Feed each decoding row its ``last [B]`` sampled token: logits ``[B, V]``."""
        return self.state.forward(last[:, None])[:, 0]

    def park(self, positions: list[int], keep_cache: bool = True) -> list[RowCache | None]:
        """Take the rows at ``positions`` (indices into ``rows``) out of the batch: their
        caches (None without ``keep_cache``), in that order."""
        state = self.state
        caches: list[RowCache | None] = []
        for at in positions:
            if not keep_cache:
                caches.append(None)
                continue
            real = state.mask[at].bool().nonzero().squeeze(-1)
            caches.append(RowCache([layer.keys[at].index_select(-2, real)
                                    for layer in state.cache.layers],
                                   [layer.values[at].index_select(-2, real)
                                    for layer in state.cache.layers]))
        gone = set(positions)
        keep = [at for at in range(len(self.rows)) if at not in gone]
        self.rows = [self.rows[at] for at in keep]
        if keep:
            state.select(torch.tensor(keep, dtype=torch.long))
            state.drop_empty_columns()
        else:
            self.state = None
        return caches

    @torch.no_grad()
    def join(self, rows: list[int], caches: list[RowCache | None],
             blocks: list[list[int]], pad_id: int) -> torch.Tensor:
        """Bring ``rows`` back with their ``caches`` and feed each its ``blocks`` of new
        tokens (a row without a cache: its whole sequence, prefilled): the logits of each
        joining row's next token ``[J, V]``. They decode with the others from here on,
        appended to ``rows``."""
        ids, fed = _left_padded(blocks, pad_id)
        if all(cache is None or cache.length == 0 for cache in caches):
            joined = KVState(self.module, ids, fed)
            logits = joined.prefill_logits
        else:
            joined = _state_of(self.module, caches)
            logits = joined.forward(ids, fed, last_only=True)[:, -1]
        self._merge(joined)
        self.rows += list(rows)
        return logits

    def _merge(self, other: KVState) -> None:
        """Append ``other``'s rows to the decoding state (the narrower side's columns
        padded with holes on the left), and pack the state when holes dominate it."""
        if self.state is None:
            self.state = other
            return
        state = self.state
        width = max(state.mask.shape[1], other.mask.shape[1])
        for mine, theirs in zip(state.cache.layers, other.cache.layers, strict=True):
            mine.keys = torch.cat([_left_pad(mine.keys, width), _left_pad(theirs.keys, width)])
            mine.values = torch.cat([_left_pad(mine.values, width),
                                     _left_pad(theirs.values, width)])
        state.mask = torch.cat([_left_pad(state.mask, width), _left_pad(other.mask, width)])
        state.next_pos = torch.cat([state.next_pos, other.next_pos])
        if state.mask.float().mean() < 0.5:
            pack(state)


def _left_padded(blocks: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, fed)``: token lists left-padded (new tokens last in a row, holes first)."""
    width = max(len(block) for block in blocks)
    ids = torch.full((len(blocks), width), pad_id, dtype=torch.long)
    fed = torch.zeros(len(blocks), width, dtype=torch.long)
    for row, block in enumerate(blocks):
        if block:
            ids[row, width - len(block):] = torch.tensor(block, dtype=torch.long)
            fed[row, width - len(block):] = 1
    return ids, fed


def _left_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """``tensor`` (``[B, L]`` or ``[B, H, L, D]``) with zero columns on the left up to
    ``width``."""
    missing = width - (tensor.shape[1] if tensor.dim() == 2 else tensor.shape[-2])
    if missing <= 0:
        return tensor
    pad = (missing, 0) if tensor.dim() == 2 else (0, 0, missing, 0)
    return torch.nn.functional.pad(tensor, pad)


def pack(state: KVState) -> None:
    """Move each row's real columns to the right end of the state, in order, and cut the
    columns no row needs: joins leave holes that attention would keep paying for."""
    width = int(state.mask.sum(-1).max())
    # a stable sort of the 0/1 mask puts holes first and keeps the real columns' order
    order = torch.sort(state.mask, dim=1, stable=True).indices[:, -width:]
    for layer in state.cache.layers:
        index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1,
                                               layer.keys.shape[-1])
        layer.keys = layer.keys.gather(2, index)
        layer.values = layer.values.gather(2, index)
    state.mask = state.mask.gather(1, order)


def _state_of(module: torch.nn.Module, caches: list[RowCache | None]) -> KVState:
    """A KV state of parked rows, left-padded to the longest (a row without a cache has
    only holes; its block is then its whole sequence)."""
    width = max(cache.length for cache in caches if cache is not None)
    template = next(cache for cache in caches if cache is not None and cache.length)

    def stacked(part: str, layer: int) -> torch.Tensor:
        like = getattr(template, part)[layer]
        empty = like.new_zeros(like.shape[0], width, like.shape[-1])
        return torch.stack([
            empty if cache is None or cache.length == 0
            else _left_pad(getattr(cache, part)[layer][None], width)[0] for cache in caches])

    layers = range(len(template.keys))
    lengths = torch.tensor([cache.length if cache is not None else 0 for cache in caches])
    mask = (torch.arange(width)[None, :] >= width - lengths[:, None]).long()
    return KVState.restore(module, {"keys": [stacked("keys", i) for i in layers],
                                    "values": [stacked("values", i) for i in layers],
                                    "mask": mask, "next_pos": lengths[:, None]})
