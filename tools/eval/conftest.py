import glob
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))

# Tests import the package from tools/eval whatever directory pytest is started from.
sys.path.insert(0, _HERE)
# The codec binding, when CMake has built it: $PROXIMA_BUILD_DIR (default <repo>/build).
_build = os.environ.get("PROXIMA_BUILD_DIR", os.path.join(_ROOT, "build"))
for _so in glob.glob(os.path.join(_build, "tools", "eval", "proxima_codec_py*.so"))[:1]:
    sys.path.insert(0, os.path.dirname(_so))
for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "2")
