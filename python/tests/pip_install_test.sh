#!/usr/bin/env bash
# make test's check of `pip install ./python` (issue #43), as a user of SGLang or vLLM runs it:
#   python/tests/pip_install_test.sh BUILD_DIR [PYTHON]
# A fresh virtualenv (--system-site-packages: numpy and torch from Debian), then
# `pip install --no-build-isolation --no-index ./python` reusing BUILD_DIR (PDLIB_CMAKE_BUILD_DIR:
# only an up-to-date check of the extension, no second build), then from outside the source tree:
# the imports, the SGLang entry point, the run-time libraries (python/tools/wheel_deps.py) and one
# two-process transfer (examples/python/run_pair.py) from that install alone.
set -euo pipefail
build=$(cd "$1" && pwd)
python=${2:-/usr/bin/python3}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
venv=$build/pip-venv
rm -rf "$venv"
"$python" -m venv --system-site-packages "$venv"
echo "pip_install_test: venv $venv"
cd "$root"
PDLIB_CMAKE_BUILD_DIR=$build "$venv/bin/pip" install --no-build-isolation --no-index --no-deps \
  --disable-pip-version-check --no-cache-dir ./python 2>&1 | tail -n 3
cd "$venv"  # nothing of the source tree on sys.path from here on
unset PYTHONPATH
where=$("$venv/bin/python" -c 'import pdlib; print(pdlib.__file__)')
echo "pip_install_test: pdlib imported from $where"
case $where in
  "$venv"/*) ;;
  *) echo "pip_install_test: FAIL: pdlib came from outside the virtualenv" >&2; exit 1 ;;
esac
"$venv/bin/python" - "$root" <<'PY'
import importlib.metadata as md
import sys

root = sys.argv[1]
import pdlib, pdlib.sglang  # noqa: E401

# pdlib.vllm needs vLLM: the replay's stand-in of its connector API (python/tests/vllm_standin).
sys.path.insert(0, root + "/python/tests/vllm_standin")
import pdlib.vllm  # noqa: E402,F401

version = md.version("pdlib")
plugins = [e for e in md.entry_points(group="sglang.srt.plugins") if e.name == "pdlib"]
assert plugins, "no sglang.srt.plugins entry point named pdlib"
assert plugins[0].value == "pdlib.sglang_plugin:register", plugins[0].value
register = plugins[0].load()
assert callable(register)
print(f"pip_install_test: pdlib {version}, backends {pdlib.list_backends()}, "
      f"entry point {plugins[0].value}")
PY
"$venv/bin/python" "$root/python/tools/wheel_deps.py"
"$venv/bin/python" "$root/examples/python/run_pair.py" --requests 8 --timeout 120
echo "pip_install_test: OK"
