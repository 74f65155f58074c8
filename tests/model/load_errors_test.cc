// Bad checkpoints and configs give clear errors naming the problem, never a crash.
#include <filesystem>
#include <fstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/model/fixture_util.h"
#include "worker/checkpoint/checkpoint.h"
#include "worker/model/model_factory.h"

namespace mobius::testing {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

class LoadErrorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    source_ = FixtureModelDir("qwen3next-tiny");
    dir_ = fs::path(::testing::TempDir()) /
           ("load_errors_" +
            std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    fs::copy_file(fs::path(source_) / "config.json", dir_ / "config.json");
    backend_ = kernels::CreateCpuBackend(1);
  }
  void TearDown() override { fs::remove_all(dir_); }

  absl::Status Load() {
    worker::ModelSource source;
    source.model_dir = dir_.string();
    return worker::LoadHybridModel(source, *backend_).status();
  }

  // Rewrites the fixture checkpoint into dir_, letting `edit` change the tensor list.
  void WriteEdited(const std::function<void(std::vector<worker::TensorToWrite>&)>& edit) {
    auto file = worker::SafetensorsFile::Open(source_ + "/model.safetensors");
    ASSERT_TRUE(file.ok()) << file.status();
    std::vector<worker::TensorToWrite> tensors;
    for (const auto& [name, r] : (*file)->tensors()) {
      tensors.push_back({name, r.dtype, r.shape, r.data, r.num_bytes});
    }
    edit(tensors);
    ASSERT_TRUE(worker::WriteSafetensors((dir_ / "model.safetensors").string(), tensors).ok());
    file_ = std::move(*file);  // keep the source mapping alive while tensors point into it
  }

  std::string source_;
  fs::path dir_;
  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<worker::SafetensorsFile> file_;
};

TEST_F(LoadErrorsTest, MissingSafetensors) {
  absl::Status s = Load();
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr("model.safetensors"));
}

TEST_F(LoadErrorsTest, TruncatedSafetensors) {
  const fs::path src = fs::path(source_) / "model.safetensors";
  std::ifstream in(src, std::ios::binary);
  std::vector<char> bytes(fs::file_size(src) / 2);
  in.read(bytes.data(), bytes.size());
  std::ofstream(dir_ / "model.safetensors", std::ios::binary).write(bytes.data(), bytes.size());
  absl::Status s = Load();
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr("model.safetensors"));
}

TEST_F(LoadErrorsTest, HeaderOffsetsPastEndOfFile) {
  const std::string header =
      R"({"model.embed_tokens.weight":{"dtype":"BF16","shape":[2048,128],"data_offsets":[0,524288]}})";
  std::ofstream out(dir_ / "model.safetensors", std::ios::binary);
  const uint64_t n = header.size();
  out.write(reinterpret_cast<const char*>(&n), 8);
  out << header << std::string(1000, '\0');
  out.close();
  absl::Status s = Load();
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr("model.embed_tokens.weight"));
}

TEST_F(LoadErrorsTest, WrongShapeIsNamed) {
  std::vector<uint16_t> small(64 * 128);
  WriteEdited([&](std::vector<worker::TensorToWrite>& t) {
    for (auto& x : t) {
      if (x.name == "model.layers.3.self_attn.k_proj.weight") {
        x.shape = {64, 128};
        x.data = small.data();
        x.num_bytes = small.size() * 2;
      }
    }
  });
  absl::Status s = Load();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("model.layers.3.self_attn.k_proj.weight"));
  EXPECT_THAT(s.message(), HasSubstr("[64, 128]"));
}

TEST_F(LoadErrorsTest, WrongDtypeIsNamed) {
  std::vector<int32_t> ints(128);
  WriteEdited([&](std::vector<worker::TensorToWrite>& t) {
    for (auto& x : t) {
      if (x.name == "model.norm.weight") {
        x.dtype = kernels::DType::kI32;
        x.data = ints.data();
        x.num_bytes = ints.size() * 4;
      }
    }
  });
  absl::Status s = Load();
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr("model.norm.weight"));
  EXPECT_THAT(s.message(), HasSubstr("dtype"));
}

TEST_F(LoadErrorsTest, MissingTensorIsNamed) {
  WriteEdited([](std::vector<worker::TensorToWrite>& t) {
    std::erase_if(t, [](const auto& x) { return x.name == "model.layers.5.linear_attn.A_log"; });
  });
  absl::Status s = Load();
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr("model.layers.5.linear_attn.A_log"));
}

TEST_F(LoadErrorsTest, MissingExpertOfPerExpertLayoutIsNamed) {
  WriteEdited([](std::vector<worker::TensorToWrite>& t) {
    std::erase_if(
        t, [](const auto& x) { return x.name == "model.layers.2.mlp.experts.7.up_proj.weight"; });
  });
  absl::Status s = Load();
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr("layers.2.mlp.experts"));
}

TEST_F(LoadErrorsTest, ConfigMissingRequiredFieldIsNamed) {
  nlohmann::json j = nlohmann::json::parse(std::ifstream(dir_ / "config.json"));
  j.erase("num_key_value_heads");
  std::ofstream(dir_ / "config.json") << j.dump();
  fs::copy_file(fs::path(source_) / "model.safetensors", dir_ / "model.safetensors");
  absl::Status s = Load();
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr("num_key_value_heads"));
}

TEST_F(LoadErrorsTest, ValidRewriteLoads) {
  WriteEdited([](std::vector<worker::TensorToWrite>&) {});
  EXPECT_TRUE(Load().ok());
}

}  // namespace
}  // namespace mobius::testing
