// Tests of the data pipeline: llm.c shard files, the token dataset and its
// sampler, and prepare_data (text files to shards).
#include <gtest/gtest.h>

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
#include <set>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/files.h"
#include "data/dataset.h"
#include "data/prepare.h"
#include "data/shard.h"
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
