"""Stored Responses API responses (`store`, the API's default): kept in memory for GET and DELETE
/v1/responses/{id}, `previous_response_id` and `item_reference`, each visible to its owner only, the
oldest dropped once the store holds more than its byte bound (and all of them at a restart)."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from stratum.server.errors import InvalidRequest, NotFound


@dataclass(slots=True)
class Stored:
    """One stored response: its body, the items it added to its conversation (its input, then its
    output) and the response it continued."""

    owner: str
    body: dict[str, Any]
    input_items: list[dict[str, Any]]
    previous_id: str | None
    num_bytes: int = 0
    item_ids: list[str] = field(default_factory=list)

    @property
    def output_items(self) -> list[dict[str, Any]]:
        return self.body["output"]


class ResponseStore:
    """Responses by id, bounded by `max_bytes` of their JSON (the oldest dropped first).

    Every read names an owner (`owner_of`): a response of another owner reads as absent, so one
    tenant can neither read nor delete nor continue another's, nor learn that it exists.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._responses: OrderedDict[str, Stored] = OrderedDict()
        # (owner, item id) -> the id of the response that holds it: clients choose item ids (Codex sends its
        # own), so one owner's ids never shadow another's
        self._items: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()  # written from the event loop, read by GETs: kept consistent by one lock

    def put(self, owner: str, body: dict[str, Any], input_items: list[dict[str, Any]], previous_id: str | None) -> None:
        """Store a finished response (`body`), with the input items it was given (ids assigned)."""
        stored = Stored(owner, body, input_items, previous_id)
        stored.num_bytes = len(json.dumps([body, input_items], ensure_ascii=False))
        stored.item_ids = [i["id"] for i in (*input_items, *body["output"]) if isinstance(i.get("id"), str)]
        if stored.num_bytes > self.max_bytes:
            return  # larger than the whole store: never kept (docs/api.md, "Stored responses")
        with self._lock:
            self._responses[body["id"]] = stored
            self.num_bytes += stored.num_bytes
            for item_id in stored.item_ids:
                self._items[owner, item_id] = body["id"]
            while self.num_bytes > self.max_bytes:
                self._drop(next(iter(self._responses)))

    def get(self, owner: str, response_id: str) -> Stored:
        """Raises NotFound (404) when there is none of that id for this owner."""
        with self._lock:
            stored = self._responses.get(response_id)
        if stored is None or stored.owner != owner:
            raise NotFound(f"Response with id '{response_id}' not found.")
        return stored

    def delete(self, owner: str, response_id: str) -> None:
        self.get(owner, response_id)
        with self._lock:
            self._drop(response_id)

    def history(self, owner: str, response_id: str) -> list[dict[str, Any]]:
        """The conversation a response ended: every input and output item of it and of the responses
        it continued, oldest first.

        Raises:
            NotFound: no such response for this owner.
            InvalidRequest: a response it continued is no longer stored (dropped or deleted).
        """
        chain: list[Stored] = []
        next_id: str | None = response_id
        while next_id is not None:
            try:
                stored = self.get(owner, next_id)
            except NotFound:
                if not chain:
                    raise
                raise InvalidRequest(f"previous_response_id: response '{response_id}' continues '{next_id}', "
                                     "which is no longer stored; send the conversation as input") from None
            chain.append(stored)
            next_id = stored.previous_id
        return [item for stored in reversed(chain) for item in (*stored.input_items, *stored.output_items)]

    def input_of(self, owner: str, response_id: str) -> list[dict[str, Any]]:
        """The items a response was given: the conversation it continued, then its own input."""
        stored = self.get(owner, response_id)
        before = self.history(owner, stored.previous_id) if stored.previous_id else []
        return [*before, *stored.input_items]

    def item(self, owner: str, item_id: str) -> dict[str, Any]:
        """An item of a stored response (input or output) by its id. Raises NotFound."""
        with self._lock:
            response_id = self._items.get((owner, item_id))
            stored = self._responses.get(response_id) if response_id is not None else None
        if stored is None or stored.owner != owner:
            raise NotFound(f"Item with id '{item_id}' not found.")
        return next(i for i in (*stored.input_items, *stored.output_items) if i.get("id") == item_id)

    def _drop(self, response_id: str) -> None:
        stored = self._responses.pop(response_id)
        self.num_bytes -= stored.num_bytes
        for item_id in stored.item_ids:
            if self._items.get((stored.owner, item_id)) == response_id:
                del self._items[stored.owner, item_id]
