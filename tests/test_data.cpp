// Tests of the data pipeline: llm.c shard files, the token dataset and its
// sampler, and prepare_data (text files to shards).
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>
#include "test_util.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/error.h"
#include "common/files.h"
#include "data/dataset.h"
#include "data/decompress.h"
#include "data/ordered_pipeline.h"
#include "data/prepare.h"
#include "data/shard.h"
#include "data/utf8.h"
#include "tokenizer/byte_tokenizer.h"

namespace fs = std::filesystem;
using malleus::Error;
using namespace malleus::data;

namespace {

using TempDir = malleus::testing::ScratchDir;

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string le32(int32_t value) {
  std::string out(4, '\0');
  auto v = static_cast<uint32_t>(value);
  for (int i = 0; i < 4; ++i)
    out[static_cast<size_t>(i)] = static_cast<char>((v >> (8 * i)) & 0xFF);
  return out;
}

// A shard header built by hand, independent of write_shard, for malformed-file tests.
std::string raw_header(int32_t magic, int32_t version, int32_t count) {
  std::string header = le32(magic) + le32(version) + le32(count);
  header.resize(static_cast<size_t>(kShardHeaderInts) * 4, '\0');
  return header;
}

// Runs `fn`, expects Error, and checks that the message holds every one of `parts`.
void expect_error(const std::function<void()>& fn, std::initializer_list<std::string> parts) {
  try {
    fn();
    ADD_FAILURE() << "expected malleus::Error, nothing was thrown";
  } catch (const Error& e) {
    const std::string message = e.what();
    for (const auto& part : parts) {
      EXPECT_NE(message.find(part), std::string::npos)
          << "message \"" << message << "\" lacks \"" << part << "\"";
    }
  }
}

std::vector<uint16_t> iota_tokens(size_t n) {
  std::vector<uint16_t> tokens(n);
  for (size_t i = 0; i < n; ++i) tokens[i] = static_cast<uint16_t>(i);
  return tokens;
}

}  // namespace

// ---------------------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------------
// Shards

TEST(Shard, RoundTrip) {
  TempDir dir;
  const std::vector<uint16_t> tokens = {0, 1, 255, 256, 1000, 50256, 65535};
  write_shard(dir / "s.bin", tokens);
  EXPECT_EQ(read_shard(dir / "s.bin"), tokens);

  write_shard(dir / "empty.bin", {});
  EXPECT_TRUE(read_shard(dir / "empty.bin").empty());

  const auto big = iota_tokens(60000);
  write_shard(dir / "big.bin", big);
  EXPECT_EQ(read_shard(dir / "big.bin"), big);
  // AtomicFile leaves no temporary files behind.
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 3);
}

TEST(Shard, HeaderBytesMatchLlmC) {
  TempDir dir;
  write_shard(dir / "s.bin", {0x0102, 0xFFFE, 7});
  const std::string bytes = read_bytes(dir / "s.bin");
  ASSERT_EQ(bytes.size(), 1024u + 3 * 2);
  auto byte = [&](size_t i) { return static_cast<unsigned char>(bytes[i]); };
  // int32 [0] = 20240520 = 0x0134D888, little-endian.
  EXPECT_EQ(byte(0), 0x88);
  EXPECT_EQ(byte(1), 0xD8);
  EXPECT_EQ(byte(2), 0x34);
  EXPECT_EQ(byte(3), 0x01);
  // int32 [1] = version 1, int32 [2] = 3 tokens.
  EXPECT_EQ(bytes.substr(4, 4), std::string("\x01\0\0\0", 4));
  EXPECT_EQ(bytes.substr(8, 4), std::string("\x03\0\0\0", 4));
  for (size_t i = 12; i < 1024; ++i) ASSERT_EQ(byte(i), 0) << "header byte " << i;
  // Tokens as little-endian uint16 right after the header.
  EXPECT_EQ(byte(1024), 0x02);
  EXPECT_EQ(byte(1025), 0x01);
  EXPECT_EQ(byte(1026), 0xFE);
  EXPECT_EQ(byte(1027), 0xFF);
  EXPECT_EQ(byte(1028), 7);
  EXPECT_EQ(byte(1029), 0);
}

TEST(Shard, ReadsHandMadeShard) {
  TempDir dir;
  write_bytes(dir / "h.bin", raw_header(20240520, 1, 2) + std::string("\x05\x00\x00\x01", 4));
  EXPECT_EQ(read_shard(dir / "h.bin"), (std::vector<uint16_t>{5, 256}));
}

TEST(Shard, MalformedFilesNameFileAndProblem) {
  TempDir dir;
  const fs::path missing = dir / "missing.bin";
  expect_error([&] { read_shard(missing); }, {missing.string(), "no such file"});

  const fs::path truncated = dir / "truncated.bin";
  write_bytes(truncated, raw_header(20240520, 1, 0).substr(0, 100));
  expect_error([&] { read_shard(truncated); }, {truncated.string(), "truncated header"});

  const fs::path magic = dir / "magic.bin";
  write_bytes(magic, raw_header(12345, 1, 0));
  expect_error([&] { read_shard(magic); }, {magic.string(), "not a token shard: bad magic 12345"});

  const fs::path version = dir / "version.bin";
  write_bytes(version, raw_header(20240520, 2, 0));
  expect_error([&] { read_shard(version); }, {version.string(), "version 2"});

  const fs::path size = dir / "size.bin";
  write_bytes(size, raw_header(20240520, 1, 10) + std::string(5 * 2, '\0'));
  expect_error([&] { read_shard(size); },
               {size.string(), "header says 10 tokens but file holds 5"});

  const fs::path odd = dir / "odd.bin";
  write_bytes(odd, raw_header(20240520, 1, 2) + std::string(5, '\0'));
  expect_error([&] { read_shard(odd); }, {odd.string(), "header says 2 tokens but file holds 2"});

  const fs::path negative = dir / "negative.bin";
  write_bytes(negative, raw_header(20240520, 1, -1));
  expect_error([&] { read_shard(negative); }, {negative.string(), "header says -1 tokens"});
}

TEST(Shard, AppendLeavesVectorAloneOnError) {
  TempDir dir;
  write_shard(dir / "a.bin", {1, 2});
  write_bytes(dir / "bad.bin", raw_header(1, 1, 0));
  std::vector<uint16_t> out;
  append_shard(dir / "a.bin", out);
  append_shard(dir / "a.bin", out);
  EXPECT_EQ(out, (std::vector<uint16_t>{1, 2, 1, 2}));
  EXPECT_THROW(append_shard(dir / "bad.bin", out), Error);
  EXPECT_EQ(out.size(), 4u);
}

// ---------------------------------------------------------------------------------------------
// TokenDataset

TEST(TokenDataset, ConcatenatesShardsInNameOrder) {
  TempDir dir;
  // Written in reverse order: the file name, not creation order, decides.
  write_shard(dir / "train_000001.bin", {3, 4});
  write_shard(dir / "train_000000.bin", {1, 2});
  write_shard(dir / "val_000000.bin", {99});
  TokenDataset data((dir / "train_*.bin").string(), 257);
  EXPECT_EQ(data.num_shards(), 2);
  EXPECT_EQ(data.num_tokens(), 4);
  EXPECT_EQ(data.tokens(), (std::vector<uint16_t>{1, 2, 3, 4}));

  TokenDataset one((dir / "val_000000.bin").string(), 257);
  EXPECT_EQ(one.num_shards(), 1);
  EXPECT_EQ(one.tokens(), (std::vector<uint16_t>{99}));
}

