"""Data: checked h5 latent files, the manifest, random-window datasets and their batch sampler."""

from lwm.data.h5 import DataError, H5Info, inspect_h5
from lwm.data.manifest import Manifest, ManifestEntry, index_directory
from lwm.data.windows import FileBatchSampler, H5WindowDataset

__all__ = [
    "DataError", "H5Info", "inspect_h5", "Manifest", "ManifestEntry", "index_directory",
    "FileBatchSampler", "H5WindowDataset",
]
