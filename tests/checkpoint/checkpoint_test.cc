#include <stdlib.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/dtype.h"
#include "nlohmann/json.hpp"
#include "worker/checkpoint/checkpoint.h"

namespace mobius::worker {
namespace {

namespace fs = std::filesystem;
using kernels::DType;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

const std::string kFixtureDir = std::string(MOBIUS_FIXTURES_DIR) + "/qwen3next-tiny";

std::vector<uint16_t> ToBF16(const std::vector<float>& values) {
  std::vector<uint16_t> out;
  for (float v : values) out.push_back(kernels::FloatToBF16(v));
  return out;
}

std::vector<float> ToFloat(const TensorRecord& record) {
  std::vector<float> out(record.num_elements());
  ConvertToFloat(record, out.data());
  return out;
}

std::string ReadFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void WriteFile(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

std::string LengthPrefix(uint64_t n) {
  std::string prefix(8, '\0');
  for (int i = 0; i < 8; ++i) prefix[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return prefix;
}

// A hand-made safetensors file: the header text verbatim, then `data_bytes` zero bytes.
std::string RawSafetensors(const std::string& header, size_t data_bytes) {
  return LengthPrefix(header.size()) + header + std::string(data_bytes, '\0');
}

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::path(::testing::TempDir()) / "checkpoint_test.XXXXXX").string();
    ASSERT_NE(mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  std::string Path(const std::string& name) const { return (dir_ / name).string(); }

  // Opens a file holding `header` (as raw text) and `data_bytes` of data; expects an error.
  absl::Status OpenRaw(const std::string& header, size_t data_bytes) {
    WriteFile(Path("model.safetensors"), RawSafetensors(header, data_bytes));
    auto file = SafetensorsFile::Open(Path("model.safetensors"));
    EXPECT_FALSE(file.ok()) << "header accepted: " << header;
    return file.status();
  }

  fs::path dir_;
};

TEST_F(CheckpointTest, RoundTripBF16F16F32WithMetadata) {
  const std::vector<float> bf16_values = {1.0f, -2.5f, 0.15625f, 1024.0f, -0.0f, 3.0f};
  const std::vector<uint16_t> bf16 = ToBF16(bf16_values);
  // 1.0, -2.0, 0.5, 65504 (max half), smallest subnormal 2^-24.
  const std::vector<uint16_t> f16 = {0x3c00, 0xc000, 0x3800, 0x7bff, 0x0001};
  const std::vector<float> f32 = {3.25f, -1e-3f, 7.0f, 1e30f};
  const std::vector<int32_t> i32 = {-7, 0, 123456};
  ASSERT_TRUE(WriteSafetensors(Path("model.safetensors"),
                               {{"b.bf16", DType::kBF16, {2, 3}, bf16.data(), 12},
                                {"a.f16", DType::kF16, {5}, f16.data(), 10},
                                {"c.f32", DType::kF32, {2, 1, 2}, f32.data(), 16},
                                {"d.i32", DType::kI32, {3}, i32.data(), 12}},
                               {{"format", "pt"}, {"note", "round trip"}})
                  .ok());

  auto file = SafetensorsFile::Open(Path("model.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status();
  const auto& tensors = (*file)->tensors();
  ASSERT_EQ(tensors.size(), 4u);
  EXPECT_EQ((*file)->metadata(),
            (std::map<std::string, std::string>{{"format", "pt"}, {"note", "round trip"}}));

  const TensorRecord& b = tensors.at("b.bf16");
  EXPECT_EQ(b.dtype, DType::kBF16);
  EXPECT_THAT(b.shape, ElementsAre(2, 3));
  EXPECT_EQ(b.num_elements(), 6);
  EXPECT_EQ(b.num_bytes, 12u);
  EXPECT_EQ(b.file, Path("model.safetensors"));
  EXPECT_EQ(ToFloat(b), bf16_values);

  const TensorRecord& a = tensors.at("a.f16");
  EXPECT_EQ(a.dtype, DType::kF16);
  EXPECT_THAT(ToFloat(a), ElementsAre(1.0f, -2.0f, 0.5f, 65504.0f, 0x1p-24f));

  const TensorRecord& c = tensors.at("c.f32");
  EXPECT_EQ(c.dtype, DType::kF32);
  EXPECT_THAT(c.shape, ElementsAre(2, 1, 2));
  EXPECT_EQ(ToFloat(c), f32);

  const TensorRecord& d = tensors.at("d.i32");
  EXPECT_EQ(d.dtype, DType::kI32);
  EXPECT_EQ(std::memcmp(d.data, i32.data(), 12), 0);
  EXPECT_THAT(ToFloat(d), ElementsAre(-7.0f, 0.0f, 123456.0f));
}

TEST_F(CheckpointTest, WriterPadsHeaderToEightBytesAndKeepsGivenOrder) {
  const uint16_t one = 0x3f80;
  const float f = 2.0f;
  ASSERT_TRUE(WriteSafetensors(Path("x.safetensors"),
                               {{"z", DType::kBF16, {1}, &one, 2}, {"a", DType::kF32, {1}, &f, 4}})
                  .ok());
  const std::string bytes = ReadFile(Path("x.safetensors"));
  ASSERT_GE(bytes.size(), 8u);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(bytes[i]);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(bytes.size(), 8 + n + 6);
  const std::string header = bytes.substr(8, n);
  EXPECT_LT(header.find("\"z\""), header.find("\"a\"")) << header;
  // Padding is spaces, after the JSON.
  EXPECT_EQ(header.find_last_not_of(' '), header.find_last_of('}'));
  const auto json = nlohmann::json::parse(header);
  EXPECT_EQ(json["a"]["data_offsets"], nlohmann::json({2, 6}));
  // No temporary file left behind.
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), 1);
}

TEST_F(CheckpointTest, ConvertsUnalignedF32Data) {
  // One BF16 element first puts the F32 tensor at an odd-of-four address in the mapping.
  const uint16_t pad = 0;
  const std::vector<float> values = {1.5f, -3.0f, 100.25f};
  ASSERT_TRUE(
      WriteSafetensors(Path("model.safetensors"), {{"pad", DType::kBF16, {1}, &pad, 2},
                                                   {"values", DType::kF32, {3}, values.data(), 12}})
          .ok());
  auto file = SafetensorsFile::Open(Path("model.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status();
  const TensorRecord& record = (*file)->tensors().at("values");
  EXPECT_NE(reinterpret_cast<uintptr_t>(record.data) % 4, 0u);
  EXPECT_EQ(ToFloat(record), values);
}

TEST_F(CheckpointTest, EmptyTensorsAreAllowedAndDoNotOverlap) {
  const float f = 1.0f;
  ASSERT_TRUE(
      WriteSafetensors(Path("model.safetensors"), {{"empty", DType::kF32, {0, 4}, nullptr, 0},
                                                   {"one", DType::kF32, {1}, &f, 4},
                                                   {"empty2", DType::kBF16, {3, 0}, nullptr, 0}})
          .ok());
  auto file = SafetensorsFile::Open(Path("model.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->tensors().at("empty").num_elements(), 0);
  EXPECT_EQ((*file)->tensors().at("empty2").num_bytes, 0u);
}

TEST_F(CheckpointTest, ReadsFixture) {
  auto file = SafetensorsFile::Open(kFixtureDir + "/model.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  const auto& tensors = (*file)->tensors();
  ASSERT_TRUE(tensors.contains("model.embed_tokens.weight"));
  const TensorRecord& embed = tensors.at("model.embed_tokens.weight");
  EXPECT_EQ(embed.dtype, DType::kBF16);
  EXPECT_THAT(embed.shape, ElementsAre(2048, 128));
  EXPECT_EQ(embed.num_bytes, 2048u * 128u * 2u);
  EXPECT_EQ((*file)->metadata().at("format"), "pt");

  const std::vector<float> values = ToFloat(embed);
  bool any_nonzero = false;
  for (float v : values) {
    ASSERT_TRUE(std::isfinite(v));
    any_nonzero |= v != 0.0f;
  }
  EXPECT_TRUE(any_nonzero);

  auto checkpoint = Checkpoint::Open(kFixtureDir);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  EXPECT_EQ((*checkpoint)->Names().size(), tensors.size());
  size_t total = 0;
  for (const auto& [name, record] : tensors) total += record.num_bytes;
  EXPECT_EQ((*checkpoint)->total_bytes(), total);
  auto got = (*checkpoint)->Get("model.embed_tokens.weight");
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(ToFloat(**got), values);
}

TEST_F(CheckpointTest, MissingFileIsNotFound) {
  auto file = SafetensorsFile::Open(Path("absent.safetensors"));
  EXPECT_EQ(file.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(file.status().ToString(), HasSubstr("absent.safetensors"));
}

TEST_F(CheckpointTest, EmptyFile) {
  WriteFile(Path("model.safetensors"), "");
  auto file = SafetensorsFile::Open(Path("model.safetensors"));
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(file.status().ToString(),
              AllOf(HasSubstr(Path("model.safetensors")), HasSubstr("empty")));
}

TEST_F(CheckpointTest, FileShorterThanLengthPrefix) {
  WriteFile(Path("model.safetensors"), "abc");
  auto file = SafetensorsFile::Open(Path("model.safetensors"));
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(file.status().ToString(), HasSubstr("3 bytes"));
}

TEST_F(CheckpointTest, TruncatedFixture) {
  const std::string bytes = ReadFile(kFixtureDir + "/model.safetensors");
  ASSERT_GT(bytes.size(), 1000u);
  WriteFile(Path("model.safetensors"), bytes.substr(0, bytes.size() / 2));
  auto file = SafetensorsFile::Open(Path("model.safetensors"));
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(file.status().ToString(),
              AllOf(HasSubstr("tensor \""), HasSubstr("data_offsets end"),
                    HasSubstr("runs past the data section"), HasSubstr("truncated")));
}

TEST_F(CheckpointTest, HeaderLengthPastEnd) {
  WriteFile(Path("model.safetensors"), LengthPrefix(1000) + "{}");
  auto file = SafetensorsFile::Open(Path("model.safetensors"));
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(file.status().ToString(),
              AllOf(HasSubstr("header length 1000"), HasSubstr("2 bytes")));
}

TEST_F(CheckpointTest, HugeHeaderLengthDoesNotCrash) {
  for (uint64_t n : {uint64_t{1} << 63, ~uint64_t{0}}) {
    WriteFile(Path("model.safetensors"), LengthPrefix(n) + "{}");
    auto file = SafetensorsFile::Open(Path("model.safetensors"));
    EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(file.status().ToString(), HasSubstr(std::to_string(n)));
  }
}

TEST_F(CheckpointTest, InvalidJson) {
  const absl::Status status = OpenRaw(R"({"a": {"dtype": "F32", )", 0);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.ToString(), AllOf(HasSubstr("header"), HasSubstr("not valid JSON")));
}

TEST_F(CheckpointTest, HeaderNotAnObject) {
  EXPECT_THAT(OpenRaw("[1, 2]", 0).ToString(), HasSubstr("expected an object"));
}

TEST_F(CheckpointTest, EntryNotAnObject) {
  EXPECT_THAT(OpenRaw(R"({"w": [1, 2]})", 0).ToString(),
              AllOf(HasSubstr("tensor \"w\""), HasSubstr("expected an object")));
}

TEST_F(CheckpointTest, DuplicateTensorKey) {
  const std::string entry = R"({"dtype": "F32", "shape": [1], "data_offsets": [0, 4]})";
  EXPECT_THAT(OpenRaw("{\"w\": " + entry + ", \"w\": " + entry + "}", 4).ToString(),
              HasSubstr("duplicate key \"w\""));
}

TEST_F(CheckpointTest, MissingField) {
  EXPECT_THAT(OpenRaw(R"({"w": {"dtype": "F32", "shape": [1]}})", 4).ToString(),
              AllOf(HasSubstr("tensor \"w\""), HasSubstr("data_offsets")));
}

TEST_F(CheckpointTest, OffsetsPastEnd) {
  const absl::Status status =
      OpenRaw(R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", 12);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.ToString(), AllOf(HasSubstr("model.safetensors: tensor \"w\""),
                                       HasSubstr("data_offsets end 16"), HasSubstr("(12 bytes)")));
}

TEST_F(CheckpointTest, OffsetsBeginAfterEnd) {
  EXPECT_THAT(
      OpenRaw(R"({"w": {"dtype": "F32", "shape": [0], "data_offsets": [8, 4]}})", 8).ToString(),
      AllOf(HasSubstr("tensor \"w\""), HasSubstr("begin 8 is after end 4")));
}

TEST_F(CheckpointTest, OffsetsNotTwoNonNegativeIntegers) {
  for (const char* offsets : {"[0]", "[0, 4, 8]", "[-4, 0]", "[0, 4.5]", "\"0-4\""}) {
    const std::string header =
        std::string(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": )") + offsets + "}}";
    EXPECT_THAT(OpenRaw(header, 8).ToString(),
                AllOf(HasSubstr("tensor \"w\""), HasSubstr("data_offsets"),
                      HasSubstr("two non-negative integers")))
        << offsets;
  }
}

TEST_F(CheckpointTest, OverlappingTensors) {
  const absl::Status status = OpenRaw(
      R"({"first": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
          "second": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
      12);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.ToString(),
              AllOf(HasSubstr("\"second\""), HasSubstr("\"first\""), HasSubstr("overlap")));
}

TEST_F(CheckpointTest, ShapeByteSizeMismatch) {
  const absl::Status status =
      OpenRaw(R"({"w": {"dtype": "BF16", "shape": [3, 4], "data_offsets": [0, 20]}})", 20);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.ToString(), AllOf(HasSubstr("tensor \"w\""), HasSubstr("span 20 bytes"),
                                       HasSubstr("[3,4]"), HasSubstr("needs 24 bytes")));
}

TEST_F(CheckpointTest, UnknownDtype) {
  const absl::Status status =
      OpenRaw(R"({"w": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}})", 8);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.ToString(),
              AllOf(HasSubstr("tensor \"w\""), HasSubstr("unknown dtype \"F64\"")));
}

TEST_F(CheckpointTest, NegativeDim) {
  const absl::Status status =
      OpenRaw(R"({"w": {"dtype": "F32", "shape": [2, -3], "data_offsets": [0, 0]}})", 0);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.ToString(),
              AllOf(HasSubstr("tensor \"w\""), HasSubstr("shape"), HasSubstr("dim 1 is -3")));
}

TEST_F(CheckpointTest, NonIntegerShape) {
  EXPECT_THAT(
      OpenRaw(R"({"w": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 0]}})", 0).ToString(),
      AllOf(HasSubstr("tensor \"w\""), HasSubstr("dim 0 is 2.5")));
  EXPECT_THAT(
      OpenRaw(R"({"w": {"dtype": "F32", "shape": 4, "data_offsets": [0, 16]}})", 16).ToString(),
      AllOf(HasSubstr("tensor \"w\""), HasSubstr("not a list of integers")));
}

TEST_F(CheckpointTest, ShapeProductOverflow) {
  // 2^32 * 2^32 * 4 bytes wraps a 64-bit count to 0, matching the empty byte range.
  const absl::Status status = OpenRaw(
      R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 0]}})", 0);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.ToString(), AllOf(HasSubstr("tensor \"w\""), HasSubstr("overflows")));
}