TEST(TokenDataset, TokenOutsideVocabNamesFileTokenAndVocab) {
  TempDir dir;
  write_shard(dir / "a.bin", {1, 2});
  write_shard(dir / "b.bin", {10, 50256, 3});
  expect_error([&] { TokenDataset((dir / "*.bin").string(), 257); },
               {(dir / "b.bin").string(), "holds token 50256", "vocab_size is 257"});
  // The largest legal token is vocab_size - 1.
  EXPECT_NO_THROW(TokenDataset((dir / "*.bin").string(), 50257));
  expect_error([&] { TokenDataset((dir / "*.bin").string(), 50256); }, {"50256"});
}

TEST(TokenDataset, ErrorsForNoFilesEmptyCorpusAndBadShard) {
  TempDir dir;
  EXPECT_THROW(TokenDataset((dir / "*.bin").string(), 257), Error);
  EXPECT_THROW(TokenDataset((dir / "nothing.bin").string(), 257), Error);

  write_shard(dir / "empty_0.bin", {});
  expect_error([&] { TokenDataset((dir / "empty_*.bin").string(), 257); }, {"empty"});

  write_bytes(dir / "broken_0.bin", raw_header(20240520, 1, 4));
  expect_error([&] { TokenDataset((dir / "broken_*.bin").string(), 257); },
               {(dir / "broken_0.bin").string(), "header says 4 tokens"});
}

// ---------------------------------------------------------------------------------------------
// Sampler

namespace {

// A corpus whose token i is i, so a sequence tells where in the corpus it came from.
struct IotaCorpus {
  TempDir dir;
  std::string pattern;
  IotaCorpus(size_t n, size_t per_shard) {
    for (size_t begin = 0, s = 0; begin < n; begin += per_shard, ++s) {
      std::vector<uint16_t> tokens;
      for (size_t i = begin; i < std::min(n, begin + per_shard); ++i) {
        tokens.push_back(static_cast<uint16_t>(i));
      }
      write_shard(dir / ("c_" + std::to_string(1000 + s) + ".bin"), tokens);
    }
    pattern = (dir / "c_*.bin").string();
  }
};

std::vector<int32_t> draw(Sampler& sampler, int64_t index) {
  const auto n = static_cast<size_t>(sampler.seq_len());
  std::vector<int32_t> seq(2 * n);
  sampler.sample(index, seq.data(), seq.data() + n);
  return seq;
}

}  // namespace

TEST(Sampler, WindowCount) {
  IotaCorpus corpus(101, 40);
  TokenDataset data(corpus.pattern, 65536);
  EXPECT_EQ(data.num_shards(), 3);
  EXPECT_EQ(Sampler(data, 10, 1).windows_per_epoch(), 10);  // last window: tokens 90..100
  EXPECT_EQ(Sampler(data, 100, 1).windows_per_epoch(), 1);
  EXPECT_EQ(Sampler(data, 7, 1).windows_per_epoch(), 14);
}

TEST(Sampler, TooShortCorpusNamesPatternCountAndSeqLen) {
  IotaCorpus corpus(64, 64);
  TokenDataset data(corpus.pattern, 65536);
  EXPECT_NO_THROW(Sampler(data, 63, 0));
  expect_error([&] { Sampler(data, 64, 0); }, {corpus.pattern, "64 tokens", "seq_len 64"});
  EXPECT_THROW(Sampler(data, 0, 0), Error);
}

TEST(Sampler, TargetsAreInputsShiftedByOne) {
  IotaCorpus corpus(1001, 300);
  TokenDataset data(corpus.pattern, 65536);
  Sampler sampler(data, 16, 7);
  for (int64_t i = 0; i < 3 * sampler.windows_per_epoch(); ++i) {
    const auto seq = draw(sampler, i);
    const int32_t start = seq[0];
    ASSERT_EQ(start % 16, 0) << "windows start at multiples of seq_len";
    for (int t = 0; t < 16; ++t) {
      ASSERT_EQ(seq[static_cast<size_t>(t)], start + t);
      ASSERT_EQ(seq[static_cast<size_t>(16 + t)], start + t + 1);
    }
  }
}

TEST(Sampler, EveryWindowOncePerEpochInFreshOrder) {
  IotaCorpus corpus(801, 801);
  TokenDataset data(corpus.pattern, 65536);
  Sampler sampler(data, 8, 123);
  const int64_t windows = sampler.windows_per_epoch();
  ASSERT_EQ(windows, 100);
  std::vector<std::vector<int32_t>> orders;
  for (int64_t epoch = 0; epoch < 4; ++epoch) {
    std::vector<int32_t> order;
    for (int64_t pos = 0; pos < windows; ++pos) {
      order.push_back(draw(sampler, epoch * windows + pos)[0] / 8);
    }
    std::vector<int32_t> sorted = order;
    std::sort(sorted.begin(), sorted.end());
    for (int32_t w = 0; w < windows; ++w) ASSERT_EQ(sorted[static_cast<size_t>(w)], w);
    orders.push_back(order);
  }
  // Shuffled, and shuffled differently each epoch.
  std::vector<int32_t> identity(static_cast<size_t>(windows));
  for (int32_t w = 0; w < windows; ++w) identity[static_cast<size_t>(w)] = w;
  EXPECT_NE(orders[0], identity);
  EXPECT_NE(orders[0], orders[1]);
  EXPECT_NE(orders[1], orders[2]);
  EXPECT_NE(orders[2], orders[3]);
}

TEST(Sampler, SameSeedSameSequencesDifferentSeedDifferent) {
  IotaCorpus corpus(2049, 1000);
  TokenDataset data(corpus.pattern, 65536);
  Sampler a(data, 32, 42), b(data, 32, 42), c(data, 32, 43);
  bool any_different = false;
  for (int64_t i = 0; i < 3 * a.windows_per_epoch(); ++i) {
    const auto sa = draw(a, i);
    ASSERT_EQ(sa, draw(b, i)) << "sample " << i;
    any_different = any_different || sa != draw(c, i);
  }
  EXPECT_TRUE(any_different);
}

TEST(Sampler, IndependentOfCallOrder) {
  IotaCorpus corpus(1025, 1025);
  TokenDataset data(corpus.pattern, 65536);
  const int64_t windows = Sampler(data, 16, 9).windows_per_epoch();

  Sampler fresh(data, 16, 9);
  const auto expected = draw(fresh, 5);

  Sampler in_order(data, 16, 9);
  for (int64_t i = 0; i < 5; ++i) draw(in_order, i);
  EXPECT_EQ(draw(in_order, 5), expected);

  // After a later epoch has replaced the cached permutation.
  Sampler later_first(data, 16, 9);
  const auto late = draw(later_first, 3 * windows + 2);
  EXPECT_EQ(draw(later_first, 5), expected);
  EXPECT_EQ(draw(later_first, 3 * windows + 2), late);

  // Backwards and interleaved across epochs.
  Sampler scrambled(data, 16, 9);
  for (int64_t i = 4 * windows; i-- > 0;) draw(scrambled, i);
  draw(scrambled, 7 * windows + 1);
  EXPECT_EQ(draw(scrambled, 5), expected);
}

TEST(Sampler, PermutationIsPinned) {
  // The order must never change silently: a resumed run or a run on another machine (other
  // standard library) has to draw the same sequences. If this fails after a deliberate change to
  // the sampler, every earlier run's data order changed with it.
  IotaCorpus corpus(11, 11);
  TokenDataset data(corpus.pattern, 65536);
  Sampler sampler(data, 1, 2024);
  std::vector<int32_t> order;
  for (int64_t i = 0; i < 20; ++i) order.push_back(draw(sampler, i)[0]);
  EXPECT_EQ(order,
            (std::vector<int32_t>{6, 0, 1, 9, 4, 7, 8, 3, 5, 2, 3, 0, 2, 6, 8, 7, 1, 9, 4, 5}));
}

