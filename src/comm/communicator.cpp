// Communicator and Request on top of the MPI C API; see communicator.h.
#include "comm/communicator.h"

#include <cstdlib>

#include <algorithm>
#include <climits>
#include <string>

#include "comm/mpi_session.h"
#include "common/error.h"

namespace malleus::comm {

namespace {

// Elements (or bytes) per MPI call when a count does not fit the int count argument.
constexpr size_t kChunk = size_t{1} << 30;

void mpi_check(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(rc, text, &length);
  throw Error(std::string("MPI: ") + call + " failed: " + std::string(text, length));
}

void check_usable() {
  check(MpiSession::initialized(),
        "Communicator: MPI is not initialized (construct an MpiSession first) or already "
        "finalized");
}

// MPI_TAG_UB is fixed for the life of MPI (and MPI cannot be initialized twice): cache it.
int tag_upper_bound() {
  static const int bound = [] {
    void* value = nullptr;
    int flag = 0;
    mpi_check(MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &value, &flag), "MPI_Comm_get_attr");
    // The standard guarantees at least 32767.
    return flag != 0 ? *static_cast<int*>(value) : 32767;
  }();
  return bound;
}

template <typename T>
MPI_Datatype mpi_type();
template <>
MPI_Datatype mpi_type<float>() {
  return MPI_FLOAT;
}
template <>
MPI_Datatype mpi_type<double>() {
  return MPI_DOUBLE;
}

template <typename T>
void all_reduce_in_place(MPI_Comm comm, T* data, size_t count, MPI_Op op) {
  check(data != nullptr || count == 0, "Communicator::all_reduce: null buffer");
  if (count <= static_cast<size_t>(INT_MAX)) {
    mpi_check(MPI_Allreduce(MPI_IN_PLACE, data, static_cast<int>(count), mpi_type<T>(), op, comm),
              "MPI_Allreduce");
    return;
  }
  for (size_t offset = 0; offset < count; offset += kChunk) {
    const size_t n = std::min(kChunk, count - offset);
    mpi_check(
        MPI_Allreduce(MPI_IN_PLACE, data + offset, static_cast<int>(n), mpi_type<T>(), op, comm),
        "MPI_Allreduce");
  }
}

template <typename T>
MPI_Request iall_reduce_in_place(MPI_Comm comm, T* data, size_t count, MPI_Op op) {
  check(data != nullptr || count == 0, "Communicator::iall_reduce: null buffer");
  check(count <= static_cast<size_t>(INT_MAX),
        "Communicator::iall_reduce: " + std::to_string(count) +
            " elements exceed the limit of INT_MAX of a nonblocking reduction");
  MPI_Request request = MPI_REQUEST_NULL;
  mpi_check(MPI_Iallreduce(MPI_IN_PLACE, data, static_cast<int>(count), mpi_type<T>(), op, comm,
                           &request),
            "MPI_Iallreduce");
  return request;
}

// The same through StagedBuffer: a device buffer is reduced in a host copy.
template <typename T>
void all_reduce_staged(MPI_Comm comm, T* data, size_t count, MPI_Op op) {
  StagedBuffer view(data, count * sizeof(T), StagedBuffer::kInOut);
  all_reduce_in_place(comm, static_cast<T*>(view.mpi()), count, op);
  view.finish();
}

template <typename T>
std::vector<StagedBuffer> staged_one(T* data, size_t bytes, StagedBuffer::Direction direction) {
  std::vector<StagedBuffer> staged;
  staged.emplace_back(data, bytes, direction);
  return staged;
}

// FNV-1a over the rank list, folded into [0, tag_ub]: distinct groups that are being created at
// the same time by overlapping ranks get distinct tags (with high probability).
int group_tag(const std::vector<int>& ranks) {
  uint64_t hash = 14695981039346656037ull;
  for (int r : ranks) {
    auto v = static_cast<uint32_t>(r);
    for (int byte = 0; byte < 4; ++byte) {
      hash ^= (v >> (8 * byte)) & 0xffu;
      hash *= 1099511628211ull;
    }
  }
  const auto bound = static_cast<uint64_t>(tag_upper_bound()) + 1;
  return static_cast<int>(hash % bound);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Communicator

struct Communicator::State {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0;
  int size = 0;
  std::vector<int> world_ranks;    // world rank of each rank of comm
  std::vector<int> rank_of_world;  // inverse, -1 for non-members; indexed by world rank

  explicit State(MPI_Comm c) : comm(c) {
    mpi_check(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
    mpi_check(MPI_Comm_size(comm, &size), "MPI_Comm_size");
    int world_size = 0;
    mpi_check(MPI_Comm_size(MPI_COMM_WORLD, &world_size), "MPI_Comm_size");
    world_ranks.resize(static_cast<size_t>(size));
    if (comm == MPI_COMM_WORLD) {
      for (int i = 0; i < size; ++i) world_ranks[static_cast<size_t>(i)] = i;
    } else {
      MPI_Group group = MPI_GROUP_NULL;
      MPI_Group world_group = MPI_GROUP_NULL;
      mpi_check(MPI_Comm_group(comm, &group), "MPI_Comm_group");
      mpi_check(MPI_Comm_group(MPI_COMM_WORLD, &world_group), "MPI_Comm_group");
      std::vector<int> local(static_cast<size_t>(size));
      for (int i = 0; i < size; ++i) local[static_cast<size_t>(i)] = i;
      const int rc =
          MPI_Group_translate_ranks(group, size, local.data(), world_group, world_ranks.data());
      MPI_Group_free(&group);
      MPI_Group_free(&world_group);
      mpi_check(rc, "MPI_Group_translate_ranks");
    }
    rank_of_world.assign(static_cast<size_t>(world_size), -1);
    for (int i = 0; i < size; ++i) {
      const int w = world_ranks[static_cast<size_t>(i)];
      check(w >= 0 && w < world_size,
            "Communicator: a member is not in MPI_COMM_WORLD (dynamic processes are unsupported)");
      rank_of_world[static_cast<size_t>(w)] = i;
    }
  }

  ~State() {
    if (comm == MPI_COMM_NULL || comm == MPI_COMM_WORLD || comm == MPI_COMM_SELF) return;
    // After MPI_Finalize the handle is gone already; freeing would be an error.
    if (MpiSession::initialized()) MPI_Comm_free(&comm);
  }

  State(const State&) = delete;
  State& operator=(const State&) = delete;
};

Communicator Communicator::world() {
  check_usable();
  return Communicator(std::make_shared<const State>(MPI_COMM_WORLD));
}

const Communicator::State& Communicator::state() const {
  check(state_ != nullptr, "Communicator: use of an empty (default-constructed) communicator");
  return *state_;
}

const Communicator::State& Communicator::live_state() const {
  const State& s = state();
  check_usable();
  return s;
}

int Communicator::rank() const {
  return state().rank;
}
int Communicator::size() const {
  return state().size;
}
MPI_Comm Communicator::handle() const {
  return state().comm;
}
const std::vector<int>& Communicator::world_ranks() const {
  return state().world_ranks;
}

int Communicator::world_rank(int rank_in_this) const {
  const State& s = state();
  check(rank_in_this >= 0 && rank_in_this < s.size,
        "Communicator::world_rank: rank " + std::to_string(rank_in_this) +
            " out of range for a communicator of size " + std::to_string(s.size));
  return s.world_ranks[static_cast<size_t>(rank_in_this)];
}

int Communicator::rank_of_world(int world_rank) const {
  const State& s = state();
  if (world_rank < 0 || static_cast<size_t>(world_rank) >= s.rank_of_world.size()) return -1;
  return s.rank_of_world[static_cast<size_t>(world_rank)];
}

Communicator Communicator::subgroup(const std::vector<int>& ranks) const {
  const State& s = live_state();
  const size_t world_size = s.rank_of_world.size();
  check(!ranks.empty(), "Communicator::subgroup: empty rank list");
  std::vector<int> local(ranks.size());
  std::vector<bool> seen(world_size, false);
  const int my_world_rank = s.world_ranks[static_cast<size_t>(s.rank)];
  bool member = false;
  for (size_t i = 0; i < ranks.size(); ++i) {
    const int w = ranks[i];
    check(w >= 0 && static_cast<size_t>(w) < world_size,
          "Communicator::subgroup: world rank " + std::to_string(w) + " out of range [0, " +
              std::to_string(world_size) + ")");
    check(!seen[static_cast<size_t>(w)],
          "Communicator::subgroup: world rank " + std::to_string(w) + " listed twice");
    seen[static_cast<size_t>(w)] = true;
    local[i] = s.rank_of_world[static_cast<size_t>(w)];
    check(local[i] >= 0, "Communicator::subgroup: world rank " + std::to_string(w) +
                             " is not a member of this communicator");
    member = member || w == my_world_rank;
  }
  check(member, "Communicator::subgroup: called by world rank " + std::to_string(my_world_rank) +
                    ", which is not in the rank list (only members may call it)");

  MPI_Comm comm = MPI_COMM_NULL;
  if (ranks.size() == 1) {
    mpi_check(MPI_Comm_dup(MPI_COMM_SELF, &comm), "MPI_Comm_dup");
  } else {
    MPI_Group parent = MPI_GROUP_NULL;
    MPI_Group group = MPI_GROUP_NULL;
    mpi_check(MPI_Comm_group(s.comm, &parent), "MPI_Comm_group");
    int rc = MPI_Group_incl(parent, static_cast<int>(local.size()), local.data(), &group);
    MPI_Group_free(&parent);
    mpi_check(rc, "MPI_Group_incl");
    rc = MPI_Comm_create_group(s.comm, group, group_tag(ranks), &comm);
    MPI_Group_free(&group);
    mpi_check(rc, "MPI_Comm_create_group");
  }
  check(comm != MPI_COMM_NULL, "Communicator::subgroup: MPI returned no communicator");
  try {
    return Communicator(std::make_shared<const State>(comm));
  } catch (...) {
    MPI_Comm_free(&comm);
    throw;
  }
}

void Communicator::all_reduce_sum(float* data, size_t count) const {
  all_reduce_staged(live_state().comm, data, count, MPI_SUM);
}
void Communicator::all_reduce_sum(double* data, size_t count) const {
  all_reduce_staged(live_state().comm, data, count, MPI_SUM);
}
void Communicator::all_reduce_max(float* data, size_t count) const {
  all_reduce_staged(live_state().comm, data, count, MPI_MAX);
}
void Communicator::all_reduce_max(double* data, size_t count) const {
  all_reduce_staged(live_state().comm, data, count, MPI_MAX);
}

namespace {

// The request of a started reduction, and its staged buffer.
template <typename T>
std::pair<MPI_Request, std::vector<StagedBuffer>> iall_reduce_staged(MPI_Comm comm, T* data,
                                                                     size_t count, MPI_Op op) {
  std::vector<StagedBuffer> staged = staged_one(data, count * sizeof(T), StagedBuffer::kInOut);
  const MPI_Request request =
      iall_reduce_in_place(comm, static_cast<T*>(staged[0].mpi()), count, op);
  return {request, std::move(staged)};
}

}  // namespace

Request Communicator::iall_reduce_sum(float* data, size_t count) const {
  auto [request, staged] = iall_reduce_staged(live_state().comm, data, count, MPI_SUM);
  return Request::posted(request, std::move(staged));
}
Request Communicator::iall_reduce_sum(double* data, size_t count) const {
  auto [request, staged] = iall_reduce_staged(live_state().comm, data, count, MPI_SUM);
  return Request::posted(request, std::move(staged));
}
Request Communicator::iall_reduce_max(float* data, size_t count) const {
  auto [request, staged] = iall_reduce_staged(live_state().comm, data, count, MPI_MAX);
  return Request::posted(request, std::move(staged));
}

double Communicator::all_reduce_sum(double value) const {
  all_reduce_in_place(live_state().comm, &value, 1, MPI_SUM);
  return value;
}

double Communicator::all_reduce_max(double value) const {
  all_reduce_in_place(live_state().comm, &value, 1, MPI_MAX);
  return value;
}

int64_t Communicator::all_reduce_sum(int64_t value) const {
  mpi_check(MPI_Allreduce(MPI_IN_PLACE, &value, 1, MPI_INT64_T, MPI_SUM, live_state().comm),
            "MPI_Allreduce");
  return value;
}

namespace {

// The parts of an uneven reduce-scatter / all-gather: one per rank, laid end to end.
void check_parts(int ranks, const std::vector<int>& counts, const std::vector<int>* displacements,
                 const char* call) {
  check(static_cast<int>(counts.size()) == ranks,
        std::string("Communicator::") + call + ": " + std::to_string(counts.size()) +
            " counts for a communicator of " + std::to_string(ranks) + " ranks");
  int64_t total = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    check(counts[i] >= 0, std::string("Communicator::") + call + ": negative count");
    check(displacements == nullptr || (*displacements)[i] == total,
          std::string("Communicator::") + call + ": the parts are not laid end to end");
    total += counts[i];
  }
  check(displacements == nullptr || displacements->size() == counts.size(),
        std::string("Communicator::") + call + ": counts and displacements differ in length");
  check(total <= INT_MAX, std::string("Communicator::") + call + ": " + std::to_string(total) +
                              " elements exceed INT_MAX");
}

// Bytes of the parts laid end to end.
size_t parts_bytes(const std::vector<int>& counts) {
  size_t total = 0;
  for (int c : counts) total += static_cast<size_t>(c);
  return total * sizeof(float);
}

// A reduce-scatter's send buffer (read whole) and this rank's receive part (written).
std::vector<StagedBuffer> staged_parts(const float* send, float* receive,
                                       const std::vector<int>& counts, int rank) {
  std::vector<StagedBuffer> staged;
  staged.emplace_back(send, parts_bytes(counts), StagedBuffer::kIn);
  staged.emplace_back(receive,
                      static_cast<size_t>(counts[static_cast<size_t>(rank)]) * sizeof(float),
                      StagedBuffer::kOut);
  return staged;
}

}  // namespace

void Communicator::reduce_scatter_sum(const float* send, float* receive,
                                      const std::vector<int>& counts) const {
  const State& s = live_state();
  check_parts(s.size, counts, nullptr, "reduce_scatter_sum");
  std::vector<StagedBuffer> staged = staged_parts(send, receive, counts, s.rank);
  mpi_check(MPI_Reduce_scatter(staged[0].mpi(), staged[1].mpi(), counts.data(), MPI_FLOAT, MPI_SUM,
                               s.comm),
            "MPI_Reduce_scatter");
  staged[1].finish();
}

Request Communicator::ireduce_scatter_sum(const float* send, float* receive,
                                          const std::vector<int>& counts) const {
  const State& s = live_state();
  check_parts(s.size, counts, nullptr, "ireduce_scatter_sum");
  std::vector<StagedBuffer> staged = staged_parts(send, receive, counts, s.rank);
  MPI_Request request = MPI_REQUEST_NULL;
  mpi_check(MPI_Ireduce_scatter(staged[0].mpi(), staged[1].mpi(), counts.data(), MPI_FLOAT, MPI_SUM,
                                s.comm, &request),
            "MPI_Ireduce_scatter");
  return Request::posted(request, std::move(staged));
}

void Communicator::all_gather_in_place(float* data, const std::vector<int>& counts,
                                       const std::vector<int>& displacements) const {
  const State& s = live_state();
  check_parts(s.size, counts, &displacements, "all_gather_in_place");
  StagedBuffer view(data, parts_bytes(counts), StagedBuffer::kInOut);
  mpi_check(MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, view.mpi(), counts.data(),
                           displacements.data(), MPI_FLOAT, s.comm),
            "MPI_Allgatherv");
  view.finish();
}

Request Communicator::iall_gather_in_place(float* data, const std::vector<int>& counts,
                                           const std::vector<int>& displacements) const {
  const State& s = live_state();
  check_parts(s.size, counts, &displacements, "iall_gather_in_place");
  std::vector<StagedBuffer> staged = staged_one(data, parts_bytes(counts), StagedBuffer::kInOut);
  MPI_Request request = MPI_REQUEST_NULL;
  mpi_check(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, staged[0].mpi(), counts.data(),
                            displacements.data(), MPI_FLOAT, s.comm, &request),
            "MPI_Iallgatherv");
  return Request::posted(request, std::move(staged));
}