TEST_F(CheckpointTest, MetadataMustBeStrings) {
  EXPECT_THAT(OpenRaw(R"({"__metadata__": {"epoch": 3}})", 0).ToString(),
              AllOf(HasSubstr("__metadata__"), HasSubstr("\"epoch\""), HasSubstr("string")));
}

TEST_F(CheckpointTest, WriterRejectsByteSizeMismatchAndLeavesNoFile) {
  const std::vector<uint16_t> data(5);
  const absl::Status status =
      WriteSafetensors(Path("model.safetensors"), {{"w", DType::kBF16, {2, 3}, data.data(), 10}});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.ToString(), AllOf(HasSubstr("tensor \"w\""), HasSubstr("num_bytes 10"),
                                       HasSubstr("needs 12 bytes")));
  EXPECT_TRUE(fs::is_empty(dir_));
}

TEST_F(CheckpointTest, WriterRejectsDuplicateNamesAndNegativeDims) {
  const float f = 0;
  EXPECT_THAT(WriteSafetensors(Path("a.safetensors"),
                               {{"w", DType::kF32, {1}, &f, 4}, {"w", DType::kF32, {1}, &f, 4}})
                  .ToString(),
              HasSubstr("written twice"));
  EXPECT_THAT(WriteSafetensors(Path("b.safetensors"), {{"w", DType::kF32, {-1}, &f, 4}}).ToString(),
              HasSubstr("negative"));
  EXPECT_TRUE(fs::is_empty(dir_));
}

