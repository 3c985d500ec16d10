"""The Kubernetes API as this project uses it: credentials, retried JSON calls, watch streams."""