void Communicator::broadcast(void* data, size_t bytes, int root) const {
  const State& s = live_state();
  check(root >= 0 && root < s.size, "Communicator::broadcast: root " + std::to_string(root) +
                                        " out of range for a communicator of size " +
                                        std::to_string(s.size));
  check(data != nullptr || bytes == 0, "Communicator::broadcast: null buffer");
  StagedBuffer view(data, bytes, s.rank == root ? StagedBuffer::kIn : StagedBuffer::kOut);
  auto* p = static_cast<char*>(view.mpi());
  if (bytes <= static_cast<size_t>(INT_MAX)) {
    mpi_check(MPI_Bcast(p, static_cast<int>(bytes), MPI_BYTE, root, s.comm), "MPI_Bcast");
    view.finish();
    return;
  }
  for (size_t offset = 0; offset < bytes; offset += kChunk) {
    const size_t n = std::min(kChunk, bytes - offset);
    mpi_check(MPI_Bcast(p + offset, static_cast<int>(n), MPI_BYTE, root, s.comm), "MPI_Bcast");
  }
  view.finish();
}

std::string Communicator::broadcast_text(const std::string& text, int root) const {
  int64_t length = static_cast<int64_t>(text.size());
  broadcast(&length, sizeof length, root);
  std::string result = rank() == root ? text : std::string(static_cast<size_t>(length), '\0');
  broadcast(result.data(), result.size(), root);
  return result;
}