// ---------------------------------------------------------------------------------------------
// prepare_data

namespace {

// Fortune-style text: documents separated by lines holding just "%".
std::string fortune_file(const std::vector<std::string>& docs) {
  std::string text;
  for (const auto& doc : docs) text += doc + "%\n";
  return text;
}

std::vector<std::string> numbered_docs(const std::string& tag, int n) {
  std::vector<std::string> docs;
  for (int i = 0; i < n; ++i) {
    docs.push_back(tag + " fortune " + std::to_string(i) + "\n\tsays — ünïcode " +
                   std::string(static_cast<size_t>(i % 5), '!') + "\n");
  }
  return docs;
}

std::string decode_split(const fs::path& dir, const std::string& split) {
  TokenDataset data((dir / (split + "_*.bin")).string(),
                    malleus::tokenizer::ByteTokenizer::kVocabSize);
  const std::vector<int32_t> ids(data.tokens().begin(), data.tokens().end());
  return malleus::tokenizer::ByteTokenizer().decode(ids);
}

std::string joined(const std::vector<std::string>& docs) {
  std::string text;
  for (const auto& doc : docs) text += doc + "\n<|endoftext|>\n";
  return text;
}

}  // namespace

TEST(PrepareData, FortuneDirectoryToShards) {
  TempDir dir;
  const fs::path in = dir / "fortunes";
  fs::create_directories(in / "more");
  const auto a_docs = numbered_docs("a", 12);
  const auto b_docs = numbered_docs("b", 8);
  // A whitespace-only entry and a trailing empty one are dropped.
  std::vector<std::string> a_with_blank = a_docs;
  a_with_blank.insert(a_with_blank.begin() + 3, "  \n\t\n");
  write_bytes(in / "alpha", fortune_file(a_with_blank) + "%\n");
  write_bytes(in / "more" / "beta", fortune_file(b_docs));
  write_bytes(in / "alpha.dat", std::string("\0\0\0\x02index", 9));
  fs::create_symlink("alpha", in / "alpha.u8");
  write_bytes(in / "zeta.bin", std::string("bin\0ary", 7));

  PrepareOptions options;
  options.inputs = {in.string()};
  options.output_dir = (dir / "out").string();  // does not exist yet
  options.document_separator = "%";
  options.val_fraction = 0.2;
  options.shard_tokens = 100;
  const PrepareSummary summary = prepare_data(options);

  EXPECT_EQ(summary.files, 2);  // alpha, more/beta
  EXPECT_EQ(summary.documents, 20);
  EXPECT_EQ(summary.val_documents, 4);  // k = 4, 9, 14, 19
  EXPECT_EQ(summary.train_documents, 16);
  EXPECT_EQ(summary.skipped.size(), 3u);  // alpha.dat, alpha.u8 (by name), zeta.bin (binary)

  std::vector<std::string> all = a_docs;
  all.insert(all.end(), b_docs.begin(), b_docs.end());
  std::vector<std::string> train_docs, val_docs;
  int64_t train_tokens = 0, val_tokens = 0;
  for (size_t k = 0; k < all.size(); ++k) {
    const bool val = (k + 1) % 5 == 0;
    (val ? val_docs : train_docs).push_back(all[k]);
    (val ? val_tokens : train_tokens) += static_cast<int64_t>(all[k].size()) + 1;
  }
  EXPECT_EQ(summary.train_tokens, train_tokens);
  EXPECT_EQ(summary.val_tokens, val_tokens);
  EXPECT_EQ(decode_split(options.output_dir, "train"), joined(train_docs));
  EXPECT_EQ(decode_split(options.output_dir, "val"), joined(val_docs));

  // Shards are full except the last of each split, and listed train first.
  const auto shard_count = [](int64_t tokens) { return static_cast<size_t>((tokens + 99) / 100); };
  const size_t train_shards = shard_count(train_tokens);
  ASSERT_EQ(summary.shards.size(), train_shards + shard_count(val_tokens));
  for (size_t i = 0; i < summary.shards.size(); ++i) {
    const bool is_train = i < train_shards;
    const size_t index = is_train ? i : i - train_shards;
    char name[32];
    std::snprintf(name, sizeof(name), "%s_%06zu.bin", is_train ? "train" : "val", index);
    const fs::path shard(summary.shards[i]);
    EXPECT_EQ(shard.filename().string(), name);
    const bool last = i + 1 == train_shards || i + 1 == summary.shards.size();
    const size_t size = read_shard(shard).size();
    if (last) {
      EXPECT_LE(size, 100u);
    } else {
      EXPECT_EQ(size, 100u);
    }
  }
  // Nothing else in the output directory (no leftover temporary files) but the tokenizer's record.
  EXPECT_EQ(std::distance(fs::directory_iterator(options.output_dir), fs::directory_iterator()),
            static_cast<std::ptrdiff_t>(summary.shards.size()) + 1);
  EXPECT_TRUE(fs::exists(fs::path(options.output_dir) / "tokenizer_meta.json"));
}

TEST(PrepareData, ValidationGetsAtLeastOneDocument) {
  TempDir dir;
  write_bytes(dir / "f", fortune_file({"one\n", "two\n", "three\n"}));
  PrepareOptions options;
  options.inputs = {(dir / "f").string()};
  options.output_dir = (dir / "out").string();
  options.document_separator = "%";
  options.val_fraction = 0.05;
  const auto summary = prepare_data(options);
  EXPECT_EQ(summary.documents, 3);
  EXPECT_EQ(summary.val_documents, 1);
  EXPECT_EQ(decode_split(options.output_dir, "train"), joined({"one\n", "two\n"}));
  EXPECT_EQ(decode_split(options.output_dir, "val"), joined({"three\n"}));

  // One document: it has to be training data.
  write_bytes(dir / "g", "only\n");
  options.inputs = {(dir / "g").string()};
  const auto single = prepare_data(options);
  EXPECT_EQ(single.val_documents, 0);
  EXPECT_EQ(single.shards.size(), 1u);
  EXPECT_FALSE(fs::exists(dir / "out" / "val_000000.bin"));  // the stale one was removed

  // val_fraction 0: no validation split at all.
  options.inputs = {(dir / "f").string()};
  options.val_fraction = 0;
  const auto none = prepare_data(options);
  EXPECT_EQ(none.val_documents, 0);
  EXPECT_EQ(none.train_documents, 3);
}

TEST(PrepareData, SeparatorVariantsAndWholeFileDocuments) {
  TempDir dir;
  // CRLF lines; "%%" and " %" are not separators; no trailing separator.
  write_bytes(dir / "crlf", "a\r\n%\r\n%%\r\n %\r\n%\r\nlast");
  write_bytes(dir / "plain", "whole file\n%\nstays one document\n");
  PrepareOptions options;
  options.inputs = {(dir / "crlf").string()};
  options.output_dir = (dir / "out").string();
  options.document_separator = "%";
  options.val_fraction = 0;
  auto summary = prepare_data(options);
  EXPECT_EQ(summary.documents, 3);
  EXPECT_EQ(decode_split(options.output_dir, "train"), joined({"a\r\n", "%%\r\n %\r\n", "last"}));

  options.inputs = {(dir / "plain").string(), (dir / "crlf").string()};
  options.document_separator = "";
  summary = prepare_data(options);
  EXPECT_EQ(summary.files, 2);
  EXPECT_EQ(summary.documents, 2);
  EXPECT_EQ(decode_split(options.output_dir, "train"),
            joined({"whole file\n%\nstays one document\n", "a\r\n%\r\n%%\r\n %\r\n%\r\nlast"}));
}

