#include "proto/wire.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/crc32c.h"

namespace proxima::wire {
namespace {

// Field tags of proxima.v1.GetResponse / GetResult (field_number << 3 | wire_type).
constexpr uint8_t kResultsTag = (1 << 3) | 2;  // repeated GetResult results = 1
constexpr uint8_t kFoundTag = (1 << 3) | 0;    // bool found = 1
constexpr uint8_t kDataTag = (2 << 3) | 2;     // bytes data = 2
constexpr uint8_t kCrcTag = (3 << 3) | 5;      // fixed32 crc32c = 3
constexpr uint8_t kLevelTag = (4 << 3) | 0;    // uint32 level = 4

void PutVarint(std::string* out, uint64_t v) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

size_t VarintSize(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

void ReleaseKeepAlive(void* p) { delete static_cast<std::shared_ptr<const void>*>(p); }

// Reads a byte stream spread over slices, never past its end.
class SliceReader {
 public:
  explicit SliceReader(const std::vector<grpc::Slice>& slices) : slices_(slices) { Settle(); }
  SliceReader(const std::vector<grpc::Slice>& slices, size_t index, size_t offset)
      : slices_(slices), index_(index), offset_(offset) {
    Settle();
  }

  size_t slice_index() const { return index_; }
  size_t slice_offset() const { return offset_; }

  bool ReadFixed64(uint64_t* v) {
    uint32_t lo, hi;
    if (!ReadFixed32(&lo) || !ReadFixed32(&hi)) return false;
    *v = lo | (static_cast<uint64_t>(hi) << 32);
    return true;
  }

  bool ReadString(uint64_t n, std::string* out) {
    out->clear();
    while (n > 0) {
      if (done()) return false;
      const grpc::Slice& s = slices_[index_];
      size_t len = static_cast<size_t>(std::min<uint64_t>(n, s.size() - offset_));
      out->append(reinterpret_cast<const char*>(s.begin() + offset_), len);
      Advance(len);
      n -= len;
    }
    return true;
  }

  // CRC32C of the next n bytes, consuming them.
  bool Crc(uint64_t n, uint32_t* crc) {
    while (n > 0) {
      if (done()) return false;
      const grpc::Slice& s = slices_[index_];
      size_t len = static_cast<size_t>(std::min<uint64_t>(n, s.size() - offset_));
      *crc = Crc32cExtend(*crc, std::as_bytes(std::span(s.begin() + offset_, len)));
      Advance(len);
      n -= len;
    }
    return true;
  }

  uint64_t position() const { return position_; }
  bool done() const { return index_ == slices_.size(); }

  bool ReadByte(uint8_t* b) {
    if (done()) return false;
    *b = slices_[index_].begin()[offset_];
    Advance(1);
    return true;
  }

  bool ReadVarint(uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t b;
      if (!ReadByte(&b)) return false;
      *v |= static_cast<uint64_t>(b & 0x7F) << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;  // over 10 bytes: malformed
  }

  bool ReadFixed32(uint32_t* v) {
    uint8_t b[4];
    for (uint8_t& x : b) {
      if (!ReadByte(&x)) return false;
    }
    *v = b[0] | (b[1] << 8) | (b[2] << 16) | (static_cast<uint32_t>(b[3]) << 24);
    return true;
  }

  // Copies n bytes into dst (or skips them when dst is null), extending *crc over them.
  bool Copy(std::byte* dst, uint64_t n, uint32_t* crc) {
    while (n > 0) {
      if (done()) return false;
      const grpc::Slice& s = slices_[index_];
      size_t len = static_cast<size_t>(std::min<uint64_t>(n, s.size() - offset_));
      auto src = std::as_bytes(std::span(s.begin() + offset_, len));
      if (dst != nullptr) {
        *crc = Crc32cCopy(std::span(dst, len), src, *crc);
        dst += len;
      }
      Advance(len);
      n -= len;
    }
    return true;
  }

  bool Skip(uint64_t n) { return Copy(nullptr, n, nullptr); }

  bool CopyPlain(std::byte* dst, uint64_t n) {
    while (n > 0) {
      if (done()) return false;
      const grpc::Slice& s = slices_[index_];
      size_t len = static_cast<size_t>(std::min<uint64_t>(n, s.size() - offset_));
      std::memcpy(dst, s.begin() + offset_, len);
      dst += len;
      Advance(len);
      n -= len;
    }
    return true;
  }

 private:
  void Advance(size_t n) {
    offset_ += n;
    position_ += n;
    Settle();
  }
  void Settle() {
    while (index_ < slices_.size() && offset_ == slices_[index_].size()) {
      ++index_;
      offset_ = 0;
    }
  }

  const std::vector<grpc::Slice>& slices_;
  size_t index_ = 0;
  size_t offset_ = 0;
  uint64_t position_ = 0;
};

bool SkipField(SliceReader& r, uint64_t tag) {
  uint64_t v;
  switch (tag & 7) {
    case 0:
      return r.ReadVarint(&v);
    case 1:
      return r.Skip(8);
    case 2:
      return r.ReadVarint(&v) && r.Skip(v);
    case 5:
      return r.Skip(4);
    default:
      return false;  // groups (3, 4) and reserved types never appear in proxima.v1
  }
}

absl::Status Malformed(const char* what, uint64_t position) {
  return absl::InternalError(
      absl::StrCat("malformed GetResponse from proximad: ", what, " at byte ", position));
}

}  // namespace

void GetResponseWriter::AddMiss() {
  pending_.push_back(static_cast<char>(kResultsTag));
  pending_.push_back(0);  // empty GetResult: found = false
}

void GetResponseWriter::AddHit(std::span<const std::byte> data, uint32_t crc32c,
                               std::shared_ptr<const void> keep_alive, uint32_t level) {
  const uint64_t inner = 2 + 1 + VarintSize(data.size()) + data.size() + 5 +
                         (level > 0 ? 1 + VarintSize(level) : 0);
  pending_.push_back(static_cast<char>(kResultsTag));
  PutVarint(&pending_, inner);
  pending_.push_back(static_cast<char>(kFoundTag));
  pending_.push_back(1);
  pending_.push_back(static_cast<char>(kDataTag));
  PutVarint(&pending_, data.size());
  slices_.emplace_back(pending_.data(), pending_.size());  // copies the few header bytes
  pending_.clear();
  slices_.emplace_back(const_cast<std::byte*>(data.data()), data.size(), &ReleaseKeepAlive,
                       new std::shared_ptr<const void>(std::move(keep_alive)));
  pending_.push_back(static_cast<char>(kCrcTag));
  for (int i = 0; i < 4; ++i) pending_.push_back(static_cast<char>(crc32c >> (8 * i)));
  if (level > 0) {
    pending_.push_back(static_cast<char>(kLevelTag));
    PutVarint(&pending_, level);
  }
}

grpc::ByteBuffer GetResponseWriter::Finish() {
  if (!pending_.empty()) slices_.emplace_back(pending_.data(), pending_.size());
  pending_.clear();
  grpc::ByteBuffer buffer(slices_.data(), slices_.size());
  slices_.clear();
  return buffer;
}

absl::Status ParseGetResponse(const grpc::ByteBuffer& buffer,
                              std::span<const std::span<std::byte>> out,
                              std::vector<GetResult>* results) {
  std::vector<grpc::Slice> slices;
  if (buffer.Valid() && !buffer.Dump(&slices).ok()) {
    return absl::InternalError("cannot read GetResponse buffer");
  }
  SliceReader r(slices);
  std::vector<GetResult> parsed;
  parsed.reserve(out.size());
  while (!r.done()) {
    uint64_t tag;
    if (!r.ReadVarint(&tag)) return Malformed("truncated tag", r.position());
    if (tag != kResultsTag) {
      if (!SkipField(r, tag)) return Malformed("bad field", r.position());
      continue;
    }
    uint64_t len;
    if (!r.ReadVarint(&len)) return Malformed("truncated result length", r.position());
    const uint64_t end = r.position() + len;
    const size_t i = parsed.size();
    if (i >= out.size()) return Malformed("more results than keys", r.position());
    GetResult result;
    bool have_data = false, have_crc = false;
    uint32_t data_crc = 0, sent_crc = 0;
    uint64_t data_len = 0;
    while (r.position() < end) {
      uint64_t t, v;
      if (!r.ReadVarint(&t)) return Malformed("truncated result field", r.position());
      if (t == kFoundTag) {
        if (!r.ReadVarint(&v)) return Malformed("truncated found", r.position());
        result.found = v != 0;
      } else if (t == kDataTag) {
        if (!r.ReadVarint(&data_len) || r.position() + data_len > end) {
          return Malformed("bad data length", r.position());
        }
        data_crc = 0;
        if (data_len == out[i].size()) {
          if (!r.Copy(out[i].data(), data_len, &data_crc)) {
            return Malformed("truncated data", r.position());
          }
          have_data = true;
        } else if (!r.Skip(data_len)) {
          return Malformed("truncated data", r.position());
        }
      } else if (t == kCrcTag) {
        if (!r.ReadFixed32(&sent_crc)) return Malformed("truncated crc32c", r.position());
        have_crc = true;
      } else if (!SkipField(r, t)) {
        return Malformed("bad result field", r.position());
      }
    }
    if (r.position() != end) return Malformed("result overruns its length", r.position());
    result.intact = result.found && have_data && have_crc && data_crc == sent_crc;
    parsed.push_back(result);
  }
  if (parsed.size() != out.size()) {
    return absl::InternalError(absl::StrCat("proximad answered ", parsed.size(),
                                            " results for ", out.size(), " keys"));
  }
  *results = std::move(parsed);
  return absl::OkStatus();
}

namespace {

// Field tags of proxima.v1.PutRequest / PutBlock.
constexpr uint8_t kNamespaceTag = (1 << 3) | 2;  // string namespace_name = 1
constexpr uint8_t kProfileTag = (2 << 3) | 1;    // fixed64 profile_id = 2
constexpr uint8_t kBlocksTag = (3 << 3) | 2;     // repeated PutBlock blocks = 3
constexpr uint8_t kKeyTag = (1 << 3) | 2;        // bytes key = 1
constexpr uint8_t kBlockDataTag = (2 << 3) | 2;  // bytes data = 2
constexpr uint8_t kBlockCrcTag = (3 << 3) | 5;   // optional fixed32 crc32c = 3
constexpr uint8_t kPositionTag = (4 << 3) | 0;   // optional uint32 position = 4
constexpr uint8_t kPriorityTag = (4 << 3) | 0;   // PutRequest: Priority priority = 4
constexpr uint8_t kFormatTag = (4 << 3) | 0;     // GetRequest: BlockFormat format = 4

// PutRequest fields are small (keys, names) except the block data; the key of a block is
// bounded here so a hostile message cannot make the parser allocate much.
constexpr uint64_t kMaxKeyBytes = 1024;

absl::Status BadPut(const char* what, uint64_t position) {
  return absl::InvalidArgumentError(
      absl::StrCat("PutRequest is not a well-formed proxima.v1.PutRequest: ", what, " at byte ",
                   position));
}

}  // namespace

grpc::ByteBuffer EncodePutRequest(const std::string& namespace_name, uint64_t profile_id,
                                  std::span<const std::array<uint8_t, 32>> keys,
                                  std::span<const std::span<const std::byte>> blocks,
                                  std::span<const int64_t> positions, bool high_priority) {
  std::vector<grpc::Slice> slices;
  std::string head;
  if (high_priority) {
    head.push_back(static_cast<char>(kPriorityTag));
    head.push_back(1);
  }
  head.push_back(static_cast<char>(kNamespaceTag));
  PutVarint(&head, namespace_name.size());
  head += namespace_name;
  head.push_back(static_cast<char>(kProfileTag));
  for (int i = 0; i < 8; ++i) head.push_back(static_cast<char>(profile_id >> (8 * i)));
  for (size_t b = 0; b < blocks.size(); ++b) {
    const uint64_t data = blocks[b].size();
    const bool has_position = b < positions.size() && positions[b] >= 0;
    const uint64_t position = has_position ? static_cast<uint64_t>(positions[b]) : 0;
    const uint64_t inner = 2 + 32 + 1 + VarintSize(data) + data + 5 +
                           (has_position ? 1 + VarintSize(position) : 0);
    head.push_back(static_cast<char>(kBlocksTag));
    PutVarint(&head, inner);
    head.push_back(static_cast<char>(kKeyTag));
    head.push_back(32);
    head.append(reinterpret_cast<const char*>(keys[b].data()), 32);
    head.push_back(static_cast<char>(kBlockDataTag));
    PutVarint(&head, data);
    slices.emplace_back(head.data(), head.size());
    head.clear();
    grpc_slice owned = grpc_slice_malloc(data);
    uint32_t crc = Crc32cCopy(
        std::as_writable_bytes(std::span(GRPC_SLICE_START_PTR(owned), data)), blocks[b]);
    slices.emplace_back(owned, grpc::Slice::STEAL_REF);
    head.push_back(static_cast<char>(kBlockCrcTag));
    for (int i = 0; i < 4; ++i) head.push_back(static_cast<char>(crc >> (8 * i)));
    if (has_position) {
      head.push_back(static_cast<char>(kPositionTag));
      PutVarint(&head, position);
    }
  }
  slices.emplace_back(head.data(), head.size());
  return grpc::ByteBuffer(slices.data(), slices.size());
}

absl::Status PutRequestReader::Parse(const grpc::ByteBuffer& buffer, size_t max_blocks) {
  slices_.clear();
  blocks_.clear();
  namespace_name_.clear();
  profile_id_ = 0;
  priority_ = 0;
  if (buffer.Valid() && !buffer.Dump(&slices_).ok()) {
    return absl::InternalError("cannot read PutRequest buffer");
  }
  SliceReader r(slices_);
  while (!r.done()) {
    uint64_t tag, len;
    if (!r.ReadVarint(&tag)) return BadPut("truncated tag", r.position());
    if (tag == kNamespaceTag) {
      if (!r.ReadVarint(&len) || len > kMaxKeyBytes || !r.ReadString(len, &namespace_name_)) {
        return BadPut("bad namespace_name", r.position());
      }
    } else if (tag == kProfileTag) {
      if (!r.ReadFixed64(&profile_id_)) return BadPut("truncated profile_id", r.position());
    } else if (tag == kPriorityTag) {
      uint64_t v;
      if (!r.ReadVarint(&v)) return BadPut("truncated priority", r.position());
      priority_ = static_cast<uint32_t>(v);
    } else if (tag == kBlocksTag) {
      if (blocks_.size() == max_blocks) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "Put has more than ", max_blocks, " blocks; the limit is ", max_blocks, " per call"));
      }
      if (!r.ReadVarint(&len)) return BadPut("truncated block length", r.position());
      const uint64_t end = r.position() + len;
      Block block;
      bool have_data = false;
      while (r.position() < end) {
        uint64_t t, n;
        if (!r.ReadVarint(&t)) return BadPut("truncated block field", r.position());
        if (t == kKeyTag) {
          if (!r.ReadVarint(&n) || n > kMaxKeyBytes || r.position() + n > end ||
              !r.ReadString(n, &block.key)) {
            return BadPut("bad key", r.position());
          }
        } else if (t == kBlockDataTag) {
          if (!r.ReadVarint(&n) || r.position() + n > end) {
            return BadPut("bad data length", r.position());
          }
          block.data_size = n;
          block.slice = r.slice_index();
          block.offset = r.slice_offset();
          have_data = true;
          if (!r.Skip(n)) return BadPut("truncated data", r.position());
        } else if (t == kBlockCrcTag) {
          if (!r.ReadFixed32(&block.crc32c)) return BadPut("truncated crc32c", r.position());
          block.has_crc32c = true;
        } else if (t == kPositionTag) {
          uint64_t v;
          if (!r.ReadVarint(&v)) return BadPut("truncated position", r.position());
          block.position = static_cast<uint32_t>(v);
          block.has_position = true;
        } else if (!SkipField(r, t)) {
          return BadPut("bad block field", r.position());
        }
      }
      if (r.position() != end) return BadPut("block overruns its length", r.position());
      if (!have_data) block.slice = slices_.size();  // empty data
      blocks_.push_back(std::move(block));
    } else if (!SkipField(r, tag)) {
      return BadPut("bad field", r.position());
    }
  }
  return absl::OkStatus();
}