std::vector<std::string> Communicator::gather_text(const std::string& text, int root) const {
  const State& s = live_state();
  check(root >= 0 && root < s.size, "Communicator::gather_text: root " + std::to_string(root) +
                                        " out of range for a communicator of size " +
                                        std::to_string(s.size));
  check(text.size() <= static_cast<size_t>(INT_MAX), "Communicator::gather_text: text of " +
                                                         std::to_string(text.size()) +
                                                         " bytes is over INT_MAX");
  const int length = static_cast<int>(text.size());
  const bool me_root = rank() == root;
  std::vector<int> lengths(me_root ? static_cast<size_t>(s.size) : 0);
  mpi_check(MPI_Gather(&length, 1, MPI_INT, lengths.data(), 1, MPI_INT, root, s.comm),
            "MPI_Gather");
  std::vector<int> displacements(lengths.size(), 0);
  int64_t total = 0;
  for (size_t r = 0; r < lengths.size(); ++r) {
    check(total + lengths[r] <= INT_MAX, "Communicator::gather_text: over INT_MAX bytes in all");
    displacements[r] = static_cast<int>(total);
    total += lengths[r];
  }
  std::string all(static_cast<size_t>(total), '\0');
  mpi_check(MPI_Gatherv(text.data(), length, MPI_CHAR, all.data(), lengths.data(),
                        displacements.data(), MPI_CHAR, root, s.comm),
            "MPI_Gatherv");
  std::vector<std::string> texts;
  for (size_t r = 0; r < lengths.size(); ++r) {
    texts.push_back(
        all.substr(static_cast<size_t>(displacements[r]), static_cast<size_t>(lengths[r])));
  }
  return texts;
}

