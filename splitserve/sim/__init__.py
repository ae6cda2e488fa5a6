"""Event-driven cluster simulator: the engine's own schedulers and the cluster's own placement, driven by performance models."""
