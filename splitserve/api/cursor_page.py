"""OpenAI's cursor pages (`/v1/files`, `/v1/batches`, a response's input items): `limit` objects
after the one with id `after`, and whether more follow."""
from __future__ import annotations

from splitserve.api.errors import RequestError


def in_order(newest_first: list[dict], order: str) -> list[dict]:
    """The objects in a list's `order`: "desc" (newest first) or "asc"."""
    if order not in ("asc", "desc"):
        raise RequestError(f"order must be 'asc' or 'desc', got {order!r}", param="order")
    return newest_first[::-1] if order == "asc" else newest_first


def cursor_page(objects: list[dict], limit: int, after: str | None, most: int) -> dict:
    """OpenAI's cursor page: up to `limit` (1 to `most`) objects after the one with id `after`."""
    if not 1 <= limit <= most:
        raise RequestError(f"limit must be between 1 and {most}, got {limit}", param="limit")
    if after is not None:
        ids = [item["id"] for item in objects]
        if after not in ids:
            raise RequestError(f"after: no object {after!r} in this list (deleted, or expired?)", param="after")
        objects = objects[ids.index(after) + 1:]
    page = objects[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(objects) > limit}
