// Checkpoint save/load (round trip, atomic replacement, refusal of every kind of damage), the
// "latest" pointer, and the Hugging Face export read back by our reader and by the independent
// NumPy reference (tests/hf_llama_reference.py).
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>
#include "test_util.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "common/checksum.h"
#include "common/error.h"
#include "common/files.h"
#include "common/json.h"
#include "layout/layout.h"
#include "layout/optimizer_shard.h"
#include "model/config.h"
#include "model/parameters.h"
#include "train/checkpoint.h"
#include "train/export.h"
#include "train/safetensors.h"

namespace malleus::train {
namespace {

namespace fs = std::filesystem;

using TempDir = malleus::testing::ScratchDir;

// Random values in every tensor, zero in the alignment gaps (the files store no padding, so only
// zero gaps survive a round trip bit for bit).
std::vector<float> random_buffer(const model::ParameterLayout& layout, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> buffer(static_cast<size_t>(layout.total_size()), 0.0f);
  for (const auto& t : layout.tensors()) {
    for (int64_t i = 0; i < t.size; ++i) buffer[static_cast<size_t>(t.offset + i)] = normal(rng);
  }
  return buffer;
}

Checkpoint make_checkpoint(uint32_t seed, bool with_optimizer = true) {
  Checkpoint c;
  c.model = model::load_model_config("tiny");
  const model::ParameterLayout layout(c.model);
  c.train_config =
      Json{{"lr", 3e-4}, {"global_batch", 8}, {"note", "seed " + std::to_string(seed)}};
  c.step = 100 + seed;
  c.consumed_samples = 800 + 8 * int64_t{seed};
  c.params = random_buffer(layout, seed);
  if (with_optimizer) {
    c.adam_m = random_buffer(layout, seed + 1000);
    c.adam_v = random_buffer(layout, seed + 2000);
    for (float& v : c.adam_v) v = v * v;
  }
  return c;
}

bool bit_identical(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

void expect_same(const Checkpoint& expected, const Checkpoint& actual, bool with_optimizer) {
  EXPECT_EQ(actual.model.to_json(), expected.model.to_json());
  EXPECT_EQ(actual.train_config, expected.train_config);
  EXPECT_EQ(actual.step, expected.step);
  EXPECT_EQ(actual.consumed_samples, expected.consumed_samples);
  EXPECT_TRUE(bit_identical(actual.params, expected.params));
  if (with_optimizer) {
    EXPECT_TRUE(bit_identical(actual.adam_m, expected.adam_m));
    EXPECT_TRUE(bit_identical(actual.adam_v, expected.adam_v));
  } else {
    EXPECT_TRUE(actual.adam_m.empty());
    EXPECT_TRUE(actual.adam_v.empty());
  }
}

// Runs `body`, expects a malleus::Error, and returns its message.
template <typename F>
std::string error_of(F&& body) {
  try {
    body();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected malleus::Error, got another exception: " << e.what();
    return e.what();
  }
  ADD_FAILURE() << "expected malleus::Error, nothing was thrown";
  return "";
}

#define EXPECT_CONTAINS(text, part) \
  EXPECT_NE(std::string(text).find(part), std::string::npos) << "message: " << (text)

// Entries of `dir` other than the expected ones: leftovers such as "*.tmp.<pid>" or "*.old.<pid>".
std::vector<std::string> leftovers(const fs::path& dir, const std::vector<std::string>& expected) {
  std::vector<std::string> extra;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (std::find(expected.begin(), expected.end(), name) == expected.end()) extra.push_back(name);
  }
  return extra;
}

void flip_byte(const fs::path& path, uintmax_t position) {
  std::string bytes = read_file(path);
  ASSERT_LT(position, bytes.size());
  bytes[position] = static_cast<char>(bytes[position] ^ 0x40);
  write_file_atomic(path, bytes);
}

// Checkpoints name their checksum XXH3-64 (manifest key "xxh3"): whichever of the library's entry
// points computes it (common/checksum.cpp may use the run-time dispatched ones), the value is the
// library's plain XXH3_64bits, at every length its code paths split on and fed in any pieces.
TEST(Checksum, IsXxh3OfTheBytesHoweverTheyAreFed) {
  std::vector<unsigned char> bytes(size_t{3} << 20);
  std::mt19937 random(7);
  for (unsigned char& b : bytes) b = static_cast<unsigned char>(random());
  EXPECT_EQ(checksum_hex(bytes.data(), 0), "2d06800538d394c2");  // XXH3-64 of no bytes
  for (const size_t length : {size_t{1}, size_t{16}, size_t{128}, size_t{240}, size_t{241},
                              size_t{1024}, size_t{65537}, bytes.size()}) {
    char expected[17];
    std::snprintf(expected, sizeof expected, "%016llx",
                  static_cast<unsigned long long>(XXH3_64bits(bytes.data(), length)));
    EXPECT_EQ(checksum_hex(bytes.data(), length), expected) << length << " bytes";
    Checksum pieces;
    for (size_t at = 0; at < length;) {
      const size_t piece = std::min(length - at, size_t{1} + at % 70001);
      pieces.update(bytes.data() + at, piece);
      at += piece;
    }
    EXPECT_EQ(pieces.hex(), expected) << length << " bytes in pieces";
  }
}

TEST(Checkpoint, RoundTripIsBitIdentical) {
  TempDir tmp;
  const Checkpoint saved = make_checkpoint(1);
  const fs::path dir = tmp.path() / "step_00000101";
  save_checkpoint(dir, saved);

  for (const char* file : {"manifest.json", "params.bin", "optimizer.bin"}) {
    EXPECT_TRUE(fs::is_regular_file(dir / file)) << file;
  }
  const model::ParameterLayout layout(saved.model);
  const auto unpadded = static_cast<uintmax_t>(layout.num_parameters()) * sizeof(float);
  EXPECT_EQ(fs::file_size(dir / "params.bin"), unpadded);
  EXPECT_EQ(fs::file_size(dir / "optimizer.bin"), 2 * unpadded);

  expect_same(saved, load_checkpoint(dir), true);
  expect_same(saved, load_checkpoint(dir, /*with_optimizer=*/false), false);
  EXPECT_TRUE(leftovers(tmp.path(), {"step_00000101"}).empty());
}

TEST(Checkpoint, ManifestDescribesTensorsAndFiles) {
  TempDir tmp;
  const Checkpoint saved = make_checkpoint(2);
  const fs::path dir = tmp.path() / "ckpt";
  save_checkpoint(dir, saved);

  const Json manifest = read_json_file((dir / "manifest.json").string());
  EXPECT_EQ(manifest["format"], "malleus-checkpoint");
  EXPECT_EQ(manifest["version"], 2);
  // The manifest's own checksum covers everything else in it.
  Json content = manifest;
  content.erase("manifest_xxh3");
  EXPECT_EQ(manifest["manifest_xxh3"], manifest_checksum(content));
  EXPECT_EQ(manifest["step"], saved.step);
  EXPECT_EQ(manifest["consumed_samples"], saved.consumed_samples);
  const model::ParameterLayout layout(saved.model);
  ASSERT_EQ(manifest["tensors"].size(), layout.tensors().size());
  int64_t offset = 0;
  for (size_t i = 0; i < layout.tensors().size(); ++i) {
    const auto& spec = layout.tensors()[i];
    const Json& entry = manifest["tensors"][i];
    EXPECT_EQ(entry["name"], spec.name);
    EXPECT_EQ(entry["shape"].get<std::vector<int64_t>>(), spec.shape);
    EXPECT_EQ(entry["offset"], offset);
    offset += spec.size * 4;
  }
  EXPECT_EQ(manifest["files"]["params.bin"]["bytes"], offset);
  EXPECT_EQ(manifest["files"]["optimizer.bin"]["bytes"], 2 * offset);
  const std::string params = read_file(dir / "params.bin");
  EXPECT_EQ(manifest["files"]["params.bin"]["xxh3"], checksum_hex(params.data(), params.size()));

  // params.bin is the tensors back to back, unpadded, as float32 in memory order.
  std::string expected;
  for (const auto& spec : layout.tensors()) {
    expected.append(reinterpret_cast<const char*>(saved.params.data() + spec.offset),
                    static_cast<size_t>(spec.size) * sizeof(float));
  }
  EXPECT_TRUE(params == expected);
}

TEST(Checkpoint, WithoutOptimizerState) {
  TempDir tmp;
  const Checkpoint saved = make_checkpoint(3, /*with_optimizer=*/false);
  const fs::path dir = tmp.path() / "ckpt";
  save_checkpoint(dir, saved);
  EXPECT_FALSE(fs::exists(dir / "optimizer.bin"));
  expect_same(saved, load_checkpoint(dir, false), false);
  const std::string message = error_of([&] { load_checkpoint(dir, true); });
  EXPECT_CONTAINS(message, dir.string());
  EXPECT_CONTAINS(message, "optimizer.bin");
}

TEST(Checkpoint, TrailingSlashNamesTheSameDirectory) {
  TempDir tmp;
  const Checkpoint saved = make_checkpoint(4);
  save_checkpoint(tmp.path() / "ckpt/", saved);
  EXPECT_TRUE(leftovers(tmp.path(), {"ckpt"}).empty());
  expect_same(saved, load_checkpoint(tmp.path() / "ckpt"), true);
}

TEST(Checkpoint, CreatesMissingParentDirectories) {
  TempDir tmp;
  const Checkpoint saved = make_checkpoint(5);
  const fs::path dir = tmp.path() / "a" / "b" / "ckpt";
  save_checkpoint(dir, saved);
  expect_same(saved, load_checkpoint(dir), true);
}

TEST(Checkpoint, OverwriteReplacesTheOldCheckpoint) {
  TempDir tmp;
  const fs::path dir = tmp.path() / "ckpt";
  save_checkpoint(dir, make_checkpoint(6));
  // A file only the old checkpoint has must not survive the replacement.
  write_file_atomic(dir / "stray.txt", "old\n");
  const Checkpoint second = make_checkpoint(7, /*with_optimizer=*/false);
  save_checkpoint(dir, second);
  expect_same(second, load_checkpoint(dir, false), false);
  EXPECT_FALSE(fs::exists(dir / "stray.txt"));
  EXPECT_FALSE(fs::exists(dir / "optimizer.bin"));
  EXPECT_TRUE(leftovers(tmp.path(), {"ckpt"}).empty());
}

TEST(Checkpoint, RejectsBuffersOfTheWrongSize) {
  TempDir tmp;
  const fs::path dir = tmp.path() / "ckpt";
  const Checkpoint good = make_checkpoint(8);
  save_checkpoint(dir, good);

  Checkpoint bad = make_checkpoint(9);
  bad.adam_v.pop_back();
  EXPECT_CONTAINS(error_of([&] { save_checkpoint(dir, bad); }), "adam_v has");
  bad = make_checkpoint(9);
  bad.params.push_back(0.0f);
  EXPECT_CONTAINS(error_of([&] { save_checkpoint(dir, bad); }), "params has");
  bad = make_checkpoint(9);
  bad.adam_v.clear();  // m without v
  EXPECT_CONTAINS(error_of([&] { save_checkpoint(dir, bad); }), "adam_v has");

  expect_same(good, load_checkpoint(dir), true);
  EXPECT_TRUE(leftovers(tmp.path(), {"ckpt"}).empty());
}

// The data files are already written when the manifest cannot be: the temporary directory must go
// and the previous checkpoint must stay as it was. Works as root, unlike a read-only directory.
TEST(Checkpoint, FailureAfterDataFilesLeavesOldCheckpointIntact) {
  TempDir tmp;
  const fs::path dir = tmp.path() / "ckpt";
  const Checkpoint good = make_checkpoint(10);
  save_checkpoint(dir, good);

  Checkpoint bad = make_checkpoint(11);
  bad.train_config = Json{{"note", std::string("\xff\xfe not UTF-8")}};
  const std::string message = error_of([&] { save_checkpoint(dir, bad); });
  EXPECT_CONTAINS(message, "manifest.json");
  expect_same(good, load_checkpoint(dir), true);
  EXPECT_TRUE(leftovers(tmp.path(), {"ckpt"}).empty());
}

// The last step (moving the old checkpoint aside) fails because its parking place is taken.
TEST(Checkpoint, FailureAtTheFinalRenameLeavesOldCheckpointIntact) {
  TempDir tmp;
  const fs::path dir = tmp.path() / "ckpt";
  const Checkpoint good = make_checkpoint(12);
  save_checkpoint(dir, good);

  const std::string old_name = "ckpt.old." + std::to_string(::getpid());
  fs::create_directories(tmp.path() / old_name);
  write_file_atomic(tmp.path() / old_name / "blocker", "x");
  const std::string message = error_of([&] { save_checkpoint(dir, make_checkpoint(13)); });
  EXPECT_CONTAINS(message, dir.string());
  expect_same(good, load_checkpoint(dir), true);
  EXPECT_TRUE(leftovers(tmp.path(), {"ckpt", old_name}).empty());
}

TEST(Checkpoint, StaleTemporaryDirectoryIsReplaced) {
  TempDir tmp;
  const fs::path dir = tmp.path() / "ckpt";
  const fs::path stale = tmp.path() / ("ckpt.tmp." + std::to_string(::getpid()));
  fs::create_directories(stale);
  write_file_atomic(stale / "params.bin", "garbage");
  const Checkpoint saved = make_checkpoint(14);
  save_checkpoint(dir, saved);
  expect_same(saved, load_checkpoint(dir), true);
  EXPECT_TRUE(leftovers(tmp.path(), {"ckpt"}).empty());
}

class CorruptCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = tmp_.path() / "step_00000042";
    save_checkpoint(dir_, make_checkpoint(42));
  }
  Json manifest() const { return read_json_file((dir_ / "manifest.json").string()); }
  // Writes an edited manifest with a matching checksum of its own, as a deliberate forger would,
  // so that the checks behind the manifest checksum are reached.
  void write_manifest(Json json) const {
    json.erase("manifest_xxh3");
    json["manifest_xxh3"] = manifest_checksum(json);
    write_file_atomic(dir_ / "manifest.json", json.dump(2));
  }
  // The message of loading, which must name the checkpoint.
  std::string load_error(bool with_optimizer = true) const {
    std::string message = error_of([&] { load_checkpoint(dir_, with_optimizer); });
    EXPECT_CONTAINS(message, dir_.string());
    return message;
  }

