// proxima_codec_py: the STAR-KV codec (kernels/codec.h) and its shared reconstruction-error
// measure (kernels/error_metrics.h) for tools/eval, which round-trips real model KV through the
// exact bytes the daemon would store. Thin by design: decode the arguments, call the kernels,
// convert a non-OK absl::Status into a Python exception at this edge (ValueError for
// kInvalidArgument, RuntimeError otherwise).
//
// Blocks are numpy uint16 arrays of bf16 bit patterns shaped [layer][2][token][head][dim].
// Thread-safety: the kernels are pure; the GIL is released around encode/decode.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kernels/codec.h"
#include "kernels/error_metrics.h"

namespace py = pybind11;

namespace proxima::codec {
namespace {

using BlockArray = py::array_t<uint16_t, py::array::c_style | py::array::forcecast>;

void ThrowIfError(const absl::Status& status) {
  if (status.ok()) return;
  const std::string what(status.ToString());
  if (status.code() == absl::StatusCode::kInvalidArgument) throw py::value_error(what);
  throw std::runtime_error(what);
}

BlockGeometry GeometryOf(const std::vector<py::ssize_t>& shape) {
  if (shape.size() != 5 || shape[1] != 2) {
    throw py::value_error("block must be shaped [layer][2][token][head][dim]");
  }
  BlockGeometry g;
  g.num_layers = static_cast<uint32_t>(shape[0]);
  g.tokens_per_block = static_cast<uint32_t>(shape[2]);
  g.num_kv_heads = static_cast<uint32_t>(shape[3]);
  g.head_dim = static_cast<uint32_t>(shape[4]);
  g.dtype = DType::kBf16;
  ThrowIfError(g.Validate());
  return g;
}

std::vector<py::ssize_t> ShapeOf(const BlockArray& a) {
  return std::vector<py::ssize_t>(a.shape(), a.shape() + a.ndim());
}

// Byte size from the element count: Debian's pybind11 2.10 reads the dtype's item size with the
// numpy 1 struct layout, so array::nbytes()/itemsize() return 0 under numpy 2.
size_t ByteSize(const BlockArray& a) { return static_cast<size_t>(a.size()) * sizeof(uint16_t); }

std::span<const std::byte> BytesOf(const BlockArray& a) {
  return {reinterpret_cast<const std::byte*>(a.data()), ByteSize(a)};
}

// Encodes one bf16 block with a plan in ParseCodecPlan's text form; returns the encoded bytes.
py::bytes Encode(const BlockArray& block, const std::string& plan_text, bool is_first_block) {
  const BlockGeometry geometry = GeometryOf(ShapeOf(block));
  absl::StatusOr<CodecPlan> plan = ParseCodecPlan(plan_text);
  ThrowIfError(plan.status());
  std::string out;
  absl::Status status;
  {
    py::gil_scoped_release release;
    status = EncodeBlock(geometry, *plan, is_first_block, BytesOf(block), {}, &out);
  }
  ThrowIfError(status);
  return py::bytes(out);
}

// Decodes an encoded block into a new uint16 array of `shape` ([L][2][T][H][D]).
BlockArray Decode(const py::bytes& encoded, const std::vector<py::ssize_t>& shape) {
  GeometryOf(shape);  // validates the shape
  const std::string_view view(encoded);
  BlockArray out(shape);
  absl::Status status;
  {
    py::gil_scoped_release release;
    status = DecodeBlock(std::span<const std::byte>(
                             reinterpret_cast<const std::byte*>(view.data()), view.size()),
                         std::span<std::byte>(reinterpret_cast<std::byte*>(out.mutable_data()),
                                              ByteSize(out)));
  }
  ThrowIfError(status);
  return out;
}

py::dict MeasureError(const BlockArray& original, const BlockArray& reconstructed,
                      uint32_t num_probes) {
  const std::vector<py::ssize_t> shape = ShapeOf(original);
  if (shape != ShapeOf(reconstructed)) throw py::value_error("shape mismatch");
  absl::StatusOr<ErrorSums> sums =
      MeasureBlockError(GeometryOf(shape), BytesOf(original), BytesOf(reconstructed), num_probes);
  ThrowIfError(sums.status());
  py::dict d;
  d["k_err"] = sums->k_err;
  d["k_ref"] = sums->k_ref;
  d["v_err"] = sums->v_err;
  d["v_ref"] = sums->v_ref;
  d["attn_err"] = sums->attn_err;
  d["attn_ref"] = sums->attn_ref;
  return d;
}

std::vector<std::string> CodecNames() {
  std::vector<std::string> names;
  for (int i = 0; i < kNumCodecs; ++i) {
    names.emplace_back(CodecName(static_cast<CodecId>(i)));
  }
  return names;
}

std::string CanonicalPlan(const std::string& plan_text) {
  absl::StatusOr<CodecPlan> plan = ParseCodecPlan(plan_text);
  ThrowIfError(plan.status());
  return plan->ToString();
}

std::vector<std::string> LayerCodecs(const std::string& plan_text, uint32_t num_layers,
                                     bool is_first_block) {
  absl::StatusOr<CodecPlan> plan = ParseCodecPlan(plan_text);
  ThrowIfError(plan.status());
  std::vector<std::string> out;
  for (uint32_t l = 0; l < num_layers; ++l) {
    out.emplace_back(CodecName(plan->CodecFor(l, is_first_block)));
  }
  return out;
}

}  // namespace
}  // namespace proxima::codec

PYBIND11_MODULE(proxima_codec_py, m) {
  namespace pc = proxima::codec;
  m.doc() = "STAR-KV codec round trip and reconstruction-error measure for tools/eval";
  m.def("encode_block", &pc::Encode, py::arg("block"), py::arg("plan"),
        py::arg("is_first_block"));
  m.def("decode_block", &pc::Decode, py::arg("encoded"), py::arg("shape"));
  m.def("measure_block_error", &pc::MeasureError, py::arg("original"),
        py::arg("reconstructed"), py::arg("num_probes") = pc::kDefaultProbeQueries);
  m.def("codec_names", &pc::CodecNames);
  m.def("canonical_plan", &pc::CanonicalPlan, py::arg("plan"));
  m.def("layer_codecs", &pc::LayerCodecs, py::arg("plan"), py::arg("num_layers"),
        py::arg("is_first_block"));
}
