// Export round trip: a trained checkpoint written as Hugging Face safetensors + config.json is
// read back bit-identically, and an independent NumPy implementation of LlamaForCausalLM
// (tests/hf_llama_reference.py, following Hugging Face's modeling_llama) computes the same loss
// from the exported files as our model does from the checkpoint.
#include <gtest/gtest.h>

#include <fstream>
#include <random>

#include "checkpoint/checkpoint.h"
#include "comm/communicator.h"
#include "hf/export.h"
#include "hf/import.h"
#include "hf/safetensors.h"
#include "test_util.h"
#include "train/trainer.h"
#include "train_config_samples.h"

using namespace malleus;
using malleus::testing::ScratchDir;

namespace {

// A few training steps so the weights are no longer at their initial values.
checkpoint::Checkpoint trained_tiny_checkpoint(const ScratchDir& dir, const std::string& model) {
  malleus::testing::write_synthetic_corpus(dir / "data");
  train::TrainConfig c = malleus::testing::synthetic_corpus_config(dir.path(), model);
  c.seq_len = 16;
  c.micro_batch_size = 2;
  c.global_batch_size = 2;
  c.steps = 3;
  train::Trainer trainer(c, model::load_model_config(model), comm::Communicator::world());
  for (int s = 0; s < 3; ++s) trainer.train_step();
  return trainer.snapshot();
}

}  // namespace

TEST(Export, SafetensorsRoundTripIsBitExact) {
  ScratchDir dir;
  const auto checkpoint = trained_tiny_checkpoint(dir, "tiny");
  hf::export_hf(checkpoint, dir / "hf");
  const auto tensors = hf::read_safetensors(dir / "hf" / "model.safetensors");
  const model::ParameterLayout layout(checkpoint.model);
  ASSERT_EQ(tensors.size(), layout.tensors().size());
  for (const auto& spec : layout.tensors()) {
    const auto it = tensors.find(spec.name);
    ASSERT_NE(it, tensors.end()) << spec.name;
    EXPECT_EQ(it->second.shape, spec.shape) << spec.name;
    const float* expected = checkpoint.params.data() + spec.offset;
    EXPECT_TRUE(std::equal(it->second.data.begin(), it->second.data.end(), expected)) << spec.name;
  }
  const Json config = read_json_file((dir / "hf" / "config.json").string());
  EXPECT_EQ(config["architectures"][0], "LlamaForCausalLM");
  EXPECT_EQ(config["num_key_value_heads"], checkpoint.model.num_kv_heads);
  EXPECT_EQ(config["intermediate_size"], checkpoint.model.ffn_hidden_size);
}

TEST(Export, HuggingFaceReferenceComputesTheSameLoss) {
  ScratchDir dir;
  const auto checkpoint = trained_tiny_checkpoint(dir, "tiny");  // grouped KV heads: 4 q, 2 kv
  hf::export_hf(checkpoint, dir / "hf");

  const int seq = 24;
  std::mt19937_64 rng(17);
  std::vector<int32_t> tokens;
  for (int i = 0; i <= seq; ++i) tokens.push_back(static_cast<int32_t>(rng() % 257));
  {
    std::ofstream out(dir / "tokens.txt");
    for (int32_t t : tokens) out << t << ' ';
  }

  auto backend = backend::make_cpu_backend<float>(1);
  model::Transformer<float> m(checkpoint.model, *backend, 1, seq);
  backend->copy_from_host(m.params(), checkpoint.params.data(), checkpoint.params.size());
  const std::vector<int32_t> inputs(tokens.begin(), tokens.end() - 1),
      targets(tokens.begin() + 1, tokens.end());
  const double ours = m.forward(inputs.data(), targets.data()) / seq;

  const auto r = malleus::testing::run_command(
      std::string(MALLEUS_PYTHON) + " " + MALLEUS_SOURCE_DIR + "/tests/hf_llama_reference.py " +
      (dir / "hf").string() + " " + (dir / "tokens.txt").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const double reference = std::stod(r.output);
  // fp32 against float64: agreement to ~1e-6 relative is expected; 1e-4 leaves margin.
  EXPECT_NEAR(ours, reference, 1e-4 * reference) << "ours " << ours << " reference " << reference;
}

TEST(Export, ReferenceSelfTest) {
  const auto r =
      malleus::testing::run_command(std::string(MALLEUS_PYTHON) + " " + MALLEUS_SOURCE_DIR +
                                    "/tests/hf_llama_reference.py --selftest");
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

// An exported model, imported back, has the same loss on the validation data, to the last bit.
TEST(Import, ReproducesTheExportedModelsEvalLossExactly) {
  ScratchDir dir;
  const auto checkpoint = trained_tiny_checkpoint(dir, "tiny");
  hf::export_hf(checkpoint, dir / "hf");
  const hf::ImportResult imported = hf::import_hf(dir / "hf");
  EXPECT_EQ(imported.checkpoint.params, checkpoint.params);

  // evaluate() is given the validation data: the config's (none) is never read here.
  train::TrainConfig c = malleus::testing::synthetic_corpus_config(dir.path(), "tiny", "eval");
  c.seq_len = 16;
  c.micro_batch_size = 2;
  c.global_batch_size = 2;
  const std::string val = (dir / "data" / "val_*.bin").string();
  train::Trainer original(c, checkpoint.model, comm::Communicator::world());
  original.restore(checkpoint);
  train::Trainer reloaded(c, imported.checkpoint.model, comm::Communicator::world());
  reloaded.restore(imported.checkpoint);
  const double a = original.evaluate(val, 16), b = reloaded.evaluate(val, 16);
  EXPECT_EQ(a, b);
  EXPECT_TRUE(std::isfinite(a) && a > 0);
}
