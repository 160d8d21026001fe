#include "data/prepare.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <set>
#include <string_view>
#include <utility>

#include "common/error.h"
#include "common/files.h"
#include "common/format.h"
#include "data/ordered_pipeline.h"
#include "data/shard.h"
#include "tokenizer/byte_tokenizer.h"

namespace malleus::data {

namespace {

std::string shard_name(const std::string& split, int64_t index) {
  char digits[32];
  std::snprintf(digits, sizeof(digits), "%06lld", static_cast<long long>(index));
  return split + "_" + digits + ".bin";
}

// True for names this module writes ("train_000012.bin"), so stale shards can be told apart from
// anything else the user keeps in the output directory.
bool is_our_shard_name(const std::string& name) {
  for (std::string_view prefix : {"train_", "val_"}) {
    if (!name.starts_with(prefix) || !name.ends_with(".bin")) continue;
    std::string_view digits(name);
    digits = digits.substr(prefix.size(), digits.size() - prefix.size() - 4);
    if (digits.size() >= 6 &&
        std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      return true;
    }
  }
  return false;
}

// Streams one split's tokens into shards in the staging directory as they come, so memory holds
// a small buffer however large a shard is.
class ShardWriter {
 public:
  ShardWriter(fs::path staging, std::string split, int64_t shard_tokens)
      : staging_(std::move(staging)), split_(std::move(split)), shard_tokens_(shard_tokens) {}

  void add(const std::vector<uint16_t>& ids) {
    size_t done = 0;
    while (done < ids.size()) {
      if (!file_) {
        names_.push_back(shard_name(split_, static_cast<int64_t>(names_.size())));
        file_ = std::make_unique<ShardFileWriter>(staging_ / names_.back());
      }
      const auto room = static_cast<size_t>(shard_tokens_ - file_->tokens()) - buffer_.size();
      const size_t take = std::min(room, ids.size() - done);
      buffer_.insert(buffer_.end(), ids.begin() + static_cast<std::ptrdiff_t>(done),
                     ids.begin() + static_cast<std::ptrdiff_t>(done + take));
      done += take;
      if (take == room) {
        finish_shard();
      } else if (buffer_.size() >= kBufferTokens) {
        file_->write(buffer_);
        buffer_.clear();
      }
    }
    total_ += static_cast<int64_t>(ids.size());
  }

  // Finishes the last shard; returns the names of the shards written, in order.
  const std::vector<std::string>& finish() {
    if (file_) finish_shard();
    return names_;
  }

  int64_t total() const { return total_; }

 private:
  static constexpr size_t kBufferTokens = 1 << 18;

  void finish_shard() {
    file_->write(buffer_);
    buffer_.clear();
    file_->finish();
    file_.reset();
  }

  fs::path staging_;
  std::string split_;
  int64_t shard_tokens_;
  std::unique_ptr<ShardFileWriter> file_;
  std::vector<uint16_t> buffer_;
  std::vector<std::string> names_;
  int64_t total_ = 0;
};

// Documents, in order, to the train and validation splits (the rule in PrepareOptions).
class Splits {
 public:
  Splits(const fs::path& staging, const PrepareOptions& options)
      : fraction_(options.val_fraction),
        train_(staging, "train", options.shard_tokens),
        val_(staging, "val", options.shard_tokens) {}

  // Each document is held back until the next one arrives: only at the end is it known whether
  // the validation split would stay empty, and then the last document goes there instead.
  void add(std::vector<uint16_t>&& ids) {
    if (have_pending_) {
      emit(goes_to_val(k_));
      ++k_;
    }
    pending_ = std::move(ids);
    have_pending_ = true;
  }

  bool empty() const { return !have_pending_; }

  // Writes the last document and finishes both splits; fills the summary's counts. Returns the
  // shards' names, train first.
  std::vector<std::string> finish(PrepareSummary& summary) {
    emit(goes_to_val(k_) || (fraction_ > 0 && k_ >= 1 && val_documents_ == 0));
    std::vector<std::string> names = train_.finish();
    const auto& val_names = val_.finish();
    names.insert(names.end(), val_names.begin(), val_names.end());
    summary.documents = k_ + 1;
    summary.train_documents = k_ + 1 - val_documents_;
    summary.val_documents = val_documents_;
    summary.train_tokens = train_.total();
    summary.val_tokens = val_.total();
    return names;
  }

 private:
  bool goes_to_val(int64_t k) const {
    const auto kd = static_cast<double>(k);
    return fraction_ > 0 && std::floor((kd + 1) * fraction_) > std::floor(kd * fraction_);
  }
  void emit(bool to_val) {
    (to_val ? val_ : train_).add(pending_);
    if (to_val) ++val_documents_;
  }

