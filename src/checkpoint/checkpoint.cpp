#include "checkpoint/checkpoint.h"

#include <signal.h>
#include <unistd.h>

#include <bit>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <fstream>
#include <initializer_list>
#include <string>
#include <system_error>

#include "checkpoint/checkpoint_detail.h"
#include "checkpoint/retention.h"
#include "common/checksum.h"
#include "common/error.h"
#include "common/files.h"
#include "common/proc_stat.h"
#include "model/parameters.h"

namespace malleus::checkpoint {

namespace {

// The files hold raw float32 in host order; declaring them little-endian is only true here.
static_assert(std::endian::native == std::endian::little,
              "checkpoint files are little-endian float32; a big-endian host needs byte swapping");

using namespace detail;

constexpr const char* kParams = "params.bin";
constexpr const char* kOptimizer = "optimizer.bin";

int64_t tensor_bytes(const model::TensorSpec& tensor) {
  return tensor.size * static_cast<int64_t>(sizeof(float));
}

struct FileEntry {
  int64_t bytes = 0;
  std::string xxh3;
};

// Writes every tensor of each buffer in turn (unpadded), hashing the bytes as they go out so the
// data is traversed once.
FileEntry write_tensors(const fs::path& path, const model::ParameterLayout& layout,
                        std::initializer_list<const std::vector<float>*> buffers) {
  AtomicFile file(path);
  Checksum sum;
  FileEntry entry;
  for (const std::vector<float>* buffer : buffers) {
    for (const auto& tensor : layout.tensors()) {
      const float* data = buffer->data() + tensor.offset;
      const auto bytes = static_cast<size_t>(tensor_bytes(tensor));
      file.write(data, bytes);
      sum.update(data, bytes);
      entry.bytes += tensor_bytes(tensor);
    }
  }
  file.commit();
  entry.xxh3 = sum.hex();
  return entry;
}

FileEntry read_file_entry(JsonReader& files, const std::string& name) {
  const Json object = files.required<Json>(name);
  JsonReader reader(object, files.source() + " \"" + name + "\"");
  FileEntry entry;
  entry.bytes = reader.required<int64_t>("bytes");
  entry.xxh3 = reader.required<std::string>("xxh3");
  reader.finish();
  return entry;
}

// Fills `buffers` (each resized to the padded layout, gaps zero) from a data file, after checking
// its size against the manifest; the checksum is checked over the same bytes once all are read.
void read_tensors(const fs::path& dir, const std::string& where, const std::string& name,
                  const FileEntry& entry, const model::ParameterLayout& layout,
                  std::initializer_list<std::vector<float>*> buffers) {
  const fs::path path = dir / name;
  int64_t expected = 0;
  for (const auto& tensor : layout.tensors()) expected += tensor_bytes(tensor);
  expected *= static_cast<int64_t>(buffers.size());
  check(entry.bytes == expected, where + ": manifest.json says " + name + " has " +
                                     std::to_string(entry.bytes) + " bytes, but the model's " +
                                     "tensors need " + std::to_string(expected));

  std::error_code ec;
  check(fs::is_regular_file(path, ec), where + ": " + name + " is missing");
  const auto size = static_cast<int64_t>(fs::file_size(path, ec));
  check(!ec, where + ": cannot stat " + name + ": " + ec.message());
  check(size >= entry.bytes, where + ": " + name + " is truncated: " + std::to_string(size) +
                                 " bytes, manifest says " + std::to_string(entry.bytes));
  check(size == entry.bytes, where + ": " + name + " has trailing data: " + std::to_string(size) +
                                 " bytes, manifest says " + std::to_string(entry.bytes));

  std::ifstream in(path, std::ios::binary);
  check(in.good(), where + ": cannot open " + name);
  Checksum sum;
  for (std::vector<float>* buffer : buffers) {
    buffer->assign(static_cast<size_t>(layout.total_size()), 0.0f);
    for (const auto& tensor : layout.tensors()) {
      char* data = reinterpret_cast<char*>(buffer->data() + tensor.offset);
      const int64_t bytes = tensor_bytes(tensor);
      in.read(data, static_cast<std::streamsize>(bytes));
      check(in.gcount() == bytes, where + ": cannot read " + name + " (it shrank while reading)");
      sum.update(data, static_cast<size_t>(bytes));
    }
  }
  const std::string actual = sum.hex();
  check(actual == entry.xxh3, where + ": " + name + " is corrupt: checksum " + actual +
                                  ", expected " + entry.xxh3 + " (from manifest.json)");
}

void check_sizes(const Checkpoint& checkpoint, const model::ParameterLayout& layout,
                 const std::string& where) {
  const auto total = static_cast<size_t>(layout.total_size());
  auto check_size = [&](const std::vector<float>& buffer, const char* what) {
    check(buffer.size() == total, where + ": " + what + " has " + std::to_string(buffer.size()) +
                                      " elements, but the parameter layout of model \"" +
                                      checkpoint.model.name + "\" has " + std::to_string(total));
  };
  check_size(checkpoint.params, "params");
  if (!checkpoint.adam_m.empty() || !checkpoint.adam_v.empty()) {
    check_size(checkpoint.adam_m, "adam_m");
    check_size(checkpoint.adam_v, "adam_v");
  }
}

}  // namespace

void save_checkpoint(const fs::path& dir_arg, const Checkpoint& checkpoint) {
  const fs::path dir = normalized(dir_arg);
  const std::string where = "checkpoint " + dir.string();
  checkpoint.model.validate(where + ": model config");
  const model::ParameterLayout layout(checkpoint.model);
  check_sizes(checkpoint, layout, where);
  const bool with_optimizer = !checkpoint.adam_m.empty();

  std::error_code ec;
  const fs::path parent = parent_of(dir);
  fs::create_directories(parent, ec);
  check(!ec, where + ": cannot create " + parent.string() + ": " + ec.message());
  check(!fs::exists(dir, ec) || fs::is_directory(dir, ec),
        where + ": exists and is not a directory");

  const std::string pid = std::to_string(::getpid());
  const fs::path tmp = with_suffix(dir, ".tmp." + pid);
  // Only this process uses this name, so whatever is there is left over from a crashed save.
  fs::remove_all(tmp, ec);
  check(!ec, where + ": cannot remove stale " + tmp.string() + ": " + ec.message());
  fs::create_directory(tmp, ec);
  check(!ec, where + ": cannot create " + tmp.string() + ": " + ec.message());
  TempDirGuard guard(tmp);

  Json files = Json::object();
  const FileEntry params = write_tensors(tmp / kParams, layout, {&checkpoint.params});
  files[kParams] = {{"bytes", params.bytes}, {"xxh3", params.xxh3}};
  if (with_optimizer) {
    const FileEntry optimizer =
        write_tensors(tmp / kOptimizer, layout, {&checkpoint.adam_m, &checkpoint.adam_v});
    files[kOptimizer] = {{"bytes", optimizer.bytes}, {"xxh3", optimizer.xxh3}};
  }

  Json tensors = Json::array();
  int64_t offset = 0;
  for (const auto& tensor : layout.tensors()) {
    tensors.push_back({{"name", tensor.name}, {"shape", tensor.shape}, {"offset", offset}});
    offset += tensor_bytes(tensor);
  }
  Json manifest = manifest_head(kVersion, checkpoint, std::move(tensors));
  manifest["files"] = std::move(files);
  const std::string text = sealed_manifest_text(manifest, where);
  if (checkpoint.tokenizer) tokenizer::save_tokenizer(*checkpoint.tokenizer, tmp);
  // Written last: a directory with a manifest is a complete checkpoint.
  write_file_atomic(tmp / kManifest, text);

  move_into_place(tmp, dir, where);
  guard.dismiss();
}

namespace detail {

Checkpoint read_single_file(const CheckpointIndex& index, bool with_optimizer) {
  const fs::path& dir = index.dir();
  const std::string where = "checkpoint " + dir.string();
  const std::string source = where + ": manifest.json";
  JsonReader reader(index.manifest(), source);
  Checkpoint checkpoint = read_manifest_header(reader, source);
  const Json tensors = reader.required<Json>("tensors");
  const Json files = reader.required<Json>("files");
  reader.finish();

  const model::ParameterLayout layout(checkpoint.model);
  const auto& specs = layout.tensors();
  check(tensors.is_array(), source + ": \"tensors\" must be an array");
  check(tensors.size() == specs.size(), source + ": lists " + std::to_string(tensors.size()) +
                                            " tensors, but its model config has " +
                                            std::to_string(specs.size()));
  int64_t offset = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    JsonReader entry(tensors[i], source + " tensors[" + std::to_string(i) + "]");
    const auto name = entry.required<std::string>("name");
    const auto shape = entry.required<std::vector<int64_t>>("shape");
    const auto tensor_offset = entry.required<int64_t>("offset");
    entry.finish();
    check(name == specs[i].name && shape == specs[i].shape,
          source + ": tensor " + std::to_string(i) + " is \"" + name + "\" " + shape_text(shape) +
              ", but the model config expects \"" + specs[i].name + "\" " +
              shape_text(specs[i].shape));
    check(tensor_offset == offset, source + ": tensor \"" + name + "\" is at byte offset " +
                                       std::to_string(tensor_offset) + ", expected " +
                                       std::to_string(offset));
    offset += tensor_bytes(specs[i]);
  }

