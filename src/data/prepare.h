// `malleus prepare-data`: text files in, token shards out.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace malleus::data {

struct PrepareOptions {
  std::vector<std::string> inputs;  // text files or directories (every regular file inside)
  std::string output_dir;
  // A line equal to this string ends a document (fortune files use "%"); empty: one file is one
  // document. Documents are separated by the end-of-text token.
  std::string document_separator;
  double val_fraction = 0.05;  // every k-th document goes to the validation split
  int64_t shard_tokens = 100'000'000;
  bool skip_binary = true;  // files with NUL bytes (e.g. fortune's .dat indexes) are skipped
};

struct PrepareSummary {
  int64_t files = 0, documents = 0, train_tokens = 0, val_tokens = 0;
  std::vector<std::string> shards;
};

// Writes <output_dir>/train_000000.bin, ... and val_000000.bin, ... (atomically, each).
PrepareSummary prepare_data(const PrepareOptions& options);

}  // namespace malleus::data