void Communicator::barrier() const {
  mpi_check(MPI_Barrier(live_state().comm), "MPI_Barrier");
}

namespace {

void check_p2p(const char* what, const void* data, size_t bytes, int peer, int tag, int size) {
  const std::string name = std::string("Communicator::") + what;
  check(peer >= 0 && peer < size, name + ": peer rank " + std::to_string(peer) +
                                      " out of range for a communicator of size " +
                                      std::to_string(size));
  check(tag >= 0 && tag <= tag_upper_bound(),
        name + ": tag " + std::to_string(tag) + " out of range [0, MPI_TAG_UB]");
  check(bytes <= static_cast<size_t>(INT_MAX), name + ": message of " + std::to_string(bytes) +
                                                   " bytes exceeds the limit of INT_MAX bytes");
  check(data != nullptr || bytes == 0, name + ": null buffer");
}

}  // namespace

Request Communicator::isend(const void* data, size_t bytes, int dest, int tag) const {
  const State& s = live_state();
  check_p2p("isend", data, bytes, dest, tag, s.size);
  std::vector<StagedBuffer> staged = staged_one(data, bytes, StagedBuffer::kIn);
  MPI_Request request = MPI_REQUEST_NULL;
  mpi_check(
      MPI_Isend(staged[0].mpi(), static_cast<int>(bytes), MPI_BYTE, dest, tag, s.comm, &request),
      "MPI_Isend");
  return Request(request, false, bytes, dest, tag, std::move(staged));
}

