#include "data/decompress.h"

#include <lzma.h>
#include <zlib.h>
#include <zstd.h>

#include <cerrno>
#include <cstring>
#include <span>

#include "common/error.h"

namespace malleus::data {

namespace {

constexpr size_t kInputChunk = 1 << 18;  // bytes read from the file at a time

bool starts_with(std::string_view head, std::string_view magic) {
  return head.substr(0, magic.size()) == magic;
}

}  // namespace

Compression detect_compression(std::string_view head, std::string* unsupported_name) {
  using namespace std::string_view_literals;
  if (starts_with(head, "\x1f\x8b"sv)) return Compression::gzip;
  if (starts_with(head,
                  "\xfd"
                  "7zXZ\0"sv))
    return Compression::xz;
  if (starts_with(head, "\x28\xb5\x2f\xfd"sv)) return Compression::zstd;
  struct Known {
    std::string_view magic, name;
  };
  static constexpr Known kUnsupported[] = {
      {"BZh"sv, "bzip2"},
      {"\x04\x22\x4d\x18"sv, "lz4"},
      {"LZIP"sv, "lzip"},
      {"PK\x03\x04"sv, "zip"},
      {"7z\xbc\xaf\x27\x1c"sv, "7-Zip"},
      {"\x1f\x9d"sv, "Unix compress (.Z)"},
  };
  for (const auto& known : kUnsupported) {
    // bzip2's magic is "BZh" and a block-size digit; a text may well start with "BZh".
    if (known.name == "bzip2" && (head.size() < 4 || head[3] < '1' || head[3] > '9')) continue;
    if (starts_with(head, known.magic)) {
      if (unsupported_name != nullptr) *unsupported_name = std::string(known.name);
      return Compression::unsupported;
    }
  }
  return Compression::none;
}

std::string compression_name(Compression compression) {
  switch (compression) {
    case Compression::none:
      return "plain";
    case Compression::gzip:
      return "gzip";
    case Compression::xz:
      return "xz";
    case Compression::zstd:
      return "zstd";
    case Compression::unsupported:
      break;
  }
  return "unsupported";
}

// Turns compressed bytes into text, a step at a time.
struct DecompressingReader::Decoder {
  virtual ~Decoder() = default;
  // Decodes from `in` (advancing it past what was used) into `out`; returns the bytes written.
  // `input_ended`: no byte follows `in`. Throws Error (with `name`) for corrupt data.
  virtual size_t step(std::span<const unsigned char>& in, std::span<char> out, bool input_ended,
                      const std::string& name) = 0;
  // True when the input so far ends where a stream ends (so the file may end here).
  virtual bool complete() const = 0;
};

namespace {

struct PlainDecoder final : DecompressingReader::Decoder {
  size_t step(std::span<const unsigned char>& in, std::span<char> out, bool,
              const std::string&) override {
    const size_t n = std::min(in.size(), out.size());
    std::memcpy(out.data(), in.data(), n);
    in = in.subspan(n);
    return n;
  }
  bool complete() const override { return true; }
};

// gzip through zlib's inflate; a new member after the end of one is read on (multi-member files).
struct GzipDecoder final : DecompressingReader::Decoder {
  z_stream z{};
  bool in_member = false;

  GzipDecoder() { check(inflateInit2(&z, 15 + 16) == Z_OK, "zlib: cannot start a gzip decoder"); }
  ~GzipDecoder() override { inflateEnd(&z); }

  size_t step(std::span<const unsigned char>& in, std::span<char> out, bool,
              const std::string& name) override {
    if (!in.empty() && !in_member) {
      if (z.total_in > 0) inflateReset(&z);  // the next member
      in_member = true;
    }
    z.next_in = const_cast<unsigned char*>(in.data());
    z.avail_in = static_cast<uInt>(in.size());
    z.next_out = reinterpret_cast<unsigned char*>(out.data());
    z.avail_out = static_cast<uInt>(out.size());
    const int ret = inflate(&z, Z_NO_FLUSH);
    in = in.subspan(in.size() - z.avail_in);
    if (ret == Z_STREAM_END) {
      in_member = false;
    } else if (ret != Z_OK && ret != Z_BUF_ERROR) {
      throw Error(name + ": corrupt gzip data (" + (z.msg != nullptr ? z.msg : zError(ret)) + ")");
    }
    return out.size() - z.avail_out;
  }
  bool complete() const override { return !in_member; }
};

struct XzDecoder final : DecompressingReader::Decoder {
  lzma_stream s = LZMA_STREAM_INIT;
  bool ended = false;

  XzDecoder() {
    check(lzma_stream_decoder(&s, UINT64_MAX, LZMA_CONCATENATED) == LZMA_OK,
          "liblzma: cannot start an xz decoder");
  }
  ~XzDecoder() override { lzma_end(&s); }

