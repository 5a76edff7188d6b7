// Safetensors: a round trip through a file this test writes, dtype widening, and malformed
// files that must fail with a reason (never crash: the sanitizer builds run these too).
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "kernel_test_util.h"
#include "pdlib_kernels/model.h"
#include "pdlib_kernels/safetensors.h"
#include "pdlib_kernels/weights.h"

namespace pdlib::kernels {
namespace {

using testing::F32Blob;
using testing::PutU64;
using testing::TensorBlob;
using testing::TinyConfig;
using testing::WriteSafetensors;

// A file path unique to this test process, removed at scope exit.
class TempFile {
 public:
  explicit TempFile(const std::string& tag)
      : path_((std::filesystem::temp_directory_path() /
               ("pdlib_kernel_" + tag + "_" + std::to_string(::getpid()) + ".safetensors"))
                  .string()) {}
  ~TempFile() { std::remove(path_.c_str()); }
  const std::string& path() const { return path_; }
  void Write(const std::vector<uint8_t>& bytes) const {
    std::ofstream out(path_, std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()),
              static_cast<std::streamsize>(bytes.size()));
    REQUIRE(out.good());
  }

 private:
  std::string path_;
};

// A file whose header is exactly `json` (and `data` after it).
std::vector<uint8_t> RawFile(const std::string& json, size_t data_bytes = 0) {
  std::vector<uint8_t> out;
  PutU64(&out, json.size());
  out.insert(out.end(), json.begin(), json.end());
  out.resize(out.size() + data_bytes, 0);
  return out;
}

Status ParseStatus(std::vector<uint8_t> bytes) {
  return SafetensorsFile::Parse(std::move(bytes)).status();
}

TEST_CASE("safetensors round trip reproduces the weights and the model bit for bit") {
  for (bool tied : {false, true}) {
    ModelConfig c = TinyConfig();
    c.tie_word_embeddings = tied;
    StatusOr<ModelWeights> w = ModelWeights::Random(c, 99);
    REQUIRE(w.ok());
    TempFile file(tied ? "tied" : "untied");
    std::vector<TensorBlob> blobs = testing::BlobsOf(*w);
    blobs.push_back(F32Blob("model.rotary_emb.inv_freq", {2}, {1.0f, 2.0f}));  // extra: ignored
    file.Write(WriteSafetensors(blobs, R"({"format":"pt"})"));

    StatusOr<ModelWeights> loaded = ModelWeights::LoadSafetensors(file.path(), c);
    INFO(loaded.status().ToString());
    REQUIRE(loaded.ok());
    ModelWeights original = *w;
    std::vector<NamedTensor> a = original.Tensors(), b = loaded->Tensors();
    REQUIRE(a.size() == b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      INFO(a[i].name);
      REQUIRE(a[i].name == b[i].name);
      REQUIRE(*a[i].data == *b[i].data);
    }
    CHECK(loaded->lm_head.empty() == tied);

    RuntimeOptions o;
    o.num_pages = 8;
    o.num_threads = 1;
    auto m1 = Model::Create(*w, o), m2 = Model::Create(*loaded, o);
    REQUIRE(m1.ok());
    REQUIRE(m2.ok());
    std::vector<int32_t> tokens = testing::PromptTokens(8, 6, c.vocab_size), pages = {0, 1};
    ForwardResult r1, r2;
    REQUIRE((*m1)->Prefill({tokens, 0, pages}, testing::FullOptions(), &r1).ok());
    REQUIRE((*m2)->Prefill({tokens, 0, pages}, testing::FullOptions(), &r2).ok());
    testing::RequireSame(r1, r2);
  }
}

TEST_CASE("safetensors reads F16 and BF16 tensors as fp32 and exposes metadata") {
  TensorBlob bf16{"b", "BF16", {3}, {0x80, 0x3F, 0x00, 0xC0, 0x49, 0x40}};  // 1, -2, 3.140625
  TensorBlob f16{"h", "F16", {2, 1}, {0x00, 0x3C, 0x00, 0xB8}};             // 1, -0.5
  TensorBlob ints{"i", "I32", {1}, {1, 0, 0, 0}};
  StatusOr<SafetensorsFile> file =
      SafetensorsFile::Parse(WriteSafetensors({bf16, f16, ints}, R"({"k":"v"})"));
  INFO(file.status().ToString());
  REQUIRE(file.ok());
  CHECK(file->metadata().at("k") == "v");
  CHECK(file->tensors().size() == 3);
  CHECK(*file->ReadFloat32("b") == std::vector<float>{1.0f, -2.0f, 3.140625f});
  CHECK(*file->ReadFloat32("h") == std::vector<float>{1.0f, -0.5f});
  CHECK(file->Find("h")->shape == std::vector<int64_t>{2, 1});
  CHECK(file->ReadFloat32("i").status().code() == StatusCode::kUnimplemented);
  CHECK(file->ReadFloat32("nope").status().code() == StatusCode::kNotFound);
}

TEST_CASE("malformed safetensors files fail with a reason") {
  const std::string t = R"("t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  CHECK(ParseStatus({1, 2, 3}).code() == StatusCode::kInvalidArgument);
  CHECK(ParseStatus(RawFile("{" + t + "}", 8)).ok());
  // Header length beyond the file, and absurdly large.
  std::vector<uint8_t> truncated = RawFile("{" + t + "}", 8);
  truncated.resize(20);
  CHECK(ParseStatus(truncated).code() == StatusCode::kDataLoss);
  std::vector<uint8_t> huge;
  PutU64(&huge, ~0ull);
  CHECK(ParseStatus(huge).code() == StatusCode::kInvalidArgument);
  // Data shorter than the offsets say.
  Status s = ParseStatus(RawFile("{" + t + "}", 4));
  CHECK(s.code() == StatusCode::kDataLoss);
  CHECK(s.message().find("'t'") != std::string_view::npos);
  struct Case {
    const char* why;
    std::string json;
  };
  const std::vector<Case> cases = {
      {"not JSON", "{\"t\":"},
      {"not an object", "[1,2]"},
      {"entry not an object", R"({"t":5})"},
      {"no dtype", R"({"t":{"shape":[2],"data_offsets":[0,8]}})"},
      {"unknown dtype", R"({"t":{"dtype":"F31","shape":[2],"data_offsets":[0,8]}})"},
      {"no shape", R"({"t":{"dtype":"F32","data_offsets":[0,8]}})"},
      {"negative dim", R"({"t":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})"},
      {"fractional dim", R"({"t":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})"},
      {"overflowing shape",
       R"({"t":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})"},
      {"size mismatch", R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})"},
      {"one offset", R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[8]}})"},
      {"begin after end", R"({"t":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})"},
      {"offset overflow",
       R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[18446744073709551615,7]}})"},
      {"overlap", "{" + t + R"(,"u":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})"},
      {"duplicate", "{" + t + "," + t + "}"},
      {"metadata not strings", "{\"__metadata__\":{\"a\":1}," + t + "}"},
      {"nesting bomb", "{\"__metadata__\":" + std::string(500, '[') + "}"},
  };
  for (const Case& c : cases) {
    INFO(c.why);
    Status st = ParseStatus(RawFile(c.json, 8));
    CHECK(!st.ok());
    CHECK(!st.message().empty());
  }
  CHECK(SafetensorsFile::Open("/nonexistent/pdlib/model.safetensors").status().code() ==
        StatusCode::kNotFound);
}

