#include "tokenizer/sentencepiece_tokenizer.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <unordered_map>

#include "common/error.h"

namespace malleus::tokenizer {

namespace {

class SentencePieceTokenizer final : public Tokenizer {
 public:
  SentencePieceTokenizer(std::string model_file, const std::string& source)
      : model_file_(std::move(model_file)) {
    check(!model_file_.empty(), source + ": empty file, not a SentencePiece model");
    const auto status = processor_.LoadFromSerializedProto(model_file_);
    check(status.ok(),
          source + ": not a usable SentencePiece model (" + std::string(status.message()) + ")");
    check(processor_.GetPieceSize() > 0, source + ": the SentencePiece model has no pieces");
  }

  std::string kind() const override { return "sentencepiece"; }
  int vocab_size() const override { return processor_.GetPieceSize(); }
  SpecialTokens special_tokens() const override {
    return {processor_.bos_id(), processor_.eos_id(), processor_.pad_id(), processor_.unk_id()};
  }

  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int> ids;
    const auto status = processor_.Encode(text, &ids);
    check(status.ok(), "SentencePiece cannot encode the text: " + std::string(status.message()));
    return {ids.begin(), ids.end()};
  }

  std::string decode(std::span<const int32_t> ids) const override {
    const int vocab = vocab_size();
    for (int32_t id : ids) {
      check(id >= 0 && id < vocab, "token " + std::to_string(id) +
                                       " is outside the SentencePiece vocabulary (" +
                                       std::to_string(vocab) + " tokens)");
    }
    std::string text;
    const auto status = processor_.Decode(std::vector<int>(ids.begin(), ids.end()), &text);
    check(status.ok(), "SentencePiece cannot decode: " + std::string(status.message()));
    return text;
  }

  std::string piece(int32_t id) const override {
    check(id >= 0 && id < vocab_size(), "token " + std::to_string(id) +
                                            " is outside the SentencePiece vocabulary (" +
                                            std::to_string(vocab_size()) + " tokens)");
    return processor_.IdToPiece(id);
  }

  const std::string& model_file() const override { return model_file_; }

 private:
  std::string model_file_;
  sentencepiece::SentencePieceProcessor processor_;
};

// Feeds the caller's sentences to the trainer one at a time, so the corpus is never copied whole.
class CallbackSentences final : public sentencepiece::SentenceIterator {
 public:
  explicit CallbackSentences(const std::function<bool(std::string&)>& next) : next_(next) {
    Next();
  }
  bool done() const override { return done_; }
  void Next() override { done_ = !next_(value_); }
  const std::string& value() const override { return value_; }
  sentencepiece::util::Status status() const override { return {}; }

 private:
  const std::function<bool(std::string&)>& next_;
  std::string value_;
  bool done_ = false;
};

}  // namespace

std::shared_ptr<const Tokenizer> sentencepiece_from_bytes(std::string model_file,
                                                          const std::string& source) {
  return std::make_shared<SentencePieceTokenizer>(std::move(model_file), source);
}

std::string train_sentencepiece(const std::function<bool(std::string&)>& next,
                                const SentencePieceTraining& options) {
  check(options.model_type == "bpe" || options.model_type == "unigram",
        "tokenizer model type must be \"bpe\" or \"unigram\", got \"" + options.model_type + "\"");
  check(options.vocab_size > 0 && options.vocab_size <= 65536,
        "tokenizer vocabulary size must be in [1, 65536] (shards hold uint16 tokens), got " +
            std::to_string(options.vocab_size));
  check(options.threads >= 1, "tokenizer training needs at least one thread");
  const std::unordered_map<std::string, std::string> args = {
      {"model_type", options.model_type},
      {"vocab_size", std::to_string(options.vocab_size)},
      {"character_coverage", std::to_string(options.character_coverage)},
      {"num_threads", std::to_string(options.threads)},
      // LLaMA-2's tokenizer settings.
      {"byte_fallback", "true"},
      {"split_digits", "true"},
      {"normalization_rule_name", "identity"},
      {"remove_extra_whitespaces", "false"},
      {"allow_whitespace_only_pieces", "true"},
      {"unk_id", "0"},
      {"bos_id", "1"},
      {"eos_id", "2"},
      {"pad_id", "-1"},
      // Warnings and errors only; the progress log is thousands of lines.
      {"minloglevel", "1"},
  };
  CallbackSentences sentences(next);
  std::string model;
  const auto status = sentencepiece::SentencePieceTrainer::Train(args, &sentences, &model);
  check(status.ok(), "SentencePiece training failed: " + std::string(status.message()));
  return model;
}

}  // namespace malleus::tokenizer
