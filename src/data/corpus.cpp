#include "data/corpus.h"

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "common/error.h"
#include "common/format.h"
#include "data/decompress.h"
#include "data/utf8.h"

namespace malleus::data {

namespace fs = std::filesystem;

namespace {

constexpr size_t kHeadBytes = 64 << 10;  // text looked at for NUL bytes and the format
constexpr size_t kFirstBuffer = 1 << 20;

bool blank(std::string_view text) {
  return text.find_first_not_of(" \t\n\r\f\v") == std::string_view::npos;
}

std::string_view without_line_break(std::string_view line) {
  if (line.ends_with('\n')) line.remove_suffix(1);
  if (line.ends_with('\r')) line.remove_suffix(1);
  return line;
}

std::string size_of(uint64_t bytes) {
  return format_bytes(static_cast<double>(bytes));
}

// Lines of a decompressed file, each with its line break; a line may not exceed `max_line`.
class LineReader {
 public:
  LineReader(DecompressingReader& source, size_t max_line, const std::string& name)
      : source_(source), max_line_(max_line), name_(name), buffer_(kFirstBuffer, '\0') {}

  // Up to `n` bytes from the start of the text, read ahead of next().
  std::string_view head(size_t n) {
    while (end_ < n && !ended_ && fill()) {
    }
    return std::string_view(buffer_).substr(begin_, std::min(n, end_ - begin_));
  }

  // The next line, with its "\n" (the last may have none); valid until the next call. False at
  // the end of the text.
  bool next(std::string_view& line) {
    for (;;) {
      const size_t found = std::string_view(buffer_).substr(0, end_).find('\n', scan_);
      if (found != std::string_view::npos) {
        line = std::string_view(buffer_).substr(begin_, found + 1 - begin_);
        begin_ = scan_ = found + 1;
        ++line_number_;
        return true;
      }
      scan_ = end_;
      if (ended_ || !fill()) {
        if (begin_ == end_) return false;
        line = std::string_view(buffer_).substr(begin_, end_ - begin_);
        begin_ = scan_ = end_;
        ++line_number_;
        return true;
      }
    }
  }

  int64_t line_number() const { return line_number_; }

 private:
  // Reads more text behind what is held, making room first; false at the end of the text.
  bool fill() {
    if (begin_ > 0) {
      std::memmove(buffer_.data(), buffer_.data() + begin_, end_ - begin_);
      end_ -= begin_;
      scan_ -= begin_;
      begin_ = 0;
    }
    if (end_ == buffer_.size()) {
      check(end_ <= max_line_, name_ + ":" + std::to_string(line_number_ + 1) +
                                   ": a line of more than " + size_of(max_line_) +
                                   " (--max-document-mb)");
      buffer_.resize(std::min(buffer_.size() * 2, max_line_ + 2));
    }
    const size_t n = source_.read(buffer_.data() + end_, buffer_.size() - end_);
    if (n == 0) {
      ended_ = true;
      return false;
    }
    end_ += n;
    return true;
  }

