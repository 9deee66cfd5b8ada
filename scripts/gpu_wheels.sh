#!/usr/bin/env bash
# The wheels batchgen needs on the lent GPU machine beyond what its image holds (Python 3.12, torch 2.11 cu130,
# transformers 5.17, pyarrow, pandas, tqdm, fsspec, filelock, pyyaml, jinja2, xxhash, attrs, matplotlib, pytest),
# into .whl/ (ignored by git; carried to the machine by the device tool). scripts/gpu_check.sh installs them there.
# Usage: bash scripts/gpu_wheels.sh    (then: du -sh .whl; the device tool carries 64 MiB at most)
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
          "${PLAT[@]}" -d .whl "$@"; }
# the config layer (antlr4's runtime is an sdist only: built here, pure Python)
get hydra-core==1.3.2 omegaconf==2.3.0
python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
# datasets and what it needs beyond the image
get datasets dill multiprocess
# constraints: xgrammar (compiled) and what it imports beyond the image (apache-tvm-ffi, pydantic and its stack), at the
# versions the CPU tests run (pydantic pins pydantic-core exactly); jsonschema and its referencing stack
get xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 jsonschema jsonschema-specifications referencing rpds-py
# quantization on CUDA: torchao (int8, int4); bitsandbytes only if it fits beside the rest
get torchao
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}" \
  --platform manylinux_2_24_x86_64 -d "$tmp" "bitsandbytes>=0.48" 2>/dev/null || true
if [ -n "$(ls "$tmp")" ] && [ $(( $(du -sm .whl | cut -f1) + $(du -sm "$tmp" | cut -f1) )) -le 60 ]; then
  mv "$tmp"/*.whl .whl/
else
  echo "bitsandbytes left out: $(du -sh "$tmp" | cut -f1) beside the rest would pass the 64 MiB the device tool carries"
fi
rm -rf "$tmp"
du -sh .whl && ls .whl
