// `malleus prepare-data`: a corpus in, token shards out.
//
// Input: the documents of a corpus, in order (corpus.h: files and directories, plain text or JSON
// Lines, plain or gzip/xz/zstd compressed, and what counts as bad input).
//
// Output: each document's tokens (tokenizer::encode_document: bos if the tokenizer has one, the
// text, eos if it has one; for the byte tokenizer the bytes and end-of-text), in document order,
// into <output_dir>/train_000000.bin, train_000001.bin, ... and val_000000.bin, ..., each at most
// shard_tokens tokens (a document may continue into the next shard); then the tokenizer itself
// (tokenizer::save_tokenizer), so training and generation know how the shards were made. Shards
// hold uint16 tokens: a tokenizer of more than 65 536 tokens is refused. Shards named like ours
// ("train_" or "val_", digits, ".bin") left in output_dir by an earlier run and not rewritten by
// this one are deleted, so "train_*.bin" never picks up stale data.
//
// At any size: documents are read on one thread, tokenized on `threads` threads and written in
// the order they were read, so the shards are the same bytes whatever the thread count. Memory
// stays bounded whatever the corpus size: at most 2 × threads + 2 batches of about batch_bytes of
// text are in flight (a larger document is a batch of its own), and shards are written as they
// fill.
//
// Never half done: shards are written into <output_dir>/.prepare-data.partial/ and moved into
// place only when every document is in; a run that fails leaves output_dir as it was, and removes
// its partial directory (one killed outright leaves it, and the next run removes it). Two runs on
// one output_dir at once are refused (a lock on the directory).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "data/corpus.h"
#include "tokenizer/tokenizer.h"

namespace malleus::data {

// Where a run is, for progress lines.
struct PrepareProgress {
  int64_t documents = 0, tokens = 0;
  uint64_t text_bytes = 0;                         // decompressed input read into documents so far
  uint64_t input_bytes_read = 0, input_bytes = 0;  // on disk: read so far, and in all
  double seconds = 0;                              // since the run started
};

// "1.20 M documents, 456.7 M tokens, 812 MB of text at 12.3 MB/s, 45 % of 1.10 GB read, ETA 3m12s"
std::string format_progress(const PrepareProgress& progress);

struct PrepareOptions : CorpusOptions {
  std::string output_dir;  // created if missing
  // Document k (0-based, counted over all documents in order) goes to validation when
  // floor((k + 1) * val_fraction) > floor(k * val_fraction): the validation documents are spread
  // evenly through the corpus, and the split is deterministic. With val_fraction > 0 and at least
  // two documents, the validation split gets at least one (the last document). Must be in [0, 1).
  double val_fraction = 0.05;
  int64_t shard_tokens = 100'000'000;  // 1 .. 2^31 - 1 (the header's count is an int32)
  std::shared_ptr<const tokenizer::Tokenizer> tokenizer;  // null: the byte tokenizer
  int threads = 1;  // tokenizing threads (documents are read on one more)
  // Called with the run's progress every progress_seconds (0: after every batch); may be empty.
  std::function<void(const PrepareProgress&)> on_progress;
  double progress_seconds = 10;
  int64_t batch_bytes = 1 << 20;  // text per batch of documents handed to a thread
};

struct PrepareSummary {
  int64_t files = 0, documents = 0, train_tokens = 0, val_tokens = 0;
  std::vector<std::string> shards;  // paths written: train shards in order, then val shards
  int64_t train_documents = 0, val_documents = 0;
  std::vector<std::string> skipped;  // input files not used, each as "path (reason)"
  int64_t bad_documents = 0;         // left out under skip_bad
  std::string bad_summary;           // BadInput::describe(); empty if none
  uint64_t text_bytes = 0;           // decompressed input read
};

// Throws Error for: no inputs, an input that does not exist, no usable text found, invalid
// options, bad input (unless skip_bad), and any failure to read an input or write a shard.
PrepareSummary prepare_data(const PrepareOptions& options);

}  // namespace malleus::data