TEST(PrepareData, ExplicitFilesAndDuplicates) {
  TempDir dir;
  write_bytes(dir / "notes.dat", "text that happens to end in .dat\n");
  write_bytes(dir / "x", "x\n");
  fs::create_symlink("x", dir / "link");
  write_bytes(dir / "blob", std::string("a\0b", 3));
  PrepareOptions options;
  // Named explicitly, a .dat file is read; the same file through a symlink is read once; a
  // binary file is skipped unless skip_binary is off.
  options.inputs = {(dir / "notes.dat").string(), (dir / "x").string(), (dir / "link").string(),
                    (dir / "blob").string()};
  options.output_dir = (dir / "out").string();
  options.val_fraction = 0;
  auto summary = prepare_data(options);
  EXPECT_EQ(summary.files, 2);
  EXPECT_EQ(summary.documents, 2);
  EXPECT_EQ(summary.skipped.size(), 2u);

  options.skip_binary = false;
  summary = prepare_data(options);
  EXPECT_EQ(summary.files, 3);
  EXPECT_EQ(decode_split(options.output_dir, "train"),
            joined({"text that happens to end in .dat\n", "x\n", std::string("a\0b", 3)}));
}

TEST(PrepareData, RerunReplacesShardsAtomicallyAndRemovesStaleOnes) {
  TempDir dir;
  const fs::path out = dir / "out";
  write_bytes(dir / "big", fortune_file(numbered_docs("big", 30)));
  write_bytes(dir / "small", fortune_file({"tiny\n", "wee\n"}));
  PrepareOptions options;
  options.inputs = {(dir / "big").string()};
  options.output_dir = out.string();
  options.document_separator = "%";
  options.shard_tokens = 200;
  const auto first = prepare_data(options);
  ASSERT_GT(first.shards.size(), 3u);
  const std::string old_first_shard = read_bytes(out / "train_000000.bin");

  // Same inputs, same bytes: the output is deterministic.
  prepare_data(options);
  EXPECT_EQ(read_bytes(out / "train_000000.bin"), old_first_shard);

  // A reader holding the old shard open keeps reading the old, complete file: the new one is
  // renamed over it, never truncated and rewritten in place.
  std::ifstream reader(out / "train_000000.bin", std::ios::binary);
  write_bytes(out / "notes.txt", "mine");
  write_bytes(out / "train_000000.bin.bak", "also mine");

  options.inputs = {(dir / "small").string()};
  const auto second = prepare_data(options);
  EXPECT_EQ(second.documents, 2);
  ASSERT_EQ(second.shards.size(), 2u);  // train_000000.bin, val_000000.bin
  EXPECT_EQ(decode_split(out, "train"), joined({"tiny\n"}));
  EXPECT_EQ(decode_split(out, "val"), joined({"wee\n"}));

  const std::string seen_by_reader{std::istreambuf_iterator<char>(reader),
                                   std::istreambuf_iterator<char>()};
  EXPECT_EQ(seen_by_reader, old_first_shard);

  // Stale shards of the first run are gone; files that only look similar are kept.
  std::set<std::string> names;
  for (const auto& entry : fs::directory_iterator(out)) {
    names.insert(entry.path().filename().string());
  }
  EXPECT_EQ(names, (std::set<std::string>{"train_000000.bin", "val_000000.bin", "notes.txt",
                                          "train_000000.bin.bak", "tokenizer_meta.json"}));
}

TEST(PrepareData, Errors) {
  TempDir dir;
  PrepareOptions options;
  options.output_dir = (dir / "out").string();
  expect_error([&] { prepare_data(options); }, {"no inputs"});

  const fs::path missing = dir / "no_such_input";
  options.inputs = {missing.string()};
  expect_error([&] { prepare_data(options); }, {missing.string(), "no such file"});

  fs::create_directories(dir / "blank");
  write_bytes(dir / "blank" / "spaces", " \n\n\t\n");
  write_bytes(dir / "blank" / "index.dat", "looks like text\n");
  write_bytes(dir / "binary", std::string("\0\0", 2));
  options.inputs = {(dir / "blank").string(), (dir / "binary").string()};
  options.document_separator = "%";
  expect_error([&] { prepare_data(options); }, {"no usable text"});

  write_bytes(dir / "ok", "fine\n");
  options.inputs = {(dir / "ok").string()};
  options.val_fraction = 1.0;
  expect_error([&] { prepare_data(options); }, {"val_fraction"});
  options.val_fraction = 0.1;
  options.shard_tokens = 0;
  expect_error([&] { prepare_data(options); }, {"shard_tokens"});
}

// ---------------------------------------------------------------------------------------------
// Compressed input (DecompressingReader). The files are made by the command-line tools (gzip,
// xz, zstd), independent of the library calls that read them.

namespace {

using malleus::testing::run_command;

void shell(const std::string& command) {
  const auto result = run_command(command);
  ASSERT_EQ(result.exit_code, 0) << command << "\n" << result.output;
}

// `tool` is "gzip", "xz" or "zstd"; writes the compressed form of `in` to `out`.
void compress(const std::string& tool, const fs::path& in, const fs::path& out) {
  const std::string flags = tool == "zstd" ? " -q -c " : " -c ";
  shell(tool + flags + in.string() + " > " + out.string());
}

std::string read_all(const fs::path& path, size_t chunk = 7919) {
  DecompressingReader reader(path);
  std::string text, buffer(chunk, '\0');
  while (size_t n = reader.read(buffer.data(), buffer.size())) text.append(buffer.data(), n);
  return text;
}

// About 400 KB of varied text: more than one read of the file and of the decoders' buffers.
std::string varied_text(int lines) {
  std::string text;
  for (int i = 0; i < lines; ++i) {
    text += "line " + std::to_string(i) + ": " +
            std::string(static_cast<size_t>(i % 97), static_cast<char>('a' + i % 26)) +
            " ünïcödé €" + std::to_string(i * 7919 % 1000) + "\n";
  }
  return text;
}

const std::vector<std::string> kTools = {"gzip", "xz", "zstd"};

}  // namespace

TEST(Decompress, ReadsGzipXzAndZstdAsTheTextTheyHoldWhateverTheName) {
  TempDir dir;
  const std::string text = varied_text(5000);
  // Names that lie: the content decides.
  write_bytes(dir / "plain.gz", text);
  EXPECT_EQ(read_all(dir / "plain.gz"), text);
  EXPECT_EQ(DecompressingReader(dir / "plain.gz").compression(), Compression::none);
  for (const auto& tool : kTools) {
    const fs::path packed = dir / (tool + ".txt");
    compress(tool, dir / "plain.gz", packed);
    ASSERT_LT(fs::file_size(packed), text.size() / 2) << tool;
    EXPECT_EQ(read_all(packed), text) << tool;
    EXPECT_EQ(read_all(packed, 1), text.substr(0, 0) + text) << tool << " read a byte at a time";
    DecompressingReader reader(packed);
    EXPECT_EQ(compression_name(reader.compression()), tool);
    EXPECT_EQ(reader.file_size(), fs::file_size(packed));
  }
  // An empty file is an empty plain text.
  write_bytes(dir / "empty", "");
  EXPECT_EQ(read_all(dir / "empty"), "");
}