  JsonReader files_reader(files, source + " files");
  const FileEntry params = read_file_entry(files_reader, kParams);
  const bool has_optimizer = files_reader.has(kOptimizer);
  const FileEntry optimizer =
      has_optimizer ? read_file_entry(files_reader, kOptimizer) : FileEntry{};
  files_reader.finish();

  read_tensors(dir, where, kParams, params, layout, {&checkpoint.params});
  if (with_optimizer) {
    check(has_optimizer, where + ": has no optimizer state (no optimizer.bin in manifest.json)");
    read_tensors(dir, where, kOptimizer, optimizer, layout,
                 {&checkpoint.adam_m, &checkpoint.adam_v});
  }
  return checkpoint;
}

Json manifest_head(int64_t version, const Checkpoint& header, Json tensors) {
  return Json{{"format", kFormat},
              {"version", version},
              {"model", header.model.to_json()},
              {"train_config", header.train_config},
              {"step", header.step},
              {"consumed_samples", header.consumed_samples},
              {"tensors", std::move(tensors)}};
}

Checkpoint read_manifest_header(JsonReader& reader, const std::string& source) {
  // Checked by verified_manifest.
  reader.required<std::string>("format");
  reader.required<int64_t>("version");
  reader.required<std::string>(kManifestChecksum);
  Checkpoint header;
  header.model = model::ModelConfig::from_json(reader.required<Json>("model"), source + " model");
  header.train_config = reader.required<Json>("train_config");
  header.step = reader.required<int64_t>("step");
  header.consumed_samples = reader.required<int64_t>("consumed_samples");
  check(header.step >= 0 && header.consumed_samples >= 0,
        source + ": step and consumed_samples must not be negative");
  return header;
}

Json verified_manifest(const std::string& text, const std::string& source, int64_t* version) {
  const Json manifest = parse_json(text, source);
  JsonReader reader(manifest, source);
  // Checked before anything else so that some other JSON file reports what it is not.
  const auto format = reader.optional<std::string>("format", "");
  check(format == kFormat,
        source + ": format is \"" + format + "\", expected \"" + std::string(kFormat) + "\"");
  *version = reader.required<int64_t>("version");
  check(*version == kVersion || *version == kShardedVersion3 || *version == kShardedVersion,
        source + ": version " + std::to_string(*version) +
            " is not supported (this build reads versions " + std::to_string(kVersion) + ", " +
            std::to_string(kShardedVersion3) + " and " + std::to_string(kShardedVersion) + ")");
  // Before any value is used: an edited step, data position or model would otherwise resume
  // silently into another schedule, data order or model.
  const auto recorded = reader.required<std::string>(kManifestChecksum);
  Json content = manifest;
  content.erase(kManifestChecksum);
  const std::string actual = manifest_checksum(content);
  check(recorded == actual, source + " is corrupt or was edited: its content hashes to " + actual +
                                ", but \"" + kManifestChecksum + "\" says " + recorded);
  return manifest;
}

std::string sealed_manifest_text(const Json& manifest, const std::string& where) {
  try {
    Json sealed = manifest;
    sealed[kManifestChecksum] = manifest_checksum(manifest);
    return sealed.dump(2) + "\n";
  } catch (const nlohmann::json::exception& e) {
    // e.g. a train_config string that is not valid UTF-8
    throw Error(where + ": cannot write manifest.json: " + e.what());
  }
}

void move_into_place(const fs::path& tmp, const fs::path& dir, const std::string& where) {
  std::error_code ec;
  const fs::path old = with_suffix(dir, ".old." + std::to_string(::getpid()));
  // Two renames rather than one: rename(2) cannot replace a non-empty directory.
  const bool replacing = fs::exists(dir, ec);
  if (replacing) {
    fs::rename(dir, old, ec);
    check(!ec, where + ": cannot move the previous checkpoint aside to " + old.string() + ": " +
                   ec.message());
  }
  fs::rename(tmp, dir, ec);
  if (ec) {
    const std::string reason = ec.message();
    if (replacing) fs::rename(old, dir, ec);
    throw Error(where + ": cannot rename " + tmp.string() + " into place: " + reason);
  }
  sync_directory(parent_of(dir));
  // The new checkpoint is complete and durable; a leftover old copy only wastes space.
  if (replacing) fs::remove_all(old, ec);
}

}  // namespace detail