  size_t step(std::span<const unsigned char>& in, std::span<char> out, bool input_ended,
              const std::string& name) override {
    if (ended) {
      in = in.subspan(in.size());
      return 0;
    }
    s.next_in = in.data();
    s.avail_in = in.size();
    s.next_out = reinterpret_cast<uint8_t*>(out.data());
    s.avail_out = out.size();
    const lzma_ret ret = lzma_code(&s, input_ended ? LZMA_FINISH : LZMA_RUN);
    in = in.subspan(in.size() - s.avail_in);
    const size_t produced = out.size() - s.avail_out;
    if (ret == LZMA_STREAM_END) {
      ended = true;
    } else if (ret == LZMA_BUF_ERROR && input_ended && produced == 0) {
      throw Error(name + ": truncated xz data: the file ends inside a stream (a partial copy?)");
    } else if (ret != LZMA_OK && ret != LZMA_BUF_ERROR) {
      throw Error(name + ": corrupt xz data (liblzma error " + std::to_string(ret) + ")");
    }
    return produced;
  }
  bool complete() const override { return ended; }
};

struct ZstdDecoder final : DecompressingReader::Decoder {
  ZSTD_DStream* stream = ZSTD_createDStream();
  size_t last = 0;  // ZSTD_decompressStream's last answer: 0 when a frame is complete and flushed

  ZstdDecoder() { check(stream != nullptr, "libzstd: cannot start a zstd decoder"); }
  ~ZstdDecoder() override { ZSTD_freeDStream(stream); }

  size_t step(std::span<const unsigned char>& in, std::span<char> out, bool,
              const std::string& name) override {
    ZSTD_inBuffer input{in.data(), in.size(), 0};
    ZSTD_outBuffer output{out.data(), out.size(), 0};
    const size_t ret = ZSTD_decompressStream(stream, &output, &input);
    if (ZSTD_isError(ret)) {
      throw Error(name + ": corrupt zstd data (" + ZSTD_getErrorName(ret) + ")");
    }
    if (input.pos > 0 || output.pos > 0) last = ret;
    in = in.subspan(input.pos);
    return output.pos;
  }
  bool complete() const override { return last == 0; }
};

}  // namespace

DecompressingReader::DecompressingReader(const std::filesystem::path& path)
    : name_(path.string()), in_(kInputChunk) {
  file_ = std::fopen(path.c_str(), "rb");
  if (file_ == nullptr) {
    const int err = errno;
    throw Error(name_ + ": " +
                (err == ENOENT ? std::string("no such file") : std::string(std::strerror(err))));
  }
  std::error_code ec;
  file_size_ = std::filesystem::file_size(path, ec);
  if (ec) file_size_ = 0;
  refill();
  const std::string_view head(reinterpret_cast<const char*>(in_.data()), in_end_);
  std::string unsupported;
  compression_ = detect_compression(head, &unsupported);
  switch (compression_) {
    case Compression::none:
      decoder_ = std::make_unique<PlainDecoder>();
      break;
    case Compression::gzip:
      decoder_ = std::make_unique<GzipDecoder>();
      break;
    case Compression::xz:
      decoder_ = std::make_unique<XzDecoder>();
      break;
    case Compression::zstd:
      decoder_ = std::make_unique<ZstdDecoder>();
      break;
    case Compression::unsupported:
      std::fclose(file_);
      file_ = nullptr;
      throw Error(name_ + ": " + unsupported +
                  "-compressed, which prepare-data does not read (it reads plain text and gzip, xz "
                  "and zstd files): decompress it first");
  }
}

DecompressingReader::~DecompressingReader() {
  if (file_ != nullptr) std::fclose(file_);
}

bool DecompressingReader::refill() {
  if (file_ended_) return false;
  if (in_begin_ > 0) {  // keep what is left at the front
    std::memmove(in_.data(), in_.data() + in_begin_, in_end_ - in_begin_);
    in_end_ -= in_begin_;
    in_begin_ = 0;
  }
  if (in_end_ == in_.size()) return false;
  const size_t n = std::fread(in_.data() + in_end_, 1, in_.size() - in_end_, file_);
  if (n == 0) {
    check(!std::ferror(file_), name_ + ": read error: " + std::strerror(errno));
    file_ended_ = true;
    return false;
  }
  in_end_ += n;
  file_bytes_read_ += n;
  return true;
}

size_t DecompressingReader::read(char* out, size_t capacity) {
  if (capacity == 0) return 0;
  for (int stalls = 0;;) {
    if (in_begin_ == in_end_) refill();
    std::span<const unsigned char> in(in_.data() + in_begin_, in_end_ - in_begin_);
    const size_t before = in.size();
    const size_t produced = decoder_->step(in, std::span<char>(out, capacity), file_ended_, name_);
    in_begin_ += before - in.size();
    if (produced > 0) return produced;
    if (file_ended_ && in_begin_ == in_end_) {
      check(decoder_->complete(),
            name_ + ": truncated " + compression_name(compression_) +
                " data: the file ends inside a compressed stream (a partial copy?)");
      return 0;
    }
    // Nothing used and nothing made: the decoder wants more than the buffer holds.
    if (before == in.size() && !refill() && ++stalls > 2) {
      throw Error(name_ + ": corrupt " + compression_name(compression_) +
                  " data: the decoder makes no progress");
    }
  }
}

}  // namespace malleus::data