  TempDir tmp_;
  fs::path dir_;
};

TEST_F(CorruptCheckpoint, MissingDirectory) {
  fs::remove_all(dir_);
  EXPECT_CONTAINS(load_error(), "not a checkpoint");
}

TEST_F(CorruptCheckpoint, MissingManifest) {
  fs::remove(dir_ / "manifest.json");
  EXPECT_CONTAINS(load_error(), "not a checkpoint: no manifest.json");
}

TEST_F(CorruptCheckpoint, MalformedManifest) {
  write_file_atomic(dir_ / "manifest.json", "{\"format\": \"malleus-checkpoint\", ");
  const std::string message = load_error();
  EXPECT_CONTAINS(message, "manifest.json");
  EXPECT_CONTAINS(message, "malformed JSON");
}

TEST_F(CorruptCheckpoint, WrongFormatOrVersion) {
  Json json = manifest();
  json["format"] = "something-else";
  write_manifest(json);
  EXPECT_CONTAINS(load_error(), "format is \"something-else\"");
  json = manifest();
  json["format"] = "malleus-checkpoint";
  json["version"] = 5;
  write_manifest(json);
  EXPECT_CONTAINS(load_error(), "version 5 is not supported");
}

TEST_F(CorruptCheckpoint, ManifestMissingKey) {
  Json json = manifest();
  json.erase("step");
  write_manifest(json);
  EXPECT_CONTAINS(load_error(), "missing key \"step\"");
}

