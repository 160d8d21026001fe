// Tokenizers: the byte tokenizer; SentencePiece models trained on a small corpus (BPE and
// unigram) round-trip text; the saved form used by data directories and checkpoints; shards
// written with a SentencePiece model; clear errors for bad tokenizer files.
#include <gtest/gtest.h>

#include <fstream>

#include "common/files.h"
#include "data/dataset.h"
#include "data/prepare.h"
#include "test_util.h"
#include "tokenizer/byte_tokenizer.h"
#include "tokenizer/sentencepiece_tokenizer.h"
#include "tokenizer/text_stream.h"

using namespace malleus;
using malleus::testing::error_of;
using malleus::testing::ScratchDir;
using tokenizer::ByteTokenizer;

namespace {

void expect_error(const std::function<void()>& f, std::initializer_list<std::string> parts) {
  const std::string message = error_of(f);
  EXPECT_FALSE(message.empty()) << "no error";
  for (const auto& part : parts) EXPECT_NE(message.find(part), std::string::npos) << message;
}

std::vector<std::string> corpus_lines() {
  return malleus::testing::tokenizer_corpus_lines();
}

std::shared_ptr<const tokenizer::Tokenizer> train_on_corpus(const std::string& type, int vocab) {
  return malleus::testing::small_sentencepiece(type, vocab);
}

// Texts the corpus never showed: unseen characters go through byte fallback.
const std::vector<std::string> kTexts = {
    "The old sailor remembers the long winter.",
    "  leading spaces,   inner   runs and a trailing space ",
    "two\nlines\n\nand a tab\there",
    "naïve café — 日本語 🚀 and digits 0123456789",
    "",
};

}  // namespace

TEST(ByteTokenizer, EncodesBytesAsTheirValues) {
  ByteTokenizer tok;
  // "é" is C3 A9 in UTF-8: bytes above 0x7F must become 128..255, not negative chars.
  EXPECT_EQ(tok.encode("Aé"), (std::vector<int32_t>{65, 0xC3, 0xA9}));
  EXPECT_TRUE(tok.encode("").empty());
}

TEST(ByteTokenizer, RoundTripsUtf8AndEveryByte) {
  ByteTokenizer tok;
  const std::string utf8 = "naïve café — 日本語 🚀\n\ttab";
  EXPECT_EQ(tok.decode(tok.encode(utf8)), utf8);
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  const auto tokens = tok.encode(all);
  ASSERT_EQ(tokens.size(), 256u);
  for (int b = 0; b < 256; ++b) EXPECT_EQ(tokens[static_cast<size_t>(b)], b);
  EXPECT_EQ(tok.decode(tokens), all);
}

TEST(ByteTokenizer, EndOfTextSpecialTokensAndVocab) {
  ByteTokenizer tok;
  EXPECT_EQ(tok.vocab_size(), 257);
  EXPECT_EQ(tok.special_tokens(), (tokenizer::SpecialTokens{.eos = 256}));
  EXPECT_EQ(tok.decode(std::vector<int32_t>{'a', 256, 'b'}), "a\n<|endoftext|>\nb");
  expect_error([&] { tok.decode(std::vector<int32_t>{'a', 300}); }, {"300", "257"});
  // Documents end with end-of-text; a prompt starts after one, as documents do in training.
  EXPECT_EQ(tokenizer::encode_document(tok, "hi"), (std::vector<int32_t>{'h', 'i', 256}));
  EXPECT_EQ(tokenizer::encode_prompt(tok, "hi"), (std::vector<int32_t>{256, 'h', 'i'}));
}

