#!/usr/bin/env bash
# Downloads into .whl/ the wheels a GPU image with JAX, transformers and torch lacks for `jaxspec serve` (its HTTP
# stack and metrics; every other command imports none of them): Python 3.12, manylinux x86_64, no dependencies
# resolved (the list is the closure over what such an image has). scripts/device_check.sh installs them with
# pip --no-index into /tmp/site when .whl/ exists. Pins follow the project's tested environment; ~3.7 MB
# (WITH_OPTIONAL=1 adds llguidance and gguf: ~6.9 MB).
# Usage: [WITH_OPTIONAL=1] scripts/fetch_device_wheels.sh [DIR] (default .whl), from the repository root, with PyPI.
set -euo pipefail
dir=${1:-.whl}
py=${PYTHON:-python3}
packages=(
  fastapi==0.165.0 starlette==1.10.0 anyio==4.16.0 annotated-doc==0.0.7       # jaxspec serve: the HTTP app
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
  uvicorn==0.54.0 h11==0.16.0 click==8.5.1                                    # serve: the ASGI server
  prometheus-client==0.26.0 opentelemetry-api==1.45.2                         # /metrics; fastapi's requirement
)
# Loaded only where used, so left out by default (the 64 MiB tree is tight): structured output's grammar masks
# (llguidance, 3 MB, manylinux_2_31: glibc >= 2.31) and GGUF checkpoints (gguf; the default LLM's GGUF cannot travel).
[ "${WITH_OPTIONAL:-0}" = 1 ] && packages+=(llguidance==1.9.1 gguf==0.19.0)
mkdir -p "$dir"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$dir" "${packages[@]}"
du -sh "$dir"
ls "$dir"
