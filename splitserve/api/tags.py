"""Tags in streamed text (`<think>`, `<tool_call>`, a stop string): a piece may end inside one."""
from __future__ import annotations


def tag_prefix_at_end(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (0 if none): held back while
    streaming until the next piece tells whether it is the tag."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
