"""Many processes: Ray Serve replicas and ingress, prefix routing, prefill/decode disaggregation."""