TEST_F(CorruptCheckpoint, MissingParams) {
  fs::remove(dir_ / "params.bin");
  EXPECT_CONTAINS(load_error(), "params.bin is missing");
}

TEST_F(CorruptCheckpoint, TruncatedParams) {
  const auto size = fs::file_size(dir_ / "params.bin");
  fs::resize_file(dir_ / "params.bin", size - 5);
  EXPECT_CONTAINS(load_error(), "params.bin is truncated: " + std::to_string(size - 5) +
                                    " bytes, manifest says " + std::to_string(size));
}

TEST_F(CorruptCheckpoint, ParamsWithTrailingData) {
  const auto size = fs::file_size(dir_ / "params.bin");
  fs::resize_file(dir_ / "params.bin", size + 4);
  EXPECT_CONTAINS(load_error(), "params.bin has trailing data");
}

TEST_F(CorruptCheckpoint, FlippedByteInParams) {
  flip_byte(dir_ / "params.bin", fs::file_size(dir_ / "params.bin") / 2);
  const std::string message = load_error();
  EXPECT_CONTAINS(message, "params.bin is corrupt: checksum ");
  EXPECT_CONTAINS(message,
                  "expected " + manifest()["files"]["params.bin"]["xxh3"].get<std::string>());
}

TEST_F(CorruptCheckpoint, FlippedByteInOptimizer) {
  flip_byte(dir_ / "optimizer.bin", fs::file_size(dir_ / "optimizer.bin") - 1);
  EXPECT_CONTAINS(load_error(), "optimizer.bin is corrupt: checksum ");
  // Without optimizer state the damaged file is not needed, so the parameters still load.
  EXPECT_EQ(load_checkpoint(dir_, false).step, make_checkpoint(42).step);
}

TEST_F(CorruptCheckpoint, TruncatedOptimizer) {
  fs::resize_file(dir_ / "optimizer.bin", 0);
  EXPECT_CONTAINS(load_error(), "optimizer.bin is truncated: 0 bytes");
}

TEST_F(CorruptCheckpoint, ChecksumInManifestChanged) {
  Json json = manifest();
  json["files"]["params.bin"]["xxh3"] = "0123456789abcdef";
  write_manifest(json);
  EXPECT_CONTAINS(load_error(), "params.bin is corrupt");
}

TEST_F(CorruptCheckpoint, TensorShapeChanged) {
  Json json = manifest();
  json["tensors"][3]["shape"] = {8, 32};
  write_manifest(json);
  const std::string message = load_error();
  EXPECT_CONTAINS(message, "tensor 3");
  EXPECT_CONTAINS(message, "[8, 32]");
  EXPECT_CONTAINS(message, "model.layers.0.self_attn.k_proj.weight");
}

TEST_F(CorruptCheckpoint, TensorOrderChanged) {
  Json json = manifest();
  std::swap(json["tensors"][2]["name"], json["tensors"][3]["name"]);
  write_manifest(json);
  EXPECT_CONTAINS(load_error(), "but the model config expects");
}

TEST_F(CorruptCheckpoint, TensorMissing) {
  Json json = manifest();
  json["tensors"].erase(json["tensors"].size() - 1);
  write_manifest(json);
  EXPECT_CONTAINS(load_error(), "tensors, but its model config has");
}

TEST_F(CorruptCheckpoint, ModelConfigChanged) {
  Json json = manifest();
  json["model"]["hidden_size"] = 64;  // the tensor list no longer matches
  write_manifest(json);
  EXPECT_CONTAINS(load_error(), "but the model config expects");
  json["model"]["hidden_size"] = "wide";
  write_manifest(json);
  EXPECT_CONTAINS(load_error(), "hidden_size");
}

TEST_F(CorruptCheckpoint, OneBitEditOfTheManifestIsRefused) {
  // A one-bit change of a digit keeps valid JSON and a plausible value: without the manifest's
  // own checksum it would resume another schedule, data position or model.
  const std::string original = read_file(dir_ / "manifest.json");
  for (const char* key : {"\"step\": ", "\"consumed_samples\": ", "\"norm_eps\": ",
                          "\"rope_theta\": ", "\"manifest_xxh3\": \""}) {
    std::string text = original;
    const size_t at = text.find(key);
    ASSERT_NE(at, std::string::npos) << key;
    // The value's last digit (a first digit could become a leading zero, which is not JSON).
    const size_t start = at + std::string(key).size();
    const size_t digit = text.find_first_not_of("0123456789abcdef.e-+", start) - 1;
    text[digit] = static_cast<char>(text[digit] ^ 1);  // 0<->1, ..., 8<->9; b<->c in hex
    ASSERT_NE(text, original);
    write_file_atomic(dir_ / "manifest.json", text);
    const std::string message = load_error();
    EXPECT_CONTAINS(message, "manifest.json is corrupt or was edited") << key;
  }
  write_file_atomic(dir_ / "manifest.json", original);
  EXPECT_EQ(load_checkpoint(dir_).step, make_checkpoint(42).step);
}

// The pid of a process that has exited (and been reaped), so it runs no longer.
pid_t dead_pid() {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  int status = 0;
  ::waitpid(child, &status, 0);
  return child;
}

TEST(Checkpoint, StaleTemporariesOfDeadProcessesAreCleaned) {
  TempDir tmp;
  const fs::path root = tmp.path();
  const std::string dead = std::to_string(dead_pid());
  const std::string alive = std::to_string(::getppid());  // our parent runs while we do
  // A save that died while writing; one that died after moving step 4 aside (so step 4 is
  // missing); one that died after step 6's new copy was in place; a "latest" being written; and a
  // save of a live process, which must be left alone.
  fs::create_directories(root / ("step_00000005.tmp." + dead));
  save_checkpoint(root / ("step_00000004.old." + dead), make_checkpoint(4));
  save_checkpoint(root / "step_00000006", make_checkpoint(6));
  fs::create_directories(root / ("step_00000006.old." + dead));
  write_file_atomic(root / ("latest.tmp." + dead), "step_00000004\n");
  fs::create_directories(root / ("step_00000007.tmp." + alive));

  const auto done = clean_stale_temporaries(root);
  EXPECT_EQ(done.size(), 4u);
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(root)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"step_00000004", "step_00000006",
                                             "step_00000007.tmp." + alive}));
  EXPECT_EQ(load_checkpoint(root / "step_00000004").step, make_checkpoint(4).step);
  EXPECT_EQ(load_checkpoint(root / "step_00000006").step, make_checkpoint(6).step);
  EXPECT_TRUE(clean_stale_temporaries(tmp.path() / "no-such-dir").empty());
}

