// The default tokenizer: one token per byte (0..255) plus an end-of-text token that separates
// documents. Any UTF-8 text round-trips exactly.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace malleus::data {

class ByteTokenizer {
 public:
  static constexpr int kEndOfText = 256;
  static constexpr int kVocabSize = 257;

  std::vector<uint16_t> encode(std::string_view text) const;
  // Bytes as they are; the end-of-text token becomes "\n<|endoftext|>\n".
  std::string decode(const std::vector<uint16_t>& tokens) const;
};

}  // namespace malleus::data
