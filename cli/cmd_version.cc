// sparkctl version [--short]
#include "cli/cmd_version.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <ostream>

#include "cli/args.h"
#include "core/strings.h"
#include "spark/version.h"

namespace spark::cli {

VersionReport collect_version(bool probe, const env::GpuProbeOptions& opts) {
  VersionReport r;
  r.sparkctl = kVersion;
  r.built_with_cuda = kBuiltWithCuda;
  r.cuda_runtime = kCudaRuntime;
  r.cuda_architectures = kCudaArchitectures;
  if (probe) {
    r.gpu = env::probe_gpu(opts);
    r.probed = true;
    r.engine_device = engine_device_for(r);
  }
  return r;
}

std::string engine_device_for(const VersionReport& r) {
  if (!r.built_with_cuda) return "cpu: built without CUDA";
  if (!r.gpu.has_gpu())
    return "cpu: " +
           (r.gpu.driver_reason.empty() ? std::string("no usable GPU") : r.gpu.driver_reason);
  const auto& d = r.gpu.devices.front();
  const std::string sm = std::to_string(d.cc_major * 10 + d.cc_minor);
  bool built = false;
  for (const auto& a : split_list(r.cuda_architectures, ','))
    if (a == sm || a == sm + "a") built = true;
  if (!built)
    return fmt::format(
        "cpu: GPU {} ({}) is sm_{}, this build has kernels for sm_{} only "
        "(DEVICE=cuda fails at start; rebuild with CMAKE_CUDA_ARCHITECTURES "
        "including {})",
        d.index, d.name, sm, join(split_list(r.cuda_architectures, ','), ", sm_"), sm);
  // WEIGHTS_PLACEMENT=auto: read in place where the GPU's memory is the host's.
  return fmt::format("cuda: GPU {} ({}, sm_{}); weights {}", d.index, d.name, sm,
                     d.integrated ? "host-mapped (unified memory)" : "in device memory");
}

nlohmann::json to_json(const VersionReport& r) {
  nlohmann::json j = {{"sparkctl", r.sparkctl},
                      {"build",
                       {{"cuda", r.built_with_cuda},
                        {"cuda_runtime", r.cuda_runtime},
                        {"cuda_architectures", r.cuda_architectures}}}};
  if (r.probed) {
    j["gpu"] = env::to_json(r.gpu);
    j["engine_device"] = r.engine_device;
  }
  return j;
}

void print_version(std::ostream& out, const VersionReport& r, int verbose) {
  out << "sparkctl " << r.sparkctl << "\n";
  if (r.built_with_cuda)
    out << fmt::format("build: CUDA runtime {} (static), kernels for sm_{}\n", r.cuda_runtime,
                       join(split_list(r.cuda_architectures, ','), ", sm_"));
  else
    out << "build: without CUDA (CPU path only)\n";
  if (!r.probed) return;
  const auto& g = r.gpu;
  if (g.driver_loaded) {
    out << fmt::format(
        "CUDA driver: {}{} ({})\n", env::cuda_version_text(g.driver_api_version),
        g.kernel_module_version.empty() ? "" : ", kernel module " + g.kernel_module_version,
        g.driver_library);
  } else {
    out << "CUDA driver: " << g.driver_reason << "\n";
  }
  for (const auto& d : g.devices) {
    out << fmt::format(
        "GPU {}: {}, compute capability {}.{}, {} memory, {} KiB shared/block (opt-in), "
        "{} SMs{}\n",
        d.index, d.name.empty() ? "?" : d.name, d.cc_major, d.cc_minor, format_size(d.total_memory),
        d.max_smem_per_block_optin / 1024, d.multiprocessors,
        d.pci_bus_id.empty() ? "" : ", " + d.pci_bus_id);
    for (const auto& e : d.errors) out << "  query failed: " << e << "\n";
  }
  if (g.driver_loaded && !g.has_gpu()) out << "GPU: none usable: " << g.driver_reason << "\n";
  out << "native engine (DEVICE=auto): " << r.engine_device << "\n";
  if (g.nccl_loaded)
    out << fmt::format("NCCL: {} ({})\n", env::nccl_version_text(g.nccl_version_code),
                       g.nccl_library);
  else
    out << "NCCL: " << g.nccl_reason << "\n";
  if (!g.holders.empty()) {
    for (const auto& h : g.holders)
      out << fmt::format("GPU held by pid {} ({}): {}\n", h.pid, h.comm, join(h.devices, ", "));
  } else if (verbose > 0) {
    out << "GPU held by: no other process\n";
  }
  if (verbose > 0 && g.holders_unreadable > 0)
    out << fmt::format(
        "GPU holders: {} process(es) could not be inspected (run as root to see all)\n",
        g.holders_unreadable);
}

int cmd_version(Context& ctx, const std::vector<std::string>& args) {
  po::options_description desc("Options");
  desc.add_options()("short", "print only the version of sparkctl; do not probe the GPU");
  po::variables_map vm;
  if (auto rc = parse_args(ctx, "version", "version [--short] [--json] [-v]", desc, args, vm))
    return *rc;
  VersionReport r = collect_version(vm.count("short") == 0);
  if (ctx.opts.json)
    *ctx.out << to_json(r).dump(2) << "\n";
  else
    print_version(*ctx.out, r, ctx.opts.verbose);
  return 0;
}

}  // namespace spark::cli
