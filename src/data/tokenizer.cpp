#include "data/tokenizer.h"

#include "common/error.h"

namespace malleus::data {

std::vector<uint16_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<uint16_t> tokens(text.size());
  // Through unsigned char: plain char is signed on x86, and bytes >= 0x80 (UTF-8) must map to
  // 128..255, not wrap around.
  for (size_t i = 0; i < text.size(); ++i) tokens[i] = static_cast<unsigned char>(text[i]);
  return tokens;
}

std::string ByteTokenizer::decode(const std::vector<uint16_t>& tokens) const {
  static constexpr std::string_view kEndOfTextText = "\n<|endoftext|>\n";
  std::string text;
  text.reserve(tokens.size());
  for (uint16_t token : tokens) {
    if (token < 256) {
      text.push_back(static_cast<char>(static_cast<unsigned char>(token)));
    } else {
      // A model with a larger vocabulary can sample ids the byte tokenizer never made; saying so
      // beats printing garbage.
      check(token == kEndOfText, "token " + std::to_string(token) +
                                     " is outside the byte tokenizer's vocabulary (" +
                                     std::to_string(kVocabSize) + " tokens)");
      text += kEndOfTextText;
    }
  }
  return text;
}

}  // namespace malleus::data
