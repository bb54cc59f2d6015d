"""Models as OCI artifacts: Docker Model Runner's media types, registry references, the distribution protocol."""
