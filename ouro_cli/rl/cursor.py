"""The data cursor: which rows each update trains on, reproducible from (seed, epoch, offset).

Every epoch visits every row once in a seeded order; `next_batch(n)` takes the next n
row indices and runs on into the next epoch (a fresh order) when the current one is
used up, so any batch size works, even one larger than the data set. The whole state
is four integers (`state_dict`), saved with every checkpoint: a resumed run continues
exactly the sequence an uninterrupted run would have drawn.

The order of epoch e is the argsort of a keyed hash, splitmix64(seed, e, row), rather
than a library shuffle: numpy's and torch's generators do not promise the same
stream across versions, and a checkpoint may be resumed on a machine with other
versions. The hash is fixed 64-bit integer arithmetic and the sort is stable, so the
order depends only on (seed, epoch, size) -- a test pins a few values.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import UserError

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_STATE_KEYS = ("seed", "size", "epoch", "offset")


def _mix64(z: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, elementwise on uint64 (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def epoch_order(seed: int, epoch: int, size: int) -> np.ndarray:
    """The row order of `epoch`: a permutation of range(size) determined by (seed, epoch)."""
    with np.errstate(over="ignore"):
        key = _mix64(np.array([seed], dtype=np.uint64))
        key = _mix64(key + np.uint64(epoch) * _GOLDEN)
        counters = np.arange(1, size + 1, dtype=np.uint64) * _GOLDEN
        return np.argsort(_mix64(key + counters), kind="stable")


class DataCursor:
    """Seeded, epoch-based walk over `size` rows; `next_batch` advances it."""

    def __init__(self, size: int, seed: int, epoch: int = 0, offset: int = 0) -> None:
        for name, value in (("size", size), ("seed", seed), ("epoch", epoch), ("offset", offset)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"cursor {name} must be an integer, got {value!r}")
        if size < 1:
            raise ValueError(f"cursor size must be >= 1, got {size}")
        if not 0 <= seed < 2**64:
            raise ValueError(f"cursor seed must lie in [0, 2**64), got {seed}")
        if epoch < 0 or not 0 <= offset < size:
            raise ValueError(f"cursor position epoch={epoch} offset={offset} is outside a data set of {size} rows")
        self.size, self.seed, self.epoch, self.offset = size, seed, epoch, offset
        self._order = epoch_order(seed, epoch, size)

    def next_batch(self, n: int) -> list[int]:
        """The next `n` row indices, continuing into following epochs as needed."""
        if n < 1:
            raise ValueError(f"batch size must be >= 1, got {n}")
        batch: list[int] = []
        while len(batch) < n:
            take = min(n - len(batch), self.size - self.offset)
            batch.extend(int(i) for i in self._order[self.offset : self.offset + take])
            self.offset += take
            if self.offset == self.size:
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = epoch_order(self.seed, self.epoch, self.size)
        return batch

    def state_dict(self) -> dict[str, int]:
        """JSON-serialisable position: enough to rebuild this cursor exactly."""
        return {"seed": self.seed, "size": self.size, "epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Move to a saved position; the saved seed and data size must be this cursor's."""
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise UserError(
                f"saved data cursor lacks {', '.join(missing)}: the checkpoint is not from this version of ouro"
            )
        if state["seed"] != self.seed:
            raise UserError(
                f"the checkpoint's data cursor was seeded with {state['seed']}, this run with {self.seed}: "
                "resume with the original --seed"
            )
        if state["size"] != self.size:
            raise UserError(
                f"the checkpoint's data cursor walks {state['size']} rows, the data now has {self.size}: "
                "resume with the original --data file"
            )
        try:
            restored = DataCursor(self.size, self.seed, int(state["epoch"]), int(state["offset"]))
        except (TypeError, ValueError) as exc:
            raise UserError(f"saved data cursor is invalid: {exc}") from exc
        self.epoch, self.offset, self._order = restored.epoch, restored.offset, restored._order

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> DataCursor:
        cursor = cls(int(state["size"]), int(state["seed"]))
        cursor.load_state_dict(state)
        return cursor

    def __repr__(self) -> str:
        return f"DataCursor(size={self.size}, seed={self.seed}, epoch={self.epoch}, offset={self.offset})"


__all__ = ["DataCursor", "epoch_order"]
