// Text shown as tokens arrive (`malleus generate` prints with it). Tokens are decoded together
// with the prompt, not one by one: a SentencePiece piece's leading space and a character split
// over byte-fallback tokens only come out right in context. Text whose decoding ends in U+FFFD
// (an incomplete UTF-8 sequence so far) waits for the next token; finish() shows what is still
// held back when no token follows, replacement character and all.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace malleus::tokenizer {

class TextStream {
 public:
  using Sink = std::function<void(std::string_view)>;
  // `prompt`: the prompt's tokens after the start-of-document token; shown at once (but for a
  // held-back end). `sink` receives each new piece of text, control characters other than
  // newline and tab shown as '?' (a model can write terminal escape sequences).
  TextStream(const Tokenizer& tokenizer, std::vector<int32_t> prompt, Sink sink);
  void add(int32_t token);
  // Shows the text held back, if any: the end of generation.
  void finish();

 private:
  void show(bool hold_incomplete);

  const Tokenizer& tokenizer_;
  std::vector<int32_t> tokens_;
  Sink sink_;
  size_t shown_ = 0;
};

}  // namespace malleus::tokenizer
