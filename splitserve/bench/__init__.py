"""Load generation and reports; talks to a server over HTTP only."""