std::string manifest_checksum(const Json& manifest) {
  // dump() is canonical: keys sorted, no spaces, numbers in their shortest round-trip form, so
  // the text parsed back from manifest.json dumps to the same bytes.
  const std::string canonical = manifest.dump();
  return checksum_hex(canonical.data(), canonical.size());
}

namespace {

// Whether a process runs: it exists and is not a zombie. A rank killed with its job may stay a
// zombie for good where nothing reaps orphans (pid 1 of a container often does not), and its
// half-written checkpoint must still be cleaned up.
bool still_running(pid_t pid) {
  if (::kill(pid, 0) != 0 && errno != EPERM) return false;
  const std::vector<std::string> fields =
      proc_stat_fields("/proc/" + std::to_string(pid) + "/stat");
  return fields.empty() || fields[0] != "Z";  // no /proc: trust kill()
}

}  // namespace

std::vector<std::string> clean_stale_temporaries(const fs::path& root) {
  std::vector<std::string> done;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return done;
  std::vector<fs::path> entries;
  for (const auto& entry : fs::directory_iterator(root, ec)) entries.push_back(entry.path());
  for (const fs::path& path : entries) {
    // "<name>.tmp.<pid>" (a checkpoint or file being written) or "<name>.old.<pid>" (the
    // checkpoint it replaces, moved aside), of a process that no longer runs.
    const std::string name = path.filename().string();
    const size_t dot = name.rfind('.');
    if (dot == std::string::npos || dot < 4) continue;
    const std::string kind = name.substr(dot - 4, 5), pid_text = name.substr(dot + 1);
    if ((kind != ".tmp." && kind != ".old.") || pid_text.empty() ||
        pid_text.find_first_not_of("0123456789") != std::string::npos || pid_text.size() > 9) {
      continue;
    }
    const auto pid = static_cast<pid_t>(std::stol(pid_text));
    if (pid == ::getpid() || still_running(pid)) continue;
    const fs::path base = root / name.substr(0, dot - 4);
    if (kind == ".old." && !fs::exists(base, ec)) {
      // The process died between moving the old checkpoint aside and renaming the new one into
      // place: the old one is complete, and "latest" may name it.
      fs::rename(path, base, ec);
      if (!ec) done.push_back("restored " + base.string() + " from " + name);
      continue;
    }
    fs::remove_all(path, ec);
    if (!ec) done.push_back("removed " + path.string() + " (left by process " + pid_text + ")");
  }
  return done;
}

