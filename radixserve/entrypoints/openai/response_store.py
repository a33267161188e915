"""The Responses API's stored responses: kept in the server process's memory, the `capacity` most recently used
ones (--responses-store-size; 0 stores nothing). Nothing survives a restart.

A stored response is the response object as it was answered and the conversation needed to continue it: its input
items (those of the response it continued first, then its own, as normalised by `responses_items.input_items`) and
its output items. Creating, reading (GET, `input_items`) and continuing (`previous_response_id`) a response makes it
the most recently used; storing one more than `capacity` drops the least recently used one."""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object, as answered
    input_items: list[dict[str, Any]]  # the whole input the model saw (instructions aside), each item with an id

    @property
    def output_items(self) -> list[dict[str, Any]]:
        return self.response["output"]

    def conversation(self) -> list[dict[str, Any]]:
        """The items a response continuing this one starts from: its input, then its output (copies)."""
        return copy.deepcopy(self.input_items + self.output_items)


class ResponseStore:
    """An LRU map of response id -> StoredResponse, bounded by count."""

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
            raise ValueError(f"the response store's capacity must be an integer >= 0; got {capacity!r}")
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, response_id: object) -> bool:
        return response_id in self._items

    def put(self, response: dict[str, Any], input_items: list[dict[str, Any]]) -> None:
        """Store `response` (under its `id`; copies are kept), evicting the least recently used beyond capacity."""
        if not self.enabled:
            return
        rid = response["id"]
        self._items[rid] = StoredResponse(copy.deepcopy(response), copy.deepcopy(input_items))
        self._items.move_to_end(rid)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response (now the most recently used), or None."""
        found = self._items.get(response_id)
        if found is not None:
            self._items.move_to_end(response_id)
        return found

    def delete(self, response_id: str) -> bool:
        """Drop the response; False when it was not stored."""
        return self._items.pop(response_id, None) is not None