TEST_F(CheckpointTest, WriterReportsUnwritableDirectory) {
  const float f = 0;
  const absl::Status status =
      WriteSafetensors(Path("no/such/dir/model.safetensors"), {{"w", DType::kF32, {1}, &f, 4}});
  EXPECT_FALSE(status.ok());
  EXPECT_THAT(status.ToString(), HasSubstr("no/such/dir/model.safetensors"));
}

TEST_F(CheckpointTest, OpenSingleFileCheckpoint) {
  const std::vector<float> x = {1, 2, 3, 4};
  ASSERT_TRUE(WriteSafetensors(
                  Path("model.safetensors"),
                  {{"z", DType::kF32, {4}, x.data(), 16}, {"a", DType::kF32, {2, 2}, x.data(), 16}})
                  .ok());
  auto checkpoint = Checkpoint::Open(dir_.string());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  EXPECT_THAT((*checkpoint)->Names(), ElementsAre("a", "z"));
  EXPECT_EQ((*checkpoint)->total_bytes(), 32u);
  EXPECT_EQ((*checkpoint)->dir(), dir_.string());
  ASSERT_NE((*checkpoint)->Find("a"), nullptr);
  EXPECT_THAT((*checkpoint)->Find("a")->shape, ElementsAre(2, 2));
  EXPECT_EQ((*checkpoint)->Find("b"), nullptr);
  auto missing = (*checkpoint)->Get("b");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().ToString(), AllOf(HasSubstr("\"b\""), HasSubstr(dir_.string())));
}