  DecompressingReader& source_;
  size_t max_line_;
  const std::string& name_;
  std::string buffer_;
  size_t begin_ = 0, end_ = 0, scan_ = 0;
  bool ended_ = false;
  int64_t line_number_ = 0;
};

// Whether a file's text is JSON Lines, from its first bytes.
bool looks_like_json_lines(std::string_view head) {
  if (head.starts_with("\xEF\xBB\xBF")) head.remove_prefix(3);
  const size_t first = head.find_first_not_of(" \t\n\r");
  return first != std::string_view::npos && head[first] == '{';
}

// The files below a directory, in the stated order; hidden and fortune-index names go to
// `skipped`.
std::vector<fs::path> files_below(const fs::path& dir, const std::string& input,
                                  std::vector<std::string>& skipped) {
  std::vector<fs::path> found;
  try {
    for (auto it = fs::recursive_directory_iterator(dir); it != fs::recursive_directory_iterator();
         ++it) {
      const std::string name = it->path().filename().string();
      if (name.starts_with(".")) {
        if (it->is_directory()) it.disable_recursion_pending();
        skipped.push_back(it->path().string() + " (hidden)");
        continue;
      }
      // is_regular_file follows a symlink to its target; a dangling link is not a file.
      if (!it->is_regular_file()) continue;
      const std::string ext = it->path().extension().string();
      if (ext == ".dat" || ext == ".u8") {
        skipped.push_back(it->path().string() +
                          (ext == ".dat" ? " (.dat: fortune index)" : " (.u8: UTF-8 duplicate)"));
        continue;
      }
      found.push_back(it->path());
    }
  } catch (const fs::filesystem_error& e) {
    throw Error("--input " + input + ": cannot list directory: " + e.what());
  }
  // fs::path compares name by name: a directory's entries in byte order, depth first.
  std::sort(found.begin(), found.end());
  return found;
}

// The files to read, in order, each once.
std::vector<fs::path> collect_inputs(const std::vector<std::string>& inputs,
                                     std::vector<std::string>& skipped) {
  check(!inputs.empty(), "--input: no inputs given");
  std::vector<fs::path> candidates;
  for (const auto& input : inputs) {
    check(!input.empty(), "--input: a path is empty");
    const fs::path path(input);
    std::error_code ec;
    const fs::file_status status = fs::status(path, ec);  // follows symlinks
    check(fs::exists(status), "--input " + input + ": no such file or directory");
    if (fs::is_directory(status)) {
      const std::vector<fs::path> found = files_below(path, input, skipped);
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

}  // namespace

std::string input_format_name(InputFormat format) {
  switch (format) {
    case InputFormat::automatic:
      return "auto";
    case InputFormat::text:
      return "text";
    case InputFormat::jsonl:
      return "jsonl";
  }
  return "auto";
}

InputFormat parse_input_format(const std::string& name) {
  for (InputFormat f : {InputFormat::automatic, InputFormat::text, InputFormat::jsonl}) {
    if (name == input_format_name(f)) return f;
  }
  throw Error("--format must be auto, text or jsonl, got \"" + name + "\"");
}

struct CorpusReader::OpenFile {
  std::string name;
  DecompressingReader source;
  LineReader lines;
  bool json = false;
  OpenFile(const fs::path& path, size_t max_line)
      : name(path.string()), source(path), lines(source, max_line, name) {}
};

CorpusReader::CorpusReader(const CorpusOptions& options) : options_(options) {
  check(options_.max_document_bytes > 0, "--max-document-mb must be positive");
  files_ = collect_inputs(options_.inputs, skipped_);
  for (const auto& file : files_) {
    std::error_code ec;
    const uintmax_t size = fs::file_size(file, ec);
    if (!ec) input_bytes_ += size;
  }
}

CorpusReader::~CorpusReader() = default;

uint64_t CorpusReader::input_bytes_read() const {
  return bytes_of_closed_files_ + (open_ ? open_->source.file_bytes_read() : 0);
}

void CorpusReader::close_file() {
  bytes_of_closed_files_ += open_->source.file_size();
  open_.reset();
}

// Opens the next file that is not passed over; false when none is left.
bool CorpusReader::open_next_file() {
  while (next_file_ < files_.size()) {
    const fs::path& path = files_[next_file_++];
    open_ = std::make_unique<OpenFile>(path, static_cast<size_t>(options_.max_document_bytes));
    const std::string_view head = open_->lines.head(kHeadBytes);
    if (options_.skip_binary && head.find('\0') != std::string_view::npos) {
      skipped_.push_back(
          path.string() + " (binary: NUL bytes in its first 64 KiB" +
          (open_->source.compression() == Compression::none
               ? std::string(")")
               : ", decompressed from " + compression_name(open_->source.compression()) + ")"));
      close_file();
      continue;
    }
    open_->json = options_.format == InputFormat::jsonl ||
                  (options_.format == InputFormat::automatic && looks_like_json_lines(head));
    ++files_read_;
    return true;
  }
  return false;
}

bool CorpusReader::next(RawDocument& doc) {
  for (;;) {
    if (!open_ && !open_next_file()) return false;
    doc.file = static_cast<int32_t>(next_file_ - 1);
    if (open_->json ? next_json(doc) : next_text(doc)) return true;
    close_file();
  }
}

bool CorpusReader::next_json(RawDocument& doc) {
  std::string_view line;
  while (open_->lines.next(line)) {
    line = without_line_break(line);
    if (blank(line)) continue;
    check(line.size() <= static_cast<size_t>(options_.max_document_bytes),
          open_->name + ":" + std::to_string(open_->lines.line_number()) +
              ": a line of more than " +
              size_of(static_cast<uint64_t>(options_.max_document_bytes)) + " (--max-document-mb)");
    doc.bytes.assign(line);
    doc.json = true;
    doc.line = open_->lines.line_number();
    return true;
  }
  return false;
}

bool CorpusReader::next_text(RawDocument& doc) {
  const std::string& separator = options_.document_separator;
  const auto max = static_cast<size_t>(options_.max_document_bytes);
  doc.bytes.clear();
  doc.json = false;
  doc.line = open_->lines.line_number() + 1;
  std::string_view line;
  bool any = false;  // a line was read into this document, or ended it
  while (open_->lines.next(line)) {
    any = true;
    if (!separator.empty() && without_line_break(line) == separator) {
      if (!blank(doc.bytes)) return true;
      doc.bytes.clear();
      doc.line = open_->lines.line_number() + 1;
      continue;
    }
    check(doc.bytes.size() + line.size() <= max,
          open_->name + ":" + std::to_string(doc.line) + ": the document starting here is over " +
              size_of(static_cast<uint64_t>(options_.max_document_bytes)) +
              " (--max-document-mb; a --separator line between documents, or JSON Lines, keeps "
              "them apart)");
    doc.bytes.append(line);
  }
  return any && !blank(doc.bytes);
}

DecodeResult decode_document(RawDocument& doc, const std::string& json_key) {
  DecodeResult result;
  const size_t invalid = invalid_utf8_offset(doc.bytes);
  if (invalid != std::string::npos) {
    result.status = DecodeResult::bad;
    result.kind = BadKind::invalid_utf8;
    const std::string_view before = std::string_view(doc.bytes).substr(0, invalid);
    result.line = doc.line + std::count(before.begin(), before.end(), '\n');
    const size_t line_start = before.rfind('\n');
    const size_t column = invalid - (line_start == std::string_view::npos ? 0 : line_start + 1);
    result.problem = "not valid UTF-8 (byte " + std::to_string(column + 1) + " of the line)";
    return result;
  }
  result.line = doc.line;
  if (doc.json) {
    auto bad = [&](BadKind kind, std::string problem) {
      result.status = DecodeResult::bad;
      result.kind = kind;
      result.problem = std::move(problem);
      return result;
    };
    nlohmann::json value;
    try {
      value = nlohmann::json::parse(doc.bytes);
    } catch (const nlohmann::json::parse_error& e) {
      // nlohmann's own message quotes the line; the position is enough.
      return bad(BadKind::not_json, "not JSON (byte " + std::to_string(e.byte) + " of the line)");
    } catch (const nlohmann::json::exception& e) {  // e.g. a number beyond double's range
      return bad(BadKind::not_json, std::string("not JSON (") + e.what() + ")");
    }
    if (!value.is_object()) {
      return bad(BadKind::not_object,
                 std::string("a JSON ") + value.type_name() + ", not an object");
    }
    const auto member = value.find(json_key);
    if (member == value.end()) {
      return bad(BadKind::missing_key, "no key \"" + json_key + "\" (--json-key)");
    }
    if (!member->is_string()) {
      return bad(BadKind::not_string, "\"" + json_key + "\" holds a " +
                                          std::string(member->type_name()) + ", not a string");
    }
    doc.bytes = std::move(member->get_ref<std::string&>());
  }
  if (blank(doc.bytes)) result.status = DecodeResult::blank;
  return result;
}

namespace {

constexpr const char* kBadNames[kBadKinds] = {"not JSON", "not a JSON object", "without the key",
                                              "not a string at the key", "not UTF-8"};

}  // namespace

void BadInput::add(const DecodeResult& result, const std::string& file) {
  const std::string where = file + ":" + std::to_string(result.line);
  check(skip_,
        where + ": " + result.problem + " (--skip-bad leaves such documents out and counts them)");
  const auto k = static_cast<size_t>(result.kind);
  if (counts_[k]++ == 0) first_[k] = where;
}

int64_t BadInput::total() const {
  int64_t total = 0;
  for (int64_t c : counts_) total += c;
  return total;
}

std::string BadInput::describe() const {
  std::string out;
  for (size_t k = 0; k < counts_.size(); ++k) {
    if (counts_[k] == 0) continue;
    if (!out.empty()) out += ", ";
    out += std::to_string(counts_[k]) + " " + kBadNames[k] + " (first: " + first_[k] + ")";
  }
  return out;
}

}  // namespace malleus::data
