"""Image generation with diffusers: the request checks, the pipeline wrapper and the backend's server. The images a
vision-language model is given to read are runlm.models.vision's."""
