"""Image generation with diffusers: the request checks, the pipeline wrapper and the backend's server."""
