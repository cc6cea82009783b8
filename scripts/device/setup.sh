# Source on the GPU machine, from the repository root: installs the carried wheels (.whl/,
# see fetch_wheels.sh) beside the machine's torch into /tmp/site, puts the checkout and them
# on PYTHONPATH, and prints the card and the versions every result must name.
if ! ls .whl/*.whl > /dev/null 2>&1; then
  echo "no wheels in .whl/: run scripts/device/fetch_wheels.sh here and carry .whl" >&2
  return 2 2> /dev/null || exit 2
fi
pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader
python3 -c "import torch, triton, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__)"
echo "tree $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
