# Sourced by the scripts here, from the repository root: installs any wheels found in .whl/
# (for a CUDA machine without network access to a package index; `python3 -m pip download`
# fills it elsewhere) into /tmp/site and puts it and the repository on PYTHONPATH; with no
# wheels, the repository alone. Returns 2 when the install fails.
if ls .whl/*.whl >/dev/null 2>&1; then
  "${PYTHON:-python3}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || return 2
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
