"""The cluster configuration schema (no Ray): what a deployment, the Serve builder, the helm
chart and the simulator all read."""
from splitserve.config.cluster import APP_IMPORT_PATH, ClusterConfig, load_cluster_config
from splitserve.config.options import PoolConfig

__all__ = ["APP_IMPORT_PATH", "ClusterConfig", "PoolConfig", "load_cluster_config"]
