#!/usr/bin/env bash
# Wheels of what lwm needs and this project's GPU image lacks (it has torch, lightning, einops, h5py, rich,
# torchmetrics, matplotlib, imageio; not omegaconf, jsonargparse, deepspeed, PyAV), for its Python 3.12, into
# .whl/ (about 40 MB), at the versions `make` installs here. benchmarks/gpu.sh installs every wheel in .whl/ (into
# a folder ahead of the image's site-packages on PYTHONPATH, so a newer typing-extensions here wins):
#
#   benchmarks/gpu_wheels.sh              # on a machine with pip's index, once
#   echo /.whl/ >> .git/info/exclude      # keep them out of git; carry .whl with each GPU call
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=(${PYTHON:-.venv/bin/python} -m pip)
version() { "${PIP[@]}" show "$1" 2>/dev/null | sed -n 's/^Version: //p'; }
# jsonargparse and its config parsing; omegaconf; PyAV; DeepSpeed's imports (msgpack, psutil; py-cpuinfo and
# ninja on first use), pydantic with what it needs (typing-extensions >= 4.16, newer than the image's).
pins=()
for name in omegaconf jsonargparse docstring-parser typeshed-client hjson pydantic pydantic-core annotated-types \
            typing-inspection typing-extensions av msgpack psutil py-cpuinfo ninja; do
    v=$(version "$name")
    pins+=("$name${v:+==$v}")
done
mkdir -p .whl
"${PIP[@]}" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${pins[@]}"
# DeepSpeed publishes a source archive only: built here as a pure-Python wheel (its CUDA ops are compiled on first
# use, where needed; ZeRO stage 2 with lwm's fused torch AdamW needs none). Its build imports torch.
v=$(version deepspeed)
"${PIP[@]}" wheel -q --no-deps --no-build-isolation -w .whl "deepspeed${v:+==$v}"
ls -la .whl