// ---- Sharded checkpoints ----

// A tensor-parallel shard of the tiny model (4 heads in 2 KV groups, FFN 64, vocabulary 257):
// heads [head, head + heads), FFN columns and vocabulary rows likewise.
model::ShardSpec tp_shard(int head, int heads, int ffn, int ffns, int vocab, int vocabs) {
  model::ShardSpec s;
  s.layer_begin = 0;
  s.layer_end = 2;
  s.head_begin = head;
  s.heads = heads;
  s.ffn_begin = ffn;
  s.ffn = ffns;
  s.vocab_begin = vocab;
  s.vocab = vocabs;
  return s;
}

// Rank 0 holds the whole model; ranks 1 and 2 split it unevenly (tensor parallelism): every
// piece is held twice, so ownership has a choice to make.
layout::Layout three_rank_layout(const model::ModelConfig& model) {
  layout::Layout l;
  l.shards = {model::ShardSpec::full(model), tp_shard(0, 2, 0, 48, 0, 200),
              tp_shard(2, 2, 48, 16, 200, 57)};
  l.replica_group = {0, 1, 1};
  return l;
}

// `local`'s part of a full-model buffer.
std::vector<float> slice(const model::ParameterLayout& full, const std::vector<float>& buffer,
                         const model::ParameterLayout& local) {
  std::vector<float> out(static_cast<size_t>(local.total_size()), 0.0f);
  for (const auto& t : local.tensors()) {
    const auto& f = full.find(t.name);
    const int index = static_cast<int>(&f - full.tensors().data());
    const int64_t extent = t.shard_axis == model::ShardAxis::kColumns ? t.shape[1] : t.shape[0];
    const layout::Piece piece{index, t.shard_begin, t.shard_begin + extent};
    std::vector<float> packed(static_cast<size_t>(layout::piece_elements(full, piece)));
    layout::pack_piece(buffer.data(), f, piece, packed.data());
    layout::unpack_piece(packed.data(), t, piece, out.data());
  }
  return out;
}

// `blocks`' part of a full-model buffer, laid out as the blocks say (`elements` in all).
std::vector<float> gather_blocks(const model::ParameterLayout& full,
                                 const std::vector<float>& buffer, const layout::Blocks& blocks,
                                 int64_t elements) {
  const layout::Blocks whole_model = layout::local_blocks(full, full);
  std::vector<float> out(static_cast<size_t>(elements), 0.0f);
  for (const layout::Block& b : blocks) {
    const layout::BlockPart part = layout::whole(b);
    std::vector<float> packed(static_cast<size_t>(part.elements));
    layout::pack_block_part(buffer.data(), whole_model[static_cast<size_t>(b.tensor)], part,
                            packed.data());
    layout::unpack_block_part(packed.data(), b, part, out.data());
  }
  return out;
}

// Small chunks for the distributed optimizer's shards, so that its slices cut column-sharded
// pieces between rows (what a large model's chunks do to its large pieces).
constexpr double kSmallChunk = 1500;

// Writes `c` as a sharded checkpoint of `l` from one process, doing each rank's part in turn
// (what train/checkpoint_writer.cpp does across ranks): with `moments_split` (the distributed
// optimizer) each rank's moments lie in its optimizer shard and are written as they lie there.
void save_sharded(const fs::path& dir, const Checkpoint& c, const layout::Layout& l,
                  bool moments_split = false) {
  const model::ParameterLayout full(c.model);
  const auto refinement = layout::common_refinement(c.model, {&l});
  const layout::GradSyncPlan sync = layout::plan_grad_sync(c.model, l);
  const fs::path tmp = temporary_dir(dir, 1);
  fs::create_directories(tmp);
  std::vector<Json> shards;
  const auto locals = layout::local_layouts(c.model, l);
  for (int r = 0; r < l.world_size(); ++r) {
    const auto& local = *locals[static_cast<size_t>(r)];
    const auto p = slice(full, c.params, local);
    std::vector<float> m, v;
    layout::Blocks blocks;
    if (moments_split) {
      const layout::OptimizerShard shard = layout::optimizer_shard(sync, r, kSmallChunk);
      blocks = layout::shard_blocks(full, sync, shard);
      m = gather_blocks(full, c.adam_m, blocks, shard.elements);
      v = gather_blocks(full, c.adam_v, blocks, shard.elements);
    } else {
      blocks = layout::local_blocks(full, local);
      m = slice(full, c.adam_m, local);
      v = slice(full, c.adam_v, local);
    }
    const ShardSnapshot snap =
        snapshot_shard(r, saved_state(c.model, refinement, r, local, p.data(), &blocks, m.data(),
                                      v.data(), moments_split));
    shards.push_back(write_shard(tmp, snap));
  }
  commit_sharded_checkpoint(tmp, dir, c, shards, /*with_moments=*/true);
}

TEST(ShardedCheckpoint, EachElementIsStoredOnceAndLoadsWhole) {
  TempDir tmp;
  const Checkpoint c = make_checkpoint(7);
  const layout::Layout l = three_rank_layout(c.model);
  save_sharded(tmp / "ckpt", c, l);
  EXPECT_TRUE(leftovers(tmp.path(), {"ckpt"}).empty());
  // Parameters and two moments, 4 bytes each, every element exactly once over the three files.
  int64_t bytes = 0;
  for (int r = 0; r < 3; ++r) {
    const fs::path file = tmp / "ckpt" / shard_file_name(r);
    ASSERT_TRUE(fs::exists(file)) << file;
    bytes += static_cast<int64_t>(fs::file_size(file));
  }
  EXPECT_EQ(bytes, 12 * model::ParameterLayout(c.model).num_parameters());
  // Rank 0 holds everything, yet ranks 1 and 2 write about as much as it does.
  const auto rank0 = static_cast<double>(fs::file_size(tmp / "ckpt" / shard_file_name(0)));
  EXPECT_LT(rank0, 0.6 * static_cast<double>(bytes));
  expect_same(c, load_checkpoint(tmp / "ckpt"), true);
  expect_same(c, load_checkpoint(tmp / "ckpt", /*with_optimizer=*/false), false);
  const CheckpointIndex index(tmp / "ckpt");
  EXPECT_TRUE(index.sharded());
  EXPECT_TRUE(index.has_optimizer());
  EXPECT_EQ(index.header().step, c.step);
}

TEST(ShardedCheckpoint, ReadsAnyOtherShardFromThePiecesItNeeds) {
  TempDir tmp;
  const Checkpoint c = make_checkpoint(8);
  save_sharded(tmp / "ckpt", c, three_rank_layout(c.model));
  const model::ParameterLayout full(c.model);
  const CheckpointIndex index(tmp / "ckpt");
  // Cuts the saving layout never had: a middle part of the heads, FFN and vocabulary, one layer.
  model::ShardSpec other = tp_shard(2, 2, 16, 40, 100, 150);
  other.layer_begin = 1;
  other.has_embedding = false;
  const model::ParameterLayout local(c.model, other);
  std::vector<float> p(static_cast<size_t>(local.total_size())), m(p.size()), v(p.size());
  const int64_t read = index.read(local, {p.data(), m.data(), v.data()});
  EXPECT_TRUE(bit_identical(p, slice(full, c.params, local)));
  EXPECT_TRUE(bit_identical(m, slice(full, c.adam_m, local)));
  EXPECT_TRUE(bit_identical(v, slice(full, c.adam_v, local)));
  // Only pieces overlapping this shard were read: far less than the whole checkpoint.
  EXPECT_LT(read, 12 * full.num_parameters() / 2);
  std::vector<float> params_only(p.size());
  index.read(local, {params_only.data()});
  EXPECT_TRUE(bit_identical(params_only, p));
}

