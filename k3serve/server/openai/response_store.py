"""Stored Responses API replies, for `previous_response_id` and GET/DELETE /v1/responses/{id}:
in memory, bounded, oldest evicted first."""

from __future__ import annotations

from collections import OrderedDict

from k3serve.server.openai.errors import APIError


class ResponseStore:
    """Stored responses (body + the conversation so far as chat messages), oldest evicted first."""

    def __init__(self, max_items: int = 1024):
        self.max_items, self._items = max_items, OrderedDict()

    def put(self, rid: str, body: dict, messages: list[dict]) -> None:
        self._items[rid] = (body, messages)
        while len(self._items) > self.max_items:
            self._items.popitem(last=False)

    def get(self, rid: str, param: str = "response_id") -> tuple[dict, list[dict]]:
        if rid not in self._items:
            raise APIError(404, f"response {rid!r} not found (not stored, or evicted)", param=param)
        return self._items[rid]

    def delete(self, rid: str) -> None:
        self.get(rid)
        del self._items[rid]