TEST(Decompress, ReadsConcatenatedStreamsAsOneText) {
  TempDir dir;
  write_bytes(dir / "a", "first part\n");
  write_bytes(dir / "b", varied_text(3000));
  for (const auto& tool : kTools) {
    compress(tool, dir / "a", dir / "a.packed");
    compress(tool, dir / "b", dir / "b.packed");
    shell("cat " + (dir / "a.packed").string() + " " + (dir / "b.packed").string() + " " +
          (dir / "a.packed").string() + " > " + (dir / "all.packed").string());
    EXPECT_EQ(read_all(dir / "all.packed"), "first part\n" + varied_text(3000) + "first part\n")
        << tool;
  }
}

TEST(Decompress, TruncatedStreamsAreErrorsNamingTheFile) {
  TempDir dir;
  write_bytes(dir / "text", varied_text(3000));
  for (const auto& tool : kTools) {
    compress(tool, dir / "text", dir / "full");
    const std::string full = read_bytes(dir / "full");
    // Cut in the middle, and only the very last byte (the end of a checksum or trailer).
    for (size_t keep : {full.size() / 2, full.size() - 1}) {
      const fs::path cut = dir / (tool + "_cut_" + std::to_string(keep));
      write_bytes(cut, full.substr(0, keep));
      const std::string message = malleus::testing::error_of([&] { read_all(cut); });
      EXPECT_NE(message.find(cut.string()), std::string::npos) << message;
      EXPECT_NE(message.find("truncated " + tool), std::string::npos) << tool << ": " << message;
    }
  }
}

TEST(Decompress, CorruptDataIsAnErrorNamingTheFile) {
  TempDir dir;
  write_bytes(dir / "text", varied_text(3000));
  for (const auto& tool : kTools) {
    compress(tool, dir / "text", dir / "full");
    std::string bytes = read_bytes(dir / "full");
    bytes[bytes.size() / 2] = static_cast<char>(bytes[bytes.size() / 2] ^ 0x55);
    const fs::path bad = dir / (tool + "_corrupt");
    write_bytes(bad, bytes);
    const std::string message = malleus::testing::error_of([&] { read_all(bad); });
    EXPECT_NE(message.find(bad.string()), std::string::npos) << message;
    EXPECT_NE(message.find("corrupt " + tool), std::string::npos) << tool << ": " << message;
  }
}

TEST(Decompress, OtherCompressionsAreRefusedByName) {
  TempDir dir;
  write_bytes(dir / "text", "some text\n");
  write_bytes(dir / "text.bz2", "BZh91AY&SY\x01\x02 the start of a bzip2 file");
  const std::string message =
      malleus::testing::error_of([&] { DecompressingReader reader(dir / "text.bz2"); });
  EXPECT_NE(message.find((dir / "text.bz2").string()), std::string::npos) << message;
  EXPECT_NE(message.find("bzip2-compressed"), std::string::npos) << message;
  EXPECT_EQ(detect_compression("PK\x03\x04rest"), Compression::unsupported);
  // Text that merely starts like a magic number is text.
  EXPECT_EQ(detect_compression("BZh, said the bee"), Compression::none);
  EXPECT_EQ(detect_compression("\x1f"), Compression::none);
}

// ---------------------------------------------------------------------------------------------
// UTF-8, against Python's strict decoder (the position of its first error).

TEST(Utf8, FirstInvalidByteAgreesWithPython) {
  std::vector<std::string> cases = {"",
                                    "plain ascii",
                                    "caf\xc3\xa9",
                                    "\xe2\x82\xac euro",
                                    "\xf0\x9f\x98\x80 emoji",
                                    "\xc3",
                                    "ab\xc3",
                                    "\xe2\x82",
                                    "\xf0\x9f\x98",
                                    "\x80",
                                    "a\xbf",
                                    "\xc0\xaf",
                                    "\xc1\xbf",
                                    "\xe0\x80\xaf",
                                    "\xe0\x9f\xbf",
                                    "\xe0\xa0\x80",
                                    "\xed\x9f\xbf",
                                    "\xed\xa0\x80",
                                    "\xed\xbf\xbf",
                                    "\xee\x80\x80",
                                    "\xf0\x8f\xbf\xbf",
                                    "\xf0\x90\x80\x80",
                                    "\xf4\x8f\xbf\xbf",
                                    "\xf4\x90\x80\x80",
                                    "\xf5\x80\x80\x80",
                                    "\xff",
                                    "\xfe",
                                    "\xe2\x28\xa1",
                                    "\xe2\x82\x28",
                                    "12345678\xc3\xa9"
                                    "12345678\xe2",
                                    "0123456789abcdef\x80",
                                    std::string("nul\0ok", 6)};
  // And random bytes, mostly ASCII with some high bytes (seeded, so reproducible).
  uint64_t state = 12345;
  for (int c = 0; c < 300; ++c) {
    std::string s;
    for (int i = 0; i < 24; ++i) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      const auto r = static_cast<unsigned>(state >> 33);
      s += static_cast<char>(r % 4 == 0 ? 0x80 + (r >> 8) % 128 : 0x20 + (r >> 8) % 95);
    }
    cases.push_back(s);
  }
  TempDir dir;
  std::string hex_lines;
  for (const auto& s : cases) {
    for (unsigned char ch : s) {
      char h[3];
      std::snprintf(h, sizeof(h), "%02x", ch);
      hex_lines += h;
    }
    hex_lines += "\n";
  }
  write_bytes(dir / "cases", hex_lines);
  const auto result = run_command(std::string(MALLEUS_PYTHON) +
                                  " -c 'import sys\n"
                                  "for line in open(sys.argv[1]):\n"
                                  "  b = bytes.fromhex(line.strip())\n"
                                  "  try:\n"
                                  "    b.decode(\"utf-8\"); print(-1)\n"
                                  "  except UnicodeDecodeError as e: print(e.start)' " +
                                  (dir / "cases").string());
  ASSERT_EQ(result.exit_code, 0) << result.output;
  std::istringstream expected(result.output);
  for (const auto& s : cases) {
    long long python = 0;
    ASSERT_TRUE(expected >> python);
    const size_t ours = invalid_utf8_offset(s);
    EXPECT_EQ(ours == std::string_view::npos ? -1 : static_cast<long long>(ours), python)
        << "case of " << s.size() << " bytes: " << s;
  }
}

// ---------------------------------------------------------------------------------------------
// prepare_data on JSON Lines and compressed corpora