TEST(ShardedCheckpoint, DamageIsNamed) {
  TempDir tmp;
  const Checkpoint c = make_checkpoint(9);
  const fs::path dir = tmp / "ckpt";
  save_sharded(dir, c, three_rank_layout(c.model));
  const fs::path file = dir / shard_file_name(1);
  const std::string good = read_file(file);

  flip_byte(file, good.size() / 2);
  EXPECT_CONTAINS(error_of([&] { load_checkpoint(dir); }), "rank_00001.bin is corrupt");
  write_file_atomic(file, good.substr(0, good.size() - 4));
  EXPECT_CONTAINS(error_of([&] { load_checkpoint(dir); }), "rank_00001.bin is truncated");
  fs::remove(file);
  EXPECT_CONTAINS(error_of([&] { load_checkpoint(dir); }), "rank_00001.bin is missing");
  write_file_atomic(file, good);

  // A manifest that lost a piece (resealed, as a forger would) leaves part of a tensor unstored.
  Json json = read_json_file((dir / "manifest.json").string());
  Json& pieces = json["files"][shard_file_name(2)]["pieces"];
  const std::string tensor = pieces.back()["tensor"];
  const int64_t end_of_file = pieces.back()["offset"].get<int64_t>();
  pieces.erase(pieces.size() - 1);
  json["files"][shard_file_name(2)]["bytes"] = end_of_file;
  json.erase("manifest_xxh3");
  json["manifest_xxh3"] = manifest_checksum(json);
  write_file_atomic(dir / "manifest.json", json.dump(2));
  const std::string message = error_of([&] { CheckpointIndex{dir}; });
  EXPECT_CONTAINS(message, tensor);
  EXPECT_CONTAINS(message, "manifest.json");
}

TEST(ShardedCheckpoint, OverlappingPiecesAreRefused) {
  TempDir tmp;
  const Checkpoint c = make_checkpoint(10);
  const fs::path dir = tmp / "ckpt";
  save_sharded(dir, c, three_rank_layout(c.model));
  Json json = read_json_file((dir / "manifest.json").string());
  Json& first = json["files"][shard_file_name(1)]["pieces"][0];
  first["begin"] = first["begin"].get<int64_t>() > 0 ? first["begin"].get<int64_t>() - 1 : 0;
  first["end"] = first["end"].get<int64_t>() + 1;
  json.erase("manifest_xxh3");
  json["manifest_xxh3"] = manifest_checksum(json);
  write_file_atomic(dir / "manifest.json", json.dump(2));
  EXPECT_FALSE(error_of([&] { CheckpointIndex{dir}; }).empty());
}

TEST(ShardedCheckpoint, MomentsAreWrittenFromOptimizerShardsEachElementOnce) {
  TempDir tmp;
  const Checkpoint c = make_checkpoint(11);
  const model::ParameterLayout full(c.model);
  const layout::Layout l = three_rank_layout(c.model);
  save_sharded(tmp / "ckpt", c, l, /*moments_split=*/true);
  // Every element of the parameters and of both moments stored exactly once over the files, each
  // rank writing the parameters and moments of the rows of its optimizer shard: rank 0 (the whole
  // model) half of each piece, ranks 1 and 2 (tensor-parallel halves) the other half.
  int64_t bytes = 0;
  const layout::GradSyncPlan sync = layout::plan_grad_sync(c.model, l);
  for (int r = 0; r < 3; ++r) {
    const auto file = static_cast<int64_t>(fs::file_size(tmp / "ckpt" / shard_file_name(r)));
    EXPECT_EQ(file, 12 * layout::optimizer_shard(sync, r, kSmallChunk).elements) << "rank " << r;
    bytes += file;
  }
  EXPECT_EQ(bytes, 12 * full.num_parameters());
  const Json manifest = read_json_file((tmp / "ckpt" / "manifest.json").string());
  EXPECT_EQ(manifest["version"], 4);
  // The shards' slices cut some column-sharded piece between its rows.
  int partial_rows = 0, moment_pieces = 0;
  for (const auto& [file, entry] : manifest["files"].items()) {
    for (const Json& piece : entry["pieces"]) {
      if (piece["state"] != "moments") continue;
      ++moment_pieces;
      if (!piece.contains("rows")) continue;
      const auto& spec = full.find(piece["tensor"].get<std::string>());
      if (piece["rows"][0] != 0 || piece["rows"][1] != spec.full_shape[0]) ++partial_rows;
    }
  }
  EXPECT_GT(moment_pieces, 0);
  EXPECT_GT(partial_rows, 0);
  // Whole, and bit-identical.
  expect_same(c, load_checkpoint(tmp / "ckpt"), true);

  // Read straight into another plan's optimizer shards (other cuts, other chunks), and into
  // whole moments of another shard.
  const CheckpointIndex index(tmp / "ckpt");
  model::ShardSpec other = tp_shard(2, 2, 16, 40, 100, 150);
  other.layer_begin = 1;
  other.has_embedding = false;
  layout::Layout l2;
  l2.shards = {model::ShardSpec::full(c.model), other, tp_shard(0, 2, 0, 16, 0, 100)};
  l2.replica_group = {0, 1, 2};
  const layout::GradSyncPlan sync2 = layout::plan_grad_sync(c.model, l2);
  const auto locals2 = layout::local_layouts(c.model, l2);
  for (int r = 0; r < 3; ++r) {
    const layout::OptimizerShard shard = layout::optimizer_shard(sync2, r, 700);
    const layout::Blocks blocks = layout::shard_blocks(full, sync2, shard);
    const model::ParameterLayout& local = *locals2[static_cast<size_t>(r)];
    const layout::Blocks param_blocks = layout::local_blocks(full, local);
    std::vector<float> p(static_cast<size_t>(local.total_size()));
    std::vector<float> m(static_cast<size_t>(shard.elements)), v(m.size());
    const StateTarget moments{&blocks, {m.data(), v.data()}};
    index.read({&param_blocks, {p.data()}}, &moments);
    EXPECT_TRUE(bit_identical(p, slice(full, c.params, local))) << "rank " << r;
    EXPECT_TRUE(bit_identical(m, gather_blocks(full, c.adam_m, blocks, shard.elements)))
        << "rank " << r;
    EXPECT_TRUE(bit_identical(v, gather_blocks(full, c.adam_v, blocks, shard.elements)))
        << "rank " << r;
  }
  std::vector<float> p(static_cast<size_t>(locals2[1]->total_size())), m(p.size()), v(p.size());
  index.read(*locals2[1], {p.data(), m.data(), v.data()});
  EXPECT_TRUE(bit_identical(m, slice(full, c.adam_m, *locals2[1])));
  EXPECT_TRUE(bit_identical(v, slice(full, c.adam_v, *locals2[1])));
}

