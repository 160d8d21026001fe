// train-tokenizer: a SentencePiece model trained on a corpus.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "common/files.h"
#include "data/corpus.h"
#include "tokenizer/sentencepiece_tokenizer.h"
#include "train/setup.h"

namespace malleus::cli {

void add_tokenizer_command(CLI::App& app) {
  struct TokenizerArgs {
    data::CorpusOptions corpus;
    tokenizer::SentencePieceTraining training;
    std::string output = "data/tokenizer.model";
    int threads = 0;
  };
  auto args = std::make_shared<TokenizerArgs>();
  auto* cmd = app.add_subcommand(
      "train-tokenizer", "Train a SentencePiece tokenizer on text files (for prepare-data)");
  add_corpus_options(*cmd, args->corpus);
  cmd->add_option("--vocab-size", args->training.vocab_size, "Tokens in the vocabulary")
      ->capture_default_str();
  cmd->add_option("--model-type", args->training.model_type, "bpe or unigram")
      ->capture_default_str();
  cmd->add_option("--character-coverage", args->training.character_coverage,
                  "Share of characters with pieces of their own (the rest: byte fallback)")
      ->capture_default_str();
  cmd->add_option("--output", args->output, "Model file to write")->capture_default_str();
  cmd->add_option("--threads", args->threads, "Threads (0: all cores)");
  cmd->callback([args] {
    args->training.threads = train::resolve_threads(args->threads, 1);
    // Sentences are the corpus's non-empty lines, as SentencePiece's own trainer reads files.
    std::vector<std::string> lines;
    data::BadInput bad(args->corpus.skip_bad);
    const data::CorpusCounts counts =
        data::for_each_document(args->corpus, bad, [&](std::string_view doc) {
          size_t begin = 0;
          while (begin < doc.size()) {
            size_t end = doc.find('\n', begin);
            if (end == std::string_view::npos) end = doc.size();
            std::string_view line = doc.substr(begin, end - begin);
            if (line.ends_with('\r')) line.remove_suffix(1);
            if (!line.empty()) lines.emplace_back(line);
            begin = end + 1;
          }
        });
    check(!lines.empty(), "train-tokenizer: no text found in the inputs");
    size_t next = 0;
    const std::string model = tokenizer::train_sentencepiece(
        [&](std::string& sentence) {
          if (next == lines.size()) return false;
          sentence = std::move(lines[next++]);
          return true;
        },
        args->training);
    const auto trained = tokenizer::sentencepiece_from_bytes(model, args->output);
    const fs::path out(args->output);
    if (out.has_parent_path()) fs::create_directories(out.parent_path());
    write_file_atomic(out, model);
    std::printf("trained a %s on %zu lines of %lld files: %s\n", args->training.model_type.c_str(),
                lines.size(), static_cast<long long>(counts.files), trained->describe().c_str());
    if (bad.total() > 0) {
      std::printf("left out %lld bad documents (--skip-bad): %s\n",
                  static_cast<long long>(bad.total()), bad.describe().c_str());
    }
    std::printf("wrote %s\n", args->output.c_str());
  });
}

}  // namespace malleus::cli
