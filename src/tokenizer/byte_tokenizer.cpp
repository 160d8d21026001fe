#include "tokenizer/byte_tokenizer.h"

#include "common/error.h"

namespace malleus::tokenizer {

std::vector<int32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> tokens(text.size());
  // Through unsigned char: plain char is signed on x86, and bytes >= 0x80 (UTF-8) must map to
  // 128..255, not wrap around.
  for (size_t i = 0; i < text.size(); ++i) tokens[i] = static_cast<unsigned char>(text[i]);
  return tokens;
}

std::string ByteTokenizer::decode(std::span<const int32_t> ids) const {
  static constexpr std::string_view kEndOfTextText = "\n<|endoftext|>\n";
  std::string text;
  text.reserve(ids.size());
  for (int32_t id : ids) {
    if (id >= 0 && id < 256) {
      text.push_back(static_cast<char>(static_cast<unsigned char>(id)));
    } else {
      // A model with a larger vocabulary can sample ids the byte tokenizer never made; saying so
      // beats printing garbage.
      check(id == kEndOfText, "token " + std::to_string(id) +
                                  " is outside the byte tokenizer's vocabulary (" +
                                  std::to_string(kVocabSize) + " tokens)");
      text += kEndOfTextText;
    }
  }
  return text;
}

std::string ByteTokenizer::piece(int32_t id) const {
  if (id == kEndOfText) return "<|endoftext|>";
  return decode(std::span<const int32_t>(&id, 1));
}

const std::string& ByteTokenizer::model_file() const {
  static const std::string kNone;
  return kNone;
}

}  // namespace malleus::tokenizer