TEST(ShardedCheckpoint, DamagedOrOverlappingMomentPiecesAreRefused) {
  TempDir tmp;
  const Checkpoint c = make_checkpoint(12);
  const fs::path dir = tmp / "ckpt";
  save_sharded(dir, c, three_rank_layout(c.model), /*moments_split=*/true);
  const Json manifest = read_json_file((dir / "manifest.json").string());
  // The last moment piece of rank 1's file: its second moment, the file's last bytes.
  const Json& pieces = manifest["files"][shard_file_name(1)]["pieces"];
  ASSERT_EQ(pieces.back()["state"], "moments");
  const fs::path file = dir / shard_file_name(1);
  const std::string good = read_file(file);
  flip_byte(file, good.size() - 2);
  std::string message = error_of([&] { load_checkpoint(dir); });
  EXPECT_CONTAINS(message, "rank_00001.bin is corrupt");
  EXPECT_CONTAINS(message, "(adam_v)");
  write_file_atomic(file, good.substr(0, good.size() - 4));
  EXPECT_CONTAINS(error_of([&] { load_checkpoint(dir); }), "rank_00001.bin is truncated");
  write_file_atomic(file, good);
  expect_same(c, load_checkpoint(dir), true);

  // A moment piece moved one row down, into its neighbour's (resealed, as a forger would).
  Json json = manifest;
  bool edited = false;
  const model::ParameterLayout full(c.model);
  for (auto& [name, entry] : json["files"].items()) {
    for (Json& piece : entry["pieces"]) {
      if (edited || piece["state"] != "moments" || !piece.contains("rows")) continue;
      const auto& spec = full.find(piece["tensor"].get<std::string>());
      if (piece["rows"][1] == spec.full_shape[0]) continue;
      piece["rows"][0] = piece["rows"][0].get<int64_t>() + 1;
      piece["rows"][1] = piece["rows"][1].get<int64_t>() + 1;
      edited = true;
    }
  }
  ASSERT_TRUE(edited);
  json.erase("manifest_xxh3");
  json["manifest_xxh3"] = manifest_checksum(json);
  write_file_atomic(dir / "manifest.json", json.dump(2));
  message = error_of([&] { CheckpointIndex{dir}; });
  EXPECT_CONTAINS(message, "manifest.json");
  EXPECT_CONTAINS(message, "moments");
}

// Version 3 stored every piece's parameters and both moments together; such checkpoints still
// load.
TEST(ShardedCheckpoint, Version3StillLoads) {
  TempDir tmp;
  const Checkpoint c = make_checkpoint(13);
  const model::ParameterLayout full(c.model);
  const fs::path dir = tmp / "v3";
  fs::create_directories(dir);
  // One rank's file: every tensor whole, its parameters, then its first and second moment.
  std::string data;
  Json pieces = Json::array();
  for (size_t t = 0; t < full.tensors().size(); ++t) {
    const model::TensorSpec& spec = full.tensors()[t];
    const int64_t extent =
        spec.shard_axis == model::ShardAxis::kColumns ? spec.full_shape[1] : spec.full_shape[0];
    Json sums = Json::array();
    const int64_t offset = static_cast<int64_t>(data.size());
    for (const std::vector<float>* buffer : {&c.params, &c.adam_m, &c.adam_v}) {
      std::vector<float> packed(static_cast<size_t>(spec.size));
      layout::pack_piece(buffer->data(), spec, {static_cast<int>(t), 0, extent}, packed.data());
      sums.push_back(checksum_hex(packed.data(), packed.size() * sizeof(float)));
      data.append(reinterpret_cast<const char*>(packed.data()), packed.size() * sizeof(float));
    }
    pieces.push_back(
        {{"tensor", spec.name}, {"begin", 0}, {"end", extent}, {"offset", offset}, {"xxh3", sums}});
  }
  write_file_atomic(dir / shard_file_name(0), data);
  Json tensors = Json::array();
  for (const auto& t : full.tensors())
    tensors.push_back({{"name", t.name}, {"shape", t.full_shape}});
  Json json = {
      {"format", "malleus-checkpoint"},
      {"version", 3},
      {"model", c.model.to_json()},
      {"train_config", c.train_config},
      {"step", c.step},
      {"consumed_samples", c.consumed_samples},
      {"tensors", tensors},
      {"buffers", {"params", "adam_m", "adam_v"}},
      {"files",
       {{shard_file_name(0), {{"bytes", static_cast<int64_t>(data.size())}, {"pieces", pieces}}}}}};
  json["manifest_xxh3"] = manifest_checksum(json);
  write_file_atomic(dir / "manifest.json", json.dump(2));
  expect_same(c, load_checkpoint(dir), true);
  flip_byte(dir / shard_file_name(0), data.size() - 1);
  EXPECT_CONTAINS(error_of([&] { load_checkpoint(dir); }), "rank_00000.bin is corrupt");
}

TEST(Latest, DirectoryNamesAndLatestPointer) {
  TempDir tmp;
  const fs::path root = tmp.path() / "run";
  EXPECT_EQ(checkpoint_dir(root, 100), root / "step_00000100");
  EXPECT_EQ(checkpoint_dir(root, 123456789), root / "step_123456789");
  EXPECT_THROW(checkpoint_dir(root, -1), Error);

  fs::create_directories(root);
  EXPECT_EQ(latest_checkpoint(root), std::nullopt);

  const Checkpoint first = make_checkpoint(20);
  save_checkpoint(checkpoint_dir(root, first.step), first);
  mark_latest(root, checkpoint_dir(root, first.step));
  EXPECT_EQ(read_file(root / "latest"), "step_00000120\n");
  EXPECT_EQ(latest_checkpoint(root), checkpoint_dir(root, first.step));

  const Checkpoint second = make_checkpoint(21);
  save_checkpoint(checkpoint_dir(root, second.step), second);
  mark_latest(root, checkpoint_dir(root, second.step).string() + "/");
  EXPECT_EQ(read_file(root / "latest"), "step_00000121\n");
  const auto latest = latest_checkpoint(root);
  ASSERT_TRUE(latest.has_value());
  expect_same(second, load_checkpoint(*latest), true);
  EXPECT_TRUE(leftovers(root, {"step_00000120", "step_00000121", "latest"}).empty());

  EXPECT_CONTAINS(error_of([&] { mark_latest(root, root / "step_00000999"); }), "step_00000999");

  fs::remove_all(checkpoint_dir(root, second.step));
  const std::string message = error_of([&] { latest_checkpoint(root); });
  EXPECT_CONTAINS(message, "latest");
  EXPECT_CONTAINS(message, "step_00000121");

  write_file_atomic(root / "latest", "../elsewhere\n");
  EXPECT_CONTAINS(error_of([&] { latest_checkpoint(root); }), "expected the name of a checkpoint");
}

// ---------------------------------------------------------------------------------------------
// Hugging Face export

uint64_t header_length(const std::string& bytes) {
  uint64_t n = 0;
  for (size_t i = 0; i < 8; ++i) n |= uint64_t{static_cast<unsigned char>(bytes[i])} << (8 * i);
  return n;
}

// A safetensors file from a header text and data bytes, header padded like ours.
std::string safetensors_bytes(std::string header, const std::string& data) {
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string bytes(8, '\0');
  for (size_t i = 0; i < 8; ++i) {
    bytes[i] = static_cast<char>((uint64_t{header.size()} >> (8 * i)) & 0xff);
  }
  return bytes + header + data;
}

TEST(Export, SafetensorsRoundTripIsBitIdentical) {
  TempDir tmp;
  const Checkpoint c = make_checkpoint(30);
  const fs::path out = tmp.path() / "hf";
  export_hf(c, out);
  const auto tensors = read_safetensors(out / "model.safetensors");
  const model::ParameterLayout layout(c.model);
  ASSERT_EQ(tensors.size(), layout.tensors().size());
  for (const auto& spec : layout.tensors()) {
    const auto it = tensors.find(spec.name);
    ASSERT_NE(it, tensors.end()) << spec.name;
    EXPECT_EQ(it->second.shape, spec.shape) << spec.name;
    ASSERT_EQ(it->second.data.size(), static_cast<size_t>(spec.size)) << spec.name;
    EXPECT_EQ(std::memcmp(it->second.data.data(), c.params.data() + spec.offset,
                          it->second.data.size() * sizeof(float)),
              0)
        << spec.name;
  }
  EXPECT_TRUE(tensors.count("lm_head.weight") && tensors.count("model.embed_tokens.weight") &&
              tensors.count("model.layers.1.mlp.down_proj.weight") &&
              tensors.count("model.norm.weight"));
}