Request Communicator::irecv(void* data, size_t bytes, int source, int tag) const {
  const State& s = live_state();
  check_p2p("irecv", data, bytes, source, tag, s.size);
  std::vector<StagedBuffer> staged = staged_one(data, bytes, StagedBuffer::kOut);
  MPI_Request request = MPI_REQUEST_NULL;
  mpi_check(
      MPI_Irecv(staged[0].mpi(), static_cast<int>(bytes), MPI_BYTE, source, tag, s.comm, &request),
      "MPI_Irecv");
  return Request(request, true, bytes, source, tag, std::move(staged));
}

// ---------------------------------------------------------------------------------------------
// Request

Request::~Request() {
  complete_quietly();
}

Request::Request(Request&& other) noexcept
    : request_(other.request_),
      is_receive_(other.is_receive_),
      bytes_(other.bytes_),
      peer_(other.peer_),
      tag_(other.tag_),
      staged_(std::move(other.staged_)) {
  other.request_ = MPI_REQUEST_NULL;
  other.staged_.clear();
}

Request& Request::operator=(Request&& other) noexcept {
  if (this != &other) {
    complete_quietly();
    request_ = other.request_;
    is_receive_ = other.is_receive_;
    bytes_ = other.bytes_;
    peer_ = other.peer_;
    tag_ = other.tag_;
    staged_ = std::move(other.staged_);
    other.request_ = MPI_REQUEST_NULL;
    other.staged_.clear();
  }
  return *this;
}

