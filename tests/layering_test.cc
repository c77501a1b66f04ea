// The layers of the source tree, checked on every #include "..." line. Bottom
// to top, and what each may include besides itself:
//
//   core                         none
//   model                        core
//   transport                    model, core
//   process                      transport, model, core
//   expert_compute               model, core
//   coordinator/agent            transport, model, core
//   gpu_worker | expert_server   every layer above, never each other
//   coordinator                  every layer above
//   client | c_api               every layer above, never each other
//
// coordinator/agent (embedded by both server layers) is the one part of
// coordinator/ that the layers below coordinator may include. include/moe/
// (the public headers) and the generated protos (moe/v1/) are includable from
// anywhere; the public headers include nothing of ours but each other.
// bench/, tests/, demo/ and python/ are outside the layers; testing/ (the
// helpers of tests, benchmarks and demos) may include the layers, and bench/
// and testing/ are never included by a layer: production libraries hold
// production code.
#include <filesystem>
#include <fstream>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"

namespace {

namespace fs = std::filesystem;

enum class Layer {
  kPublic, kProto, kCore, kModel, kTransport, kProcess, kExpertCompute, kAgent, kGpuWorker, kExpertServer,
  kCoordinator, kClient, kCApi, kTesting, kBench
};

const char* Name(Layer l) {
  switch (l) {
    case Layer::kPublic: return "include/moe (public)";
    case Layer::kProto: return "moe/v1 (protos)";
    case Layer::kCore: return "core";
    case Layer::kModel: return "model";
    case Layer::kTransport: return "transport";
    case Layer::kProcess: return "process";
    case Layer::kExpertCompute: return "expert_compute";
    case Layer::kAgent: return "coordinator/agent";
    case Layer::kGpuWorker: return "gpu_worker";
    case Layer::kExpertServer: return "expert_server";
    case Layer::kCoordinator: return "coordinator";
    case Layer::kClient: return "client";
    case Layer::kCApi: return "c_api";
    case Layer::kTesting: return "testing";
    case Layer::kBench: return "bench";
  }
  return "?";
}

bool StartsWith(const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; }

// The layer of a path relative to the source root (a source file), or of an
// include path (as written between the quotes). nullopt: not ours.
std::optional<Layer> LayerOf(const std::string& path, bool is_include) {
  if (is_include && StartsWith(path, "moe/v1/")) return Layer::kProto;
  if (is_include ? StartsWith(path, "moe/") : StartsWith(path, "include/moe/")) return Layer::kPublic;
  if (StartsWith(path, "core/")) return Layer::kCore;
  if (StartsWith(path, "model/")) return Layer::kModel;
  if (StartsWith(path, "transport/")) return Layer::kTransport;
  if (StartsWith(path, "process/")) return Layer::kProcess;
  if (StartsWith(path, "expert_compute/")) return Layer::kExpertCompute;
  if (StartsWith(path, "coordinator/agent/")) return Layer::kAgent;
  if (StartsWith(path, "gpu_worker/")) return Layer::kGpuWorker;
  if (StartsWith(path, "expert_server/")) return Layer::kExpertServer;
  if (StartsWith(path, "coordinator/")) return Layer::kCoordinator;
  if (StartsWith(path, "client/")) return Layer::kClient;
  if (StartsWith(path, "c_api/")) return Layer::kCApi;
  if (StartsWith(path, "testing/")) return Layer::kTesting;
  if (StartsWith(path, "bench/")) return Layer::kBench;
  return std::nullopt;
}

// What a layer may include (besides itself).
std::vector<Layer> Allowed(Layer from) {
  using L = Layer;
  // What the server layers, coordinator, the top layers and testing may include.
  const std::vector<Layer> servers = {L::kPublic,    L::kProto,   L::kCore,          L::kModel,
                                      L::kTransport, L::kProcess, L::kExpertCompute, L::kAgent};
  std::vector<Layer> below_coordinator = servers;
  below_coordinator.insert(below_coordinator.end(), {L::kGpuWorker, L::kExpertServer});
  std::vector<Layer> below_top = below_coordinator;
  below_top.push_back(L::kCoordinator);
  std::vector<Layer> production = below_top;
  production.insert(production.end(), {L::kClient, L::kCApi});
  switch (from) {
    case L::kPublic: return {};
    case L::kProto: return {};
    case L::kCore: return {L::kPublic, L::kProto};
    case L::kModel: return {L::kPublic, L::kProto, L::kCore};
    case L::kTransport: return {L::kPublic, L::kProto, L::kCore, L::kModel};
    case L::kProcess: return {L::kPublic, L::kProto, L::kCore, L::kModel, L::kTransport};
    case L::kExpertCompute: return {L::kPublic, L::kProto, L::kCore, L::kModel};
    case L::kAgent: return {L::kPublic, L::kProto, L::kCore, L::kModel, L::kTransport};
    case L::kGpuWorker:
    case L::kExpertServer: return servers;
    case L::kCoordinator: return below_coordinator;
    case L::kClient:
    case L::kCApi: return below_top;
    case L::kTesting: return production;  // the helpers: any layer, never the benchmarks
    case L::kBench: {                     // outside the layers: anything (not scanned)
      std::vector<Layer> all = production;
      all.push_back(L::kTesting);
      return all;
    }
  }
  return {};
}

// An error naming the line when `file` (relative to the source root) may not
// include `included`; nullopt when it may (or either is not ours).
std::optional<std::string> CheckInclude(const std::string& file, int line, const std::string& included) {
  const std::optional<Layer> from = LayerOf(file, false);
  const std::optional<Layer> to = LayerOf(included, true);
  if (!from || !to || *from == *to) return std::nullopt;
  for (Layer ok : Allowed(*from))
    if (ok == *to) return std::nullopt;
  return absl::StrCat(file, ":", line, ": #include \"", included, "\": ", Name(*from), " may not include ",
                      Name(*to));
}

std::vector<std::string> CheckTree(const fs::path& root, int* files_checked) {
  static const std::regex kInclude(R"(^\s*#\s*include\s*"([^"]+)\")");
  std::vector<std::string> errors;
  *files_checked = 0;
  for (const char* top :
       {"include", "core", "model", "transport", "process", "expert_compute", "gpu_worker", "expert_server",
        "coordinator", "client", "c_api", "testing"}) {
    if (!fs::exists(root / top)) {
      errors.push_back(absl::StrCat("missing layer folder ", top));
      continue;
    }
    for (const fs::directory_entry& e : fs::recursive_directory_iterator(root / top)) {
      const std::string ext = e.path().extension().string();
      if (!e.is_regular_file() || (ext != ".h" && ext != ".cc" && ext != ".cu" && ext != ".cuh" && ext != ".c"))
        continue;
      ++*files_checked;
      const std::string rel = fs::relative(e.path(), root).generic_string();
      std::ifstream in(e.path());
      std::string text;
      std::smatch m;
      for (int n = 1; std::getline(in, text); ++n)
        if (std::regex_search(text, m, kInclude))
          if (std::optional<std::string> err = CheckInclude(rel, n, m[1].str())) errors.push_back(*err);
    }
  }
  return errors;
}

TEST(Layering, RulesRefuseUpwardAndCrossIncludes) {
  // The checker itself: it must refuse what the layering forbids...
  EXPECT_TRUE(CheckInclude("core/tensor.h", 3, "gpu_worker/expert_cache.h").has_value());
  EXPECT_TRUE(CheckInclude("expert_compute/moe_executor.cc", 1, "expert_server/expert_service.h").has_value());
  EXPECT_TRUE(CheckInclude("gpu_worker/host_memory_backend.cc", 1, "expert_server/expert_service.h").has_value());
  EXPECT_TRUE(CheckInclude("expert_server/main.cc", 1, "gpu_worker/layer_dispatcher.h").has_value());
  EXPECT_TRUE(CheckInclude("gpu_worker/worker_main.cc", 1, "coordinator/placement.h").has_value());
  EXPECT_TRUE(CheckInclude("coordinator/agent/coordinator_agent.cc", 1, "expert_compute/expert_kernel.h").has_value());
  EXPECT_TRUE(CheckInclude("coordinator/placement.cc", 1, "client/expert_client.h").has_value());
  EXPECT_TRUE(CheckInclude("include/moe/engine.h", 1, "core/bf16.h").has_value());
  EXPECT_TRUE(CheckInclude("core/flags.cc", 1, "model/routing.h").has_value());
  EXPECT_TRUE(CheckInclude("model/model_source.cc", 1, "transport/wire.h").has_value());
  EXPECT_TRUE(CheckInclude("transport/grpc_channel.cc", 1, "process/service_main.h").has_value());
  EXPECT_TRUE(CheckInclude("expert_compute/moe_executor.cc", 1, "transport/transport.h").has_value());
  EXPECT_TRUE(CheckInclude("process/service_main.cc", 1, "expert_compute/expert_kernel.h").has_value());
  EXPECT_TRUE(CheckInclude("coordinator/agent/coordinator_agent.cc", 1, "process/service_main.h").has_value());
  EXPECT_TRUE(CheckInclude("c_api/moe_c_api.cc", 1, "client/worker_client.h").has_value());
  EXPECT_TRUE(CheckInclude("client/moectl_main.cc", 1, "c_api/moe_c_api.h").has_value());
  // Production code never includes the test helpers or the bench model.
  EXPECT_TRUE(CheckInclude("model/model_source.cc", 1, "testing/random_data.h").has_value());
  EXPECT_TRUE(CheckInclude("gpu_worker/layer_dispatcher.cc", 1, "bench/model/attention.h").has_value());
  EXPECT_TRUE(CheckInclude("c_api/moe_c_api.cc", 1, "testing/subprocess.h").has_value());
  EXPECT_TRUE(CheckInclude("testing/random_data.cc", 1, "bench/model/step_time_model.h").has_value());
  // ...naming the file, the line and both layers...
  EXPECT_EQ(*CheckInclude("core/tensor.h", 3, "gpu_worker/expert_cache.h"),
            "core/tensor.h:3: #include \"gpu_worker/expert_cache.h\": core may not include gpu_worker");
  // ...and allow what it permits.
  EXPECT_FALSE(CheckInclude("gpu_worker/host_memory_backend.cc", 1, "expert_compute/moe_executor.h").has_value());
  EXPECT_FALSE(CheckInclude("gpu_worker/worker_main.cc", 1, "coordinator/agent/coordinator_agent.h").has_value());
  EXPECT_FALSE(CheckInclude("expert_server/main.cc", 1, "coordinator/agent/coordinator_agent.h").has_value());
  EXPECT_FALSE(CheckInclude("core/bf16.h", 1, "moe/types.h").has_value());
  EXPECT_FALSE(CheckInclude("model/routing.h", 1, "core/bf16.h").has_value());
  EXPECT_FALSE(CheckInclude("transport/transport.h", 1, "model/moe_batch.h").has_value());
  EXPECT_FALSE(CheckInclude("process/service_main.cc", 1, "transport/grpc_channel.h").has_value());
  EXPECT_FALSE(CheckInclude("expert_compute/expert_store.cc", 1, "model/model_source.h").has_value());
  EXPECT_FALSE(CheckInclude("coordinator/agent/coordinator_agent.cc", 1, "transport/wire.h").has_value());
  EXPECT_FALSE(CheckInclude("expert_server/expert_server.cc", 1, "process/service_main.h").has_value());
  EXPECT_FALSE(CheckInclude("coordinator/main.cc", 1, "process/service_main.h").has_value());
  EXPECT_FALSE(CheckInclude("transport/wire.h", 1, "moe/v1/expert.pb.h").has_value());
  EXPECT_FALSE(CheckInclude("c_api/moe_c_api.cc", 1, "gpu_worker/device_backend.h").has_value());
  EXPECT_FALSE(CheckInclude("coordinator/coordinator.cc", 1, "coordinator/agent/coordinator_agent.h").has_value());
  EXPECT_FALSE(CheckInclude("tests/x.cc", 1, "client/expert_client.h").has_value());
  EXPECT_FALSE(CheckInclude("demo/demo_main.cc", 1, "testing/routing_trace.h").has_value());
  EXPECT_FALSE(CheckInclude("bench/moe_layer.cc", 1, "testing/subprocess.h").has_value());
  EXPECT_FALSE(CheckInclude("testing/routing_trace.cc", 1, "core/status_macros.h").has_value());
  EXPECT_FALSE(CheckInclude("core/x.cc", 1, "absl/status/status.h").has_value());
}

TEST(Layering, EveryIncludeInTheTreeFollowsTheLayers) {
  int files = 0;
  const std::vector<std::string> errors = CheckTree(MOE_SOURCE_DIR, &files);
  EXPECT_GT(files, 100) << "the scan found too few sources under " << MOE_SOURCE_DIR;
  EXPECT_TRUE(errors.empty()) << errors.size() << " include(s) break the layering:\n" << absl::StrJoin(errors, "\n");
}

}  // namespace
