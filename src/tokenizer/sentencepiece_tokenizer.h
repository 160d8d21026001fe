// SentencePiece models (Kudo & Richardson, EMNLP 2018) through Debian's libsentencepiece: BPE or
// unigram, the format of LLaMA-2's tokenizer.model; and training a new one on a corpus.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "tokenizer/tokenizer.h"

namespace malleus::tokenizer {

// `model_file` holds a serialized SentencePiece ModelProto; `source` names it in errors. Throws
// Error if the bytes are not a usable model.
std::shared_ptr<const Tokenizer> sentencepiece_from_bytes(std::string model_file,
                                                          const std::string& source);

struct SentencePieceTraining {
  int vocab_size = 8000;
  std::string model_type = "bpe";  // "bpe" or "unigram"
  int threads = 1;
  // Share of the corpus's characters that get pieces of their own; the rest are spelled with the
  // 256 byte pieces (byte fallback), so no text is ever unknown.
  double character_coverage = 0.9995;
};

// Trains a model on the sentences `next` yields (it fills its argument and returns true, or
// returns false at the end) with LLaMA-2's settings: byte fallback, digits split, text kept as
// it is (identity normalisation, whitespace kept), ids unk 0, bos 1, eos 2, no pad. Returns the
// serialized model. Throws Error with SentencePiece's reason if training fails (e.g. a vocabulary
// too small for the characters it must cover, or too large for the corpus).
std::string train_sentencepiece(const std::function<bool(std::string&)>& next,
                                const SentencePieceTraining& options);

}  // namespace malleus::tokenizer
