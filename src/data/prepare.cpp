#include "data/prepare.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <set>
#include <string_view>
#include <utility>

#include "common/error.h"
#include "common/files.h"
#include "data/shard.h"
#include "tokenizer/byte_tokenizer.h"

namespace malleus::data {

namespace {

bool whitespace_only(std::string_view text) {
  return text.find_first_not_of(" \t\n\r\f\v") == std::string_view::npos;
}

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

// Streams one split's tokens into fixed-size shards, so memory stays at one shard however large
// the corpus is.
class ShardWriter {
 public:
  ShardWriter(fs::path dir, std::string split, int64_t shard_tokens,
              std::vector<std::string>& written)
      : dir_(std::move(dir)),
        split_(std::move(split)),
        shard_tokens_(static_cast<size_t>(shard_tokens)),
        written_(written) {}

  void add(const std::vector<int32_t>& ids) {
    // Ids were checked against the vocabulary size, which fits uint16.
    const std::vector<uint16_t> tokens(ids.begin(), ids.end());
    size_t done = 0;
    while (done < tokens.size()) {
      const size_t take = std::min(shard_tokens_ - buffer_.size(), tokens.size() - done);
      buffer_.insert(buffer_.end(), tokens.begin() + static_cast<std::ptrdiff_t>(done),
                     tokens.begin() + static_cast<std::ptrdiff_t>(done + take));
      done += take;
      if (buffer_.size() == shard_tokens_) flush();
    }
    total_ += static_cast<int64_t>(tokens.size());
  }

  void finish() {
    if (!buffer_.empty()) flush();
  }

  int64_t total() const { return total_; }

 private:
  void flush() {
    const fs::path path = dir_ / shard_name(split_, next_index_++);
    write_shard(path, buffer_);
    written_.push_back(path.string());
    buffer_.clear();
  }

  fs::path dir_;
  std::string split_;
  size_t shard_tokens_;
  std::vector<std::string>& written_;
  std::vector<uint16_t> buffer_;
  int64_t next_index_ = 0;
  int64_t total_ = 0;
};

// The files to read, in order, each once.
std::vector<fs::path> collect_inputs(const std::vector<std::string>& inputs,
                                     std::vector<std::string>& skipped) {
  std::vector<fs::path> candidates;
  for (const auto& input : inputs) {
    check(!input.empty(), "--input: a path is empty");
    const fs::path path(input);
    std::error_code ec;
    const fs::file_status status = fs::status(path, ec);  // follows symlinks
    check(fs::exists(status), "--input " + input + ": no such file or directory");
    if (fs::is_directory(status)) {
      std::vector<fs::path> found;
      try {
        for (const auto& entry : fs::recursive_directory_iterator(path)) {
          // is_regular_file follows a symlink to its target; a dangling link is not a file.
          if (!entry.is_regular_file()) continue;
          const std::string ext = entry.path().extension().string();
          if (ext == ".dat" || ext == ".u8") {
            skipped.push_back(entry.path().string() + (ext == ".dat" ? " (.dat: fortune index)"
                                                                     : " (.u8: UTF-8 duplicate)"));
            continue;
          }
          found.push_back(entry.path());
        }
      } catch (const fs::filesystem_error& e) {
        throw Error("--input " + input + ": cannot list directory: " + e.what());
      }
      std::sort(found.begin(), found.end());
      candidates.insert(candidates.end(), found.begin(), found.end());
    } else if (fs::is_regular_file(status)) {
      candidates.push_back(path);
    } else {
      throw Error("--input " + input + ": not a regular file or directory");
    }
  }

  std::vector<fs::path> files;
  std::set<fs::path> seen;
  for (const auto& path : candidates) {
    std::error_code ec;
    fs::path canonical = fs::canonical(path, ec);
    if (ec) canonical = path;
    if (!seen.insert(canonical).second) {
      skipped.push_back(path.string() + " (same file as an earlier input)");
      continue;
    }
    files.push_back(path);
  }
  return files;
}

// Calls on_document(text) for every document of one file, in order.
template <typename F>
void split_documents(std::string_view text, const std::string& separator, F&& on_document) {
  if (separator.empty()) {
    on_document(text);
    return;
  }
  size_t doc_begin = 0, line_begin = 0;
  while (line_begin < text.size()) {
    size_t line_end = text.find('\n', line_begin);
    const size_t next = line_end == std::string_view::npos ? text.size() : line_end + 1;
    if (line_end == std::string_view::npos) line_end = text.size();
    std::string_view line = text.substr(line_begin, line_end - line_begin);
    if (line.ends_with('\r')) line.remove_suffix(1);
    if (line == separator) {
      on_document(text.substr(doc_begin, line_begin - doc_begin));
      doc_begin = next;
    }
    line_begin = next;
  }
  on_document(text.substr(doc_begin));
}

}  // namespace

void for_each_document(const PrepareOptions& options, PrepareSummary& summary,
                       const std::function<void(std::string_view)>& on_document) {
  check(!options.inputs.empty(), "--input: no inputs given");
  // Inputs are listed before anything is written, so shards from an earlier run in a directory
  // that is also an input are never read back as text.
  const std::vector<fs::path> files = collect_inputs(options.inputs, summary.skipped);
  for (const auto& path : files) {
    const std::string text = read_file(path);
    if (options.skip_binary && text.find('\0') != std::string::npos) {
      summary.skipped.push_back(path.string() + " (binary: contains NUL bytes)");
      continue;
    }
    ++summary.files;
    split_documents(text, options.document_separator, on_document);
  }
}

namespace {

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
  check(encoder->vocab_size() <= 65536,
        "prepare-data: the " + encoder->describe() +
            " has more ids than shards can hold (uint16 tokens: at most 65536)");

