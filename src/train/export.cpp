#include "train/export.h"

#include <bit>
#include <charconv>
#include <fstream>
#include <system_error>

#include "common/error.h"
#include "common/files.h"
#include "model/parameters.h"
#include "train/checkpoint.h"

namespace malleus::train {

namespace {

// safetensors stores little-endian data; we copy float32 from memory as it is.
static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; a big-endian host needs byte swapping");

constexpr size_t kLengthBytes = 8;

// The shortest decimal that reads back as `value`: 1e-5f as float is 9.99999974737875e-06 as
// double, and config.json should say 1e-05 like a Python-written one does.
double shortest_decimal(float value) {
  char text[64];
  const auto written = std::to_chars(text, text + sizeof text, value);
  double result = value;
  std::from_chars(text, written.ptr, result);
  return result;
}

}  // namespace

Json hf_config_json(const model::ModelConfig& config) {
  auto id = [](int token) { return token >= 0 ? Json(token) : Json(nullptr); };
  return Json{
      {"architectures", Json::array({"LlamaForCausalLM"})},
      {"model_type", "llama"},
      {"vocab_size", config.vocab_size},
      {"hidden_size", config.hidden_size},
      {"intermediate_size", config.ffn_hidden_size},
      {"num_hidden_layers", config.num_layers},
      {"num_attention_heads", config.num_heads},
      {"num_key_value_heads", config.num_kv_heads},
      {"head_dim", config.head_dim()},
      {"max_position_embeddings", config.max_seq_len},
      {"rms_norm_eps", shortest_decimal(config.norm_eps)},
      {"rope_theta", shortest_decimal(config.rope_theta)},
      {"rope_scaling", nullptr},
      {"hidden_act", "silu"},
      {"tie_word_embeddings", false},
      {"attention_bias", false},
      {"mlp_bias", false},
      {"torch_dtype", "float32"},
      {"initializer_range", shortest_decimal(config.init_std)},
      // null, not absent, where there is none: LlamaConfig would default bos to 1 and eos to 2.
      {"bos_token_id", id(config.bos_token_id)},
      {"eos_token_id", id(config.eos_token_id)},
      {"pad_token_id", id(config.pad_token_id)},
  };
}

void export_hf(const Checkpoint& checkpoint, const fs::path& out_dir) {
  const std::string where = "export to " + out_dir.string();
  checkpoint.model.validate(where + ": model config");
  const model::ParameterLayout layout(checkpoint.model);
  check(checkpoint.params.size() == static_cast<size_t>(layout.total_size()),
        where + ": params has " + std::to_string(checkpoint.params.size()) +
            " elements, but the parameter layout has " + std::to_string(layout.total_size()));
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  check(!ec, where + ": cannot create " + out_dir.string() + ": " + ec.message());

  // ordered_json: readers do not care, but layout order keeps the file easy to inspect and diff.
  nlohmann::ordered_json header;
  header["__metadata__"] = {{"format", "pt"}};
  int64_t offset = 0;
  for (const auto& tensor : layout.tensors()) {
    const int64_t bytes = tensor.size * static_cast<int64_t>(sizeof(float));
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

  AtomicFile file(out_dir / "model.safetensors");
  file.write(length, sizeof length);
  file.write(text);
  for (const auto& tensor : layout.tensors()) {
    file.write(checkpoint.params.data() + tensor.offset,
               static_cast<size_t>(tensor.size) * sizeof(float));
  }
  file.commit();

  write_file_atomic(out_dir / "config.json", hf_config_json(checkpoint.model).dump(2) + "\n");
}

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

  unsigned char length[kLengthBytes];
  in.read(reinterpret_cast<char*>(length), sizeof length);
  check(in.good(), where + ": cannot read the header length");
  uint64_t header_size = 0;
  for (size_t i = 0; i < kLengthBytes; ++i) header_size |= uint64_t{length[i]} << (8 * i);
  check(header_size <= file_size - kLengthBytes,
        where + ": header length " + std::to_string(header_size) +
            " is beyond the end of the file (" + std::to_string(file_size) + " bytes)");
  std::string text(header_size, '\0');
  in.read(text.data(), static_cast<std::streamsize>(header_size));
  check(in.good(), where + ": cannot read the header");
  const Json header = parse_json(text, where + " (safetensors header)");
  check(header.is_object(), where + ": the safetensors header is not a JSON object");

  const uint64_t data_start = kLengthBytes + header_size;
  const uint64_t data_size = file_size - data_start;
  std::map<std::string, SafetensorsTensor> tensors;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") continue;
    const std::string source = where + ": tensor \"" + name + "\"";
    JsonReader reader(value, source);
    const auto dtype = reader.required<std::string>("dtype");
    const auto shape = reader.required<std::vector<int64_t>>("shape");
    const auto offsets = reader.required<std::vector<uint64_t>>("data_offsets");
    reader.finish();
    check(dtype == "F32", source + ": unsupported dtype \"" + dtype + "\" (only F32 is read)");
    check(offsets.size() == 2, source + ": data_offsets must be [begin, end]");
    check(offsets[0] <= offsets[1] && offsets[1] <= data_size,
          source + ": data_offsets [" + std::to_string(offsets[0]) + ", " +
              std::to_string(offsets[1]) + "] are out of range (the data is " +
              std::to_string(data_size) + " bytes)");
    // Bounded by the byte count already known to be in the file, so the product cannot overflow.
    const uint64_t max_elements = (offsets[1] - offsets[0]) / sizeof(float);
    uint64_t elements = 1;
    for (int64_t dim : shape) {
      check(dim >= 0, source + ": negative dimension in shape");
      const auto d = static_cast<uint64_t>(dim);
      check(d == 0 || elements <= max_elements / d,
            source + ": shape does not match data_offsets (more elements than bytes)");
      elements *= d;
    }
    check(elements * sizeof(float) == offsets[1] - offsets[0],
          source + ": shape has " + std::to_string(elements) + " elements, but data_offsets span " +
              std::to_string(offsets[1] - offsets[0]) + " bytes");

    SafetensorsTensor tensor;
    tensor.shape = shape;
    tensor.data.resize(elements);
    in.seekg(static_cast<std::streamoff>(data_start + offsets[0]));
    in.read(reinterpret_cast<char*>(tensor.data.data()),
            static_cast<std::streamsize>(elements * sizeof(float)));
    check(in.good(), source + ": cannot read its data");
    tensors.emplace(name, std::move(tensor));
  }
  return tensors;
}

}  // namespace malleus::train
