#include "hf/safetensors.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <fstream>
#include <system_error>
#include <tuple>

#include "common/error.h"
#include "common/files.h"
#include "common/json.h"

namespace malleus::hf {

namespace {

// safetensors stores little-endian data; float32 is copied from memory as it is.
static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; a big-endian host needs byte swapping");

constexpr size_t kLengthBytes = 8;
// The format's reader refuses longer headers (safetensors' MAX_HEADER_SIZE).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

float bf16_to_float(uint16_t bits) {
  return std::bit_cast<float>(uint32_t{bits} << 16);
}

// IEEE half precision: 1 sign, 5 exponent (bias 15), 10 mantissa bits.
float f16_to_float(uint16_t bits) {
  const uint32_t sign = uint32_t{bits & 0x8000u} << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  uint32_t mantissa = bits & 0x3ffu;
  if (exponent == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0) {
    return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
  }
  if (mantissa == 0) return std::bit_cast<float>(sign);
  // Subnormal half: normalise it, which float's wider exponent always allows.
  int shift = 0;
  while ((mantissa & 0x400u) == 0) {
    mantissa <<= 1;
    ++shift;
  }
  mantissa &= 0x3ffu;
  return std::bit_cast<float>(sign | ((113u - static_cast<uint32_t>(shift)) << 23) |
                              (mantissa << 13));
}

size_t dtype_bytes(const std::string& dtype) {
  if (dtype == "F32") return 4;
  if (dtype == "BF16" || dtype == "F16") return 2;
  return 0;
}

int64_t elements_of(const TensorRef& tensor) {
  int64_t elements = 1;
  for (int64_t d : tensor.shape) elements *= d;
  return elements;
}

}  // namespace

void write_safetensors(const fs::path& path, const std::vector<TensorRef>& tensors) {
  // ordered_json: readers do not care, but the given order keeps the file easy to inspect and
  // its bytes a function of the tensors alone.
  nlohmann::ordered_json header;
  header["__metadata__"] = {{"format", "pt"}};
  int64_t offset = 0;
  for (const auto& tensor : tensors) {
    const int64_t bytes = elements_of(tensor) * static_cast<int64_t>(sizeof(float));
    header[tensor.name] = {
        {"dtype", "F32"},
        {"shape", tensor.shape},
        {"data_offsets", nlohmann::ordered_json::array({offset, offset + bytes})}};
    offset += bytes;
  }
  std::string text = header.dump();
  // Padding keeps the data 8-byte aligned for readers that map the file.
  text.append((kLengthBytes - text.size() % kLengthBytes) % kLengthBytes, ' ');
  unsigned char length[kLengthBytes];
  for (size_t i = 0; i < kLengthBytes; ++i) {
    length[i] = static_cast<unsigned char>((uint64_t{text.size()} >> (8 * i)) & 0xff);
  }
  AtomicFile file(path);
  file.write(length, sizeof length);
  file.write(text);
  for (const auto& tensor : tensors) {
    file.write(tensor.data, static_cast<size_t>(elements_of(tensor)) * sizeof(float));
  }
  file.commit();
}

namespace {

// The bytes [begin, end) of the data that a tensor's data_offsets name.
struct Extent {
  uint64_t begin = 0, end = 0;
  std::string name;
};

// The format's rule: the tensors' data, in offset order, tile the data exactly: the first begins
// at 0, each begins where the one before ends (no gap, no overlap), the last ends at its end (no
// trailing bytes).
void check_extents(std::vector<Extent> extents, uint64_t data_size, const std::string& where) {
  std::sort(extents.begin(), extents.end(), [](const Extent& a, const Extent& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  const auto range = [](const Extent& e) {
    std::string text = "[";
    text += std::to_string(e.begin);
    text += ", ";
    text += std::to_string(e.end);
    text += "]";
    return text;
  };
  uint64_t expected = 0;
  const Extent* previous = nullptr;
  for (const Extent& e : extents) {
    std::string tensor = where;
    tensor += ": tensor \"" + e.name + "\": data_offsets " + range(e);
    if (e.begin < expected) {
      tensor += " overlap tensor \"" + previous->name + "\"'s " + range(*previous);
      throw Error(tensor + " (the format forbids it)");
    }
    check(e.begin == expected, tensor + " leave bytes [" + std::to_string(expected) + ", " +
                                   std::to_string(e.begin) +
                                   ") before it to no tensor (the data must be contiguous)");
    expected = e.end;
    previous = &e;
  }
  if (expected == data_size) return;
  std::string last = "the header, which names no tensor";
  if (previous != nullptr) {
    last = "the last tensor's data (tensor \"" + previous->name + "\" ends at ";
    last += std::to_string(expected) + ")";
  }
  throw Error(where + ": " + std::to_string(data_size - expected) + " bytes after " + last +
              ": the data must end where the last tensor ends");
}

// The header: its length, its JSON (an object beginning with '{'), its metadata (strings), and
// where the data begins and how long it is.
struct Header {
  Json json;
  uint64_t data_start = 0, data_size = 0;
};

Header read_header(std::ifstream& in, uint64_t file_size, const std::string& where) {
  unsigned char length[kLengthBytes];
  in.read(reinterpret_cast<char*>(length), sizeof length);
  check(in.good(), where + ": cannot read the header length");
  uint64_t header_size = 0;
  for (size_t i = 0; i < kLengthBytes; ++i) header_size |= uint64_t{length[i]} << (8 * i);
  check(header_size <= kMaxHeaderBytes, where + ": header length " + std::to_string(header_size) +
                                            " exceeds the format's limit of " +
                                            std::to_string(kMaxHeaderBytes) + " bytes");
  check(header_size <= file_size - kLengthBytes,
        where + ": header length " + std::to_string(header_size) +
            " is beyond the end of the file (" + std::to_string(file_size) + " bytes)");
  std::string text(header_size, '\0');
  in.read(text.data(), static_cast<std::streamsize>(header_size));
  check(in.good(), where + ": cannot read the header");
  Header header;
  header.json = parse_json(text, where + " (safetensors header)");
  check(header.json.is_object(), where + ": the safetensors header is not a JSON object");
  check(text.starts_with('{'), where + ": the safetensors header must begin with '{'");
  if (header.json.contains("__metadata__")) {
    const Json& metadata = header.json["__metadata__"];
    check(metadata.is_object(), where + ": __metadata__ must be an object of strings");
    for (const auto& [key, value] : metadata.items()) {
      check(value.is_string(),
            where + ": __metadata__ \"" + key + "\" is " + value.dump() + ", not a string");
    }
  }
  header.data_start = kLengthBytes + header_size;
  header.data_size = file_size - header.data_start;
  return header;
}

// One tensor's header entry, checked: a dtype read, offsets within the data, and a shape whose
// elements fill them exactly.
struct TensorEntry {
  std::string dtype;
  std::vector<int64_t> shape;
  Extent extent;
  size_t width = 0;       // bytes per element
  uint64_t elements = 0;  // of the shape
};

TensorEntry read_tensor_entry(const std::string& name, const Json& value, uint64_t data_size,
                              const std::string& source) {
  JsonReader reader(value, source);
  TensorEntry t;
  t.dtype = reader.required<std::string>("dtype");
  t.shape = reader.required<std::vector<int64_t>>("shape");
  const auto offsets = reader.required<std::vector<uint64_t>>("data_offsets");
  reader.finish();
  t.width = dtype_bytes(t.dtype);
  check(t.width > 0,
        source + ": unsupported dtype \"" + t.dtype + "\" (F32, BF16 and F16 are read)");
  check(offsets.size() == 2, source + ": data_offsets must be [begin, end]");
  check(offsets[0] <= offsets[1] && offsets[1] <= data_size,
        source + ": data_offsets [" + std::to_string(offsets[0]) + ", " +
            std::to_string(offsets[1]) + "] are out of range (the data is " +
            std::to_string(data_size) + " bytes)");
  t.extent = {offsets[0], offsets[1], name};
  // Bounded by the byte count already known to be in the file, so the product cannot overflow.
  const uint64_t max_elements = (offsets[1] - offsets[0]) / t.width;
  t.elements = 1;
  for (int64_t dim : t.shape) {
    check(dim >= 0, source + ": negative dimension in shape");
    const auto d = static_cast<uint64_t>(dim);
    check(d == 0 || t.elements <= max_elements / d,
          source + ": shape does not match data_offsets (more elements than bytes)");
    t.elements *= d;
  }
  check(t.elements * t.width == offsets[1] - offsets[0],
        source + ": shape has " + std::to_string(t.elements) + " elements of " + t.dtype +
            ", but data_offsets span " + std::to_string(offsets[1] - offsets[0]) + " bytes");
  return t;
}

// The tensor's data, converted to float32; `raw` is scratch reused across tensors.
SafetensorsTensor read_tensor_data(std::ifstream& in, const TensorEntry& t, uint64_t data_start,
                                   std::vector<char>& raw, const std::string& source) {
  SafetensorsTensor tensor;
  tensor.dtype = t.dtype;
  tensor.shape = t.shape;
  tensor.data.resize(t.elements);
  raw.resize(t.elements * t.width);
  in.seekg(static_cast<std::streamoff>(data_start + t.extent.begin));
  in.read(raw.data(), static_cast<std::streamsize>(raw.size()));
  check(in.good() || raw.empty(), source + ": cannot read its data");
  if (raw.empty()) {
    // An empty tensor: nothing to copy (and memcpy must not see the null pointers).
  } else if (t.dtype == "F32") {
    std::memcpy(tensor.data.data(), raw.data(), raw.size());
  } else {
    for (size_t i = 0; i < t.elements; ++i) {
      uint16_t bits;
      std::memcpy(&bits, raw.data() + 2 * i, 2);
      tensor.data[i] = t.dtype == "BF16" ? bf16_to_float(bits) : f16_to_float(bits);
    }
  }
  return tensor;
}

}  // namespace

std::map<std::string, SafetensorsTensor> read_safetensors(const fs::path& path) {
  const std::string where = path.string();
  std::error_code ec;
  check(fs::is_regular_file(path, ec), where + ": no such file");
  const uint64_t file_size = fs::file_size(path, ec);
  check(!ec, where + ": cannot stat: " + ec.message());
  check(file_size >= kLengthBytes,
        where + ": too short for a safetensors file (" + std::to_string(file_size) + " bytes)");
  std::ifstream in(path, std::ios::binary);
  check(in.good(), where + ": cannot open");
  const Header header = read_header(in, file_size, where);

  std::map<std::string, SafetensorsTensor> tensors;
  std::vector<Extent> extents;
  std::vector<char> raw;
  for (const auto& [name, value] : header.json.items()) {
    if (name == "__metadata__") continue;
    const std::string source = where + ": tensor \"" + name + "\"";
    const TensorEntry entry = read_tensor_entry(name, value, header.data_size, source);
    tensors.emplace(name, read_tensor_data(in, entry, header.data_start, raw, source));
    extents.push_back(entry.extent);
  }
  check_extents(std::move(extents), header.data_size, where);
  return tensors;
}

}  // namespace malleus::hf
