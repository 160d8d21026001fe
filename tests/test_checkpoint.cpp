// Checkpoint save/load (round trip, atomic replacement, refusal of every kind of damage), sharded
// checkpoints read under any plan, and the "latest" pointer; the memory copies' folders: private,
// another user's refused, abandoned ones removed.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>
#include "checkpoint_samples.h"
#include "test_util.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "checkpoint/memory_checkpoint.h"
#include "checkpoint/memory_folder.h"
#include "checkpoint/retention.h"
#include "common/checksum.h"
#include "common/error.h"
#include "common/files.h"
#include "common/format.h"
#include "common/json.h"
#include "layout/layout.h"
#include "layout/optimizer_shard.h"
#include "model/config.h"
#include "model/parameters.h"

namespace malleus::checkpoint {
namespace {

namespace fs = std::filesystem;

using namespace malleus::testing::checkpoints;

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
// (what checkpoint/checkpoint_writer.cpp does across ranks): with `moments_split` (the distributed
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
  // And back: the step in such a name, nothing for any other name.
  EXPECT_EQ(checkpoint_dir_step(checkpoint_dir(root, 100)), 100);
  EXPECT_EQ(checkpoint_dir_step(checkpoint_dir(root, 123456789) / ""), 123456789);
  for (const char* other :
       {"imported", "step_", "step_12a", "step_00000100.tmp.42", "step_1234567890123456789012"}) {
    EXPECT_EQ(checkpoint_dir_step(root / other), std::nullopt) << other;
  }

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

// ---- The folders of memory copies (memory_folder.h) ----

// The mode bits of `path` (not following a link), and its owner.
mode_t mode_of(const fs::path& path) {
  struct stat st;
  EXPECT_EQ(::lstat(path.c_str(), &st), 0) << path;
  return st.st_mode & 07777;
}

// Sets $MALLEUS_MEMORY_CHECKPOINT_DIR to a private folder of the scratch directory while it lives.
class MemoryBase {
 public:
  explicit MemoryBase(const fs::path& path) : path_(path) {
    fs::create_directories(path_);
    fs::permissions(path_, fs::perms::owner_all, fs::perm_options::replace);
    ::setenv("MALLEUS_MEMORY_CHECKPOINT_DIR", path_.c_str(), 1);
  }
  ~MemoryBase() { ::unsetenv("MALLEUS_MEMORY_CHECKPOINT_DIR"); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

constexpr uid_t kNobody = 65534;  // Debian's "nobody"

TEST(MemoryFolder, IsMadePrivateWhateverTheUmaskAndFilesAreWrittenForItsOwnerOnly) {
  malleus::testing::ScratchDir dir;
  const MemoryBase base(dir / "shm");
  const mode_t umask = ::umask(0);  // the most permissive: nothing taken away
  const fs::path root = memory_checkpoint_root(dir / "run");
  make_private_dir(root, "memory checkpoints");
  write_file_atomic(root / "file", "x", FileAccess::kPrivate);
  write_file_atomic(root / "shared", "x");
  ::umask(umask);
  EXPECT_EQ(root.parent_path(), base.path());
  EXPECT_EQ(mode_of(root), 0700u);
  EXPECT_EQ(mode_of(root / "file"), 0600u);
  EXPECT_EQ(mode_of(root / "shared"), 0666u);  // the default: what the umask lets
  // Made again: the folder is there and is the user's own.
  EXPECT_NO_THROW(make_private_dir(root, "memory checkpoints"));
  EXPECT_EQ(private_memory_root(dir / "run"), root);
  EXPECT_EQ(private_memory_root(dir / "other"), std::nullopt);  // none yet
  // A leftover temporary of another mode is made private too.
  write_file_atomic(root / ("again.tmp." + std::to_string(::getpid())), "y");
  fs::permissions(root / ("again.tmp." + std::to_string(::getpid())), fs::perms::all);
  write_file_atomic(root / "again", "z", FileAccess::kPrivate);
  EXPECT_EQ(mode_of(root / "again"), 0600u);
}

TEST(MemoryFolder, AFolderOthersCanWriteOrALinkIsRefusedNamingPathAndOwner) {
  malleus::testing::ScratchDir dir;
  const MemoryBase base(dir / "shm");
  const fs::path root = memory_checkpoint_root(dir / "run");
  make_private_dir(root, "memory checkpoints");
  fs::permissions(root, fs::perms::group_write, fs::perm_options::add);
  std::string message = malleus::testing::error_of([&] { private_memory_root(dir / "run"); });
  EXPECT_CONTAINS(message, root.string());
  EXPECT_CONTAINS(message, "mode 0720");
  EXPECT_CONTAINS(message, "group or others can write");
  fs::remove_all(root);
  fs::create_directories(dir / "elsewhere");
  fs::create_directory_symlink(dir / "elsewhere", root);
  message = malleus::testing::error_of([&] { private_memory_root(dir / "run"); });
  EXPECT_CONTAINS(message, root.string() + " is a symbolic link");
  EXPECT_FALSE(remove_memory_checkpoints(dir / "run"));  // not its copies: left alone
  EXPECT_TRUE(fs::exists(dir / "elsewhere"));
  // A base others can write without the sticky bit: anyone could replace the run's folder.
  fs::permissions(base.path(), fs::perms::all, fs::perm_options::replace);
  message = malleus::testing::error_of([&] { check_memory_base(base.path()); });
  EXPECT_CONTAINS(message, "mode 0777");
  fs::permissions(base.path(), fs::perms::all | fs::perms::sticky_bit, fs::perm_options::replace);
  EXPECT_NO_THROW(check_memory_base(base.path()));  // as /dev/shm is
}

TEST(MemoryFolder, AStepFolderRemovedWhileListedIsSkippedAWritableOneStillRefused) {
  // The running job removes old steps while a restart lists them (host_memory_copies): a
  // folder gone between the listing and the check is no error; one others can write still is.
  malleus::testing::ScratchDir dir;
  const MemoryBase base(dir / "shm");
  const fs::path root = memory_checkpoint_root(dir / "run");
  make_private_dir(root, "memory checkpoints");
  EXPECT_FALSE(check_private_dir_if_present(root / "step_00000004", "memory checkpoint"));
  make_private_dir(root / "step_00000005", "memory checkpoint");
  EXPECT_TRUE(check_private_dir_if_present(root / "step_00000005", "memory checkpoint"));
  fs::permissions(root / "step_00000005", fs::perms::others_write, fs::perm_options::add);
  EXPECT_CONTAINS(malleus::testing::error_of([&] {
                    check_private_dir_if_present(root / "step_00000005", "memory checkpoint");
                  }),
                  "mode 0702");
}

TEST(MemoryFolder, AnotherUsersFolderIsRefusedNamingItsOwner) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root, to give a folder to another user";
  malleus::testing::ScratchDir dir;
  const MemoryBase base(dir / "shm");
  const fs::path root = memory_checkpoint_root(dir / "run");
  make_private_dir(root, "memory checkpoints");
  ASSERT_EQ(::chown(root.c_str(), kNobody, kNobody), 0);
  const std::string message = malleus::testing::error_of([&] { private_memory_root(dir / "run"); });
  EXPECT_CONTAINS(message, root.string() + " belongs to user " + user_name(kNobody) + " (uid " +
                               std::to_string(kNobody) + "), not to user " + user_name(0) +
                               " (uid 0)");
  EXPECT_CONTAINS(malleus::testing::error_of([&] { make_private_dir(root, "memory checkpoints"); }),
                  "belongs to user");
  // A step folder in the user's own folder is checked too.
  ASSERT_EQ(::chown(root.c_str(), 0, 0), 0);
  make_private_dir(root / "step_00000003", "memory checkpoint");
  write_file_atomic(root / "step_00000003" / "manifest.json", "{}", FileAccess::kPrivate);
  ASSERT_EQ(::chown((root / "step_00000003").c_str(), kNobody, kNobody), 0);
  EXPECT_CONTAINS(malleus::testing::error_of([&] { latest_memory_checkpoint(dir / "run"); }),
                  "step_00000003 belongs to user " + user_name(kNobody));
  EXPECT_CONTAINS(
      malleus::testing::error_of([&] { check_memory_copy_dir(root / "step_00000003"); }),
      "belongs to user " + user_name(kNobody));
}

TEST(MemoryFolder, RunsWhoseProcessesAreGoneAreSweptOthersKept) {
  malleus::testing::ScratchDir dir;
  const MemoryBase base(dir / "shm");
  const HostProcess me = this_process();
  ASSERT_TRUE(is_running(me));
  // The same pid with another start time: a later process that got a dead rank's pid.
  const HostProcess reused{me.pid, me.start + 1};
  EXPECT_FALSE(is_running(reused));
  const auto folder = [&](const std::string& run, const std::optional<MemoryOwner>& owner) {
    const fs::path root = memory_checkpoint_root(dir / run);
    make_private_dir(root, "memory checkpoints");
    make_private_dir(root / "step_00000001", "memory checkpoint");
    write_file_atomic(root / "step_00000001" / "rank_00000.bin", std::string(1000, 'x'),
                      FileAccess::kPrivate);
    if (owner) write_memory_owner(root, *owner);
    return root;
  };
  const auto owned_by = [&](const std::string& run, std::vector<HostProcess> ranks) {
    MemoryOwner o;
    o.run_dir = (dir / run).string();
    o.host = host_name();
    o.ranks = std::move(ranks);
    return o;
  };
  const fs::path gone = folder("gone", owned_by("gone", {reused}));
  const fs::path alive = folder("alive", owned_by("alive", {reused, me}));
  MemoryOwner supervised = owned_by("supervised", {reused});
  supervised.supervisor = me;
  supervised.supervisor_host = host_name();
  const fs::path waiting = folder("supervised", supervised);  // between a job and its restart
  const fs::path fresh = folder("fresh", std::nullopt);       // no record yet, just made
  const fs::path kept = folder("starting", owned_by("starting", {reused}));
  const auto gone_bytes = static_cast<double>(1000 + fs::file_size(gone / kMemoryOwnerFile));
  const std::vector<std::string> removed = remove_abandoned_memory_copies(kept);
  ASSERT_EQ(removed.size(), 1u);
  EXPECT_EQ(removed[0], "removed " + gone.string() + " (" + format_bytes(gone_bytes) + ") of run " +
                            (dir / "gone").string() + ": its processes are gone");
  EXPECT_FALSE(fs::exists(gone));
  for (const fs::path& root : {alive, waiting, fresh, kept}) EXPECT_TRUE(fs::exists(root)) << root;
  // A supervisor on another host cannot be asked: its run's folder goes once it has been quiet
  // for kAbandonedAfterS; so does one without a record.
  MemoryOwner remote = owned_by("remote", {reused});
  remote.supervisor = me;
  remote.supervisor_host = "elsewhere";
  const fs::path far = folder("remote", remote);
  EXPECT_TRUE(remove_abandoned_memory_copies(kept).empty());
  const auto old = fs::file_time_type::clock::now() -
                   std::chrono::seconds(static_cast<int>(kAbandonedAfterS) + 5);
  for (const fs::path& root : {far, fresh}) {
    for (const auto& entry : fs::directory_iterator(root)) fs::last_write_time(entry.path(), old);
    fs::last_write_time(root, old);
  }
  EXPECT_EQ(remove_abandoned_memory_copies(kept).size(), 2u);
  EXPECT_FALSE(fs::exists(far));
  EXPECT_FALSE(fs::exists(fresh));
  EXPECT_TRUE(fs::exists(alive));
  EXPECT_EQ(memory_copies_held(dir / "alive")->bytes, folder_bytes(alive));
  EXPECT_GE(folder_bytes(alive), 1000);
}

// ---- Retention (retention.h) ----

// Checkpoints of steps 1..n in a fresh root, `latest` naming the newest.
fs::path root_of_checkpoints(const malleus::testing::ScratchDir& dir, int n) {
  const fs::path root = dir / "checkpoints";
  for (int step = 1; step <= n; ++step) {
    Checkpoint c = make_checkpoint(static_cast<uint32_t>(step));
    c.step = step;
    save_checkpoint(checkpoint_dir(root, step), c);
    mark_latest(root, checkpoint_dir(root, step));
  }
  return root;
}

std::vector<int64_t> steps_in(const fs::path& root) {
  std::vector<int64_t> steps;
  for (const auto& entry : fs::directory_iterator(root)) {
    if (const auto step = checkpoint_dir_step(entry.path())) steps.push_back(*step);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

TEST(Retention, KeepsTheNewestTheLatestAndTheMarkedOnesAndTheyLoad) {
  malleus::testing::ScratchDir dir;
  const fs::path root = root_of_checkpoints(dir, 7);
  write_file_atomic(checkpoint_dir(root, 1) / kKeepMarker, "");
  mark_latest(root, checkpoint_dir(root, 3));  // e.g. a newer save not committed by this run
  const RetentionPass pass = prune_checkpoints(root, 2);
  EXPECT_TRUE(pass.left.empty());
  EXPECT_EQ(pass.removed.size(), 3u);
  EXPECT_EQ(steps_in(root), (std::vector<int64_t>{1, 3, 6, 7}));
  for (const int64_t step : steps_in(root)) {
    EXPECT_EQ(load_checkpoint(checkpoint_dir(root, step)).step, step);
  }
  EXPECT_TRUE(leftovers(root, {"step_00000001", "step_00000003", "step_00000006", "step_00000007",
                               "latest"})
                  .empty());
  EXPECT_TRUE(prune_checkpoints(root, 0).removed.empty());  // 0: keep all
  EXPECT_EQ(prune_checkpoints(root, 1).removed, std::vector<fs::path>{checkpoint_dir(root, 6)});
}

TEST(Retention, ACheckpointBeingReadIsLeftUntilItsReaderIsDone) {
  malleus::testing::ScratchDir dir;
  const fs::path root = root_of_checkpoints(dir, 4);
  {
    const CheckpointIndex reading(checkpoint_dir(root, 1));  // e.g. a resume from step 1
    const RetentionPass pass = prune_checkpoints(root, 1);
    EXPECT_EQ(steps_in(root), (std::vector<int64_t>{1, 4}));
    ASSERT_EQ(pass.left.size(), 1u);
    EXPECT_EQ(pass.left[0], checkpoint_dir(root, 1).string() + ": a reader holds it");
    EXPECT_EQ(load_checkpoint(checkpoint_dir(root, 1)).step, 1);  // whole
  }
  EXPECT_EQ(prune_checkpoints(root, 1).removed.size(), 1u);
  EXPECT_EQ(steps_in(root), std::vector<int64_t>{4});
  // A reader that comes to a removed checkpoint is told so, by name.
  EXPECT_CONTAINS(error_of([&] { CheckpointReadLock lock(checkpoint_dir(root, 2)); }),
                  checkpoint_dir(root, 2).string() + ": not a checkpoint");
}

TEST(Retention, ARemovalThatFailsHalfWayLeavesNoPartOfACheckpoint) {
  malleus::testing::ScratchDir dir;
  const fs::path root = root_of_checkpoints(dir, 3);
  // A mount inside step 1 makes its removal fail (EBUSY) after the move aside.
  malleus::testing::SmallFilesystem busy(checkpoint_dir(root, 1) / "busy", 1 << 20);
  MALLEUS_REQUIRE_SMALL_FILESYSTEM(busy);
  const RetentionPass pass = prune_checkpoints(root, 1);
  const fs::path moved = temporary_dir(checkpoint_dir(root, 1), ::getpid());
  // Step 2 went; step 1 is no checkpoint any more, only a temporary; step 3 loads.
  EXPECT_EQ(steps_in(root), std::vector<int64_t>{3});
  EXPECT_TRUE(fs::exists(moved / "busy"));
  EXPECT_EQ(load_checkpoint(*latest_checkpoint(root)).step, 3);
  EXPECT_EQ(pass.removed.size(), 2u);
  ::umount2((moved / "busy").c_str(), MNT_DETACH);
  // Once this process is gone, clean_stale_temporaries would remove it; here it still runs.
  fs::remove_all(moved);
}

}  // namespace
}  // namespace malleus::checkpoint