namespace {

// A JSON string literal for `text`, written by Python's json.dumps (an encoder independent of
// the parser that reads it back).
std::vector<std::string> python_json_lines(const fs::path& dir,
                                           const std::vector<std::string>& texts,
                                           const std::string& key = "text") {
  std::string joined_texts;
  for (const auto& t : texts) joined_texts += t + '\x1e';  // record separator between texts
  write_bytes(dir / "texts.raw", joined_texts);
  const auto result = run_command(
      std::string(MALLEUS_PYTHON) +
      " -c 'import sys, json\n"
      "texts = open(sys.argv[1], encoding=\"utf-8\", newline=\"\").read().split(\"\\x1e\")[:-1]\n"
      "for i, t in enumerate(texts): print(json.dumps({\"id\": i, sys.argv[2]: t, \"meta\": "
      "{\"n\": [1, 2.5, None]}}))' " +
      (dir / "texts.raw").string() + " " + key);
  EXPECT_EQ(result.exit_code, 0) << result.output;
  std::vector<std::string> lines;
  std::istringstream in(result.output);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

std::string lines_of(const std::vector<std::string>& lines) {
  std::string text;
  for (const auto& line : lines) text += line + "\n";
  return text;
}

PrepareOptions options_for(const fs::path& input, const fs::path& out) {
  PrepareOptions options;
  options.inputs = {input.string()};
  options.output_dir = out.string();
  options.val_fraction = 0.25;
  options.shard_tokens = 500;
  return options;
}

// Every file of a directory, name to bytes.
std::map<std::string, std::string> directory_bytes(const fs::path& dir) {
  std::map<std::string, std::string> files;
  for (const auto& entry : fs::recursive_directory_iterator(dir)) {
    if (entry.is_regular_file()) {
      files[fs::relative(entry.path(), dir).string()] = read_bytes(entry.path());
    }
  }
  return files;
}

std::vector<std::string> sample_texts(int n) {
  std::vector<std::string> texts;
  for (int i = 0; i < n; ++i) {
    texts.push_back("Document " + std::to_string(i) +
                    " says \"hi\"\n\twith a tab, a backslash \\ " + "and ünïcödé ✓ 😀" +
                    std::string(static_cast<size_t>(i % 13), '.') + "\n");
  }
  return texts;
}

}  // namespace

TEST(PrepareData, EveryInputFormGivesTheSameShards) {
  TempDir dir;
  const auto texts = sample_texts(40);
  write_bytes(dir / "corpus.jsonl", lines_of(python_json_lines(dir.path(), texts)));
  write_bytes(dir / "corpus.txt", fortune_file(texts));
  std::vector<std::pair<fs::path, std::string>> forms = {{dir / "corpus.jsonl", ""},
                                                         {dir / "corpus.txt", "%"}};
  for (const auto& tool : kTools) {
    // Named as if plain: the content decides.
    compress(tool, dir / "corpus.jsonl", dir / (tool + "_jsonl.json"));
    compress(tool, dir / "corpus.txt", dir / (tool + "_text.txt"));
    forms.push_back({dir / (tool + "_jsonl.json"), ""});
    forms.push_back({dir / (tool + "_text.txt"), "%"});
  }
  std::map<std::string, std::string> first;
  for (const auto& [input, separator] : forms) {
    PrepareOptions options = options_for(input, dir / "out");
    options.document_separator = separator;
    const auto summary = prepare_data(options);
    EXPECT_EQ(summary.documents, 40) << input;
    const auto shards = directory_bytes(dir / "out");
    if (first.empty()) {
      first = shards;
      std::vector<std::string> train, val;
      for (size_t k = 0; k < texts.size(); ++k)
        ((k + 1) % 4 == 0 ? val : train).push_back(texts[k]);
      EXPECT_EQ(decode_split(dir / "out", "train"), joined(train));
      EXPECT_EQ(decode_split(dir / "out", "val"), joined(val));
    } else {
      EXPECT_EQ(shards, first) << input << " gives other shards than " << forms[0].first;
    }
  }
}

TEST(PrepareData, JsonLinesDecodeAsPythonWroteThem) {
  TempDir dir;
  const std::vector<std::string> texts = {"quotes \" and \\ backslashes",
                                          "controls \x01\x1f and \t tabs\nnew lines\r\n",
                                          "BMP ünïcödé ĀĒĪ 中文",
                                          "astral 😀 𝄞 (surrogate pairs in \\u form)",
                                          "/ slash </script>",
                                          std::string("a NUL \0 inside", 14)};
  auto lines = python_json_lines(dir.path(), texts);
  // Python wrote ASCII with \u escapes; also give one line as raw UTF-8, one with CRLF, blank
  // lines around, and a byte order mark at the start.
  lines.push_back("{\"text\": \"raw ünïcödé 😀\", \"other\": 1}\r");
  lines.insert(lines.begin() + 2, "   ");
  lines.push_back("");
  write_bytes(dir / "corpus.jsonl", "\xEF\xBB\xBF" + lines_of(lines) + "\n\n");
  PrepareOptions options = options_for(dir / "corpus.jsonl", dir / "out");
  options.val_fraction = 0;
  const auto summary = prepare_data(options);
  std::vector<std::string> expected = texts;
  expected.push_back("raw ünïcödé 😀");
  EXPECT_EQ(summary.documents, static_cast<int64_t>(expected.size()));
  EXPECT_EQ(decode_split(dir / "out", "train"), joined(expected));
}

TEST(PrepareData, JsonKeyChoosesTheMemberAndEmptyTextsAreLeftOut) {
  TempDir dir;
  write_bytes(dir / "c.jsonl",
              "{\"text\": \"not this\", \"content\": \"this\"}\n"
              "{\"content\": \"   \"}\n"
              "{\"content\": \"\"}\n"
              "{\"content\": \"and this\", \"text\": 5}\n");
  PrepareOptions options = options_for(dir / "c.jsonl", dir / "out");
  options.json_key = "content";
  options.val_fraction = 0;
  const auto summary = prepare_data(options);
  EXPECT_EQ(summary.documents, 2);
  EXPECT_EQ(decode_split(dir / "out", "train"), joined({"this", "and this"}));
}

TEST(PrepareData, FormatIsToldFromTheTextUnlessGiven) {
  TempDir dir;
  write_bytes(dir / "code.txt", "{ looks like JSON but is C }\n%\nint main() {}\n");
  PrepareOptions options = options_for(dir / "code.txt", dir / "out");
  options.document_separator = "%";
  options.val_fraction = 0;
  const std::string message = malleus::testing::error_of([&] { prepare_data(options); });
  EXPECT_NE(message.find((dir / "code.txt").string() + ":1: not JSON"), std::string::npos)
      << message;
  options.format = InputFormat::text;
  EXPECT_EQ(prepare_data(options).documents, 2);
  // --format jsonl reads a file that does not start with "{" as JSON Lines too.
  write_bytes(dir / "late.jsonl", "\n\n  {\"text\": \"x\"}\n");
  options = options_for(dir / "late.jsonl", dir / "out");
  options.val_fraction = 0;
  EXPECT_EQ(prepare_data(options).documents, 1);  // auto: white space before "{" is fine
  options.format = InputFormat::jsonl;
  EXPECT_EQ(prepare_data(options).documents, 1);
  EXPECT_EQ(parse_input_format("jsonl"), InputFormat::jsonl);
  EXPECT_NE(malleus::testing::error_of([] { parse_input_format("csv"); }).find("csv"),
            std::string::npos);
}

namespace {

struct BadCase {
  std::string line;  // a JSON line, or for text: the document
  bool json;
  std::string problem;  // part of the message
  int64_t line_number;  // reported
};

}  // namespace

TEST(PrepareData, BadInputStopsNamingFileAndLineAndLeavesTheOutputAsItWas) {
  TempDir dir;
  const fs::path out = dir / "out";
  write_bytes(dir / "good.jsonl", "{\"text\": \"earlier run\"}\n");
  prepare_data(options_for(dir / "good.jsonl", out));
  const auto before = directory_bytes(out);

  const std::vector<BadCase> cases = {
      {"{\"text\": \"unterminated}", true, "not JSON", 3},
      {"[\"text\", \"an array\"]", true, "a JSON array, not an object", 3},
      {"\"text\"", true, "a JSON string, not an object", 3},
      {"{\"txt\": \"typo\"}", true, "no key \"text\"", 3},
      {"{\"text\": 42}", true, "\"text\" holds a number, not a string", 3},
      {"{\"text\": null}", true, "\"text\" holds a null, not a string", 3},
      {"{\"text\": [\"a\"]}", true, "\"text\" holds a array, not a string", 3},
      {"{\"text\": \"Latin-1 caf\xe9\"}", true, "not valid UTF-8 (byte 22 of the line)", 3},
      {"{\"text\": \"lone \\ud800 surrogate\"}", true, "not JSON", 3},
      {"{\"text\": 1e999}", true, "not JSON", 3},
      {"fine line\nLatin-1 caf\xe9\n", false, "not valid UTF-8 (byte 12 of the line)", 4},
  };
  for (const auto& c : cases) {
    // Many good documents first, so shards fill and are written before the bad one is met.
    std::string text;
    if (c.json) {
      text = "{\"text\": \"first\"}\n\n" + c.line + "\n{\"text\": \"after\"}\n";
    } else {
      text = "first\n%\n" + c.line + "%\nafter\n";
    }
    write_bytes(dir / "bad", text);
    PrepareOptions options = options_for(dir / "bad", out);
    options.document_separator = "%";
    options.shard_tokens = 1;  // a shard per token: written before the bad document is reached
    const std::string message = malleus::testing::error_of([&] { prepare_data(options); });
    const std::string where = (dir / "bad").string() + ":" + std::to_string(c.line_number) + ": ";
    EXPECT_NE(message.find(where + c.problem), std::string::npos)
        << "expected \"" << where << c.problem << "\" in: " << message;
    EXPECT_NE(message.find("--skip-bad"), std::string::npos) << message;
    EXPECT_EQ(directory_bytes(out), before) << "after: " << message;
  }
}

TEST(PrepareData, SkipBadLeavesBadDocumentsOutAndCountsThem) {
  TempDir dir;
  write_bytes(dir / "a.jsonl",
              "{\"text\": \"one\"}\n"
              "not json\n"
              "{\"text\": \"two\"}\n"
              "{\"body\": \"no key\"}\n"
              "{\"text\": 3}\n"
              "also not json\n"
              "{\"text\": \"caf\xe9\"}\n"
              "{\"text\": \"three\"}\n");
  write_bytes(dir / "b.txt", "four\n%\nbad \xff byte\n%\nfive\n");
  PrepareOptions options;
  options.inputs = {(dir / "a.jsonl").string(), (dir / "b.txt").string()};
  options.output_dir = (dir / "out").string();
  options.document_separator = "%";
  options.val_fraction = 0;
  options.skip_bad = true;
  const auto summary = prepare_data(options);
  EXPECT_EQ(summary.documents, 5);
  EXPECT_EQ(summary.bad_documents, 6);
  EXPECT_EQ(decode_split(dir / "out", "train"),
            joined({"one", "two", "three", "four\n", "five\n"}));
  const std::string a = (dir / "a.jsonl").string();
  EXPECT_EQ(summary.bad_summary, "2 not JSON (first: " + a + ":2), 1 without the key (first: " + a +
                                     ":4), 1 not a string at the key (first: " + a +
                                     ":5), 2 not UTF-8 (first: " + a + ":7)");
}

TEST(PrepareData, TruncatedCompressedInputStopsAndLeavesTheOutputAsItWas) {
  TempDir dir;
  const fs::path out = dir / "out";
  write_bytes(dir / "good.txt", "an earlier run\n");
  prepare_data(options_for(dir / "good.txt", out));
  // A stale staging directory of a run that was killed: removed by the next run.
  fs::create_directories(out / ".prepare-data.partial");
  write_bytes(out / ".prepare-data.partial" / "train_000000.bin", "half");
  const auto before = directory_bytes(out);

  write_bytes(dir / "corpus.jsonl", lines_of(python_json_lines(dir.path(), sample_texts(3000))));
  for (const auto& tool : kTools) {
    compress(tool, dir / "corpus.jsonl", dir / "full");
    const std::string full = read_bytes(dir / "full");
    write_bytes(dir / "cut", full.substr(0, full.size() * 3 / 4));
    PrepareOptions options = options_for(dir / "cut", out);
    options.threads = 2;
    options.batch_bytes = 4096;
    const std::string message = malleus::testing::error_of([&] { prepare_data(options); });
    EXPECT_NE(message.find((dir / "cut").string() + ": truncated " + tool), std::string::npos)
        << message;
    auto after = directory_bytes(out);
    EXPECT_FALSE(fs::exists(out / ".prepare-data.partial")) << tool;
    after[".prepare-data.partial/train_000000.bin"] = "half";
    EXPECT_EQ(after, before) << tool;
  }
}

TEST(PrepareData, ShardsAreTheSameBytesForAnyThreadCount) {
  TempDir dir;
  // Documents of very different lengths, bad lines among them, several files.
  std::vector<std::string> texts;
  for (int i = 0; i < 3000; ++i) {
    texts.push_back(
        "doc " + std::to_string(i) + " " +
        std::string(static_cast<size_t>((i * 7919) % 3000), static_cast<char>('a' + i % 26)));
  }
  auto lines = python_json_lines(dir.path(), texts);
  for (size_t i = 100; i < lines.size(); i += 397) lines[i] = "{broken";
  fs::create_directories(dir / "in");
  write_bytes(dir / "in" / "part1.jsonl",
              lines_of(std::vector<std::string>(lines.begin(), lines.begin() + 1500)));
  write_bytes(dir / "in" / "part0.jsonl",
              lines_of(std::vector<std::string>(lines.begin() + 1500, lines.end())));
  compress("zstd", dir / "in" / "part1.jsonl", dir / "in" / "part1.jsonl.zst");
  fs::remove(dir / "in" / "part1.jsonl");

  std::map<std::string, std::string> reference;
  for (int threads : {1, 2, 3, 8}) {
    PrepareOptions options = options_for(dir / "in", dir / ("out" + std::to_string(threads)));
    options.threads = threads;
    options.batch_bytes = 10000;
    options.shard_tokens = 300'000;
    options.val_fraction = 0.1;
    options.skip_bad = true;
    const auto summary = prepare_data(options);
    EXPECT_EQ(summary.documents + summary.bad_documents, 3000);
    EXPECT_EQ(summary.bad_documents, 8);
    const auto shards = directory_bytes(options.output_dir);
    EXPECT_GT(shards.size(), 10u);
    if (threads == 1) {
      reference = shards;
    } else {
      EXPECT_TRUE(shards == reference) << threads << " threads give other shards than 1";
    }
  }
  // Without --skip-bad the first bad line is the one reported, whatever the thread count.
  for (int threads : {1, 3}) {
    PrepareOptions options = options_for(dir / "in", dir / "out");
    options.threads = threads;
    options.batch_bytes = 5000;
    const std::string message = malleus::testing::error_of([&] { prepare_data(options); });
    EXPECT_NE(message.find((dir / "in" / "part0.jsonl").string() + ":" +
                           std::to_string(1688 - 1500 + 1) + ": not JSON"),
              std::string::npos)
        << message;
  }
}

TEST(PrepareData, DirectoriesAreReadDepthFirstInByteOrderOfNames) {
  TempDir dir;
  const fs::path in = dir / "in";
  for (const char* sub : {"a/b", ".git", ".cache/x"}) fs::create_directories(in / sub);
  write_bytes(in / "b", "b\n");
  write_bytes(in / "a" / "z", "a/z\n");
  write_bytes(in / "a" / "b" / "c", "a/b/c\n");
  write_bytes(in / "a.txt", "a.txt\n");
  write_bytes(in / "A", "A\n");
  write_bytes(in / ".hidden", "hidden\n");
  write_bytes(in / ".git" / "HEAD", "ref: refs/heads/main\n");
  write_bytes(in / ".cache" / "x" / "y", "cached\n");
  PrepareOptions options = options_for(in, dir / "out");
  options.val_fraction = 0;
  const auto summary = prepare_data(options);
  EXPECT_EQ(decode_split(dir / "out", "train"),
            joined({"A\n", "a/b/c\n", "a/z\n", "a.txt\n", "b\n"}));
  EXPECT_EQ(summary.skipped.size(), 3u);  // .cache, .git, .hidden
  for (const auto& s : summary.skipped) EXPECT_NE(s.find("(hidden)"), std::string::npos) << s;
}

TEST(PrepareData, BinaryIsJudgedOnTheDecompressedText) {
  TempDir dir;
  write_bytes(dir / "blob", std::string("bin\0ary", 7) + std::string(100, 'x'));
  compress("gzip", dir / "blob", dir / "blob.gz");
  write_bytes(dir / "text", "words\n");
  PrepareOptions options;
  options.inputs = {(dir / "blob.gz").string(), (dir / "text").string()};
  options.output_dir = (dir / "out").string();
  const auto summary = prepare_data(options);
  EXPECT_EQ(summary.files, 1);
  ASSERT_EQ(summary.skipped.size(), 1u);
  EXPECT_NE(summary.skipped[0].find("decompressed from gzip"), std::string::npos)
      << summary.skipped[0];
}

TEST(PrepareData, ADocumentOverTheLimitStopsTheRun) {
  TempDir dir;
  write_bytes(dir / "long.txt",
              "short\n%\n" + std::string(3000, 'x') + "\n" + std::string(3000, 'y') + "\n");
  PrepareOptions options = options_for(dir / "long.txt", dir / "out");
  options.document_separator = "%";
  options.max_document_bytes = 5000;
  std::string message = malleus::testing::error_of([&] { prepare_data(options); });
  EXPECT_NE(message.find((dir / "long.txt").string() + ":3: the document starting here is over"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("--max-document-mb"), std::string::npos) << message;
  options.skip_bad = true;  // not a bad document to skip: it bounds memory
  EXPECT_NE(malleus::testing::error_of([&] { prepare_data(options); }), "");

  write_bytes(dir / "long.jsonl",
              "{\"text\": \"ok\"}\n{\"text\": \"" + std::string(9000, 'z') + "\"}\n");
  options = options_for(dir / "long.jsonl", dir / "out");
  options.max_document_bytes = 5000;
  message = malleus::testing::error_of([&] { prepare_data(options); });
  EXPECT_NE(message.find((dir / "long.jsonl").string() + ":2: a line of more than"),
            std::string::npos)
      << message;
  options.max_document_bytes = 10000;
  EXPECT_EQ(prepare_data(options).documents, 2);
}

TEST(PrepareData, ASecondRunOnTheSameOutputIsRefused) {
  TempDir dir;
  write_bytes(dir / "t", "text\n");
  fs::create_directories(dir / "out");
  const int fd = ::open((dir / "out").c_str(), O_RDONLY | O_DIRECTORY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX), 0);  // as a running prepare-data holds it
  const std::string message =
      malleus::testing::error_of([&] { prepare_data(options_for(dir / "t", dir / "out")); });
  EXPECT_NE(message.find("another prepare-data is writing to " + (dir / "out").string()),
            std::string::npos)
      << message;
  ::close(fd);
  EXPECT_EQ(prepare_data(options_for(dir / "t", dir / "out")).documents, 1);
}

TEST(PrepareData, ReportsProgressInOrder) {
  TempDir dir;
  write_bytes(dir / "c.jsonl", lines_of(python_json_lines(dir.path(), sample_texts(2000))));
  compress("xz", dir / "c.jsonl", dir / "c.jsonl.xz");
  PrepareOptions options = options_for(dir / "c.jsonl.xz", dir / "out");
  options.threads = 2;
  options.batch_bytes = 8192;
  options.progress_seconds = 0;
  std::vector<PrepareProgress> seen;
  options.on_progress = [&](const PrepareProgress& p) { seen.push_back(p); };
  const auto summary = prepare_data(options);
  ASSERT_GT(seen.size(), 5u);
  for (size_t i = 1; i < seen.size(); ++i) {
    EXPECT_GT(seen[i].documents, seen[i - 1].documents);
    EXPECT_GT(seen[i].tokens, seen[i - 1].tokens);
    EXPECT_GE(seen[i].input_bytes_read, seen[i - 1].input_bytes_read);
    EXPECT_GE(seen[i].seconds, seen[i - 1].seconds);
  }
  EXPECT_EQ(seen.back().documents, summary.documents);
  EXPECT_EQ(seen.back().tokens, summary.train_tokens + summary.val_tokens);
  EXPECT_EQ(seen.back().input_bytes, fs::file_size(dir / "c.jsonl.xz"));
  EXPECT_EQ(seen.back().input_bytes_read, seen.back().input_bytes);
  // The documents' bytes: every line but its line break.
  EXPECT_EQ(seen.back().text_bytes, fs::file_size(dir / "c.jsonl") - 2000);

  PrepareProgress p;
  p.documents = 1'200'000;
  p.tokens = 456'700'000;
  p.text_bytes = 800'000'000;
  p.seconds = 100;
  p.input_bytes = 1000;
  p.input_bytes_read = 250;
  EXPECT_EQ(format_progress(p),
            "1.2M documents, 457M tokens, 8.0 MB/s, 25 % of 1000 B read, ETA 5m00s");
}

// ---------------------------------------------------------------------------------------------
// run_ordered

TEST(OrderedPipeline, ConsumesInTheOrderProducedWhateverTheThreads) {
  for (int threads : {1, 2, 5}) {
    int next = 0;
    std::vector<int> consumed;
    std::atomic<int> in_flight{0}, most{0};
    run_ordered<std::pair<int, int>>(
        threads, 3,
        [&](std::pair<int, int>& b) {
          if (next == 200) return false;
          b.first = next++;
          most = std::max(most.load(), ++in_flight);
          return true;
        },
        [&](std::pair<int, int>& b) {
          // Later batches often finish first.
          std::this_thread::sleep_for(std::chrono::microseconds((200 - b.first) % 7 * 50));
          b.second = b.first * b.first;
        },
        [&](std::pair<int, int>& b) {
          EXPECT_EQ(b.second, b.first * b.first);
          consumed.push_back(b.first);
          --in_flight;
        });
    std::vector<int> expected(200);
    for (int i = 0; i < 200; ++i) expected[static_cast<size_t>(i)] = i;
    EXPECT_EQ(consumed, expected) << threads << " threads";
    EXPECT_LE(most.load(), threads <= 1 ? 1 : 4) << "in flight: 3, and one being produced";
  }
}

TEST(OrderedPipeline, AnErrorComesAfterEveryEarlierBatch) {
  for (int threads : {1, 3}) {
    for (const std::string stage : {"produce", "work", "consume"}) {
      int next = 0;
      std::vector<int> consumed;
      auto fail_at = [&](const std::string& here, int i) {
        if (here == stage && i == 50) throw Error(stage + " failed at 50");
      };
      const std::string message = malleus::testing::error_of([&] {
        run_ordered<int>(
            threads, 4,
            [&](int& b) {
              if (next == 100) return false;
              fail_at("produce", next);
              b = next++;
              return true;
            },
            [&](int& b) {
              if (b < 50) std::this_thread::sleep_for(std::chrono::microseconds(200));
              fail_at("work", b);
            },
            [&](int& b) {
              fail_at("consume", b);
              consumed.push_back(b);
            });
      });
      EXPECT_EQ(message, stage + " failed at 50");
      EXPECT_EQ(consumed.size(), 50u) << stage << " on " << threads << " threads";
    }
  }
}