TEST_F(CheckpointTest, MissingDirectory) {
  auto checkpoint = Checkpoint::Open(Path("nowhere"));
  EXPECT_EQ(checkpoint.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(checkpoint.status().ToString(), HasSubstr("nowhere"));
}

TEST_F(CheckpointTest, DirectoryWithoutCheckpointFiles) {
  auto checkpoint = Checkpoint::Open(dir_.string());
  EXPECT_EQ(checkpoint.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(checkpoint.status().ToString(),
              AllOf(HasSubstr("model.safetensors"), HasSubstr("model.safetensors.index.json")));
}

TEST_F(CheckpointTest, CorruptFileFailsCheckpointOpen) {
  WriteFile(Path("model.safetensors"), "");
  auto checkpoint = Checkpoint::Open(dir_.string());
  EXPECT_EQ(checkpoint.status().code(), absl::StatusCode::kInvalidArgument);
}

class ShardedCheckpointTest : public CheckpointTest {
 protected:
  // Two shards: a, b in shard 1; c and an unlisted "extra" in shard 2.
  void WriteShards() {
    ASSERT_TRUE(WriteSafetensors(
                    Path("model-00001-of-00002.safetensors"),
                    {{"a", DType::kF32, {2}, a_.data(), 8}, {"b", DType::kF32, {1}, b_.data(), 4}})
                    .ok());
    ASSERT_TRUE(WriteSafetensors(Path("model-00002-of-00002.safetensors"),
                                 {{"c", DType::kF32, {3}, c_.data(), 12},
                                  {"extra", DType::kF32, {1}, b_.data(), 4}})
                    .ok());
  }
  void WriteIndex(const nlohmann::json& weight_map) {
    WriteFile(
        Path("model.safetensors.index.json"),
        nlohmann::json{{"metadata", {{"total_size", 28}}}, {"weight_map", weight_map}}.dump());
  }
  nlohmann::json GoodMap() const {
    return {{"a", "model-00001-of-00002.safetensors"},
            {"b", "model-00001-of-00002.safetensors"},
            {"c", "model-00002-of-00002.safetensors"}};
  }

  std::vector<float> a_ = {1, 2}, b_ = {3}, c_ = {4, 5, 6};
};

TEST_F(ShardedCheckpointTest, OpensAllShardsIncludingUnlistedTensors) {
  WriteShards();
  WriteIndex(GoodMap());
  auto checkpoint = Checkpoint::Open(dir_.string());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  EXPECT_THAT((*checkpoint)->Names(), ElementsAre("a", "b", "c", "extra"));
  EXPECT_EQ((*checkpoint)->total_bytes(), 28u);
  auto c = (*checkpoint)->Get("c");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(ToFloat(**c), c_);
  EXPECT_EQ((*c)->file, Path("model-00002-of-00002.safetensors"));
  EXPECT_EQ(ToFloat(*(*checkpoint)->Find("a")), a_);
}

TEST_F(ShardedCheckpointTest, IndexPointingToMissingShard) {
  WriteShards();
  nlohmann::json map = GoodMap();
  map["d"] = "model-00003-of-00003.safetensors";
  WriteIndex(map);
  auto checkpoint = Checkpoint::Open(dir_.string());
  EXPECT_EQ(checkpoint.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(checkpoint.status().ToString(),
              AllOf(HasSubstr("model-00003-of-00003.safetensors"), HasSubstr("\"d\"")));
}

TEST_F(ShardedCheckpointTest, TensorMissingFromItsShard) {
  WriteShards();
  nlohmann::json map = GoodMap();
  map["ghost"] = "model-00001-of-00002.safetensors";
  WriteIndex(map);
  auto checkpoint = Checkpoint::Open(dir_.string());
  EXPECT_EQ(checkpoint.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(checkpoint.status().ToString(),
              AllOf(HasSubstr("\"ghost\""), HasSubstr("model-00001-of-00002.safetensors"),
                    HasSubstr("does not hold it")));
}

TEST_F(ShardedCheckpointTest, TensorInTheOtherShard) {
  WriteShards();
  nlohmann::json map = GoodMap();
  map["c"] = "model-00001-of-00002.safetensors";
  map["extra"] = "model-00002-of-00002.safetensors";
  WriteIndex(map);
  auto checkpoint = Checkpoint::Open(dir_.string());
  EXPECT_EQ(checkpoint.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(checkpoint.status().ToString(),
              AllOf(HasSubstr("\"c\""), HasSubstr("model-00002-of-00002.safetensors")));
}

TEST_F(ShardedCheckpointTest, TensorInTwoShards) {
  WriteShards();
  ASSERT_TRUE(WriteSafetensors(
                  Path("model-00002-of-00002.safetensors"),
                  {{"c", DType::kF32, {3}, c_.data(), 12}, {"a", DType::kF32, {2}, a_.data(), 8}})
                  .ok());
  WriteIndex(GoodMap());
  auto checkpoint = Checkpoint::Open(dir_.string());
  EXPECT_EQ(checkpoint.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(checkpoint.status().ToString(),
              AllOf(HasSubstr("\"a\""), HasSubstr("model-00001-of-00002.safetensors"),
                    HasSubstr("model-00002-of-00002.safetensors")));
}

TEST_F(ShardedCheckpointTest, CorruptShardIsReported) {
  WriteShards();
  WriteFile(Path("model-00002-of-00002.safetensors"), "short");
  WriteIndex(GoodMap());
  auto checkpoint = Checkpoint::Open(dir_.string());
  EXPECT_EQ(checkpoint.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(checkpoint.status().ToString(), HasSubstr("model-00002-of-00002.safetensors"));
}

TEST_F(ShardedCheckpointTest, MalformedIndex) {
  WriteShards();
  WriteFile(Path("model.safetensors.index.json"), R"({"weight_map": )");
  EXPECT_THAT(Checkpoint::Open(dir_.string()).status().ToString(),
              AllOf(HasSubstr("model.safetensors.index.json"), HasSubstr("not valid JSON")));
  WriteFile(Path("model.safetensors.index.json"), R"({"metadata": {}})");
  EXPECT_THAT(Checkpoint::Open(dir_.string()).status().ToString(), HasSubstr("weight_map"));
  WriteIndex({{"a", 7}});
  EXPECT_THAT(Checkpoint::Open(dir_.string()).status().ToString(),
              AllOf(HasSubstr("\"a\""), HasSubstr("shard file name")));
}

TEST_F(ShardedCheckpointTest, ShardNameOutsideDirectoryIsRejected) {
  WriteShards();
  nlohmann::json map = GoodMap();
  map["a"] = "../model-00001-of-00002.safetensors";
  WriteIndex(map);
  auto checkpoint = Checkpoint::Open(dir_.string());
  EXPECT_EQ(checkpoint.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(checkpoint.status().ToString(), HasSubstr("\"a\""));
}

}  // namespace
}  // namespace mobius::worker
