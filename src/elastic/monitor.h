// The straggler monitor: every rank's rate is how many times longer its device now takes for the
// work the plan gave it than the same device took when healthy (1 = healthy).
//
// Each step every rank reports the elapsed time of its own compute and the FLOPs of its work
// (runtime::StepResult), and the monitor compares its time per FLOP with a reference: that rank's
// own healthy speed, never its peers' (a median of peers is wrong as soon as half of them slow
// down). Time per FLOP depends on the shape of the work as well as on the device — a narrow
// tensor-parallel share runs narrower, less efficient GEMMs; first and last stages add the
// embedding and the LM head — so references are kept per rank and per geometry (the shape of
// the rank's shard, or the probe an idle rank runs):
//
// - a reference is the lowest median of `block` consecutive steps the rank has shown in that
//   geometry: it is never raised again (a rank slow for a long time does not become the new
//   normal), and neither one lucky step nor a slow first one (cold caches, new buffers) moves it;
// - a rank entering a geometry it has no reference for, where a peer has one, takes the peer's,
//   scaled by how the two ranks' references compare in a geometry both know (1 where they share
//   none: the devices of a job are of one kind): it is rated from its first step there, and its
//   own slowdown at the switch does not enter the seed (a pipeline re-plan that swaps the first
//   and last stages between a slow and a healthy rank is rated right, whenever the load leaves);
// - where no peer has one, the rank keeps its previous rate for `window` steps, then seeds the
//   reference from them: median time per FLOP there / the rank's rate just before the switch
//   (its slowdown is assumed unchanged across the switch; the reference comes down to the truth
//   when the rank later runs faster than the seed says);
// - the first geometry of the run is calibrated from its first `window` measured steps; a rank
//   whose calibration is more than `calibration_tolerance` slower than the fastest rank
//   calibrating the identical geometry takes that rank's reference, so a device slow from the
//   first step is seen (devices of one job are assumed to be of one kind, as the cluster spec
//   says). A rank slow from the start with no identical peer reads 1 until it speeds up;
// - when every rank slows at once, every rate says so; nothing is gained by re-planning.
//
// Rates are a per-rank median over a sliding window of `window` steps, so one noisy step moves
// nothing. Every rank sees the same measurements and geometries, so all compute the same rates.
#pragma once

#include <deque>
#include <map>
#include <string>
#include <vector>

#include "layout/layout.h"

namespace malleus::elastic {

struct MonitorOptions {
  int window = 3;                      // steps in the sliding median; steps to settle a geometry
  int block = 8;                       // steps whose median may lower a reference
  double calibration_tolerance = 1.2;  // a first calibration this much slower than a peer's
};

class Monitor {
 public:
  static constexpr int kMaxRanks = 1 << 20;  // a world larger than this is refused

  Monitor(int world_size, MonitorOptions options = {});

  // Adds one step: every rank's (seconds, FLOPs) of its work (StepResult::measurements) and the
  // geometry of that work (work_geometries). Returns the rates.
  const std::vector<double>& observe(const std::vector<double>& measurements,
                                     const std::vector<std::string>& geometries);
  const std::vector<double>& rates() const { return rates_; }
  // The last step's rates alone, unsmoothed: its time per FLOP over the reference; while a rank
  // settles in a geometry new to it, over the reference of the geometry it came from (time per
  // FLOP depends on the shape somewhat, but a stale rate would hide a load that moved); the
  // windowed rate where it has neither, or measured nothing.
  const std::vector<double>& step_rates() const { return step_rates_; }
  // Steps observed since the last re-plan (or the start).
  int samples() const { return samples_; }
  void note_replan() { samples_ = 0; }
  // The healthy time per FLOP rank `rank` is rated against in its current geometry; 0 while it
  // has none yet.
  double reference(int rank) const;
  // Fixes rank `rank`'s reference in `geometry` at `value` (time per FLOP): a healthy time known
  // without measuring (the cost model's, for the link probe). The rank is rated against it from
  // its first step there, with no calibration, and its own steps never move it.
  void set_reference(int rank, const std::string& geometry, double value);

 private:
  struct Reference {
    std::deque<double> block;  // the last `block` measured times per FLOP, newest last
    double value = 0;          // the healthy time per FLOP; 0: not known yet
    bool fixed = false;        // set_reference's: measurements do not move it
  };
  struct RankState {
    std::string geometry;        // of the current visit; empty before the first step
    std::deque<double> window;   // this visit's last `window` measured times per FLOP
    double entry_rate = 0;       // rate when this visit began; 0: the run's first geometry
    double entry_reference = 0;  // the reference of the geometry this visit came from
    double rate = 1;
    std::map<std::string, Reference> references;
  };

  // A reference for `geometry` of rank `rank` (which came from geometry `from`) from its peers'
  // references there (median over peers); 0: no peer has one.
  double peer_seed(size_t rank, const std::string& geometry, const std::string& from) const;

  MonitorOptions options_;
  std::vector<RankState> ranks_;
  std::vector<double> rates_, step_rates_;
  int samples_ = 0;
};

// The link monitor: how many times slower each node's link to the other nodes now is than it
// was when healthy (1 = healthy), measured separately from the compute rates. Each step every
// node's leader reports the elapsed time and the bytes of the engine's link probe
// (runtime::StepResult::link_measurements: the fastest of its exchanges with the other nodes'
// leaders, each timed after the pair met, so a slow device's late arrival is not counted; the
// other ranks report nothing); a Monitor rates each leader's time per byte against its healthy
// time per byte with the same references and windows as compute (one geometry: the probe is the
// same under every plan, so a plan that sends nothing across a link still sees it, and a re-plan
// never reseeds a reference), and a node's link rate is the median over its measured ranks. The
// healthy time per byte, when given, is the cost model's for the probe on the cluster's healthy
// links, fixed: a link rate then says how many times slower than the cluster file's inter-node
// bandwidth the link now is, which is what the planner divides that bandwidth by
// (plan::ClusterSpec::link_rates), and it does not depend on the first steps: a reference taken
// from them, on a busy machine (on emulated links the transfer itself is CPU work), hid a link
// slowed later. Without it, each rank's own (the lowest median of `block` steps). An exchange
// runs at the pace of the slower of its two links, so with three or more nodes the fastest
// exchange of a node with a healthy link is fast and only a slow node reads slow
// (docs/slow-links.md); with two, both nodes read the one link between them.
class LinkMonitor {
 public:
  // `node_of_rank`: the cluster node of each rank (the cost model's numbering);
  // `expected_seconds_per_byte`: each rank's probe time per byte on healthy links as the cost
  // model predicts it (plan::CostModel::link_probe_seconds_per_byte; 0 for a rank that does not
  // probe), or empty: own references.
  LinkMonitor(std::vector<int> node_of_rank, MonitorOptions options = {},
              const std::vector<double>& expected_seconds_per_byte = {});
  // Adds one step: every rank's (seconds, bytes) of its probe (0, 0: not measured). Returns every
  // node's link rate.
  const std::vector<double>& observe(const std::vector<double>& link_measurements);
  const std::vector<double>& node_rates() const { return node_rates_; }
  const std::vector<double>& rank_rates() const { return ranks_.rates(); }

 private:
  std::vector<int> node_of_rank_;
  Monitor ranks_;
  std::vector<double> node_rates_;
};

// The geometry of every rank's work under `layout`: its shard's shape (head / FFN / vocabulary
// shares, embedding, LM head; not its layer count nor its position in the model), or "probe" when
// idle.
std::vector<std::string> work_geometries(const layout::Layout& layout);

}  // namespace malleus::elastic
