#!/usr/bin/env bash
# Packs what a bare GPU machine's Python 3.12 image (PyTorch, NumPy, SciPy, aiohttp, ... but no
# Ray, pydantic or FastAPI) lacks to run dptune: this venv's versions of the packages below, as
# cp312 manylinux wheels unpacked into one tree, Ray's Java jars, RLlib and LLM code left out,
# xz-compressed into .gpu/site.tar.xz (a device call carries at most 64 MiB, so it must stay under).
#
#     bash bench/device/pack.sh        # needs pip and the package index; writes .gpu/
#
# bench/device/run.sh unpacks it on the device machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
PACKAGES="absl-py aiohttp-cors alembic annotated-types cffi colorful cryptography distlib dm-tree
dp-accounting fastapi fastapi-offline google-api-core google-auth googleapis-common-protos grpcio jsonschema
jsonschema-specifications mako mnist1d msgspec opacus opencensus opencensus-context
opentelemetry-api opentelemetry-exporter-prometheus opentelemetry-proto opentelemetry-sdk
opentelemetry-semantic-conventions platformdirs proto-plus protobuf py-spy pyasn1 pyasn1-modules
psutil pytest pluggy iniconfig pytest-timeout pycparser pydantic pydantic-core pydantic-settings python-discovery python-dotenv randomgen ray
referencing rpds-py smart-open sqlalchemy starlette tensorboardx typing-extensions
typing-inspection tzdata uvicorn virtualenv"
pins=$(.venv/bin/python - $PACKAGES <<'PY'
import importlib.metadata as md, sys
print(" ".join(f"{n}=={md.version(n)}" for n in sys.argv[1:]))
PY
)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
platforms=""
for p in manylinux_2_35 manylinux_2_34 manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
  platforms+=" --platform ${p}_x86_64"
done
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp $platforms -d "$work/wheels" $pins
mkdir "$work/site"
for wheel in "$work"/wheels/*.whl; do unzip -q -o "$wheel" -d "$work/site"; done
rm -rf "$work"/site/ray/{jars,rllib,llm,cpp}
find "$work/site" -name "*.pyi" -delete
mkdir -p .gpu
tar cf - -C "$work/site" . | xz -T0 -6 > .gpu/site.tar.xz
ls -l .gpu/site.tar.xz