TEST(SentencePiece, TrainedBpeModelRoundTripsText) {
  const auto tok = train_on_corpus("bpe", 400);
  EXPECT_EQ(tok->kind(), "sentencepiece");
  EXPECT_EQ(tok->vocab_size(), 400);
  EXPECT_EQ(tok->special_tokens(), (tokenizer::SpecialTokens{1, 2, -1, 0}));
  for (const auto& text : kTexts) EXPECT_EQ(tok->decode(tok->encode(text)), text) << text;
  for (const auto& line : corpus_lines()) ASSERT_EQ(tok->decode(tok->encode(line)), line);
  // It learned pieces: a corpus sentence takes far fewer tokens than bytes.
  const std::string sentence = corpus_lines()[5];
  EXPECT_LT(tok->encode(sentence).size() * 3, sentence.size());
  // Documents are bos + text + eos; prompts start with bos.
  const auto doc = tokenizer::encode_document(*tok, "Nobody");
  EXPECT_EQ(doc.front(), 1);
  EXPECT_EQ(doc.back(), 2);
  EXPECT_EQ(tokenizer::encode_prompt(*tok, "Nobody").front(), 1);
  expect_error([&] { tok->decode(std::vector<int32_t>{400}); }, {"400", "outside"});
}

TEST(SentencePiece, TrainedUnigramModelRoundTripsText) {
  const auto tok = train_on_corpus("unigram", 320);
  EXPECT_EQ(tok->vocab_size(), 320);
  for (const auto& text : kTexts) EXPECT_EQ(tok->decode(tok->encode(text)), text) << text;
  EXPECT_FALSE(tokenizer::same_tokenizer(*tok, *train_on_corpus("bpe", 320)));
}

TEST(SentencePiece, TrainingErrorsAreClear) {
  expect_error([] { train_on_corpus("bpe", 100); }, {"SentencePiece training failed"});
  expect_error([] { train_on_corpus("wordpiece", 400); }, {"wordpiece", "bpe", "unigram"});
  expect_error([] { train_on_corpus("bpe", 70000); }, {"70000", "65536"});
}

TEST(SentencePiece, BadModelFilesAreNamed) {
  ScratchDir dir;
  expect_error([&] { tokenizer::load_tokenizer((dir / "missing.model").string()); },
               {"missing.model", "no such file"});
  write_file_atomic(dir / "garbage.model", "this is not a protocol buffer \x01\x02\xff");
  expect_error([&] { tokenizer::load_tokenizer((dir / "garbage.model").string()); },
               {"garbage.model", "not a usable SentencePiece model"});
  write_file_atomic(dir / "empty.model", "");
  expect_error([&] { tokenizer::load_tokenizer((dir / "empty.model").string()); },
               {"empty.model", "empty"});
  // A truncated real model.
  const std::string model = train_on_corpus("bpe", 300)->model_file();
  write_file_atomic(dir / "cut.model", model.substr(0, model.size() / 2));
  expect_error([&] { tokenizer::load_tokenizer((dir / "cut.model").string()); }, {"cut.model"});
  write_file_atomic(dir / "good.model", model);
  const auto loaded = tokenizer::load_tokenizer((dir / "good.model").string());
  EXPECT_EQ(loaded->model_file(), model);  // kept byte for byte, for export
  EXPECT_EQ(tokenizer::load_tokenizer("byte")->kind(), "byte");
}

TEST(SavedTokenizer, RoundTripsAndRefusesCorruption) {
  ScratchDir dir;
  EXPECT_EQ(tokenizer::load_saved_tokenizer(dir.path()), nullptr);
  const auto tok = train_on_corpus("bpe", 300);
  tokenizer::save_tokenizer(*tok, dir.path());
  const auto loaded = tokenizer::load_saved_tokenizer(dir.path());
  ASSERT_NE(loaded, nullptr);
  EXPECT_TRUE(tokenizer::same_tokenizer(*loaded, *tok));

  std::string bytes = read_file(dir / "tokenizer.model");
  bytes[bytes.size() / 2] = static_cast<char>(bytes[bytes.size() / 2] ^ 0x20);
  write_file_atomic(dir / "tokenizer.model", bytes);
  expect_error([&] { tokenizer::load_saved_tokenizer(dir.path()); },
               {"tokenizer.model", "corrupt"});
  write_file_atomic(dir / "tokenizer_meta.json", R"({"kind": "wordpiece"})");
  expect_error([&] { tokenizer::load_saved_tokenizer(dir.path()); },
               {"tokenizer_meta.json", "wordpiece"});

  // Saving the byte tokenizer over it removes the stale model file.
  tokenizer::save_tokenizer(ByteTokenizer(), dir.path());
  EXPECT_FALSE(fs::exists(dir / "tokenizer.model"));
  EXPECT_EQ(tokenizer::load_saved_tokenizer(dir.path())->kind(), "byte");
}