  double fraction_;
  ShardWriter train_, val_;
  std::vector<uint16_t> pending_;
  bool have_pending_ = false;
  int64_t k_ = 0;  // number of the pending document
  int64_t val_documents_ = 0;
};

// The output directory while a run writes into it: locked against a second run, with a staging
// directory for the new shards that is removed however the run ends.
class OutputDir {
 public:
  explicit OutputDir(const std::string& dir) : dir_(dir), staging_(dir_ / ".prepare-data.partial") {
    std::error_code ec;
    fs::create_directories(dir_, ec);
    check(!ec && fs::is_directory(dir_),
          "prepare-data: cannot create output directory " + dir +
              (ec ? ": " + ec.message() : std::string(": exists and is not a directory")));
    lock_fd_ = ::open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    check(lock_fd_ >= 0, "prepare-data: cannot open " + dir + ": " + std::strerror(errno));
    if (::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
      ::close(lock_fd_);
      throw Error("prepare-data: another prepare-data is writing to " + dir);
    }
    fs::remove_all(staging_, ec);  // left by a run that was killed
    fs::create_directory(staging_, ec);
    if (ec) {
      ::close(lock_fd_);
      throw Error("prepare-data: cannot create " + staging_.string() + ": " + ec.message());
    }
  }
  ~OutputDir() {
    std::error_code ignored;
    fs::remove_all(staging_, ignored);
    ::close(lock_fd_);
  }
  OutputDir(const OutputDir&) = delete;
  OutputDir& operator=(const OutputDir&) = delete;

  const fs::path& path() const { return dir_; }
  const fs::path& staging() const { return staging_; }

  // Moves the staged shards into place, each replacing an old one atomically; returns their paths.
  std::vector<std::string> commit(const std::vector<std::string>& names) {
    std::vector<std::string> paths;
    for (const auto& name : names) {
      std::error_code ec;
      fs::rename(staging_ / name, dir_ / name, ec);
      check(!ec,
            "prepare-data: cannot move " + name + " into " + dir_.string() + ": " + ec.message());
      paths.push_back((dir_ / name).string());
    }
    sync_directory(dir_);
    return paths;
  }

