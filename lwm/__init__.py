"""lwm: latent world models from unlabeled video latents (PyTorch Lightning)."""

__version__ = "0.1.0"