fs::path checkpoint_dir(const fs::path& root, int64_t step) {
  check(step >= 0, "checkpoint step must not be negative (got " + std::to_string(step) + ")");
  char name[32];
  std::snprintf(name, sizeof name, "step_%08lld", static_cast<long long>(step));
  return root / name;
}

std::optional<int64_t> checkpoint_dir_step(const fs::path& dir) {
  const std::string name = normalized(dir).filename().string();
  const size_t digits = name.size() - std::min<size_t>(name.size(), 5);
  if (name.rfind("step_", 0) != 0 || digits == 0 || digits > 18) return std::nullopt;
  if (name.find_first_not_of("0123456789", 5) != std::string::npos) return std::nullopt;
  return std::stoll(name.substr(5));
}

CheckpointSource locate_checkpoint(const fs::path& given) {
  const fs::path path = given.lexically_normal();
  // <run>/checkpoints is a checkpoint root inside a run directory.
  auto run_of_root = [](const fs::path& root) -> std::optional<fs::path> {
    const fs::path r = root.has_filename() ? root : root.parent_path();
    if (r.filename() == "checkpoints") return r.has_parent_path() ? r.parent_path() : fs::path(".");
    return std::nullopt;
  };
  if (fs::exists(path / kManifest)) {
    const fs::path dir = path.has_filename() ? path : path.parent_path();
    return {dir, run_of_root(dir.has_parent_path() ? dir.parent_path() : fs::path("."))};
  }
  if (auto latest = latest_checkpoint(path / "checkpoints")) return {*latest, path};
  if (auto latest = latest_checkpoint(path)) return {*latest, run_of_root(path)};
  throw Error(given.string() + " is not a checkpoint and holds no checkpoints/latest");
}

void mark_latest(const fs::path& root, const fs::path& dir) {
  const std::string name = normalized(dir).filename().string();
  check(!name.empty() && name != "." && name != "..",
        "mark_latest: \"" + dir.string() + "\" does not name a checkpoint directory");
  std::error_code ec;
  check(fs::is_directory(root / name, ec),
        "mark_latest: " + (root / name).string() + " is not a directory");
  // Relative, so that the whole root can be moved or copied elsewhere.
  write_file_atomic(root / "latest", name + "\n");
}

std::optional<fs::path> latest_checkpoint(const fs::path& root) {
  const fs::path file = root / "latest";
  std::error_code ec;
  if (!fs::exists(file, ec)) return std::nullopt;
  std::string name = read_file(file);
  while (!name.empty() && std::isspace(static_cast<unsigned char>(name.back()))) name.pop_back();
  check(!name.empty() && name.find('/') == std::string::npos && name != "." && name != "..",
        file.string() + ": expected the name of a checkpoint directory, got \"" + name + "\"");
  const fs::path dir = root / name;
  check(fs::is_directory(dir, ec),
        file.string() + " names \"" + name + "\", but " + dir.string() + " does not exist");
  return dir;
}

}  // namespace malleus::checkpoint
