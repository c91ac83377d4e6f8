"""OpenAI's logit_bias, checked once and frozen: the token ids and biases as
arrays (int64, float32), which the engine stages as they are every step.
Immutable, so a request's prompts and samples share one check and one copy;
a pickled one is checked again where it lands (the engine trusts nobody)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from shoal.proto.errors import InvalidRequestError

MAX_BIAS = 100.0  # OpenAI's range: [-100, 100]
DEFAULT_MAX_LOGIT_BIAS = 300  # entries in one request (--max-logit-bias), as OpenAI allows
_FIELD = "logit_bias"


class LogitBias(Mapping[int, float]):
    """A read-only map token id -> bias; `max_token_id` makes the
    vocabulary check O(1)."""

    __slots__ = ("_map", "token_ids", "values", "max_token_id")
    token_ids: npt.NDArray[np.int64]
    # an array in place of Mapping.values(): what the engine stages
    values: npt.NDArray[np.float32]  # type: ignore[assignment]
    max_token_id: int

    def __init__(self, bias: Mapping[Any, Any]) -> None:
        if not isinstance(bias, Mapping):
            raise InvalidRequestError(f"logit_bias must map token ids to numbers, got {_show(bias)}", field=_FIELD)
        for token, value in bias.items():
            if type(token) is not int or not 0 <= token < 2**63:  # not bool, not a float
                raise InvalidRequestError(
                    f"logit_bias must map non-negative token ids to numbers, got key {_show(token)}", field=_FIELD
                )
            if type(value) not in (int, float) or not (math.isfinite(value) and -MAX_BIAS <= value <= MAX_BIAS):
                raise InvalidRequestError(
                    f"logit_bias values must be numbers in [-100, 100], got {_show(value)}", field=_FIELD
                )
        self._map: dict[int, float] = {t: float(v) for t, v in bias.items()}
        self.token_ids = np.fromiter(self._map, np.int64, len(self._map))
        self.values = np.fromiter(self._map.values(), np.float32, len(self._map))
        self.token_ids.flags.writeable = self.values.flags.writeable = False
        self.max_token_id = int(self.token_ids.max()) if len(self._map) else -1

    def __getitem__(self, token: int) -> float:
        return self._map[token]

    def __iter__(self) -> Iterator[int]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._map)

    def __repr__(self) -> str:
        return f"LogitBias({self._map!r})"

    def __reduce__(self) -> tuple[type[LogitBias], tuple[dict[int, float]]]:
        return (LogitBias, (self._map,))


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_count(n: int, limit: int) -> None:
    """At most `limit` entries (--max-logit-bias): checked before any entry is read."""
    if n > limit:
        raise InvalidRequestError(
            f"logit_bias has {n} entries; at most {limit} are allowed (--max-logit-bias)", field=_FIELD
        )
