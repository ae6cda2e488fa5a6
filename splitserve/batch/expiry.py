"""OpenAI's expiration policy for files (`expires_after` on an upload, `output_expires_after` on a
batch): `{"anchor": "created_at", "seconds": N}`, N from one hour to 30 days."""
from __future__ import annotations

from splitserve.api.errors import RequestError

MIN_S, MAX_S = 3600, 30 * 24 * 3600


def expiry_seconds(policy: object, param: str) -> int | None:
    """The policy's seconds after the file's creation (None without a policy), or a RequestError
    naming the field. `seconds` may be a decimal string: a multipart form sends it so."""
    if policy is None:
        return None
    if not isinstance(policy, dict):
        raise RequestError(f"{param} must be an object with anchor and seconds", param=param)
    if policy.get("anchor") != "created_at":
        raise RequestError(f"{param}.anchor must be 'created_at', got {policy.get('anchor')!r}",
                           param=f"{param}.anchor")
    raw = policy.get("seconds")
    seconds = raw if isinstance(raw, int) and not isinstance(raw, bool) else None
    if isinstance(raw, str) and raw.strip().isascii() and raw.strip().isdigit():
        seconds = int(raw)
    if seconds is None or not MIN_S <= seconds <= MAX_S:
        raise RequestError(f"{param}.seconds must be an integer from {MIN_S} (1 hour) to {MAX_S} (30 days), "
                           f"got {raw!r}", param=f"{param}.seconds")
    return seconds
