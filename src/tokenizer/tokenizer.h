// Tokenizers: text to token ids and back. Two kinds behind one interface: the byte-level default
// (no dependency, every text round-trips) and SentencePiece models (BPE or unigram, the format of
// LLaMA-2's tokenizer.model), read or trained through Debian's libsentencepiece.
//
// A tokenizer travels with what it made: prepare-data saves it beside the shards, the trainer
// records it in every checkpoint, export writes it for Hugging Face, import reads it back. The
// saved form is one directory layout for all of them (save_tokenizer / load_saved_tokenizer).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/files.h"

namespace malleus::tokenizer {

// Special token ids; -1 where the tokenizer has none.
struct SpecialTokens {
  int32_t bos = -1, eos = -1, pad = -1, unk = -1;
  bool operator==(const SpecialTokens&) const = default;
};

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::string kind() const = 0;  // "byte" or "sentencepiece"
  virtual int vocab_size() const = 0;
  virtual SpecialTokens special_tokens() const = 0;
  // Text to ids, without special tokens.
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // Ids to text; throws Error for an id outside the vocabulary.
  virtual std::string decode(std::span<const int32_t> ids) const = 0;
  // The vocabulary entry of one id as the tokenizer writes it ("<s>", "▁the", "<0x0A>").
  virtual std::string piece(int32_t id) const = 0;
  // The file that defines the tokenizer, byte for byte as it was read (a SentencePiece
  // ModelProto); empty for the byte tokenizer, which needs none.
  virtual const std::string& model_file() const = 0;
  // One line for logs: kind, vocabulary, special ids.
  std::string describe() const;
};

// The tokens of one document in a shard: bos (if the tokenizer has one), the text, eos (if it
// has one). For the byte tokenizer: the bytes, then end-of-text.
std::vector<int32_t> encode_document(const Tokenizer& tokenizer, std::string_view text);

// The tokens a generated text continues: the start of a document as training saw it (bos, or
// else eos, which ends the document before), then the prompt.
std::vector<int32_t> encode_prompt(const Tokenizer& tokenizer, std::string_view prompt);

// "byte", or the path of a SentencePiece model file. Throws Error naming the file if it is
// missing or not a SentencePiece model.
std::shared_ptr<const Tokenizer> load_tokenizer(const std::string& name_or_path);

// True when both encode alike: same kind and the same model file.
bool same_tokenizer(const Tokenizer& a, const Tokenizer& b);

// Saved form in a directory: tokenizer_meta.json (kind, vocabulary size, special ids, and the
// model file's size and checksum) and, for SentencePiece, tokenizer.model. Both written
// atomically (`access`: common/files.h); a stale tokenizer.model is removed when saving the byte
// tokenizer.
void save_tokenizer(const Tokenizer& tokenizer, const std::filesystem::path& dir,
                    FileAccess access = FileAccess::kShared);
// The tokenizer saved in `dir`, or null when the directory holds none (no tokenizer_meta.json).
// Throws Error naming the file for a malformed description, a missing, corrupt or mismatching
// model file.
std::shared_ptr<const Tokenizer> load_saved_tokenizer(const std::filesystem::path& dir);

constexpr const char* kMetaFile = "tokenizer_meta.json";
constexpr const char* kModelFile = "tokenizer.model";

}  // namespace malleus::tokenizer
