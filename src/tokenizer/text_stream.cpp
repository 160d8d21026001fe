#include "tokenizer/text_stream.h"

namespace malleus::tokenizer {

TextStream::TextStream(const Tokenizer& tokenizer, std::vector<int32_t> prompt, Sink sink)
    : tokenizer_(tokenizer), tokens_(std::move(prompt)), sink_(std::move(sink)) {
  show(/*hold_incomplete=*/true);
}

void TextStream::add(int32_t token) {
  tokens_.push_back(token);
  show(/*hold_incomplete=*/true);
}

void TextStream::finish() {
  show(/*hold_incomplete=*/false);
}

void TextStream::show(bool hold_incomplete) {
  if (tokens_.empty()) return;
  const std::string text = tokenizer_.decode(tokens_);
  static constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD
  if (hold_incomplete && std::string_view(text).ends_with(kReplacement)) return;
  // Decoding more tokens only appends to the text (SentencePiece joins pieces, the byte
  // tokenizer bytes), so what was shown stays valid.
  if (text.size() <= shown_) return;
  std::string piece = text.substr(shown_);
  for (char& c : piece) {
    const auto byte = static_cast<unsigned char>(c);
    if ((byte < 0x20 && c != '\n' && c != '\t') || byte == 0x7f) c = '?';
  }
  sink_(piece);
  shown_ = text.size();
}

}  // namespace malleus::tokenizer
