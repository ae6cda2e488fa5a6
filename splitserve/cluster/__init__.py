"""Ray layer: workers, the cluster-level scheduler, the OpenAI ingress."""