absl::Status ParseKeyedRequest(const grpc::ByteBuffer& buffer, size_t max_keys,
                               const char* method, KeyedRequest* out) {
  std::vector<grpc::Slice> slices;
  if (buffer.Valid() && !buffer.Dump(&slices).ok()) {
    return absl::InternalError("cannot read request buffer");
  }
  auto bad = [method](const char* what, uint64_t position) {
    return absl::InvalidArgumentError(absl::StrCat(method, " request is malformed: ", what,
                                                   " at byte ", position));
  };
  KeyedRequest req;
  SliceReader r(slices);
  while (!r.done()) {
    uint64_t tag, len;
    if (!r.ReadVarint(&tag)) return bad("truncated tag", r.position());
    if (tag == kNamespaceTag) {
      if (!r.ReadVarint(&len) || len > kMaxKeyBytes || !r.ReadString(len, &req.namespace_name)) {
        return bad("bad namespace_name", r.position());
      }
    } else if (tag == kProfileTag) {
      if (!r.ReadFixed64(&req.profile_id)) return bad("truncated profile_id", r.position());
    } else if (tag == kFormatTag) {
      uint64_t v;
      if (!r.ReadVarint(&v)) return bad("truncated format", r.position());
      req.format = static_cast<uint32_t>(v);
    } else if (tag == kBlocksTag) {  // field 3, length-delimited: keys
      if (req.keys.size() == max_keys) {
        return absl::ResourceExhaustedError(absl::StrCat(method, " has more than ", max_keys,
                                                         " keys; the limit is ", max_keys,
                                                         " per call"));
      }
      std::string key;
      if (!r.ReadVarint(&len) || len > kMaxKeyBytes || !r.ReadString(len, &key)) {
        return bad("bad key", r.position());
      }
      req.keys.push_back(std::move(key));
    } else if (!SkipField(r, tag)) {
      return bad("bad field", r.position());
    }
  }
  *out = std::move(req);
  return absl::OkStatus();
}

uint32_t PutRequestReader::DataCrc32c(size_t i) const {
  const Block& b = blocks_[i];
  SliceReader r(slices_, b.slice, b.offset);
  uint32_t crc = 0;
  r.Crc(b.data_size, &crc);  // Parse() checked that the bytes are there
  return crc;
}

void PutRequestReader::CopyData(size_t i, std::span<std::byte> dst) const {
  const Block& b = blocks_[i];
  SliceReader r(slices_, b.slice, b.offset);
  r.CopyPlain(dst.data(), b.data_size);
}

}  // namespace proxima::wire
