// `malleus prepare-data`: text files in, token shards out.
//
// Input selection:
// - An input is a file or a directory. A directory contributes every regular file below it
//   (recursively; symlinks to files are followed, symlinks to directories are not, so a link
//   cycle cannot loop), in sorted path order so the output does not depend on the file system.
// - Files met inside a directory whose names end in ".dat" or ".u8" are skipped: in a fortune
//   directory (/usr/share/games/fortunes) the former are strfile's binary indexes and the latter
//   UTF-8 duplicates (usually symlinks) of the plain files, which would put every fortune in the
//   corpus twice. A file named explicitly as an input is never skipped for its name.
// - With skip_binary, a file holding a NUL byte is skipped as binary.
// - The same file reached twice (through symlinks, or named twice) is read once.
//
// Output: each document's tokens (tokenizer::encode_document: bos if the tokenizer has one, the
// text, eos if it has one; for the byte tokenizer the bytes and end-of-text), streamed into
// <output_dir>/train_000000.bin, train_000001.bin, ... and val_000000.bin, ..., each at most
// shard_tokens tokens (a document may continue into the next shard), each written atomically;
// then the tokenizer itself (tokenizer::save_tokenizer), so training and generation know how the
// shards were made. Shards hold uint16 tokens: a tokenizer of more than 65 536 tokens is refused.
// Shards named like ours ("train_" or "val_", digits, ".bin") left in output_dir by an earlier run
// and not rewritten by this one are deleted, so "train_*.bin" never picks up stale data.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace malleus::data {

struct PrepareOptions {
  std::vector<std::string> inputs;  // text files or directories (see above)
  std::string output_dir;           // created if missing
  // A line equal to this string ends a document (fortune files use "%"; a trailing "\r" on the
  // line is ignored, for CRLF files); empty: one file is one document. Documents that are empty
  // or only whitespace are dropped.
  std::string document_separator;
  // Document k (0-based, counted over all files in order) goes to validation when
  // floor((k + 1) * val_fraction) > floor(k * val_fraction): the validation documents are spread
  // evenly through the corpus, and the split is deterministic. With val_fraction > 0 and at least
  // two documents, the validation split gets at least one (the last document). Must be in [0, 1).
  double val_fraction = 0.05;
  int64_t shard_tokens = 100'000'000;  // 1 .. 2^31 - 1 (the header's count is an int32)
  bool skip_binary = true;             // files with NUL bytes (e.g. fortune's .dat indexes)
  std::shared_ptr<const tokenizer::Tokenizer> tokenizer;  // null: the byte tokenizer
};

struct PrepareSummary {
  int64_t files = 0, documents = 0, train_tokens = 0, val_tokens = 0;
  std::vector<std::string> shards;  // paths written: train shards in order, then val shards
  int64_t train_documents = 0, val_documents = 0;
  std::vector<std::string> skipped;  // input files not used, each as "path (reason)"
};

// Throws Error for: no inputs, an input that does not exist, no usable text found, invalid
// options, and any failure to read an input or write a shard.
PrepareSummary prepare_data(const PrepareOptions& options);

// The documents prepare_data would tokenize (same input selection and splitting, empty documents
// included), in order: on_document is called once per document. Fills summary.files and
// summary.skipped. Throws Error like prepare_data for bad inputs. Training a tokenizer reads the
// corpus through this.
void for_each_document(const PrepareOptions& options, PrepareSummary& summary,
                       const std::function<void(std::string_view)>& on_document);

}  // namespace malleus::data