 private:
  fs::path dir_, staging_;
  int lock_fd_ = -1;
};

// The options' checks, before anything is read or written; returns the tokenizer to encode with
// (the byte tokenizer unless one is given).
std::shared_ptr<const tokenizer::Tokenizer> checked_encoder(const PrepareOptions& options) {
  check(!options.inputs.empty(), "prepare-data: no inputs given");
  check(!options.output_dir.empty(), "prepare-data: no output directory given");
  const double fraction = options.val_fraction;
  check(std::isfinite(fraction) && fraction >= 0 && fraction < 1,
        "prepare-data: val_fraction must be in [0, 1), got " + std::to_string(fraction));
  check(options.shard_tokens > 0 && options.shard_tokens <= std::numeric_limits<int32_t>::max(),
        "prepare-data: shard_tokens must be in [1, 2^31 - 1] (the shard header's count is an "
        "int32), got " +
            std::to_string(options.shard_tokens));
  const std::shared_ptr<const tokenizer::Tokenizer> encoder =
      options.tokenizer ? options.tokenizer : std::make_shared<tokenizer::ByteTokenizer>();
  check(options.batch_bytes > 0,
        "prepare-data: batch_bytes must be positive, got " + std::to_string(options.batch_bytes));
  check(options.threads >= 1,
        "prepare-data: threads must be at least 1, got " + std::to_string(options.threads));
  check(encoder->vocab_size() <= 65536,
        "prepare-data: the " + encoder->describe() +
            " has more ids than shards can hold (uint16 tokens: at most 65536)");
  return encoder;
}

// Removes the shards of `out_dir` that this run did not write.
void remove_stale_shards(const fs::path& out_dir, const std::vector<std::string>& shards) {
  std::set<std::string> written;
  for (const auto& shard : shards) written.insert(fs::path(shard).filename().string());
  for (const auto& entry : fs::directory_iterator(out_dir)) {
    const std::string name = entry.path().filename().string();
    if (is_our_shard_name(name) && !written.contains(name)) {
      std::error_code ec;
      fs::remove(entry.path(), ec);
      check(!ec, "prepare-data: cannot remove stale shard " + entry.path().string() + ": " +
                     ec.message());
    }
  }
}

}  // namespace

std::string format_progress(const PrepareProgress& p) {
  const double mb = static_cast<double>(p.text_bytes) / 1e6;
  char rate[64];
  std::snprintf(rate, sizeof(rate), "%.1f MB/s", p.seconds > 0 ? mb / p.seconds : 0.0);
  std::string line = format_count(static_cast<double>(p.documents)) + " documents, " +
                     format_count(static_cast<double>(p.tokens)) + " tokens, " + rate;
  if (p.input_bytes > 0) {
    const double done =
        static_cast<double>(p.input_bytes_read) / static_cast<double>(p.input_bytes);
    char percent[32];
    std::snprintf(percent, sizeof(percent), "%.0f %%", 100 * done);
    line += std::string(", ") + percent + " of " +
            format_bytes(static_cast<double>(p.input_bytes)) + " read";
    if (done > 0 && p.seconds > 0) {
      line += ", ETA " + format_duration(p.seconds * (1 - done) / done);
    }
  }
  return line;
}

namespace {

// A batch of documents on its way through a run.
struct Batch {
  std::vector<RawDocument> docs;
  std::vector<DecodeResult> results;
  std::vector<std::vector<uint16_t>> ids;  // ids fit uint16: the vocabulary was checked
  uint64_t text_bytes = 0;                 // the documents' bytes as read
  uint64_t input_bytes_read = 0;           // where the reader was on disk after the batch
};

// Reads the next batch of documents; false at the end of the corpus.
bool read_batch(CorpusReader& reader, uint64_t batch_bytes, Batch& batch) {
  RawDocument doc;
  while (batch.text_bytes < batch_bytes && reader.next(doc)) {
    batch.text_bytes += doc.bytes.size();
    batch.docs.push_back(std::move(doc));
    doc = RawDocument{};
  }
  batch.input_bytes_read = reader.input_bytes_read();
  return !batch.docs.empty();
}

// Decodes and tokenizes a batch (on any thread); the text is freed as soon as it is tokenized.
void tokenize_batch(Batch& batch, const tokenizer::Tokenizer& encoder, const std::string& key) {
  batch.results.resize(batch.docs.size());
  batch.ids.resize(batch.docs.size());
  for (size_t i = 0; i < batch.docs.size(); ++i) {
    RawDocument& doc = batch.docs[i];
    batch.results[i] = decode_document(doc, key);
    if (batch.results[i].status == DecodeResult::ok) {
      const std::vector<int32_t> ids = tokenizer::encode_document(encoder, doc.bytes);
      batch.ids[i].assign(ids.begin(), ids.end());
    }
    std::string().swap(doc.bytes);
  }
}

}  // namespace

PrepareSummary prepare_data(const PrepareOptions& options) {
  const std::shared_ptr<const tokenizer::Tokenizer> encoder = checked_encoder(options);
  // Inputs are listed before anything is written, so shards from an earlier run in a directory
  // that is also an input are never read back as text.
  CorpusReader reader(options);
  OutputDir out(options.output_dir);
  Splits splits(out.staging(), options);
  BadInput bad(options.skip_bad);

  const auto batch_bytes = static_cast<uint64_t>(options.batch_bytes);
  PrepareProgress progress;
  progress.input_bytes = reader.input_bytes();
  const auto start = std::chrono::steady_clock::now();
  double last_report = 0;
  auto consume = [&](Batch& batch) {
    for (size_t i = 0; i < batch.docs.size(); ++i) {
      const DecodeResult& result = batch.results[i];
      if (result.status == DecodeResult::bad) {
        bad.add(result, reader.files()[static_cast<size_t>(batch.docs[i].file)].string());
      } else if (result.status == DecodeResult::ok) {
        ++progress.documents;
        progress.tokens += static_cast<int64_t>(batch.ids[i].size());
        splits.add(std::move(batch.ids[i]));
      }
    }
    progress.text_bytes += batch.text_bytes;
    progress.input_bytes_read = batch.input_bytes_read;
    progress.seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (options.on_progress && progress.seconds - last_report >= options.progress_seconds) {
      options.on_progress(progress);
      last_report = progress.seconds;
    }
  };
  run_ordered<Batch>(
      options.threads, 2 * options.threads + 2,
      [&](Batch& batch) { return read_batch(reader, batch_bytes, batch); },
      [&](Batch& batch) { tokenize_batch(batch, *encoder, options.json_key); }, consume);

  PrepareSummary summary;
  summary.files = reader.files_read();
  summary.skipped = reader.skipped();
  summary.bad_documents = bad.total();
  summary.bad_summary = bad.describe();
  summary.text_bytes = progress.text_bytes;
  check(!splits.empty(),
        "prepare-data: no usable text found in the inputs (" + std::to_string(summary.files) +
            " file(s) read, " + std::to_string(summary.skipped.size()) + " skipped" +
            (summary.bad_documents > 0
                 ? ", " + std::to_string(summary.bad_documents) + " bad document(s) left out"
                 : std::string()) +
            ")");
  const std::vector<std::string> names = splits.finish(summary);
  summary.shards = out.commit(names);
  tokenizer::save_tokenizer(*encoder, out.path());
  remove_stale_shards(out.path(), summary.shards);
  return summary;
}

}  // namespace malleus::data
