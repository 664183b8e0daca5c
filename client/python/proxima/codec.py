"""The STAR-KV block codec (kernels/codec.h): tools/eval's proxima_codec_py module, built from
tools/eval/codec_binding.cc and installed inside this package."""
from .proxima_codec_py import *  # noqa: F401,F403
