// A corpus as prepare-data and train-tokenizer read it: which files, in which order, how each
// is cut into documents, and which input is bad.
//
// Files: an input is a file or a directory. A directory contributes every regular file below it,
// depth first, the entries of each directory in byte order of their names (so the order never
// depends on the file system). Below a directory, names starting with "." are passed over (.git,
// .cache and the like), and so are names ending in ".dat" or ".u8": in a fortune directory
// (/usr/share/games/fortunes) those are strfile's binary indexes and UTF-8 duplicates. Symlinks to
// files are followed, symlinks to directories are not (a link cycle cannot loop). A file named as
// an input is never passed over for its name; the same file reached twice is read once.
//
// Each file is read through DecompressingReader (plain, gzip, xz or zstd, told from its content).
// Its text is then
// - JSON Lines when format is jsonl, or with format automatic when its first character other than
//   white space (after a UTF-8 byte order mark) is "{": every line that is not blank is a JSON
//   object, and its member json_key, a string, is one document;
// - plain text otherwise: a line equal to document_separator (a trailing "\r" ignored) ends a
//   document; with an empty separator the whole file is one document.
// With skip_binary, a file whose first 64 KiB of text hold a NUL byte is passed over as binary.
//
// Bad input: a JSON line that does not parse, is not an object, lacks the key or holds something
// other than a string there, and text that is not UTF-8, stop with an Error naming the file and the
// line; with skip_bad such documents are counted (BadInput) and left out instead. A document of
// more than max_document_bytes always stops with an Error: it is what bounds the memory a document
// can take.
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace malleus::data {

enum class InputFormat { automatic, text, jsonl };

// "auto", "text", "jsonl" and back; parse_input_format throws Error for another name.
std::string input_format_name(InputFormat format);
InputFormat parse_input_format(const std::string& name);

struct CorpusOptions {
  std::vector<std::string> inputs;  // files or directories
  InputFormat format = InputFormat::automatic;
  std::string json_key = "text";
  // Plain text only: a line equal to this ends a document; empty: one file is one document.
  std::string document_separator;
  bool skip_binary = true;  // pass over files whose text starts with a NUL byte in 64 KiB
  bool skip_bad = false;    // count bad documents and leave them out instead of stopping
  int64_t max_document_bytes = int64_t{64} << 20;
};

// One document as read, before it is decoded: a JSON line or the text of a plain document.
struct RawDocument {
  std::string bytes;  // the line (without its line break) or the document's text
  bool json = false;
  int32_t file = 0;  // index into CorpusReader::files()
  int64_t line = 0;  // 1-based line of the file where the document starts
};

// Reads the documents of a corpus in order, one file open at a time.
class CorpusReader {
 public:
  // Lists the inputs; throws Error naming an input that does not exist or cannot be listed.
  explicit CorpusReader(const CorpusOptions& options);
  ~CorpusReader();
  CorpusReader(const CorpusReader&) = delete;
  CorpusReader& operator=(const CorpusReader&) = delete;

  // The next document that is not blank (white space only), in input order; false at the end.
  // Throws Error naming the file (and line) for unreadable, corrupt or truncated input and for a
  // document over max_document_bytes.
  bool next(RawDocument& doc);

  // Every file to be read, in order (RawDocument::file indexes this).
  const std::vector<std::filesystem::path>& files() const { return files_; }
  // Input files not used, each as "path (reason)".
  const std::vector<std::string>& skipped() const { return skipped_; }
  int64_t files_read() const { return files_read_; }
  // The size on disk of every file listed, and how much of it has been read so far.
  uint64_t input_bytes() const { return input_bytes_; }
  uint64_t input_bytes_read() const;

 private:
  bool open_next_file();
  bool next_json(RawDocument& doc);
  bool next_text(RawDocument& doc);
  void close_file();

  CorpusOptions options_;
  std::vector<std::filesystem::path> files_;
  std::vector<std::string> skipped_;
  int64_t files_read_ = 0;
  uint64_t input_bytes_ = 0, bytes_of_closed_files_ = 0;
  size_t next_file_ = 0;
  struct OpenFile;
  std::unique_ptr<OpenFile> open_;
};

// What decoding a document found.
enum class BadKind { not_json, not_object, missing_key, not_string, invalid_utf8 };
constexpr int kBadKinds = 5;

struct DecodeResult {
  enum Status { ok, blank, bad } status = ok;
  BadKind kind = BadKind::not_json;  // when bad
  std::string problem;               // when bad: what is wrong, for the message
  int64_t line = 0;                  // when bad: the line at fault
};

// Turns a raw document into its text, in place: a JSON line into its key's string, plain text
// checked to be UTF-8. A document whose text is white space only comes back blank.
DecodeResult decode_document(RawDocument& doc, const std::string& json_key);

// The bad documents of a run: with skip_bad counted, otherwise the first one stops the run.
class BadInput {
 public:
  explicit BadInput(bool skip) : skip_(skip) {}
  // Throws Error "<file>:<line>: <problem>" unless skipping; counts it otherwise.
  void add(const DecodeResult& result, const std::string& file);
  int64_t total() const;
  // "2 not JSON (first: a.jsonl:3), 1 without the key (first: b.jsonl:9)"; empty if none.
  std::string describe() const;

 private:
  bool skip_;
  std::array<int64_t, kBadKinds> counts_{};
  std::array<std::string, kBadKinds> first_;
};

// Reads, decodes and checks every document in order, calling on_document with its text (blank
// documents left out); bad ones go to `bad`. Training a tokenizer reads the corpus through this.
struct CorpusCounts {
  int64_t files = 0, documents = 0;
  std::vector<std::string> skipped;
};
template <typename F>
CorpusCounts for_each_document(const CorpusOptions& options, BadInput& bad, F&& on_document) {
  CorpusReader reader(options);
  RawDocument doc;
  CorpusCounts counts;
  while (reader.next(doc)) {
    const DecodeResult result = decode_document(doc, options.json_key);
    if (result.status == DecodeResult::bad) {
      bad.add(result, reader.files()[static_cast<size_t>(doc.file)].string());
    } else if (result.status == DecodeResult::ok) {
      ++counts.documents;
      on_document(std::string_view(doc.bytes));
    }
  }
  counts.files = reader.files_read();
  counts.skipped = reader.skipped();
  return counts;
}

}  // namespace malleus::data
