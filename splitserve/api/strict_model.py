"""The pydantic settings every request model shares."""
from pydantic import ConfigDict

# Strict: JSON types must match ("16" is not an integer, true is not 1); an integer is still a valid float.
STRICT = ConfigDict(extra="forbid", strict=True)
