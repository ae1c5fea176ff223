# Source from the project's root on the lent GPU machine (run's carry: [".device"]): luisa-python from
# ../shared/device/prepare.sh's .device/env.sh, the pure-Python dependencies the machine lacks
# (safetensors, platformdirs, filelock, tqdm, jinja2) from wheels in .device/wheels, and the package
# laid out as `pip install -e .` maps it (operators/, shaders/, opsets/ inside luisaml/) under /tmp/lm.
# The wheels, once, on this side (the machine has no internet):
#   mkdir -p .device/wheels && python3 -m pip download -d .device/wheels --only-binary=:all: \
#     --python-version 3.12 --implementation cp --platform manylinux_2_17_x86_64 --platform any \
#     safetensors platformdirs filelock tqdm jinja2 markupsafe
source .device/env.sh
if ls .device/wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/deps .device/wheels/*.whl 2>&1 | grep -v WARNING | tail -3
  export PYTHONPATH=$PYTHONPATH:/tmp/deps
fi
rm -rf /tmp/lm && mkdir -p /tmp/lm && cp -rs "$PWD/luisaml" /tmp/lm/luisaml
for d in operators shaders opsets; do ln -sfn "$PWD/$d" "/tmp/lm/luisaml/$d"; done
export PYTHONPATH=/tmp/lm:$PYTHONPATH   # run python with -P so that the checkout does not shadow /tmp/lm
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