TEST(SentencePiece, PreparedShardsHoldDocumentsBetweenBosAndEos) {
  ScratchDir dir;
  std::string text;
  const auto lines = corpus_lines();
  for (size_t i = 0; i < 40; ++i) text += lines[i] + "\n%\n";
  write_file_atomic(dir / "corpus.txt", text);
  const auto tok = train_on_corpus("bpe", 400);
  data::PrepareOptions options;
  options.inputs = {(dir / "corpus.txt").string()};
  options.output_dir = (dir / "out").string();
  options.document_separator = "%";
  options.val_fraction = 0.1;
  options.tokenizer = tok;
  const auto summary = data::prepare_data(options);
  EXPECT_EQ(summary.documents, 40);
  const auto saved = tokenizer::load_saved_tokenizer(dir / "out");
  ASSERT_NE(saved, nullptr);
  EXPECT_TRUE(tokenizer::same_tokenizer(*saved, *tok));

  const data::TokenDataset train((dir / "out" / "train_*.bin").string(), tok->vocab_size());
  std::vector<std::string> docs;
  std::vector<int32_t> current;
  for (uint16_t t : train.tokens()) {
    if (t == 1) {
      EXPECT_TRUE(current.empty());
    } else if (t == 2) {
      docs.push_back(tok->decode(current));
      current.clear();
    } else {
      current.push_back(t);
    }
  }
  EXPECT_TRUE(current.empty());
  ASSERT_EQ(docs.size(), 36u);
  EXPECT_EQ(docs[0], lines[0] + "\n");
  EXPECT_EQ(docs[1], lines[1] + "\n");
}

// Text whose decoding ends in U+FFFD waits for the next token, and is shown at the end of
// generation when none comes: a prompt ending in it, and an output ending in it.
TEST(TextStream, HeldBackTextIsShownAtTheEnd) {
  ByteTokenizer tok;
  std::string shown;
  const auto sink = [&](std::string_view text) { shown += text; };
  const std::string prompt = "price: 5 \xEF\xBF\xBD";
  {
    tokenizer::TextStream stream(tok, tok.encode(prompt), sink);
    EXPECT_EQ(shown, "");  // held back: it may be the start of a longer character
    stream.finish();
    EXPECT_EQ(shown, prompt);
  }
  shown.clear();
  {
    // The byte tokenizer decodes bytes as they are: the text ends in U+FFFD only once all three
    // of its bytes came, and its last byte waits.
    tokenizer::TextStream stream(tok, tok.encode("ok "), sink);
    EXPECT_EQ(shown, "ok ");
    for (int32_t byte : {0xE2, 0x82, 0xAC, 0xEF, 0xBF, 0xBD}) stream.add(byte);  // "€\uFFFD"
    EXPECT_EQ(shown, "ok \xE2\x82\xAC\xEF\xBF");
    stream.add(0x01);  // more text: what waited is shown with it (a control character as '?')
    EXPECT_EQ(shown, "ok \xE2\x82\xAC\xEF\xBF\xBD?");
    stream.finish();  // nothing held back: nothing more
    EXPECT_EQ(shown, "ok \xE2\x82\xAC\xEF\xBF\xBD?");
  }
  shown.clear();
  {
    // An output ending in U+FFFD: shown at the end of generation, once.
    tokenizer::TextStream stream(tok, tok.encode("a"), sink);
    for (int32_t byte : {0xEF, 0xBF, 0xBD}) stream.add(byte);
    EXPECT_EQ(shown, "a\xEF\xBF");
    stream.finish();
    EXPECT_EQ(shown, "a\xEF\xBF\xBD");
    stream.finish();
    EXPECT_EQ(shown, "a\xEF\xBF\xBD");
  }
}
