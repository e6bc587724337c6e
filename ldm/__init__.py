"""ldm: the latent diffusion models and their weights (Stable Diffusion layout)."""
