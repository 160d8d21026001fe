#include "tokenizer/tokenizer.h"

#include <system_error>

#include "common/checksum.h"
#include "common/error.h"
#include "common/files.h"
#include "common/json.h"
#include "tokenizer/byte_tokenizer.h"
#include "tokenizer/sentencepiece_tokenizer.h"

namespace malleus::tokenizer {

std::string Tokenizer::describe() const {
  const SpecialTokens s = special_tokens();
  auto id = [](int32_t v) { return v < 0 ? std::string("none") : std::to_string(v); };
  return kind() + " tokenizer, " + std::to_string(vocab_size()) + " tokens (bos " + id(s.bos) +
         ", eos " + id(s.eos) + ", pad " + id(s.pad) + ", unk " + id(s.unk) + ")";
}

std::vector<int32_t> encode_document(const Tokenizer& tokenizer, std::string_view text) {
  const SpecialTokens s = tokenizer.special_tokens();
  std::vector<int32_t> ids;
  if (s.bos >= 0) ids.push_back(s.bos);
  const std::vector<int32_t> body = tokenizer.encode(text);
  ids.insert(ids.end(), body.begin(), body.end());
  if (s.eos >= 0) ids.push_back(s.eos);
  return ids;
}

std::vector<int32_t> encode_prompt(const Tokenizer& tokenizer, std::string_view prompt) {
  const SpecialTokens s = tokenizer.special_tokens();
  std::vector<int32_t> ids;
  if (s.bos >= 0) {
    ids.push_back(s.bos);
  } else if (s.eos >= 0) {
    ids.push_back(s.eos);
  }
  const std::vector<int32_t> body = tokenizer.encode(prompt);
  ids.insert(ids.end(), body.begin(), body.end());
  return ids;
}

std::shared_ptr<const Tokenizer> load_tokenizer(const std::string& name_or_path) {
  if (name_or_path == "byte") return std::make_shared<ByteTokenizer>();
  std::error_code ec;
  check(fs::is_regular_file(name_or_path, ec),
        "tokenizer " + name_or_path +
            ": no such file (give \"byte\" or a SentencePiece .model file)");
  return sentencepiece_from_bytes(read_file(name_or_path), "tokenizer " + name_or_path);
}

bool same_tokenizer(const Tokenizer& a, const Tokenizer& b) {
  return a.kind() == b.kind() && a.model_file() == b.model_file();
}

void save_tokenizer(const Tokenizer& tokenizer, const fs::path& dir, FileAccess access) {
  const SpecialTokens s = tokenizer.special_tokens();
  Json meta = {{"kind", tokenizer.kind()}, {"vocab_size", tokenizer.vocab_size()},
               {"bos_token_id", s.bos},    {"eos_token_id", s.eos},
               {"pad_token_id", s.pad},    {"unk_token_id", s.unk}};
  const std::string& model = tokenizer.model_file();
  if (!model.empty()) {
    write_file_atomic(dir / kModelFile, model, access);
    meta["model_file"] = {{"name", kModelFile},
                          {"bytes", model.size()},
                          {"xxh3", checksum_hex(model.data(), model.size())}};
  } else {
    std::error_code ec;
    fs::remove(dir / kModelFile, ec);
    check(!ec, "cannot remove stale " + (dir / kModelFile).string() + ": " + ec.message());
  }
  write_file_atomic(dir / kMetaFile, meta.dump(2) + "\n", access);
}

std::shared_ptr<const Tokenizer> load_saved_tokenizer(const fs::path& dir) {
  const fs::path meta_path = dir / kMetaFile;
  std::error_code ec;
  if (!fs::exists(meta_path, ec)) return nullptr;
  const std::string source = meta_path.string();
  const Json meta = read_json_file(source);
  JsonReader r(meta, source);
  const auto kind = r.required<std::string>("kind");
  check(kind == "byte" || kind == "sentencepiece",
        source + ": unknown tokenizer kind \"" + kind +
            "\" (expected \"byte\" or \"sentencepiece\")");
  const auto vocab = r.required<int>("vocab_size");
  SpecialTokens expected;
  expected.bos = r.required<int32_t>("bos_token_id");
  expected.eos = r.required<int32_t>("eos_token_id");
  expected.pad = r.required<int32_t>("pad_token_id");
  expected.unk = r.required<int32_t>("unk_token_id");
  std::shared_ptr<const Tokenizer> tokenizer;
  if (kind == "byte") {
    tokenizer = std::make_shared<ByteTokenizer>();
  } else {
    const Json model_file = r.required<Json>("model_file");  // JsonReader keeps a reference
    JsonReader file(model_file, source + " model_file");
    const auto name = file.required<std::string>("name");
    const auto bytes = file.required<uint64_t>("bytes");
    const auto xxh3 = file.required<std::string>("xxh3");
    file.finish();
    check(name == kModelFile, source + ": model_file name must be \"" + std::string(kModelFile) +
                                  "\", got \"" + name + "\"");
    const std::string model = read_file(dir / kModelFile);
    check(model.size() == bytes, (dir / kModelFile).string() + " has " +
                                     std::to_string(model.size()) + " bytes, " + source + " says " +
                                     std::to_string(bytes));
    const std::string actual = checksum_hex(model.data(), model.size());
    check(actual == xxh3, (dir / kModelFile).string() + " is corrupt: checksum " + actual +
                              ", expected " + xxh3 + " (from " + source + ")");
    tokenizer = sentencepiece_from_bytes(model, (dir / kModelFile).string());
  }
  r.finish();
  check(tokenizer->vocab_size() == vocab && tokenizer->special_tokens() == expected,
        source + ": describes " + std::to_string(vocab) + " tokens and its special ids, but the " +
            "tokenizer it names is a " + tokenizer->describe());
  return tokenizer;
}

}  // namespace malleus::tokenizer
