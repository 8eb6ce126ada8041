"""Data: checked h5 latent files, the manifest, random-window datasets and their batch sampler."""