void Request::complete_quietly() noexcept {
  if (request_ != MPI_REQUEST_NULL) {
    // After MPI_Finalize the request cannot be waited on (and MPI has released it).
    if (MpiSession::initialized()) MPI_Wait(&request_, MPI_STATUS_IGNORE);
    request_ = MPI_REQUEST_NULL;
    // What MPI wrote reaches the device buffer as it would have reached a host buffer.
    for (StagedBuffer& buffer : staged_) {
      try {
        buffer.finish();
      } catch (...) {  // a destructor must not throw; the device's error shows at its next call
      }
    }
  }
  staged_.clear();
}

void Request::check_completed(const MPI_Status& status) {
  for (StagedBuffer& buffer : staged_) buffer.finish();
  staged_.clear();
  if (!is_receive_) return;
  int received = 0;
  MPI_Get_count(&status, MPI_BYTE, &received);
  check(received >= 0 && static_cast<size_t>(received) == bytes_,
        "Request: receive from rank " + std::to_string(peer_) + " with tag " +
            std::to_string(tag_) + " expected " + std::to_string(bytes_) + " bytes but got " +
            std::to_string(received));
}

void Request::wait() {
  if (request_ == MPI_REQUEST_NULL) return;
  check_usable();
  MPI_Status status;
  const int rc = MPI_Wait(&request_, &status);
  request_ = MPI_REQUEST_NULL;
  mpi_check(rc, "MPI_Wait");
  check_completed(status);
}

bool Request::test() {
  if (request_ == MPI_REQUEST_NULL) return true;
  check_usable();
  MPI_Status status;
  int done = 0;
  mpi_check(MPI_Test(&request_, &done, &status), "MPI_Test");
  if (done == 0) return false;
  request_ = MPI_REQUEST_NULL;
  check_completed(status);
  return true;
}

void Request::wait_all(std::vector<Request>& requests) {
  std::vector<MPI_Request> handles;
  std::vector<size_t> which;
  for (size_t i = 0; i < requests.size(); ++i) {
    if (!requests[i].pending()) continue;
    handles.push_back(requests[i].request_);
    which.push_back(i);
  }
  if (handles.empty()) return;
  check_usable();
  std::vector<MPI_Status> statuses(handles.size());
  const int rc = MPI_Waitall(static_cast<int>(handles.size()), handles.data(), statuses.data());
  for (size_t k = 0; k < which.size(); ++k) requests[which[k]].request_ = handles[k];
  mpi_check(rc, "MPI_Waitall");
  for (size_t k = 0; k < which.size(); ++k) requests[which[k]].check_completed(statuses[k]);
}

void Communicator::abort(int code) const {
  MPI_Abort(handle(), code);
  std::abort();  // MPI_Abort does not return; this keeps [[noreturn]] honest
}

std::string error_of(const std::function<void()>& body) {
  try {
    body();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

void agree_on_error(const Communicator& world, const std::string& error) {
  if (world.all_reduce_sum(int64_t{error.empty() ? 0 : 1}) == 0) return;
  std::string first;
  for (const std::string& e : world.gather_text(error, 0)) {
    if (first.empty()) first = e;
  }
  throw Error(world.broadcast_text(first, 0));
}

}  // namespace malleus::comm