TEST(Export, SafetensorsFileLayout) {
  TempDir tmp;
  const Checkpoint c = make_checkpoint(31);
  const fs::path out = tmp.path() / "hf";
  export_hf(c, out);
  const std::string bytes = read_file(out / "model.safetensors");
  ASSERT_GE(bytes.size(), 8u);
  const uint64_t n = header_length(bytes);
  EXPECT_EQ(n % 8, 0u);
  ASSERT_LE(8 + n, bytes.size());
  const std::string text = bytes.substr(8, n);
  EXPECT_EQ(text.front(), '{');
  EXPECT_EQ(text.find_last_not_of(' '), text.rfind('}'));
  const auto header = nlohmann::ordered_json::parse(text);

  const model::ParameterLayout layout(c.model);
  auto it = header.begin();
  ASSERT_EQ(it.key(), "__metadata__");
  EXPECT_EQ(it.value(), (nlohmann::ordered_json{{"format", "pt"}}));
  int64_t offset = 0;
  for (const auto& spec : layout.tensors()) {
    ++it;
    ASSERT_NE(it, header.end());
    EXPECT_EQ(it.key(), spec.name);  // layout order
    EXPECT_EQ(it.value()["dtype"], "F32");
    EXPECT_EQ(it.value()["shape"].get<std::vector<int64_t>>(), spec.shape);
    EXPECT_EQ(it.value()["data_offsets"].get<std::vector<int64_t>>(),
              (std::vector<int64_t>{offset, offset + spec.size * 4}));
    offset += spec.size * 4;
  }
  EXPECT_EQ(bytes.size(), 8 + n + static_cast<uint64_t>(offset));
  EXPECT_TRUE(leftovers(out, {"model.safetensors", "config.json"}).empty());
}

TEST(Export, ConfigJsonHasLlamaConfigFields) {
  TempDir tmp;
  const Checkpoint c = make_checkpoint(32, /*with_optimizer=*/false);
  const fs::path out = tmp.path() / "hf";
  export_hf(c, out);
  const Json config = read_json_file((out / "config.json").string());
  EXPECT_EQ(config, hf_config_json(c.model));
  EXPECT_EQ(config["architectures"], Json::array({"LlamaForCausalLM"}));
  EXPECT_EQ(config["model_type"], "llama");
  EXPECT_EQ(config["vocab_size"], 257);
  EXPECT_EQ(config["hidden_size"], 32);
  EXPECT_EQ(config["intermediate_size"], 64);
  EXPECT_EQ(config["num_hidden_layers"], 2);
  EXPECT_EQ(config["num_attention_heads"], 4);
  EXPECT_EQ(config["num_key_value_heads"], 2);
  EXPECT_EQ(config["head_dim"], 8);
  EXPECT_EQ(config["max_position_embeddings"], 64);
  // The decimal a Python config would hold, not float 1e-5 widened to double.
  EXPECT_EQ(config["rms_norm_eps"].get<double>(), 1e-5);
  EXPECT_EQ(config["rope_theta"].get<double>(), 10000.0);
  EXPECT_EQ(config["initializer_range"].get<double>(), 0.02);
  EXPECT_EQ(config["hidden_act"], "silu");
  EXPECT_EQ(config["tie_word_embeddings"], false);
  EXPECT_EQ(config["attention_bias"], false);
  EXPECT_EQ(config["mlp_bias"], false);
  EXPECT_EQ(config["torch_dtype"], "float32");
  // Special ids come from the model config: none known here.
  EXPECT_TRUE(config["bos_token_id"].is_null());
  EXPECT_TRUE(config["eos_token_id"].is_null());
  EXPECT_TRUE(config["pad_token_id"].is_null());
  EXPECT_FALSE(fs::exists(out / "tokenizer.model"));  // no tokenizer recorded, none written

  model::ModelConfig byte_model = c.model;
  byte_model.eos_token_id = 256;  // what a run on byte-tokenized data records
  EXPECT_EQ(hf_config_json(byte_model)["eos_token_id"], 256);
  EXPECT_TRUE(hf_config_json(byte_model)["bos_token_id"].is_null());
}

TEST(Export, OverwritesAnEarlierExport) {
  TempDir tmp;
  const fs::path out = tmp.path() / "hf";
  export_hf(make_checkpoint(33), out);
  const Checkpoint second = make_checkpoint(34);
  export_hf(second, out);
  const auto tensors = read_safetensors(out / "model.safetensors");
  const auto& embed = tensors.at("model.embed_tokens.weight");
  EXPECT_EQ(std::memcmp(embed.data.data(), second.params.data(), embed.data.size() * sizeof(float)),
            0);
  EXPECT_TRUE(leftovers(out, {"model.safetensors", "config.json"}).empty());

  Checkpoint bad = second;
  bad.params.pop_back();
  EXPECT_CONTAINS(error_of([&] { export_hf(bad, out); }), "params has");
}

TEST(Safetensors, RefusesTruncatedFiles) {
  TempDir tmp;
  const fs::path out = tmp.path() / "hf";
  export_hf(make_checkpoint(35), out);
  const std::string bytes = read_file(out / "model.safetensors");
  const uint64_t n = header_length(bytes);
  const fs::path cut = tmp.path() / "cut.safetensors";
  const std::vector<std::pair<size_t, std::string>> cases = {
      {0, "too short"},
      {5, "too short"},
      {8 + n / 2, "beyond the end of the file"},
      {8 + n, "out of range"},
      {8 + n + 100, "out of range"},
      {bytes.size() - 1, "out of range"},
  };
  for (const auto& [size, expected] : cases) {
    write_file_atomic(cut, bytes.substr(0, size));
    const std::string message = error_of([&] { read_safetensors(cut); });
    EXPECT_CONTAINS(message, cut.string());
    EXPECT_CONTAINS(message, expected);
  }
  EXPECT_CONTAINS(error_of([&] { read_safetensors(tmp.path() / "missing.safetensors"); }),
                  "missing.safetensors");
}