TEST_CASE("the weight loader names missing and misshapen tensors") {
  ModelConfig c = TinyConfig();
  StatusOr<ModelWeights> w = ModelWeights::Random(c, 5);
  REQUIRE(w.ok());
  std::vector<TensorBlob> blobs = testing::BlobsOf(*w);
  std::vector<TensorBlob> missing(blobs.begin(), blobs.end() - 1);  // no lm_head
  StatusOr<SafetensorsFile> file = SafetensorsFile::Parse(WriteSafetensors(missing));
  REQUIRE(file.ok());
  Status s = ModelWeights::FromSafetensors(*file, c).status();
  CHECK(s.code() == StatusCode::kNotFound);
  CHECK(s.message().find("lm_head.weight") != std::string_view::npos);

  std::vector<TensorBlob> wrong = blobs;
  wrong[2].shape = {static_cast<int64_t>(c.q_width()) * c.hidden_size};  // q_proj flattened
  file = SafetensorsFile::Parse(WriteSafetensors(wrong));
  REQUIRE(file.ok());
  s = ModelWeights::FromSafetensors(*file, c).status();
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message().find("model.layers.0.self_attn.q_proj.weight") != std::string_view::npos);
}

TEST_CASE("every truncation and many corruptions of a valid file are handled") {
  ModelConfig c = TinyConfig();
  c.num_layers = 1;
  c.vocab_size = 8;
  StatusOr<ModelWeights> w = ModelWeights::Random(c, 6);
  REQUIRE(w.ok());
  const std::vector<uint8_t> good = WriteSafetensors(testing::BlobsOf(*w));
  REQUIRE(SafetensorsFile::Parse(good).ok());
  uint64_t header_len = 0;
  std::memcpy(&header_len, good.data(), 8);
  // Every truncation inside the header and a sample of those inside the data.
  for (size_t len = 0; len < good.size(); len += len < header_len + 16 ? 1 : 97) {
    std::vector<uint8_t> cut(good.begin(), good.begin() + static_cast<ptrdiff_t>(len));
    REQUIRE(!SafetensorsFile::Parse(cut).ok());
  }
  // Byte flips in the header: parse or fail, but never crash or read out of bounds.
  uint64_t x = 42;
  for (int i = 0; i < 3000; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::vector<uint8_t> bad = good;
    bad[8 + x % header_len] = static_cast<uint8_t>(x >> 32);
    StatusOr<SafetensorsFile> f = SafetensorsFile::Parse(std::move(bad));
    if (f.ok()) {
      for (const SafetensorsTensor& t : f->tensors()) f->ReadFloat32(t.name).status().IgnoreError();
      ModelWeights::FromSafetensors(*f, c).status().IgnoreError();
    }
  }
}

}  // namespace
}  // namespace pdlib::kernels
