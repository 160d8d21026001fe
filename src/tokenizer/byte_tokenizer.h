// The default tokenizer: one token per byte (0..255) plus an end-of-text token that ends each
// document. Any text round-trips exactly; no file defines it.
#pragma once

#include "tokenizer/tokenizer.h"

namespace malleus::tokenizer {

class ByteTokenizer final : public Tokenizer {
 public:
  static constexpr int kEndOfText = 256;
  static constexpr int kVocabSize = 257;

  std::string kind() const override { return "byte"; }
  int vocab_size() const override { return kVocabSize; }
  SpecialTokens special_tokens() const override { return {.eos = kEndOfText}; }
  std::vector<int32_t> encode(std::string_view text) const override;
  // Bytes as they are; the end-of-text token becomes "\n<|endoftext|>\n".
  std::string decode(std::span<const int32_t> ids) const override;
  // The byte itself; "<|endoftext|>" for end-of-text.
  std::string piece(int32_t id) const override;
  const std::string& model_file() const override;
};

}  // namespace malleus::tokenizer