TEST(Safetensors, RefusesMalformedHeaders) {
  TempDir tmp;
  const fs::path path = tmp.path() / "bad.safetensors";
  const std::string data(24, '\0');  // six floats
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"a": {"dtype": "F32", "shape": [2, 3], )", "malformed JSON"},
      {R"([1, 2])", "not a JSON object"},
      {R"({"a": {"dtype": "F64", "shape": [3], "data_offsets": [0, 24]}})",
       "unsupported dtype \"F64\""},
      {R"({"a": {"dtype": "F16", "shape": [2, 3], "data_offsets": [0, 24]}})",
       "shape has 6 elements of F16"},
      {R"({"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 24]}})",
       "shape has 4 elements"},
      {R"({"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [8, 32]}})", "out of range"},
      {R"({"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [24, 0]}})", "out of range"},
      {R"({"a": {"dtype": "F32", "shape": [2, 3]}})", "missing key \"data_offsets\""},
      {R"({"a": {"dtype": "F32", "shape": [-2, -3], "data_offsets": [0, 24]}})",
       "negative dimension"},
      {R"({"a": {"dtype": "F32", "shape": [4294967296, 4294967296, 4], "data_offsets": [0, 24]}})",
       "shape does not match"},
  };
  for (const auto& [header, expected] : cases) {
    write_file_atomic(path, safetensors_bytes(header, data));
    const std::string message = error_of([&] { read_safetensors(path); });
    EXPECT_CONTAINS(message, path.string());
    EXPECT_CONTAINS(message, expected);
  }

  // A well-formed hand-written file, with keys in any order and an empty tensor.
  const float values[6] = {1.0f, -2.0f, 3.5f, 0.0f, 1e-30f, 6.0f};
  write_file_atomic(
      path, safetensors_bytes(R"({"z": {"dtype": "F32", "shape": [0], "data_offsets": [24, 24]},
        "a": {"data_offsets": [0, 24], "shape": [3, 2], "dtype": "F32"}})",
                              std::string(reinterpret_cast<const char*>(values), 24)));
  const auto tensors = read_safetensors(path);
  ASSERT_EQ(tensors.size(), 2u);
  EXPECT_EQ(tensors.at("a").shape, (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(std::memcmp(tensors.at("a").data.data(), values, sizeof values), 0);
  EXPECT_TRUE(tensors.at("z").data.empty());
}

// Half-precision weights (as most Hugging Face models are stored) are read exactly into float.
TEST(Safetensors, ReadsBf16AndF16Exactly) {
  TempDir tmp;
  const fs::path path = tmp.path() / "half.safetensors";
  // F16: 1, -2, the smallest subnormal 2^-24, the largest finite 65504, +inf, a subnormal 3·2^-24.
  // BF16 (float's upper 16 bits): 1, -3.140625, 2^-133 (a float subnormal), -0.
  const uint16_t f16[6] = {0x3C00, 0xC000, 0x0001, 0x7BFF, 0x7C00, 0x0003};
  const uint16_t bf16[4] = {0x3F80, 0xC049, 0x0001, 0x8000};
  std::string data(reinterpret_cast<const char*>(f16), sizeof f16);
  data.append(reinterpret_cast<const char*>(bf16), sizeof bf16);
  write_file_atomic(path, safetensors_bytes(R"({"h": {"dtype": "F16", "shape": [6],
        "data_offsets": [0, 12]}, "b": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [12, 20]}})",
                                            data));
  const auto tensors = read_safetensors(path);
  const std::vector<float> h = tensors.at("h").data;
  EXPECT_EQ(tensors.at("h").dtype, "F16");
  EXPECT_EQ(h[0], 1.0f);
  EXPECT_EQ(h[1], -2.0f);
  EXPECT_EQ(h[2], std::ldexp(1.0f, -24));
  EXPECT_EQ(h[3], 65504.0f);
  EXPECT_TRUE(std::isinf(h[4]) && h[4] > 0);
  EXPECT_EQ(h[5], 3 * std::ldexp(1.0f, -24));
  const std::vector<float> b = tensors.at("b").data;
  EXPECT_EQ(b[0], 1.0f);
  EXPECT_EQ(b[1], -3.140625f);
  EXPECT_EQ(b[2], std::ldexp(1.0f, -133));
  EXPECT_TRUE(b[3] == 0.0f && std::signbit(b[3]));
}

// ---------------------------------------------------------------------------------------------
// The independent NumPy reference of Hugging Face's LlamaForCausalLM (tests/hf_llama_reference.py)

struct CommandResult {
  int status = -1;
  std::string output;
};

CommandResult run_command(const std::string& command) {
  CommandResult result;
  std::FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return result;
  char buffer[4096];
  size_t n = 0;
  while ((n = std::fread(buffer, 1, sizeof buffer, pipe)) > 0) result.output.append(buffer, n);
  result.status = ::pclose(pipe);
  return result;
}

const std::string kReference = std::string(MALLEUS_SOURCE_DIR) + "/tests/hf_llama_reference.py";

TEST(HfReference, SelfTestPasses) {
  const CommandResult result =
      run_command(std::string(MALLEUS_PYTHON) + " '" + kReference + "' --selftest");
  EXPECT_EQ(result.status, 0) << result.output;
  EXPECT_CONTAINS(result.output, "selftest passed");
}

// With o_proj and down_proj zero every block is the identity, so the loss is a function of the
// embedding, final norm and lm_head alone, computed here in a few lines. Agreement checks that the
// reference reads our safetensors and config.json with the tensors in the orientation HF expects.
TEST(HfReference, ReadsOurExport) {
  TempDir tmp;
  Checkpoint c = make_checkpoint(36, /*with_optimizer=*/false);
  const model::ParameterLayout layout(c.model);
  for (int l = 0; l < c.model.num_layers; ++l) {
    for (int index : {layout.block(l).o_proj, layout.block(l).down_proj}) {
      const auto& spec = layout.tensor(index);
      std::fill_n(c.params.begin() + spec.offset, spec.size, 0.0f);
    }
  }
  const fs::path out = tmp.path() / "hf";
  export_hf(c, out);
  const std::vector<std::vector<int>> sequences = {{5, 17, 200, 256, 3, 99, 0}, {256, 1, 2}};
  std::string text;
  for (const auto& sequence : sequences) {
    for (int token : sequence) text += std::to_string(token) + " ";
    text += "\n";
  }
  write_file_atomic(out / "tokens.txt", text);

  const auto& embed = layout.tensor(layout.embedding());
  const auto& norm = layout.tensor(layout.final_norm());
  const auto& head = layout.tensor(layout.lm_head());
  const int64_t hidden = c.model.hidden_size, vocab = c.model.vocab_size;
  auto at = [&](const model::TensorSpec& spec, int64_t i) {
    return double{c.params[static_cast<size_t>(spec.offset + i)]};
  };
  double total = 0.0;
  int count = 0;
  for (const auto& sequence : sequences) {
    for (size_t t = 0; t + 1 < sequence.size(); ++t) {
      std::vector<double> x(static_cast<size_t>(hidden));
      double mean_square = 0.0;
      for (int64_t i = 0; i < hidden; ++i) {
        x[static_cast<size_t>(i)] = at(embed, sequence[t] * hidden + i);
        mean_square += x[static_cast<size_t>(i)] * x[static_cast<size_t>(i)];
      }
      const double scale = 1.0 / std::sqrt(mean_square / static_cast<double>(hidden) + 1e-5);
      for (int64_t i = 0; i < hidden; ++i) x[static_cast<size_t>(i)] *= scale * at(norm, i);
      std::vector<double> logits(static_cast<size_t>(vocab));
      double max_logit = -1e300;
      for (int64_t v = 0; v < vocab; ++v) {
        double dot = 0.0;
        for (int64_t i = 0; i < hidden; ++i)
          dot += at(head, v * hidden + i) * x[static_cast<size_t>(i)];
        logits[static_cast<size_t>(v)] = dot;
        max_logit = std::max(max_logit, dot);
      }
      double z = 0.0;
      for (double logit : logits) z += std::exp(logit - max_logit);
      total += max_logit + std::log(z) - logits[static_cast<size_t>(sequence[t + 1])];
      ++count;
    }
  }
  const double expected = total / count;

  const CommandResult result =
      run_command(std::string(MALLEUS_PYTHON) + " '" + kReference + "' '" + out.string() + "' '" +
                  (out / "tokens.txt").string() + "'");
  ASSERT_EQ(result.status, 0) << result.output;
  const double reference = std::stod(result.output);
  EXPECT_NEAR(reference, expected, 1e-9 * expected) << result.output;
}

}  // namespace
}  // namespace malleus::train