  // Checked before the output directory is touched.
  for (const auto& input : options.inputs) {
    std::error_code ec;
    check(!input.empty(), "--input: a path is empty");
    check(fs::exists(fs::status(input, ec)), "--input " + input + ": no such file or directory");
  }
  return encoder;
}

// Each shard is replaced atomically, but the set of shards is not: a run that fails midway
// leaves old and new shards side by side, and must be rerun. Removes the shards of `out_dir`
// that this run did not write.
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

PrepareSummary prepare_data(const PrepareOptions& options) {
  const std::shared_ptr<const tokenizer::Tokenizer> encoder = checked_encoder(options);
  const double fraction = options.val_fraction;
  PrepareSummary summary;
  const fs::path out_dir(options.output_dir);
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  check(!ec && fs::is_directory(out_dir),
        "prepare-data: cannot create output directory " + options.output_dir +
            (ec ? ": " + ec.message() : std::string(": exists and is not a directory")));

  std::vector<std::string> train_shards, val_shards;
  ShardWriter train(out_dir, "train", options.shard_tokens, train_shards);
  ShardWriter val(out_dir, "val", options.shard_tokens, val_shards);

  auto goes_to_val = [fraction](int64_t k) {
    const auto kd = static_cast<double>(k);
    return fraction > 0 && std::floor((kd + 1) * fraction) > std::floor(kd * fraction);
  };
  auto emit = [&](const std::vector<int32_t>& tokens, bool to_val) {
    (to_val ? val : train).add(tokens);
    ++(to_val ? summary.val_documents : summary.train_documents);
  };

  // Each document is held back until the next one arrives: only at the end is it known whether
  // the validation split would stay empty, and then the last document goes there instead.
  std::vector<int32_t> pending;
  bool have_pending = false;
  int64_t k = 0;  // number of the pending document
  for_each_document(options, summary, [&](std::string_view doc) {
    if (whitespace_only(doc)) return;
    if (have_pending) {
      emit(pending, goes_to_val(k));
      ++k;
    }
    pending = tokenizer::encode_document(*encoder, doc);
    have_pending = true;
  });
  check(have_pending, "prepare-data: no usable text found in the inputs (" +
                          std::to_string(summary.files) + " text file(s) read, " +
                          std::to_string(summary.skipped.size()) + " skipped)");
  emit(pending, goes_to_val(k) || (fraction > 0 && k >= 1 && summary.val_documents == 0));
  train.finish();
  val.finish();

  summary.documents = k + 1;
  summary.train_tokens = train.total();
  summary.val_tokens = val.total();
  summary.shards = train_shards;
  summary.shards.insert(summary.shards.end(), val_shards.begin(), val_shards.end());

  tokenizer::save_tokenizer(*encoder, out_dir);

  remove_stale_shards(out_dir, summary.shards);
  return summary;
}

}  // namespace malleus::data
